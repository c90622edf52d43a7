from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class GetUsageRequest(_message.Message):
    __slots__ = ("tenant_id", "start_unix_s", "end_unix_s")
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    START_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    END_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    tenant_id: str
    start_unix_s: float
    end_unix_s: float
    def __init__(self, tenant_id: _Optional[str] = ..., start_unix_s: _Optional[float] = ..., end_unix_s: _Optional[float] = ...) -> None: ...

class GetUsageResponse(_message.Message):
    __slots__ = ("tenant_id", "requests", "prompt_tokens", "cached_prompt_tokens", "completion_tokens", "prefill_device_seconds", "decode_device_seconds")
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_DEVICE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DECODE_DEVICE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    tenant_id: str
    requests: int
    prompt_tokens: int
    cached_prompt_tokens: int
    completion_tokens: int
    prefill_device_seconds: float
    decode_device_seconds: float
    def __init__(self, tenant_id: _Optional[str] = ..., requests: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., prefill_device_seconds: _Optional[float] = ..., decode_device_seconds: _Optional[float] = ...) -> None: ...
