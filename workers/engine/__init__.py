"""The worker's inference engine: paged KV cache with prefix caching and continuous batching."""
from workers.engine.async_engine import AsyncEngine
from workers.engine.config import CacheInfo, EngineConfig
from workers.engine.engine_core import EngineCore
from workers.engine.outputs import EngineLoad, RequestOutput, RequestUsage
from workers.engine.request import Priority, Request, RequestStatus
from workers.engine.sampling import SamplingParams

__all__ = ["AsyncEngine", "CacheInfo", "EngineConfig", "EngineCore", "EngineLoad", "Priority",
           "Request", "RequestOutput", "RequestStatus", "RequestUsage", "SamplingParams"]
