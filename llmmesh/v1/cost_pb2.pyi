from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Granularity(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    GRANULARITY_UNSPECIFIED: _ClassVar[Granularity]
    GRANULARITY_TOTAL: _ClassVar[Granularity]
    GRANULARITY_HOUR: _ClassVar[Granularity]
    GRANULARITY_DAY: _ClassVar[Granularity]
    GRANULARITY_MONTH: _ClassVar[Granularity]

class IdlePolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    IDLE_POLICY_UNSPECIFIED: _ClassVar[IdlePolicy]
    IDLE_POLICY_UNUSED: _ClassVar[IdlePolicy]
    IDLE_POLICY_PRO_RATA: _ClassVar[IdlePolicy]

class TokenKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TOKEN_KIND_UNSPECIFIED: _ClassVar[TokenKind]
    TOKEN_KIND_PROMPT: _ClassVar[TokenKind]
    TOKEN_KIND_COMPLETION: _ClassVar[TokenKind]
    TOKEN_KIND_IDLE: _ClassVar[TokenKind]
    TOKEN_KIND_LOADING: _ClassVar[TokenKind]

class ExportSchema(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EXPORT_SCHEMA_UNSPECIFIED: _ClassVar[ExportSchema]
    EXPORT_SCHEMA_FOCUS: _ClassVar[ExportSchema]
    EXPORT_SCHEMA_INVOICE_LINES: _ClassVar[ExportSchema]
    EXPORT_SCHEMA_CLOUDEVENTS: _ClassVar[ExportSchema]

class ExportFormat(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EXPORT_FORMAT_UNSPECIFIED: _ClassVar[ExportFormat]
    EXPORT_FORMAT_CSV: _ClassVar[ExportFormat]
    EXPORT_FORMAT_PARQUET: _ClassVar[ExportFormat]
    EXPORT_FORMAT_JSONL: _ClassVar[ExportFormat]
GRANULARITY_UNSPECIFIED: Granularity
GRANULARITY_TOTAL: Granularity
GRANULARITY_HOUR: Granularity
GRANULARITY_DAY: Granularity
GRANULARITY_MONTH: Granularity
IDLE_POLICY_UNSPECIFIED: IdlePolicy
IDLE_POLICY_UNUSED: IdlePolicy
IDLE_POLICY_PRO_RATA: IdlePolicy
TOKEN_KIND_UNSPECIFIED: TokenKind
TOKEN_KIND_PROMPT: TokenKind
TOKEN_KIND_COMPLETION: TokenKind
TOKEN_KIND_IDLE: TokenKind
TOKEN_KIND_LOADING: TokenKind
EXPORT_SCHEMA_UNSPECIFIED: ExportSchema
EXPORT_SCHEMA_FOCUS: ExportSchema
EXPORT_SCHEMA_INVOICE_LINES: ExportSchema
EXPORT_SCHEMA_CLOUDEVENTS: ExportSchema
EXPORT_FORMAT_UNSPECIFIED: ExportFormat
EXPORT_FORMAT_CSV: ExportFormat
EXPORT_FORMAT_PARQUET: ExportFormat
EXPORT_FORMAT_JSONL: ExportFormat

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

class BillingQuery(_message.Message):
    __slots__ = ("tenant_id", "start_unix_s", "end_unix_s", "granularity", "idle_policy")
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    START_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    END_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    GRANULARITY_FIELD_NUMBER: _ClassVar[int]
    IDLE_POLICY_FIELD_NUMBER: _ClassVar[int]
    tenant_id: str
    start_unix_s: float
    end_unix_s: float
    granularity: Granularity
    idle_policy: IdlePolicy
    def __init__(self, tenant_id: _Optional[str] = ..., start_unix_s: _Optional[float] = ..., end_unix_s: _Optional[float] = ..., granularity: _Optional[_Union[Granularity, str]] = ..., idle_policy: _Optional[_Union[IdlePolicy, str]] = ...) -> None: ...

class GetInvoiceRequest(_message.Message):
    __slots__ = ("query",)
    QUERY_FIELD_NUMBER: _ClassVar[int]
    query: BillingQuery
    def __init__(self, query: _Optional[_Union[BillingQuery, _Mapping]] = ...) -> None: ...

class InvoiceLine(_message.Message):
    __slots__ = ("period_start_unix_s", "period_end_unix_s", "model", "request_class", "device", "token_kind", "requests", "tokens", "cached_tokens", "device_ns", "cost", "list_cost", "cost_per_million_tokens")
    PERIOD_START_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    PERIOD_END_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REQUEST_CLASS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_KIND_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_NS_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    LIST_COST_FIELD_NUMBER: _ClassVar[int]
    COST_PER_MILLION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    period_start_unix_s: float
    period_end_unix_s: float
    model: str
    request_class: str
    device: str
    token_kind: TokenKind
    requests: int
    tokens: int
    cached_tokens: int
    device_ns: int
    cost: str
    list_cost: str
    cost_per_million_tokens: str
    def __init__(self, period_start_unix_s: _Optional[float] = ..., period_end_unix_s: _Optional[float] = ..., model: _Optional[str] = ..., request_class: _Optional[str] = ..., device: _Optional[str] = ..., token_kind: _Optional[_Union[TokenKind, str]] = ..., requests: _Optional[int] = ..., tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., device_ns: _Optional[int] = ..., cost: _Optional[str] = ..., list_cost: _Optional[str] = ..., cost_per_million_tokens: _Optional[str] = ...) -> None: ...

class Invoice(_message.Message):
    __slots__ = ("tenant_id", "lines", "requests", "prompt_tokens", "cached_prompt_tokens", "completion_tokens", "prompt_cost", "completion_cost", "idle_cost", "total", "amount_due", "prompt_cost_per_million_tokens", "completion_cost_per_million_tokens", "loading_cost")
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    LINES_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_COST_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_COST_FIELD_NUMBER: _ClassVar[int]
    IDLE_COST_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    AMOUNT_DUE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_COST_PER_MILLION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_COST_PER_MILLION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOADING_COST_FIELD_NUMBER: _ClassVar[int]
    tenant_id: str
    lines: _containers.RepeatedCompositeFieldContainer[InvoiceLine]
    requests: int
    prompt_tokens: int
    cached_prompt_tokens: int
    completion_tokens: int
    prompt_cost: str
    completion_cost: str
    idle_cost: str
    total: str
    amount_due: str
    prompt_cost_per_million_tokens: str
    completion_cost_per_million_tokens: str
    loading_cost: str
    def __init__(self, tenant_id: _Optional[str] = ..., lines: _Optional[_Iterable[_Union[InvoiceLine, _Mapping]]] = ..., requests: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., prompt_cost: _Optional[str] = ..., completion_cost: _Optional[str] = ..., idle_cost: _Optional[str] = ..., total: _Optional[str] = ..., amount_due: _Optional[str] = ..., prompt_cost_per_million_tokens: _Optional[str] = ..., completion_cost_per_million_tokens: _Optional[str] = ..., loading_cost: _Optional[str] = ...) -> None: ...

class DeviceReconciliation(_message.Message):
    __slots__ = ("device", "capacity_ns", "attributed_ns", "idle_ns", "capacity_cost", "attributed_cost", "idle_allocated_cost", "idle_unallocated_cost", "loading_ns", "loading_cost")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_NS_FIELD_NUMBER: _ClassVar[int]
    ATTRIBUTED_NS_FIELD_NUMBER: _ClassVar[int]
    IDLE_NS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_COST_FIELD_NUMBER: _ClassVar[int]
    ATTRIBUTED_COST_FIELD_NUMBER: _ClassVar[int]
    IDLE_ALLOCATED_COST_FIELD_NUMBER: _ClassVar[int]
    IDLE_UNALLOCATED_COST_FIELD_NUMBER: _ClassVar[int]
    LOADING_NS_FIELD_NUMBER: _ClassVar[int]
    LOADING_COST_FIELD_NUMBER: _ClassVar[int]
    device: str
    capacity_ns: int
    attributed_ns: int
    idle_ns: int
    capacity_cost: str
    attributed_cost: str
    idle_allocated_cost: str
    idle_unallocated_cost: str
    loading_ns: int
    loading_cost: str
    def __init__(self, device: _Optional[str] = ..., capacity_ns: _Optional[int] = ..., attributed_ns: _Optional[int] = ..., idle_ns: _Optional[int] = ..., capacity_cost: _Optional[str] = ..., attributed_cost: _Optional[str] = ..., idle_allocated_cost: _Optional[str] = ..., idle_unallocated_cost: _Optional[str] = ..., loading_ns: _Optional[int] = ..., loading_cost: _Optional[str] = ...) -> None: ...

class WorkerCapacity(_message.Message):
    __slots__ = ("device", "worker_id", "uptime_ns")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    UPTIME_NS_FIELD_NUMBER: _ClassVar[int]
    device: str
    worker_id: str
    uptime_ns: int
    def __init__(self, device: _Optional[str] = ..., worker_id: _Optional[str] = ..., uptime_ns: _Optional[int] = ...) -> None: ...

class Reconciliation(_message.Message):
    __slots__ = ("capacity_cost", "tenants_cost", "unused_cost", "capacity_due", "tenants_due", "unused_due", "devices", "workers", "unused_lines")
    CAPACITY_COST_FIELD_NUMBER: _ClassVar[int]
    TENANTS_COST_FIELD_NUMBER: _ClassVar[int]
    UNUSED_COST_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_DUE_FIELD_NUMBER: _ClassVar[int]
    TENANTS_DUE_FIELD_NUMBER: _ClassVar[int]
    UNUSED_DUE_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    UNUSED_LINES_FIELD_NUMBER: _ClassVar[int]
    capacity_cost: str
    tenants_cost: str
    unused_cost: str
    capacity_due: str
    tenants_due: str
    unused_due: str
    devices: _containers.RepeatedCompositeFieldContainer[DeviceReconciliation]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerCapacity]
    unused_lines: _containers.RepeatedCompositeFieldContainer[InvoiceLine]
    def __init__(self, capacity_cost: _Optional[str] = ..., tenants_cost: _Optional[str] = ..., unused_cost: _Optional[str] = ..., capacity_due: _Optional[str] = ..., tenants_due: _Optional[str] = ..., unused_due: _Optional[str] = ..., devices: _Optional[_Iterable[_Union[DeviceReconciliation, _Mapping]]] = ..., workers: _Optional[_Iterable[_Union[WorkerCapacity, _Mapping]]] = ..., unused_lines: _Optional[_Iterable[_Union[InvoiceLine, _Mapping]]] = ...) -> None: ...

class GetInvoiceResponse(_message.Message):
    __slots__ = ("currency", "start_unix_s", "end_unix_s", "invoices", "reconciliation", "warnings")
    CURRENCY_FIELD_NUMBER: _ClassVar[int]
    START_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    END_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    INVOICES_FIELD_NUMBER: _ClassVar[int]
    RECONCILIATION_FIELD_NUMBER: _ClassVar[int]
    WARNINGS_FIELD_NUMBER: _ClassVar[int]
    currency: str
    start_unix_s: float
    end_unix_s: float
    invoices: _containers.RepeatedCompositeFieldContainer[Invoice]
    reconciliation: Reconciliation
    warnings: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, currency: _Optional[str] = ..., start_unix_s: _Optional[float] = ..., end_unix_s: _Optional[float] = ..., invoices: _Optional[_Iterable[_Union[Invoice, _Mapping]]] = ..., reconciliation: _Optional[_Union[Reconciliation, _Mapping]] = ..., warnings: _Optional[_Iterable[str]] = ...) -> None: ...

class ExportBillingRequest(_message.Message):
    __slots__ = ("query", "schema", "format")
    QUERY_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    query: BillingQuery
    schema: ExportSchema
    format: ExportFormat
    def __init__(self, query: _Optional[_Union[BillingQuery, _Mapping]] = ..., schema: _Optional[_Union[ExportSchema, str]] = ..., format: _Optional[_Union[ExportFormat, str]] = ...) -> None: ...

class ExportSummary(_message.Message):
    __slots__ = ("rows", "size_bytes", "sha256", "content_type", "file_extension")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    CONTENT_TYPE_FIELD_NUMBER: _ClassVar[int]
    FILE_EXTENSION_FIELD_NUMBER: _ClassVar[int]
    rows: int
    size_bytes: int
    sha256: str
    content_type: str
    file_extension: str
    def __init__(self, rows: _Optional[int] = ..., size_bytes: _Optional[int] = ..., sha256: _Optional[str] = ..., content_type: _Optional[str] = ..., file_extension: _Optional[str] = ...) -> None: ...

class ExportBillingChunk(_message.Message):
    __slots__ = ("data", "summary")
    DATA_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    summary: ExportSummary
    def __init__(self, data: _Optional[bytes] = ..., summary: _Optional[_Union[ExportSummary, _Mapping]] = ...) -> None: ...

class LengthBucket(_message.Message):
    __slots__ = ("tokens", "weight")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    tokens: int
    weight: float
    def __init__(self, tokens: _Optional[int] = ..., weight: _Optional[float] = ...) -> None: ...

class TrafficProfile(_message.Message):
    __slots__ = ("requests_per_s_by_hour", "prompt_tokens", "completion_tokens", "prefix_hit_rate")
    REQUESTS_PER_S_BY_HOUR_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    requests_per_s_by_hour: _containers.RepeatedScalarFieldContainer[float]
    prompt_tokens: _containers.RepeatedCompositeFieldContainer[LengthBucket]
    completion_tokens: _containers.RepeatedCompositeFieldContainer[LengthBucket]
    prefix_hit_rate: float
    def __init__(self, requests_per_s_by_hour: _Optional[_Iterable[float]] = ..., prompt_tokens: _Optional[_Iterable[_Union[LengthBucket, _Mapping]]] = ..., completion_tokens: _Optional[_Iterable[_Union[LengthBucket, _Mapping]]] = ..., prefix_hit_rate: _Optional[float] = ...) -> None: ...

class Scenario(_message.Message):
    __slots__ = ("device", "price_per_hour", "quantization", "max_batch", "prompt_length_change_pct", "max_devices", "target_utilisation", "autoscale", "p95_latency_slo_s")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    PRICE_PER_HOUR_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LENGTH_CHANGE_PCT_FIELD_NUMBER: _ClassVar[int]
    MAX_DEVICES_FIELD_NUMBER: _ClassVar[int]
    TARGET_UTILISATION_FIELD_NUMBER: _ClassVar[int]
    AUTOSCALE_FIELD_NUMBER: _ClassVar[int]
    P95_LATENCY_SLO_S_FIELD_NUMBER: _ClassVar[int]
    device: str
    price_per_hour: str
    quantization: str
    max_batch: int
    prompt_length_change_pct: float
    max_devices: int
    target_utilisation: float
    autoscale: bool
    p95_latency_slo_s: float
    def __init__(self, device: _Optional[str] = ..., price_per_hour: _Optional[str] = ..., quantization: _Optional[str] = ..., max_batch: _Optional[int] = ..., prompt_length_change_pct: _Optional[float] = ..., max_devices: _Optional[int] = ..., target_utilisation: _Optional[float] = ..., autoscale: _Optional[bool] = ..., p95_latency_slo_s: _Optional[float] = ...) -> None: ...

class WhatIfRequest(_message.Message):
    __slots__ = ("profile", "scenario", "curve_json")
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    SCENARIO_FIELD_NUMBER: _ClassVar[int]
    CURVE_JSON_FIELD_NUMBER: _ClassVar[int]
    profile: TrafficProfile
    scenario: Scenario
    curve_json: str
    def __init__(self, profile: _Optional[_Union[TrafficProfile, _Mapping]] = ..., scenario: _Optional[_Union[Scenario, _Mapping]] = ..., curve_json: _Optional[str] = ...) -> None: ...

class WhatIfHour(_message.Message):
    __slots__ = ("hour", "requests_per_s", "tokens_per_s", "devices", "utilisation", "cost")
    HOUR_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_PER_S_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    UTILISATION_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    hour: int
    requests_per_s: float
    tokens_per_s: float
    devices: int
    utilisation: float
    cost: str
    def __init__(self, hour: _Optional[int] = ..., requests_per_s: _Optional[float] = ..., tokens_per_s: _Optional[float] = ..., devices: _Optional[int] = ..., utilisation: _Optional[float] = ..., cost: _Optional[str] = ...) -> None: ...

class WhatIfResponse(_message.Message):
    __slots__ = ("feasible", "reasons", "currency", "cost_per_million_tokens", "prompt_cost_per_million_tokens", "completion_cost_per_million_tokens", "cost_per_million_tokens_at_full_utilisation", "cost", "devices_needed", "device_hours", "utilisation", "p95_latency_s", "concurrency", "tokens_per_s_per_device", "tokens", "curve", "hours")
    FEASIBLE_FIELD_NUMBER: _ClassVar[int]
    REASONS_FIELD_NUMBER: _ClassVar[int]
    CURRENCY_FIELD_NUMBER: _ClassVar[int]
    COST_PER_MILLION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_COST_PER_MILLION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_COST_PER_MILLION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COST_PER_MILLION_TOKENS_AT_FULL_UTILISATION_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    DEVICES_NEEDED_FIELD_NUMBER: _ClassVar[int]
    DEVICE_HOURS_FIELD_NUMBER: _ClassVar[int]
    UTILISATION_FIELD_NUMBER: _ClassVar[int]
    P95_LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    CONCURRENCY_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_PER_DEVICE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CURVE_FIELD_NUMBER: _ClassVar[int]
    HOURS_FIELD_NUMBER: _ClassVar[int]
    feasible: bool
    reasons: _containers.RepeatedScalarFieldContainer[str]
    currency: str
    cost_per_million_tokens: str
    prompt_cost_per_million_tokens: str
    completion_cost_per_million_tokens: str
    cost_per_million_tokens_at_full_utilisation: str
    cost: str
    devices_needed: int
    device_hours: float
    utilisation: float
    p95_latency_s: float
    concurrency: int
    tokens_per_s_per_device: float
    tokens: float
    curve: str
    hours: _containers.RepeatedCompositeFieldContainer[WhatIfHour]
    def __init__(self, feasible: _Optional[bool] = ..., reasons: _Optional[_Iterable[str]] = ..., currency: _Optional[str] = ..., cost_per_million_tokens: _Optional[str] = ..., prompt_cost_per_million_tokens: _Optional[str] = ..., completion_cost_per_million_tokens: _Optional[str] = ..., cost_per_million_tokens_at_full_utilisation: _Optional[str] = ..., cost: _Optional[str] = ..., devices_needed: _Optional[int] = ..., device_hours: _Optional[float] = ..., utilisation: _Optional[float] = ..., p95_latency_s: _Optional[float] = ..., concurrency: _Optional[int] = ..., tokens_per_s_per_device: _Optional[float] = ..., tokens: _Optional[float] = ..., curve: _Optional[str] = ..., hours: _Optional[_Iterable[_Union[WhatIfHour, _Mapping]]] = ...) -> None: ...

class ConsolidationModel(_message.Message):
    __slots__ = ("name", "profile", "curve", "curve_json", "memory_mib", "load_s", "pinned")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    CURVE_FIELD_NUMBER: _ClassVar[int]
    CURVE_JSON_FIELD_NUMBER: _ClassVar[int]
    MEMORY_MIB_FIELD_NUMBER: _ClassVar[int]
    LOAD_S_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    name: str
    profile: TrafficProfile
    curve: str
    curve_json: str
    memory_mib: float
    load_s: float
    pinned: bool
    def __init__(self, name: _Optional[str] = ..., profile: _Optional[_Union[TrafficProfile, _Mapping]] = ..., curve: _Optional[str] = ..., curve_json: _Optional[str] = ..., memory_mib: _Optional[float] = ..., load_s: _Optional[float] = ..., pinned: _Optional[bool] = ...) -> None: ...

class ConsolidationRequest(_message.Message):
    __slots__ = ("models", "scenario", "device_memory_mib")
    MODELS_FIELD_NUMBER: _ClassVar[int]
    SCENARIO_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MEMORY_MIB_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ConsolidationModel]
    scenario: Scenario
    device_memory_mib: float
    def __init__(self, models: _Optional[_Iterable[_Union[ConsolidationModel, _Mapping]]] = ..., scenario: _Optional[_Union[Scenario, _Mapping]] = ..., device_memory_mib: _Optional[float] = ...) -> None: ...

class ConsolidationLayout(_message.Message):
    __slots__ = ("feasible", "reasons", "cost", "devices_needed", "device_hours", "utilisation", "cost_per_million_tokens", "loading_s", "devices_by_hour")
    FEASIBLE_FIELD_NUMBER: _ClassVar[int]
    REASONS_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    DEVICES_NEEDED_FIELD_NUMBER: _ClassVar[int]
    DEVICE_HOURS_FIELD_NUMBER: _ClassVar[int]
    UTILISATION_FIELD_NUMBER: _ClassVar[int]
    COST_PER_MILLION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOADING_S_FIELD_NUMBER: _ClassVar[int]
    DEVICES_BY_HOUR_FIELD_NUMBER: _ClassVar[int]
    feasible: bool
    reasons: _containers.RepeatedScalarFieldContainer[str]
    cost: str
    devices_needed: int
    device_hours: float
    utilisation: float
    cost_per_million_tokens: str
    loading_s: float
    devices_by_hour: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, feasible: _Optional[bool] = ..., reasons: _Optional[_Iterable[str]] = ..., cost: _Optional[str] = ..., devices_needed: _Optional[int] = ..., device_hours: _Optional[float] = ..., utilisation: _Optional[float] = ..., cost_per_million_tokens: _Optional[str] = ..., loading_s: _Optional[float] = ..., devices_by_hour: _Optional[_Iterable[int]] = ...) -> None: ...

class ConsolidationModelResult(_message.Message):
    __slots__ = ("name", "curve", "tokens", "concurrency", "p95_latency_s", "busy_s", "dedicated_cost", "dedicated_device_hours", "dedicated_cost_per_million_tokens", "shared_cost", "shared_cost_per_million_tokens", "loads", "loading_s")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CURVE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONCURRENCY_FIELD_NUMBER: _ClassVar[int]
    P95_LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    BUSY_S_FIELD_NUMBER: _ClassVar[int]
    DEDICATED_COST_FIELD_NUMBER: _ClassVar[int]
    DEDICATED_DEVICE_HOURS_FIELD_NUMBER: _ClassVar[int]
    DEDICATED_COST_PER_MILLION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SHARED_COST_FIELD_NUMBER: _ClassVar[int]
    SHARED_COST_PER_MILLION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOADS_FIELD_NUMBER: _ClassVar[int]
    LOADING_S_FIELD_NUMBER: _ClassVar[int]
    name: str
    curve: str
    tokens: float
    concurrency: int
    p95_latency_s: float
    busy_s: float
    dedicated_cost: str
    dedicated_device_hours: float
    dedicated_cost_per_million_tokens: str
    shared_cost: str
    shared_cost_per_million_tokens: str
    loads: int
    loading_s: float
    def __init__(self, name: _Optional[str] = ..., curve: _Optional[str] = ..., tokens: _Optional[float] = ..., concurrency: _Optional[int] = ..., p95_latency_s: _Optional[float] = ..., busy_s: _Optional[float] = ..., dedicated_cost: _Optional[str] = ..., dedicated_device_hours: _Optional[float] = ..., dedicated_cost_per_million_tokens: _Optional[str] = ..., shared_cost: _Optional[str] = ..., shared_cost_per_million_tokens: _Optional[str] = ..., loads: _Optional[int] = ..., loading_s: _Optional[float] = ...) -> None: ...

class ConsolidationHour(_message.Message):
    __slots__ = ("hour", "dedicated_devices", "shared_devices", "busy_devices", "loading_s", "loaded")
    HOUR_FIELD_NUMBER: _ClassVar[int]
    DEDICATED_DEVICES_FIELD_NUMBER: _ClassVar[int]
    SHARED_DEVICES_FIELD_NUMBER: _ClassVar[int]
    BUSY_DEVICES_FIELD_NUMBER: _ClassVar[int]
    LOADING_S_FIELD_NUMBER: _ClassVar[int]
    LOADED_FIELD_NUMBER: _ClassVar[int]
    hour: int
    dedicated_devices: int
    shared_devices: int
    busy_devices: float
    loading_s: float
    loaded: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, hour: _Optional[int] = ..., dedicated_devices: _Optional[int] = ..., shared_devices: _Optional[int] = ..., busy_devices: _Optional[float] = ..., loading_s: _Optional[float] = ..., loaded: _Optional[_Iterable[str]] = ...) -> None: ...

class ConsolidationResponse(_message.Message):
    __slots__ = ("currency", "dedicated", "shared", "models", "hours", "saving", "saving_pct", "cheaper", "caveats")
    CURRENCY_FIELD_NUMBER: _ClassVar[int]
    DEDICATED_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    HOURS_FIELD_NUMBER: _ClassVar[int]
    SAVING_FIELD_NUMBER: _ClassVar[int]
    SAVING_PCT_FIELD_NUMBER: _ClassVar[int]
    CHEAPER_FIELD_NUMBER: _ClassVar[int]
    CAVEATS_FIELD_NUMBER: _ClassVar[int]
    currency: str
    dedicated: ConsolidationLayout
    shared: ConsolidationLayout
    models: _containers.RepeatedCompositeFieldContainer[ConsolidationModelResult]
    hours: _containers.RepeatedCompositeFieldContainer[ConsolidationHour]
    saving: str
    saving_pct: float
    cheaper: str
    caveats: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, currency: _Optional[str] = ..., dedicated: _Optional[_Union[ConsolidationLayout, _Mapping]] = ..., shared: _Optional[_Union[ConsolidationLayout, _Mapping]] = ..., models: _Optional[_Iterable[_Union[ConsolidationModelResult, _Mapping]]] = ..., hours: _Optional[_Iterable[_Union[ConsolidationHour, _Mapping]]] = ..., saving: _Optional[str] = ..., saving_pct: _Optional[float] = ..., cheaper: _Optional[str] = ..., caveats: _Optional[_Iterable[str]] = ...) -> None: ...
