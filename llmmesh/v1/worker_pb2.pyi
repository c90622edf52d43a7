from llmmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerGenerateRequest(_message.Message):
    __slots__ = ("request_id", "tenant_id", "model", "prompt_token_ids", "sampling", "request_class", "cache_salt", "deadline_unix_ns", "start_index", "num_original_prompt_tokens", "result_stream", "operation", "attempt", "attempt_key")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    REQUEST_CLASS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    START_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_ORIGINAL_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESULT_STREAM_FIELD_NUMBER: _ClassVar[int]
    OPERATION_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_KEY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tenant_id: str
    model: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    request_class: _common_pb2.RequestClass
    cache_salt: str
    deadline_unix_ns: int
    start_index: int
    num_original_prompt_tokens: int
    result_stream: str
    operation: str
    attempt: int
    attempt_key: bytes
    def __init__(self, request_id: _Optional[str] = ..., tenant_id: _Optional[str] = ..., model: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., request_class: _Optional[_Union[_common_pb2.RequestClass, str]] = ..., cache_salt: _Optional[str] = ..., deadline_unix_ns: _Optional[int] = ..., start_index: _Optional[int] = ..., num_original_prompt_tokens: _Optional[int] = ..., result_stream: _Optional[str] = ..., operation: _Optional[str] = ..., attempt: _Optional[int] = ..., attempt_key: _Optional[bytes] = ...) -> None: ...

class WorkerTokens(_message.Message):
    __slots__ = ("index", "token_ids", "logprobs")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class WorkerFinal(_message.Message):
    __slots__ = ("finish_reason", "usage", "token_ids")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    finish_reason: _common_pb2.FinishReason
    usage: _common_pb2.Usage
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class WorkerGenerateResponse(_message.Message):
    __slots__ = ("tokens", "final")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    tokens: WorkerTokens
    final: WorkerFinal
    def __init__(self, tokens: _Optional[_Union[WorkerTokens, _Mapping]] = ..., final: _Optional[_Union[WorkerFinal, _Mapping]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("aborted",)
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    aborted: bool
    def __init__(self, aborted: _Optional[bool] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetLoadResponse(_message.Message):
    __slots__ = ("num_running", "num_waiting", "num_free_blocks", "num_total_blocks", "block_size", "models", "device_type", "quantization", "context_length", "num_requests_total", "num_cached_prompt_tokens_total", "num_prompt_tokens_total", "model_states", "memory_budget_bytes", "memory_used_bytes")
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_TYPE_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_PROMPT_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    MODEL_STATES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    block_size: int
    models: _containers.RepeatedScalarFieldContainer[str]
    device_type: str
    quantization: str
    context_length: int
    num_requests_total: int
    num_cached_prompt_tokens_total: int
    num_prompt_tokens_total: int
    model_states: _containers.RepeatedCompositeFieldContainer[ModelState]
    memory_budget_bytes: int
    memory_used_bytes: int
    def __init__(self, num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., models: _Optional[_Iterable[str]] = ..., device_type: _Optional[str] = ..., quantization: _Optional[str] = ..., context_length: _Optional[int] = ..., num_requests_total: _Optional[int] = ..., num_cached_prompt_tokens_total: _Optional[int] = ..., num_prompt_tokens_total: _Optional[int] = ..., model_states: _Optional[_Iterable[_Union[ModelState, _Mapping]]] = ..., memory_budget_bytes: _Optional[int] = ..., memory_used_bytes: _Optional[int] = ...) -> None: ...

class ModelState(_message.Message):
    __slots__ = ("name", "state", "quantization", "num_running", "num_waiting", "context_length", "memory_bytes", "load_seconds", "pinned", "idle_seconds", "evictable")
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    IDLE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    EVICTABLE_FIELD_NUMBER: _ClassVar[int]
    name: str
    state: str
    quantization: str
    num_running: int
    num_waiting: int
    context_length: int
    memory_bytes: int
    load_seconds: float
    pinned: bool
    idle_seconds: float
    evictable: bool
    def __init__(self, name: _Optional[str] = ..., state: _Optional[str] = ..., quantization: _Optional[str] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., context_length: _Optional[int] = ..., memory_bytes: _Optional[int] = ..., load_seconds: _Optional[float] = ..., pinned: _Optional[bool] = ..., idle_seconds: _Optional[float] = ..., evictable: _Optional[bool] = ...) -> None: ...
