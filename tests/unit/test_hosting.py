"""ModelHost on two generated Llama GGUFs (other shapes, one vocabulary of their own): loading on
first use beside a running model, one step loop for both, unloading by keep_alive and by memory
(least recently used, never a busy or pinned model), and the catalog's validation."""
from __future__ import annotations

import asyncio

import pytest

from llmmesh.catalog import CatalogError, CatalogFile, parse_catalog
from llmmesh.errors import NotFound, Unavailable
from tests.tiny_gguf import write_tiny_llama
from workers.engine import EngineConfig, SamplingParams
from workers.hosting import LOADED, UNLOADED, ModelHost

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    d = tmp_path_factory.mktemp("ggufs")
    return (write_tiny_llama(str(d / "a.gguf"), seed=1),
            write_tiny_llama(str(d / "b.gguf"), hidden=96, heads=6, kv_heads=3, layers=3, seed=2))


def catalog(tmp_path, ggufs, a_extra="", b_extra=""):
    path = tmp_path / "models.toml"
    path.write_text(f'default = "a"\n[models.a]\nsource = "{ggufs[0]}"\nquantization = "fp32"\n'
                    f'kv_cache_mib = 1\n{a_extra}\n'
                    f'[models.b]\nsource = "{ggufs[1]}"\nquantization = "fp32"\nkv_cache_mib = 1\n'
                    f'{b_extra}\n')
    return CatalogFile(str(path))


def base() -> EngineConfig:
    return EngineConfig(calibrate=False, max_num_seqs=4, batch_nice=None)


async def host_with_room_for_one(tmp_path, ggufs) -> ModelHost:
    """A host serving `a` whose budget holds one model, not both (sizes measured by a load)."""
    probe = ModelHost(catalog(tmp_path, ggufs), base())
    await probe.start(["a", "b"])
    one = max(h.memory_bytes for h in probe.hosted.values())
    await probe.engine.shutdown()
    host = ModelHost(catalog(tmp_path, ggufs), base(), memory_budget_bytes=int(one * 1.5))
    await host.start(["a"])
    return host


async def run(host: ModelHost, model: str, rid: str, prompt=(5, 6, 7, 8), sampling=GREEDY):
    async with host.use(model) as hosted:
        tokens = []
        async for out in host.engine.generate(rid, list(prompt), sampling, model=model):
            tokens += out.new_token_ids
        return hosted.entry.name, tokens


def test_a_second_model_loads_on_first_use_and_each_answers_as_itself(tmp_path, ggufs):
    async def main():
        host = ModelHost(catalog(tmp_path, ggufs), base())
        await host.start(["a"])
        try:
            states_before = {s.name: s.state for s in host.states()}
            (_, a1), (_, b1), (_, a2) = [await run(host, m, f"r{i}") for i, m in
                                         enumerate(("a", "b", "a"))]
            return states_before, {s.name: s.state for s in host.states()}, a1, b1, a2, host
        finally:
            await host.engine.shutdown()

    before, after, a1, b1, a2, host = asyncio.run(main())
    assert before == {"a": LOADED, "b": UNLOADED} and after == {"a": LOADED, "b": LOADED}
    assert a1 == a2 and a1 != b1          # same prompt, other weights: another answer
    assert host.hosted["b"].load_s > 0 and host.num_loads == 2


def test_a_budget_for_one_unloads_the_idle_model_and_reloads_it_on_demand(tmp_path, ggufs):
    async def main():
        host = await host_with_room_for_one(tmp_path, ggufs)
        try:
            _, a1 = await run(host, "a", "x1")
            await run(host, "b", "x2")
            after_b = {s.name: s.state for s in host.states()}
            _, a2 = await run(host, "a", "x3")
            return after_b, a1, a2, host.num_unloads
        finally:
            await host.engine.shutdown()

    after_b, a1, a2, unloads = asyncio.run(main())
    assert after_b == {"a": UNLOADED, "b": LOADED}
    assert a1 == a2 and unloads == 2       # reloaded, and answers the same


def test_a_running_request_is_never_cut_by_an_unload(tmp_path, ggufs):
    async def main():
        host = await host_with_room_for_one(tmp_path, ggufs)
        try:
            long = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)
            running = asyncio.create_task(run(host, "a", "long", sampling=long))
            await asyncio.sleep(0.05)
            b = await run(host, "b", "short")      # waits for `a` to go idle, then takes its room
            name, tokens = await running
            return tokens, b, {s.name: s.state for s in host.states()}
        finally:
            await host.engine.shutdown()

    tokens, (b_name, b_tokens), states = asyncio.run(main())
    assert len(tokens) == 120 and b_name == "b" and len(b_tokens) == 6
    assert states == {"a": UNLOADED, "b": LOADED}


def test_pinned_models_stay_and_keep_alive_unloads_only_idle_ones(tmp_path, ggufs):
    async def main():
        host = ModelHost(catalog(tmp_path, ggufs, a_extra="pinned = true",
                                 b_extra="keep_alive_s = 0"), base())
        await host.start([])                       # pinned `a` loads anyway
        try:
            loaded_at_start = sorted(host.engine.models)
            await run(host, "b", "k1")
            async with host.use("b"):
                busy = await host.unload_idle()    # in flight: kept
            idle = await host.unload_idle()
            return loaded_at_start, busy, idle, sorted(host.engine.models)
        finally:
            await host.engine.shutdown()

    loaded_at_start, busy, idle, left = asyncio.run(main())
    assert loaded_at_start == ["a"] and busy == [] and idle == ["b"] and left == ["a"]


def test_a_model_that_cannot_fit_beside_pinned_ones_is_refused_with_the_numbers(tmp_path, ggufs):
    async def main():
        host = ModelHost(catalog(tmp_path, ggufs, a_extra="pinned = true"), base())
        await host.start([])
        host.memory_budget_bytes = (host.hosted["a"].memory_bytes
                                    + host.estimate_bytes(host._hosted("b")) // 2)
        try:
            with pytest.raises(Unavailable, match="does not fit beside this worker's pinned"):
                await run(host, "b", "n1")
            with pytest.raises(NotFound, match="it serves: a, b"):
                await run(host, "c", "n2")
        finally:
            await host.engine.shutdown()

    asyncio.run(main())


@pytest.mark.parametrize("body, message", [
    ('[models.a]\nquantization = "int4"\n', r":1: models.a.source: required"),
    ('[models.a]\nsource = "x"\nquantisation = "int4"\n', r":3: models.a.quantisation: unknown key"),
    ('[models.a]\nsource = "x"\nquantization = "int3"\n', r":3: models.a.quantization: must be one of"),
    ('default = "b"\n[models.a]\nsource = "x"\n', r":1: default: 'b' is not one of"),
    ('[models.a]\nsource = "x"\nkeep_alive_s = -5\n', r"keep_alive_s: must be seconds >= 0"),
    ('[models.a]\nsource = "x"\nallowed_tenants = "acme"\n', r"allowed_tenants: must be a list"),
])
def test_a_bad_catalog_is_refused_naming_file_line_and_key(body, message):
    with pytest.raises(CatalogError, match=message):
        parse_catalog("models.toml", body)


def test_the_shipped_catalog_serves_the_packaged_model_as_int4_and_as_fp32():
    from llmmesh.catalog import load_catalog

    c = load_catalog()
    default, fp32 = c.get(""), c.get("smollm2-135m-instruct-fp32")
    assert default.name == "smollm2-135m-instruct" and default.pinned
    assert fp32.quantization == "fp32" and fp32.gguf_path == default.gguf_path
    with pytest.raises(KeyError, match="known: smollm2-135m-instruct, smollm2-135m-instruct-fp32"):
        c.get("gpt-5")
