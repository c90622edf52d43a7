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
