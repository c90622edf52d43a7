"""The engine report's roofline (bench/engine/roofline.py): bounds from measured peaks, and a
measurement that runs."""
from __future__ import annotations

import pytest
import torch

from bench.engine import roofline
from bench.engine.ours import ModeResult
from bench.engine.roofline import Roofline, decode_bound_tps, prefill_bound_tps

ROOF = Roofline(read_gbs=20.0, int8_gops=200.0, fp32_gflops=100.0, bf16_gflops=50.0, int_mm_gops=2.0)


def test_decode_is_bandwidth_bound_alone_and_compute_bound_in_a_big_batch():
    streamed, params = 100e6, 130e6        # bytes per step, weights per token
    assert decode_bound_tps(ROOF, "int4", streamed, params, 1) == pytest.approx(200.0)  # 20e9/100e6
    # 64 sequences: 2*130e6*64 ops at 200 GOP/s = 83 ms > 5 ms of streaming.
    assert decode_bound_tps(ROOF, "int4", streamed, params, 64) == pytest.approx(200e9 / (2 * 130e6))
    # fp32 weights are bounded by the fp32 GEMM peak, not the int8 one.
    assert decode_bound_tps(ROOF, "fp32", streamed, params, 64) == pytest.approx(100e9 / (2 * 130e6))
    assert prefill_bound_tps(ROOF, 100e6) == pytest.approx(200e9 / 2e8)


def test_a_decode_step_must_also_read_each_sequences_kv_cache():
    streamed, params, kv = 100e6, 130e6, 10e6
    # One sequence: 110 MB at 20 GB/s; four: 140 MB (7 ms > 5.2 ms of int8 arithmetic); the
    # compute term is unchanged.
    assert decode_bound_tps(ROOF, "int4", streamed, params, 1, kv) == pytest.approx(20e9 / 110e6)
    assert decode_bound_tps(ROOF, "int4", streamed, params, 4, kv) == pytest.approx(4 * 20e9 / 140e6)
    assert decode_bound_tps(ROOF, "int4", streamed, params, 64, kv) == pytest.approx(
        decode_bound_tps(ROOF, "int4", streamed, params, 64))
    m = ModeResult("int4", decode_tps={1: 150.0}, weight_bytes={"streamed_per_step": 100_000_000},
                   linear_params=130_000_000, prefill_params=100_000_000, kv_read_per_seq=kv)
    lines = roofline.table(ROOF, [m], [1])
    assert "150 of 182 (82%)" in next(line for line in lines if line.startswith("| int4"))
    assert any("int4 75% of 200" in line for line in lines)   # the weights alone, as before


def test_the_int8_bound_is_the_machines_fastest_int8_gemm_not_ours_alone():
    """On VNNI and AMX CPUs oneDNN's int8 GEMM (torch._int_mm) outruns our kernels; the bound
    then takes it, and the table also shows decode against our own peak (the former bound)."""
    streamed, params = 100e6, 130e6
    faster = Roofline(read_gbs=20.0, int8_gops=200.0, fp32_gflops=100.0, bf16_gflops=50.0,
                      int_mm_gops=300.0)
    assert decode_bound_tps(faster, "int8", streamed, params, 64) == pytest.approx(300e9 / (2 * 130e6))
    assert decode_bound_tps(faster, "fp32", streamed, params, 64) == pytest.approx(100e9 / (2 * 130e6))
    assert prefill_bound_tps(faster, 100e6) == pytest.approx(300e9 / 2e8)
    m = ModeResult("int4", decode_tps={1: 150.0, 64: 700.0},
                   weight_bytes={"streamed_per_step": 100_000_000}, linear_params=130_000_000,
                   prefill_params=100_000_000)
    lines = roofline.table(faster, [m], [1, 64])
    assert "int8 GEMM: 300 GOP/s" in lines[0] and "ours (best at 128/512 rows: 200)" in lines[0]
    assert "700 of 1,154 (61%)" in next(line for line in lines if line.startswith("| int4"))
    # @64 against ours alone: 200e9 / 2.6e8 = 769 tok/s; @1 is bandwidth-bound either way.
    assert any("int4 @64 91% of 769" in line and "@1 " not in line for line in lines)
    # Where ours is the faster, the bound and the table are as before.
    assert decode_bound_tps(ROOF, "int8", streamed, params, 64) == pytest.approx(200e9 / (2 * 130e6))
    assert not any("own int8 peak" in line for line in roofline.table(ROOF, [m], [1, 64]))


def test_the_table_shows_each_measurement_when_the_host_moved_between_them():
    """The bound takes the better of the before and after measurements; the table shows both,
    so a bound lifted by one fast moment (a shared host) is visible as such."""
    before = Roofline(read_gbs=51.0, int8_gops=1100.0, fp32_gflops=100.0, bf16_gflops=50.0,
                      int_mm_gops=1800.0)
    after = Roofline(read_gbs=86.2, int8_gops=1290.0, fp32_gflops=90.0, bf16_gflops=60.0,
                     int_mm_gops=1750.0)
    lines = roofline.table(roofline.best_of(before, after), [], [1], (before, after))
    assert "streaming read: 86.2 GB/s" in lines[0]
    assert lines[1] == ("- each measurement (before our cells, after them): streaming read "
                        "51.0 / 86.2 GB/s; int8 GEMM ours 1100 / 1290, torch._int_mm 1800 / 1750 GOP/s")
    assert not any("each measurement" in line for line in roofline.table(before, [], [1]))


def test_kv_read_per_step_counts_every_layers_k_and_v():
    from workers.model import ModelConfig, build_random_model
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=3,
                      num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=10000.0,
                      rms_norm_eps=1e-5, max_position_embeddings=64, tie_word_embeddings=True,
                      bos_token_id=None, eos_token_id=0)
    model = build_random_model(cfg)
    assert roofline.kv_read_per_step(model, torch.float32, 100.5) == 3 * 2 * 2 * 8 * 4 * 100.5
    assert roofline.kv_read_per_step(model, torch.float16, 100.5) == 3 * 2 * 2 * 8 * 2 * 100.5


def test_the_table_shows_each_cell_as_a_share_of_its_bound():
    m = ModeResult("int4", prefill_tps={1: 500.0}, decode_tps={1: 150.0},
                   weight_bytes={"streamed_per_step": 100_000_000}, linear_params=130_000_000,
                   prefill_params=100_000_000)
    lines = roofline.table(ROOF, [m, ModeResult("bf16")], [1])
    assert "20.0 GB/s" in lines[0]
    row = next(line for line in lines if line.startswith("| int4"))
    assert "150 of 200 (75%)" in row and "500 of 1,000 (50%)" in row
    assert not any(line.startswith("| bf16") for line in lines)   # no cells measured


def test_measure_runs_and_finds_positive_peaks():
    roof = roofline.measure(read_mib=8, gemm=256, rows=(16,), repeats=1)
    assert roof.read_gbs > 0 and roof.int8_gops > 0 and roof.fp32_gflops > 0 and roof.bf16_gflops > 0


@pytest.mark.parametrize("tied", [True, False])
def test_linear_params_count_the_output_layer_for_decode_only(tied):
    from workers.model.config import ModelConfig
    from workers.model.loader import build_random_model
    cfg = ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0,
                      rms_norm_eps=1e-5, max_position_embeddings=128, tie_word_embeddings=tied,
                      bos_token_id=1, eos_token_id=2)
    decode, prefill = roofline.linear_params(build_random_model(cfg))
    per_layer = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 96   # q, k, v, o, gate, up, down
    assert prefill == 2 * per_layer
    assert decode - prefill == 96 * 64


def test_the_streaming_read_is_also_measured_on_huge_pages(monkeypatch):
    """The packed weights lie on huge pages, which stream faster than 4 KiB ones: a read bound
    from 4 KiB pages alone could be passed by a decode cell."""
    from workers.model import hugepages
    asked = []
    real = hugepages.zeros
    monkeypatch.setattr(hugepages, "zeros", lambda shape, dtype: asked.append(shape) or real(shape, dtype))
    roof = roofline.measure(read_mib=8, gemm=256, rows=(16,), repeats=1)
    assert (8 * 2**20 // 4,) in asked and roof.read_gbs > 0


def test_best_of_keeps_each_rate_at_its_better_measurement():
    later = Roofline(read_gbs=25.0, int8_gops=150.0, fp32_gflops=110.0, bf16_gflops=40.0,
                     int_mm_gops=1.0)
    assert roofline.best_of(ROOF, later) == Roofline(25.0, 200.0, 110.0, 50.0, 2.0)
