"""Domain errors and the one table that maps them to gRPC status codes.

Services raise these from transport-free code; `ErrorMappingInterceptor` (llmmesh.server)
turns them into a precise status for the client. Anything else becomes INTERNAL with a
generic message: a stack trace never reaches a client.
"""
from __future__ import annotations

import grpc
from google.protobuf import duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2


class MeshError(Exception):
    """An error a client can act on."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def trailing_metadata(self) -> tuple[tuple[str, bytes], ...]:
        return ()


class InvalidArgument(MeshError):
    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field}: {problem}")
        self.field = field


class Unauthenticated(MeshError):
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(MeshError):
    code = grpc.StatusCode.PERMISSION_DENIED


class NotFound(MeshError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(MeshError):
    code = grpc.StatusCode.ALREADY_EXISTS


class DeadlineExceeded(MeshError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Unavailable(MeshError):
    code = grpc.StatusCode.UNAVAILABLE


class Cancelled(MeshError):
    code = grpc.StatusCode.CANCELLED


class Aborted(MeshError):
    code = grpc.StatusCode.ABORTED


class Internal(MeshError):
    code = grpc.StatusCode.INTERNAL


class ResourceExhausted(MeshError):
    """A refusal with a delay after which a retry may succeed (google.rpc.RetryInfo)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(f"{message}; retry after {retry_after_s:.2f}s")
        self.retry_after_s = retry_after_s

    def trailing_metadata(self) -> tuple[tuple[str, bytes], ...]:
        delay = duration_pb2.Duration()
        delay.FromNanoseconds(int(self.retry_after_s * 1e9))
        status = status_pb2.Status(code=code_pb2.RESOURCE_EXHAUSTED, message=self.message)
        status.details.add().Pack(error_details_pb2.RetryInfo(retry_delay=delay))
        return (("grpc-status-details-bin", status.SerializeToString()),)


_BY_CODE = {cls.code: cls for cls in (
    InvalidArgument, Unauthenticated, PermissionDenied, NotFound, AlreadyExists, DeadlineExceeded,
    Unavailable, Cancelled, Internal, ResourceExhausted)}


def error_from_code(code_name: str, message: str) -> MeshError:
    """Rebuild a typed error from a status name carried through Redis (e.g. "UNAVAILABLE")."""
    try:
        code = grpc.StatusCode[code_name]
    except KeyError:
        code = grpc.StatusCode.INTERNAL
    err = MeshError(message)
    err.code = code
    return err


def retry_delay_s(err: grpc.aio.AioRpcError | grpc.RpcError) -> float | None:
    """The RetryInfo delay of a RESOURCE_EXHAUSTED error, for clients."""
    for key, value in (err.trailing_metadata() or ()):
        if key == "grpc-status-details-bin":
            status = status_pb2.Status.FromString(value)
            for detail in status.details:
                info = error_details_pb2.RetryInfo()
                if detail.Unpack(info):
                    return info.retry_delay.ToNanoseconds() / 1e9
    return None
