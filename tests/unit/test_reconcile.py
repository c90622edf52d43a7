"""The reconciler against a real redis-server and a real SQLite ledger: settlements and billing
records that the ledger lacks, disagrees with, or never heard of; repair bills once."""
from __future__ import annotations

import asyncio
import dataclasses
import time

import redis.asyncio as aioredis

from costd.ledger import LedgerConfig, UsageLedger
from costd.reconcile import MISMATCH, UNBILLED, UNKNOWN, Reconciler, usage_record_of
from llmmesh import billing
from llmmesh.admission import Admission, Reservation, read_settlements

USAGE = {"prompt_tokens": 12, "cached_prompt_tokens": 4, "completion_tokens": 7,
         "prefill_device_s": 0.01, "decode_device_s": 0.02, "queue_s": 0.0}


def _run(redis_server, tmp_path, scenario):
    async def main():
        redis = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
        ledger = UsageLedger(LedgerConfig(path=str(tmp_path / "ledger.sqlite")))
        await ledger.start()
        try:
            await redis.xgroup_create(billing.BILLING_STREAM, billing.SHIPPER_GROUP, id="0",
                                      mkstream=True)
            return await scenario(redis, ledger)
        finally:
            await ledger.shutdown()
            await redis.aclose()
    return asyncio.run(main())


async def _bill(redis, request_id: str, tenant_id: str = "acme", usage=USAGE) -> str:
    """The router's record, as written with the request's final event."""
    attributes = billing.record_attributes(
        request_id=request_id, tenant_id=tenant_id, model="m", request_class="interactive",
        usage=usage, finish_reason="stop", device_type="cpu", worker_ids=["w0"])
    now = time.time_ns()
    return await redis.xadd(billing.BILLING_STREAM, billing.encode_record(
        attributes, start_unix_ns=now - 1_000_000, end_unix_ns=now))


async def _settle(redis, request_id: str, used: int, tenant_id: str = "acme") -> None:
    await Admission(redis).settle(Reservation(tenant_id, f"{request_id}#ab12", 100, ""), used,
                                  request_id)


async def _ship(redis) -> list[str]:
    """What a shipper does once costd has committed: read, acknowledge."""
    got = await redis.xreadgroup(billing.SHIPPER_GROUP, "s0", {billing.BILLING_STREAM: ">"})
    ids = [entry_id for _, entries in got for entry_id, _ in entries]
    if ids:
        await redis.xack(billing.BILLING_STREAM, billing.SHIPPER_GROUP, *ids)
    return ids


async def _record(redis, entry_id: str):
    (record,) = [r for r in await billing.read_records(redis, 0) if r.entry_id == entry_id]
    return record


def _rows(ledger, request_id: str):
    return ledger.store.usage_records_by_id([request_id])


def test_settled_request_never_shipped_is_unbilled_and_repair_bills_it_exactly_once(
        redis_server, tmp_path):
    async def scenario(redis, ledger):
        await _bill(redis, "r1")
        await _settle(redis, "r1", 19)
        reconciler = Reconciler(redis, ledger, grace_s=0)
        found = await reconciler.run(3600)
        (gap,) = found.gaps
        assert (gap.kind, gap.request_id, gap.tenant_id, gap.redis_tokens, gap.ledger_tokens,
                gap.repairable, gap.repaired) == (UNBILLED, "r1", "acme", 19, None, True, False)
        assert "waits for a shipper" in gap.detail and "prompt 12 (cached 4), completion 7" \
            in gap.detail
        assert _rows(ledger, "r1") == []             # reporting alone writes nothing

        repaired = await reconciler.run(3600, repair=True)
        assert repaired.num_repaired == 1 and repaired.open_gaps == []
        again = await reconciler.run(3600, repair=True)
        assert again.gaps == [] and again.num_matched == 1
        # The shipper ships it after all: still one row, billed once.
        await _ship(redis)
        final = await reconciler.run(3600)
        assert final.gaps == [] and final.num_matched == 1
        (row,) = _rows(ledger, "r1")
        usage = ledger.usage("acme")
        assert (usage.num_requests, usage.num_prompt_tokens, usage.num_cached_prompt_tokens,
                usage.num_completion_tokens) == (1, 12, 4, 7)
        assert row.tenant_id == "acme"
    _run(redis_server, tmp_path, scenario)


def test_fully_billed_request_has_no_gap(redis_server, tmp_path):
    async def scenario(redis, ledger):
        entry_id = await _bill(redis, "r2")
        await _settle(redis, "r2", 19)
        assert await _ship(redis) == [entry_id]
        ledger.insert([usage_record_of(await _record(redis, entry_id))])
        report = await Reconciler(redis, ledger, grace_s=0).run(3600, repair=True)
        assert report.gaps == [] and report.num_repaired == 0
        assert (report.num_matched, report.num_settled, report.num_records,
                report.num_ledger_rows) == (1, 1, 1, 1)
    _run(redis_server, tmp_path, scenario)


def test_ledger_tokens_that_differ_from_the_record_are_a_mismatch(redis_server, tmp_path):
    async def scenario(redis, ledger):
        entry_id = await _bill(redis, "r3")
        await _settle(redis, "r3", 19)
        await _ship(redis)
        row = usage_record_of(await _record(redis, entry_id))
        ledger.insert([dataclasses.replace(row, num_completion_tokens=8)])
        report = await Reconciler(redis, ledger, grace_s=0).run(3600, repair=True)
        (gap,) = report.gaps
        assert (gap.kind, gap.request_id, gap.redis_tokens, gap.ledger_tokens, gap.repaired) == (
            MISMATCH, "r3", 19, 20, False)
        assert "completion 7 vs ledger prompt 12 (cached 4), completion 8" in gap.detail
        assert "admission charged 19 tokens vs ledger 20" in gap.detail
        assert report.num_matched == 0
    _run(redis_server, tmp_path, scenario)


def test_settlement_without_a_record_is_reported_unrepairable(redis_server, tmp_path):
    async def scenario(redis, ledger):
        await _settle(redis, "r4", 33, tenant_id="globex")
        report = await Reconciler(redis, ledger, grace_s=0).run(3600, repair=True)
        (gap,) = report.gaps
        assert (gap.kind, gap.request_id, gap.tenant_id, gap.redis_tokens, gap.repairable,
                gap.repaired) == (UNBILLED, "r4", "globex", 33, False, False)
        assert "unrepairable" in gap.detail
        assert _rows(ledger, "r4") == []
    _run(redis_server, tmp_path, scenario)


def test_settlement_of_no_tokens_is_no_gap(redis_server, tmp_path):
    async def scenario(redis, ledger):
        await _settle(redis, "r5", 0)     # ended before any token: nothing to bill
        (settlement,) = await read_settlements(redis, 0)
        assert (settlement.tenant_id, settlement.request_id, settlement.used_tokens) == (
            "acme", "r5", 0)
        report = await Reconciler(redis, ledger, grace_s=0).run(3600)
        assert report.gaps == [] and report.num_settled == 0
    _run(redis_server, tmp_path, scenario)


def test_a_record_younger_than_the_grace_is_left_for_the_shipper(redis_server, tmp_path):
    async def scenario(redis, ledger):
        await _bill(redis, "r6")
        assert (await Reconciler(redis, ledger, grace_s=60).run(3600)).gaps == []
        assert [g.kind for g in (await Reconciler(redis, ledger, grace_s=0).run(3600)).gaps] \
            == [UNBILLED]
    _run(redis_server, tmp_path, scenario)


def test_ledger_row_unknown_to_redis_is_a_gap_until_redis_dropped_its_time(redis_server,
                                                                           tmp_path):
    async def scenario(redis, ledger):
        entry_id = await _bill(redis, "r7")
        row = usage_record_of(await _record(redis, entry_id))
        await redis.delete(billing.BILLING_STREAM)      # Redis lost it: the row is unexplained
        ledger.insert([row])
        (gap,) = (await Reconciler(redis, ledger, grace_s=0).run(3600)).gaps
        assert (gap.kind, gap.request_id, gap.ledger_tokens) == (UNKNOWN, "r7", 19)

        # Records trimmed after shipping, up to past the row's time: expired, not a gap.
        await redis.xgroup_create(billing.BILLING_STREAM, billing.SHIPPER_GROUP, id="0",
                                  mkstream=True)
        await _bill(redis, "r8")
        await _ship(redis)
        await asyncio.sleep(0.01)
        assert await billing.trim_shipped(redis, retention_s=0) == 1
        assert await billing.horizon_unix_ms(redis) >= row.end_unix_ns // 1_000_000
        report = await Reconciler(redis, ledger, grace_s=0).run(3600)
        assert report.gaps == [] and report.num_expired == 1
    _run(redis_server, tmp_path, scenario)


def test_trim_keeps_every_record_not_yet_shipped(redis_server, tmp_path):
    async def scenario(redis, ledger):
        shipped = await _bill(redis, "a")
        await _ship(redis)
        waiting = await _bill(redis, "b")
        await redis.xreadgroup(billing.SHIPPER_GROUP, "s0", {billing.BILLING_STREAM: ">"})
        undelivered = await _bill(redis, "c")
        await asyncio.sleep(0.01)
        assert await billing.trim_shipped(redis, retention_s=3600) == 0   # all young
        assert await billing.trim_shipped(redis, retention_s=0) == 1
        left = {r.entry_id: r.shipped for r in await billing.read_records(redis, 0)}
        assert left == {waiting: False, undelivered: False}
        assert shipped not in left
        await _ship(redis)      # only what was never delivered; "b" stays pending
        assert await billing.trim_shipped(redis, retention_s=0) == 0
    _run(redis_server, tmp_path, scenario)


def test_a_record_costd_refuses_is_reported_not_repaired(redis_server, tmp_path):
    async def scenario(redis, ledger):
        await _bill(redis, "r9", usage={**USAGE, "cached_prompt_tokens": 99})
        await _ship(redis)       # refused by costd, then acknowledged (permanent)
        (gap,) = (await Reconciler(redis, ledger, grace_s=0).run(3600, repair=True)).gaps
        assert (gap.kind, gap.repairable, gap.repaired) == (UNBILLED, False, False)
        assert "shipped, yet not in the ledger" in gap.detail and "costd refuses it" in gap.detail
        assert _rows(ledger, "r9") == []
    _run(redis_server, tmp_path, scenario)


def test_costd_timer_repairs_exports_gap_metrics_and_survives_a_failed_run(redis_server,
                                                                          tmp_path):
    from prometheus_client import CollectorRegistry

    from costd.reconcile.timer import ReconcileMetrics, ReconcileTimer

    async def scenario(redis, ledger):
        registry = CollectorRegistry()
        timer = ReconcileTimer(Reconciler(redis, ledger, grace_s=0), interval_s=300,
                               metrics=ReconcileMetrics(registry))
        await _bill(redis, "t1")                 # repairable
        await _settle(redis, "t2", 5)            # a settlement alone: stays open
        report = await timer.run_once()
        assert [(g.request_id, g.repaired) for g in report.gaps] == [("t1", True), ("t2", False)]
        sample = registry.get_sample_value
        assert sample("llmmesh_costd_reconcile_repaired_total") == 1
        assert sample("llmmesh_costd_reconcile_gaps", {"kind": UNBILLED}) == 1
        assert sample("llmmesh_costd_reconcile_gaps", {"kind": MISMATCH}) == 0
        assert sample("llmmesh_costd_reconcile_runs_total", {"outcome": "ok"}) == 1

        away = aioredis.Redis(port=1, socket_connect_timeout=0.2)   # nothing listens there
        timer.reconciler = Reconciler(away, ledger, grace_s=0)
        assert await timer.run_once() is None
        assert sample("llmmesh_costd_reconcile_runs_total", {"outcome": "failed"}) == 1
        await away.aclose()
    _run(redis_server, tmp_path, scenario)
