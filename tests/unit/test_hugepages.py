"""KV cache tensors on transparent huge pages (workers.model.hugepages): zero-filled, 2 MiB
aligned, and backed by huge pages where the kernel offers them on request; ordinary tensors
when turned off."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from workers.model import hugepages
from workers.model.attention import allocate_kv_caches
from workers.model.config import ModelConfig


def _huge_kib(address: int) -> int:
    """AnonHugePages of the mapping holding `address` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    return 0


def _offered() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


needs_thp = pytest.mark.skipif(not sys.platform.startswith("linux") or not _offered(),
                               reason="no transparent huge pages here")


@needs_thp
def test_zeros_are_aligned_zero_and_on_huge_pages(monkeypatch):
    monkeypatch.delenv("LLMMESH_HUGEPAGES", raising=False)
    t = hugepages.zeros((8, 1 << 20), torch.float32)          # 32 MiB
    assert t.shape == (8, 1 << 20) and t.is_contiguous() and not t.any()
    assert t.data_ptr() % hugepages.HUGE_PAGE == 0
    assert _huge_kib(t.data_ptr()) >= 2048, "not backed by huge pages"


@needs_thp
def test_turned_off_gives_an_ordinary_tensor(monkeypatch):
    """Off: no madvise, a plain zero tensor. The page check runs in a fresh process: in this
    one, an earlier test's advised range can lie inside glibc's heap and be handed out again
    (the advice stays on the range after free), which gave an ordinary torch.zeros 14 MiB of
    huge pages once in the full suite."""
    monkeypatch.setenv("LLMMESH_HUGEPAGES", "off")
    if "[always]" in open("/sys/kernel/mm/transparent_hugepage/enabled").read():
        pytest.skip("the kernel gives every large mapping huge pages")
    advised = []
    monkeypatch.setattr(hugepages, "_madvise", lambda *a: advised.append(a) or True)
    t = hugepages.zeros((8, 1 << 20), torch.float32)
    assert not t.any() and t.shape == (8, 1 << 20) and advised == []
    monkeypatch.delenv("LLMMESH_HUGEPAGES")
    hugepages.zeros((8, 1 << 20), torch.float32)
    assert len(advised) == 1          # the spy does see the call when it is on
    code = ("import torch; from workers.model import hugepages; "
            "from tests.unit.test_hugepages import _huge_kib; "
            "t = hugepages.zeros((8, 1 << 20), torch.float32); print(_huge_kib(t.data_ptr()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "LLMMESH_HUGEPAGES": "off"}, timeout=120)
    assert out.stdout.split()[-1] == "0", out.stdout


def test_small_tensors_stay_ordinary():
    t = hugepages.zeros((3, 5), torch.float32)
    assert t.shape == (3, 5) and not t.any()


def _config() -> ModelConfig:
    return ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=3,
                       num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5,
                       rope_theta=10000.0, max_position_embeddings=128, tie_word_embeddings=True,
                       bos_token_id=None, eos_token_id=0)


def test_every_layer_gets_its_own_contiguous_kv_cache_in_one_buffer():
    caches = allocate_kv_caches(_config(), num_blocks=512, block_size=16, device="cpu",
                                dtype=torch.float32)
    assert len(caches) == 3
    for c in caches:
        assert c.shape == (2, 512, 16, 2, 16) and c.is_contiguous() and not c.any()
    caches[0].fill_(1.0)        # layers do not overlap
    assert not caches[1].any() and not caches[2].any()


@needs_thp
def test_the_cpu_kv_cache_is_on_huge_pages(monkeypatch):
    """A decode step reads it in scattered 12 KiB blocks: with 4 KiB pages, a TLB miss each."""
    monkeypatch.delenv("LLMMESH_HUGEPAGES", raising=False)
    caches = allocate_kv_caches(_config(), num_blocks=2048, block_size=16, device="cpu",
                                dtype=torch.float32)
    assert all(_huge_kib(c.data_ptr()) >= 2048 for c in caches)


def test_arena_copies_tensors_in_order_into_one_aligned_buffer():
    tensors = [torch.arange(37, dtype=torch.int8), torch.randn(3, 5).half(),
               torch.randn(7, 3), torch.randint(0, 255, (1, 130), dtype=torch.uint8)]
    views = hugepages.arena(tensors)
    storage = {v.untyped_storage().data_ptr() for v in views}
    assert len(storage) == 1, "one buffer"
    assert [v.data_ptr() for v in views] == sorted(v.data_ptr() for v in views), "in order"
    for t, v in zip(tensors, views):
        assert v.dtype == t.dtype and v.shape == t.shape and v.is_contiguous()
        assert v.data_ptr() % 64 == 0 and torch.equal(v, t)
        assert v.data_ptr() != t.data_ptr(), "a copy, not the original"
    views[0].fill_(5)                   # neighbours do not overlap
    assert torch.equal(views[1], tensors[1]) and torch.equal(tensors[0], torch.arange(37, dtype=torch.int8))


@needs_thp
def test_an_arena_of_megabytes_is_on_huge_pages(monkeypatch):
    monkeypatch.delenv("LLMMESH_HUGEPAGES", raising=False)
    views = hugepages.arena([torch.ones(3 << 20, dtype=torch.uint8), torch.ones(5, 1 << 20)])
    assert views[0].data_ptr() % hugepages.HUGE_PAGE == 0
    assert _huge_kib(views[0].data_ptr()) >= 2048, "not backed by huge pages"


def test_a_quantized_model_streams_its_packed_weights_from_one_buffer():
    """Every layer's packed projections, then the output layer, in the order a decode step reads
    them, in one buffer (4 KiB pages cost decode @1 ~6% on a Zen 4); outputs unchanged."""
    from workers.model import ModelConfig, build_random_model
    from workers.model.kernels import cpu_kernels
    from workers.model.linear import convert_linear
    from workers.model.quantize import _PROJECTIONS, quantize_model
    if cpu_kernels() is None:
        pytest.skip("no CPU kernels here: nothing is packed")
    config = ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0,
                         rms_norm_eps=1e-5, max_position_embeddings=64,
                         tie_word_embeddings=True, bos_token_id=None, eos_token_id=0)
    for mode in ("int8", "int4"):
        model = build_random_model(config, seed=3)
        reference = build_random_model(config, seed=3)
        quantize_model(model, mode, device="cpu", dtype=torch.float32)
        modules = [getattr(getattr(layer, parent), name) for layer in model.layers
                   for parent, name in (path.split(".") for path in _PROJECTIONS)]
        modules.append(model.lm_head)
        packed = [t for m in modules for t in m.tensors.values()]
        assert len({t.untyped_storage().data_ptr() for t in packed}) == 1, mode
        starts = [t.data_ptr() for t in packed]
        assert starts == sorted(starts), f"{mode}: not in the order a step reads them"
        assert all(m._packed_weight is m.tensors["packed"] for m in modules)
        # The same values as packing without the buffer (what the kernels read is unchanged).
        layer = reference.layers[1].mlp.down_proj
        alone = convert_linear(layer, mode, "cpu", torch.float32)
        for name, t in alone.tensors.items():
            assert torch.equal(model.layers[1].mlp.down_proj.tensors[name], t), (mode, name)
        x = torch.randn(3, config.intermediate_size * 2)
        torch.testing.assert_close(model.layers[1].mlp.down_proj(x, silu_mul=True),
                                   alone(x, silu_mul=True), rtol=0, atol=0)
