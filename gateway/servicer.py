"""GatewayService: converts proto <-> domain at the edge; the work happens in Frontend."""
from __future__ import annotations

import time

from gateway.batch_jobs import BatchJobs
from gateway.frontend import FinalOut, Frontend
from gateway.tenants import TenantBook
from gateway.models import describe, live_states
from gateway.validation import ServedModel, validate
from llmmesh.errors import InvalidArgument
from llmmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from llmmesh.vocab import FinishReason, RequestClass



def _final_proto(out: FinalOut) -> gateway_pb2.GenerateFinal:
    u = out.usage
    return gateway_pb2.GenerateFinal(
        finish_reason=FinishReason.of(out.finish_reason).proto,
        request_id=out.request_id, request_class=RequestClass(out.request_class).proto,
        usage=common_pb2.Usage(
            prompt_tokens=u.get("prompt_tokens", 0), cached_prompt_tokens=u.get("cached_prompt_tokens", 0),
            completion_tokens=u.get("completion_tokens", 0),
            prefill_device_seconds=u.get("prefill_device_s", 0.0),
            decode_device_seconds=u.get("decode_device_s", 0.0), queue_seconds=u.get("queue_s", 0.0),
            prefill_seconds=u.get("prefill_s", 0.0)))


def _deadline_unix_ns(context) -> int:
    remaining = context.time_remaining()
    return 0 if remaining is None else time.time_ns() + int(remaining * 1e9)


_BATCH_STATUS = {"running": gateway_pb2.BATCH_STATUS_RUNNING,
                 "completed": gateway_pb2.BATCH_STATUS_COMPLETED,
                 "cancelled": gateway_pb2.BATCH_STATUS_CANCELLED}


def _job_proto(job: dict) -> gateway_pb2.BatchJob:
    return gateway_pb2.BatchJob(
        job_id=job["job_id"], display_name=job["display_name"], status=_BATCH_STATUS[job["status"]],
        num_requests=job["num_requests"], num_completed=job["num_completed"],
        num_failed=job["num_failed"], created_unix_s=job["created_unix_s"],
        prompt_tokens=job["prompt_tokens"], completion_tokens=job["completion_tokens"],
        results_ttl_s=job["results_ttl_s"])


class GatewayServicer(gateway_pb2_grpc.GatewayServiceServicer):
    def __init__(self, frontend: Frontend, tenants: TenantBook, models: dict[str, ServedModel],
                 default_model: str, batch_jobs: BatchJobs):
        self.batch_jobs = batch_jobs
        self.frontend = frontend
        self.tenants = tenants
        self.models = models
        self.default_model = default_model

    async def _events(self, request, context):
        tenant = self.tenants.authenticate(context.invocation_metadata())
        valid = validate(request, self.models, self.default_model)
        async for out in self.frontend.generate(tenant, valid, _deadline_unix_ns(context)):
            yield out

    async def Generate(self, request, context):
        async for out in self._events(request, context):
            if isinstance(out, FinalOut):
                yield gateway_pb2.GenerateResponse(final=_final_proto(out))
            else:
                yield gateway_pb2.GenerateResponse(chunk=gateway_pb2.TokenChunk(
                    index=out.index, token_ids=out.token_ids, text=out.text, logprobs=out.logprobs))

    async def Complete(self, request, context):
        text, token_ids, final = [], [], None
        async for out in self._events(request.request, context):
            if isinstance(out, FinalOut):
                final = _final_proto(out)
            else:
                text.append(out.text)
                token_ids.extend(out.token_ids)
        return gateway_pb2.CompleteResponse(text="".join(text), token_ids=token_ids, final=final)

    async def ListModels(self, request, context):
        """The catalog, with each model's live state and the weight format workers load."""
        self.tenants.authenticate(context.invocation_metadata())
        live = await live_states(self.frontend.redis)
        return gateway_pb2.ListModelsResponse(
            models=[gateway_pb2.ModelInfo(**row) for row in describe(self.models, live)])

    async def SubmitBatch(self, request, context):
        tenant = self.tenants.authenticate(context.invocation_metadata())
        items = []
        for i, req in enumerate(request.requests):
            try:
                items.append(validate(req, self.models, self.default_model))
            except InvalidArgument as exc:
                raise InvalidArgument(f"requests[{i}].{exc.field}", exc.message.split(": ", 1)[1]) from exc
        job = await self.batch_jobs.submit(tenant, items, request.display_name)
        return gateway_pb2.SubmitBatchResponse(job=_job_proto(job))

    async def GetBatch(self, request, context):
        tenant = self.tenants.authenticate(context.invocation_metadata())
        return _job_proto(await self.batch_jobs.get(tenant, request.job_id))

    async def CancelBatch(self, request, context):
        tenant = self.tenants.authenticate(context.invocation_metadata())
        return _job_proto(await self.batch_jobs.cancel(tenant, request.job_id))

    async def StreamBatchResults(self, request, context):
        tenant = self.tenants.authenticate(context.invocation_metadata())
        async for r in self.batch_jobs.results(tenant, request.job_id):
            # Each item is decoded by its own model's tokenizer (results written before the
            # model was recorded are the default model's: the only one there was).
            # A model since removed from the catalog has no tokenizer here: its token ids only.
            model = self.models.get(r.get("model") or self.default_model)
            result = gateway_pb2.BatchResult(
                index=r["index"], request_id=r["request_id"], token_ids=r["token_ids"],
                text=model.tokenizer.decode(r["token_ids"]) if r["token_ids"] and model else "",
                error_code=r["error_code"], error_message=r["error_message"])
            if not r["error_code"]:
                result.final.CopyFrom(_final_proto(FinalOut(
                    r["request_id"], RequestClass.BATCH, r["finish_reason"], r["usage"])))
            yield result
