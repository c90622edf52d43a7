"""The batch-job API on the real mesh: submit, follow, stream results, cancel, tenant walls,
and a job that outlives a gateway restart."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from llmmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.e2e.meshkit import DEMO_KEYS, auth, chat, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.model]
ACME, GLOBEX = auth(DEMO_KEYS["acme"]), auth(DEMO_KEYS["globex"])


def _job(stub, job_id, md=ACME):
    return stub.GetBatch(gateway_pb2.GetBatchRequest(job_id=job_id), metadata=md, timeout=10)


def _submit(stub, prompts, max_tokens):
    req = gateway_pb2.SubmitBatchRequest(requests=[chat(p, max_tokens) for p in prompts],
                                         display_name="test")
    return stub.SubmitBatch(req, metadata=ACME, timeout=30).job


def test_job_completes_across_a_gateway_restart_and_streams_every_result(mesh, gateway):
    prompts = [f"Write one sentence about the number {i}." for i in range(5)]
    job = _submit(gateway, prompts, 16)
    assert job.num_requests == 5 and job.status == gateway_pb2.BATCH_STATUS_RUNNING
    address = mesh.procs["gateway"].address
    mesh.stop_one("gateway")
    mesh.start_service("gateway", "gateway", address=address)
    asyncio.run(mesh.wait_ready(["gateway"], 60))
    with grpc.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        done = wait_until(lambda: (j := _job(stub, job.job_id)).status != gateway_pb2.BATCH_STATUS_RUNNING and j,
                          120, interval_s=0.2, what="the job to finish")
        assert done.status == gateway_pb2.BATCH_STATUS_COMPLETED
        assert done.num_completed == 5 and done.num_failed == 0
        results = list(stub.StreamBatchResults(
            gateway_pb2.StreamBatchResultsRequest(job_id=job.job_id), metadata=ACME, timeout=30))
        assert sorted(r.index for r in results) == list(range(5))
        assert all(r.text and not r.error_code for r in results)
        assert sum(r.final.usage.completion_tokens for r in results) == done.completion_tokens
        # Tenant walls: globex cannot see acme's job, not even that it exists.
        with pytest.raises(grpc.RpcError) as info:
            _job(stub, job.job_id, GLOBEX)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.RpcError) as info:
            list(stub.StreamBatchResults(gateway_pb2.StreamBatchResultsRequest(job_id=job.job_id),
                                         metadata=GLOBEX, timeout=10))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_cancel_ends_every_unfinished_request(mesh, gateway):
    job = _submit(gateway, [f"Tell a long story number {i}." for i in range(12)], 120)
    cancelled = gateway.CancelBatch(gateway_pb2.CancelBatchRequest(job_id=job.job_id),
                                    metadata=ACME, timeout=10)
    assert cancelled.status == gateway_pb2.BATCH_STATUS_CANCELLED
    results = list(gateway.StreamBatchResults(
        gateway_pb2.StreamBatchResultsRequest(job_id=job.job_id), metadata=ACME, timeout=120))
    assert len(results) == 12
    errors = [r for r in results if r.error_code]
    assert errors and all(r.error_code == "CANCELLED" for r in errors)
    # A request cancelled while it ran is a failed item too, never a "completed" one.
    assert all(r.final.finish_reason in (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH)
               for r in results if not r.error_code)
    final = _job(gateway, job.job_id)
    assert final.num_completed + final.num_failed == 12 and final.num_failed == len(errors)


def test_invalid_item_names_its_index(gateway):
    req = gateway_pb2.SubmitBatchRequest(requests=[chat("ok", 4), gateway_pb2.GenerateRequest()])
    with pytest.raises(grpc.RpcError) as info:
        gateway.SubmitBatch(req, metadata=ACME, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("requests[1].prompt")
