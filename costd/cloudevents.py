"""CloudEvents 1.0 usage events: one per billed request, structured mode, one event per line.

Each request is priced alone (its device time × the price in force when it ended, rounded to
1e-9), so a consumer summing events can differ from the invoice by at most 0.5e-9 per event;
the invoice, which rounds once per line, is the bill. `id` is the request id: a consumer
that sees an event twice can drop the repeat, as the CloudEvents spec intends.
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from decimal import Decimal

from costd.costmodel import NANO
from costd.periods import HOUR_NS, iso
from costd.pricebook import PriceBook
from costd.usage import UsageRecord

EVENT_TYPE = "dev.llmmesh.usage.v1"
SOURCE = "/llmmesh/costd"
CONTENT_TYPE = "application/cloudevents+json"
_NS_PER_HOUR = Decimal(HOUR_NS)


def usage_event(record: UsageRecord, book: PriceBook) -> dict:
    device = book.device_for(record.device_type)
    price = book.price(device, record.end_unix_ns) if device else None
    per_hour = price.per_hour if price else Decimal(0)
    prompt_cost = (record.prefill_device_ns * per_hour / _NS_PER_HOUR).quantize(NANO)
    completion_cost = (record.decode_device_ns * per_hour / _NS_PER_HOUR).quantize(NANO)
    return {
        "specversion": "1.0", "id": record.request_id, "source": SOURCE, "type": EVENT_TYPE,
        "time": iso(record.end_unix_ns), "subject": record.tenant_id,
        "datacontenttype": "application/json",
        "data": {
            "tenant_id": record.tenant_id, "model": record.model,
            "request_class": record.request_class, "prompt_tokens": record.num_prompt_tokens,
            "cached_prompt_tokens": record.num_cached_prompt_tokens,
            "completion_tokens": record.num_completion_tokens,
            "prefill_device_ns": record.prefill_device_ns,
            "decode_device_ns": record.decode_device_ns,
            "device_type": record.device_type, "device": device or "",
            "worker_id": record.worker_id, "finish_reasons": list(record.finish_reasons),
            "currency": book.currency, "prompt_cost": format(prompt_cost, "f"),
            "completion_cost": format(completion_cost, "f"),
            "cost": format(prompt_cost + completion_cost, "f"),
        },
    }


def to_jsonl(records: Iterable[UsageRecord], book: PriceBook) -> tuple[bytes, int]:
    """The events as JSON Lines, and how many there are."""
    lines = [json.dumps(usage_event(r, book), separators=(",", ":")) for r in records]
    return "".join(line + "\n" for line in lines).encode(), len(lines)
