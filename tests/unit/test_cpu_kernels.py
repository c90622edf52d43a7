"""AVX2 kernels against plain torch references, exact up to fp32 summation order.

The GEMM quantizes activations to int8 per 32-block (as llama.cpp does); the reference emulates
that step in float64, so the only remaining difference is the order of fp32 sums.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from workers.model import quant_formats as qf
from workers.model.kernels import cpu_kernels
from workers.model.linear import QuantizedLinear

ext = cpu_kernels()
pytestmark = pytest.mark.skipif(ext is None,
                                reason="CPU kernels unavailable (no AVX2 or no compiler)")

SHAPES = [(1, 64, 96), (7, 100, 200), (32, 48, 576), (5, 13, 40), (64, 24, 1536), (9, 40, 64)]


def _has_vnni() -> bool:
    if ext is None:
        return False
    default = ext.vnni_mode()
    try:
        ext.set_tunable("vnni", 1.0)     # refused when the CPU lacks AVX-512 VNNI
    except RuntimeError:
        return False
    ext.set_tunable("vnni", float(default))
    return True


_VNNI = _has_vnni()


@pytest.fixture(params=["avx2", "avx512_vnni", "vnni_pairs", "auto"])
def isa(request):
    """Each GEMM tile implementation this CPU can run: AVX2 always; AVX-512 VNNI (the pattern
    tiles forced for every call, int8 and int4), the VNNI pair tiles (two weight tiles per
    activation broadcast) for every call from one row, and the default per-call choice where
    the CPU has it."""
    if request.param != "avx2" and not _VNNI:
        pytest.skip("CPU has no AVX-512 VNNI")
    default, pair_rows = ext.vnni_mode(), ext.pair_min_rows()
    ext.set_tunable("vnni", {"avx2": 0.0, "avx512_vnni": 2.0, "vnni_pairs": 1.0,
                             "auto": 1.0}[request.param])
    if _VNNI:   # the pair knob is refused (non-zero) where the CPU has no VNNI
        ext.set_tunable("vnni_pair_min_rows", 1.0 if request.param == "vnni_pairs" else pair_rows)
    yield request.param
    ext.set_tunable("vnni", float(default))
    if _VNNI:
        ext.set_tunable("vnni_pair_min_rows", float(pair_rows))


def quantized_activations(x: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest int8 per 32-block with scale amax / 127, back in float64.

    In fp32 like the kernel (x * (1 / scale)): float64 would round a few near-.5 values the
    other way, one int8 step apart."""
    rows, k = x.shape
    kp = -(-k // 32) * 32
    blocks = F.pad(x.float(), (0, kp - k)).view(rows, -1, 32)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = torch.round(blocks * inverse)
    return (q.double() * scale.double()).view(rows, kp)[:, :k]


def reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return quantized_activations(x) @ weight.double().t()


def run(mode: str, x: torch.Tensor, w: torch.Tensor, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """(kernel output, the dequantized weight it stands for)."""
    n, k = w.shape
    if mode == "int8":
        q, scale = qf.quantize_int8(w)
        out = ext.qgemm(x, qf.pack_int8(q), qf.pack_int8_scale(scale), n, k, False,
                        kwargs.get("pre", 0), kwargs.get("norm_w"), kwargs.get("eps", 0.0),
                        kwargs.get("out"), kwargs.get("out") is not None)
        return out, qf.dequantize_int8(q, scale, torch.float64)
    q, scale, low = qf.quantize_int4(w)
    out = ext.qgemm(x, qf.pack_int4(q), qf.pack_int4_scales(scale, low), n, k, True,
                    kwargs.get("pre", 0), kwargs.get("norm_w"), kwargs.get("eps", 0.0),
                    kwargs.get("out"), kwargs.get("out") is not None)
    return out, qf.dequantize_int4(q, scale, low, k, torch.float64)


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("rows,n,k", SHAPES)
def test_qgemm_matches_reference(mode, rows, n, k, isa):
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    x, w = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen)
    out, weight = run(mode, x, w)
    expected = reference(x, weight)
    assert out.shape == (rows, n)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-4)


def test_pair_min_rows_is_zero_where_the_pair_tiles_never_run():
    """`pair_min_rows()` answers from how many rows the VNNI pair tiles run: with the VNNI tiles
    off (as on a CPU without them) or forced to the pattern tiles, never (0); it answered 4,
    the rows a VNNI CPU starts them from, wherever they could not run."""
    default, rows = ext.vnni_mode(), ext.pair_min_rows()
    try:
        ext.set_tunable("vnni", 0.0)
        assert ext.pair_min_rows() == 0
        if _VNNI:
            ext.set_tunable("vnni", 2.0)
            assert ext.pair_min_rows() == 0
            ext.set_tunable("vnni", 1.0)
            assert ext.pair_min_rows() > 0
    finally:
        ext.set_tunable("vnni", float(default))
    assert ext.pair_min_rows() == rows


@pytest.mark.skipif(not _VNNI, reason="CPU has no AVX-512 VNNI")
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_the_pair_tiles_prefetch_lead_changes_no_output(mode):
    """The pair tiles prefetch the next pair of weight tiles (past the weight's end for the
    last pair, and an odd last block runs apart): outputs are bitwise those of the old fixed
    lead, at one row block and at several, forked or not."""
    default = ext.vnni_mode()
    ext.set_tunable("vnni", 1.0)
    try:
        for rows, n, k in ((32, 3 * 8 * 7, 576), (5, 8 * 9, 1536), (17, 8 * 130, 64)):
            gen = torch.Generator().manual_seed(rows + n + k)
            x, w = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen)
            ext.set_tunable("pair_next", 0.0)
            before, weight = run(mode, x, w)
            ext.set_tunable("pair_next", 1.0)
            after, _ = run(mode, x, w)
            assert torch.equal(before, after), (rows, n, k)
            torch.testing.assert_close(after.double(), reference(x, weight), rtol=1e-5, atol=1e-4)
    finally:
        ext.set_tunable("pair_next", 1.0)
        ext.set_tunable("vnni", float(default))


@pytest.mark.parametrize("segments", [1.0, 0.0])
@pytest.mark.parametrize("threads", [2, 3])
def test_the_pool_computes_every_output_block_exactly_once(segments, threads):
    """Calls large enough to fork (300+ KB of weights), odd block counts, 2 and 3 threads: with
    per-thread segments (and with one shared counter) each block is computed once. Accumulating
    into zeros shows a block done twice as twice its value, and a block skipped as zeros."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    ext.set_tunable("pool_segments", segments)
    try:
        for nb, rows in ((37, 1), (75, 1), (129, 3), (600, 1)):
            n, k = 8 * nb - 3, 1152
            gen = torch.Generator().manual_seed(nb)
            x, w = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen)
            out, weight = run("int8", x, w, out=torch.zeros(rows, n))
            torch.testing.assert_close(out.double(), reference(x, weight), rtol=1e-5, atol=1e-4)
    finally:
        ext.set_tunable("pool_segments", 1.0)
        torch.set_num_threads(before)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_qgemm_quantization_error_is_small_against_fp32(mode, isa):
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(32, 576, generator=gen), torch.randn(200, 576, generator=gen)
    out, _ = run(mode, x, w)
    exact = x @ w.t()
    relative = (out - exact).norm() / exact.norm()
    assert relative < {"int8": 0.02, "int4": 0.12}[mode]


def test_fused_rms_norm_silu_and_residual(isa):
    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(7, 96, generator=gen), torch.randn(40, 96, generator=gen)
    norm_w = torch.rand(96, generator=gen) + 0.5
    normed = norm_w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    out, weight = run("int8", x, w, pre=1, norm_w=norm_w, eps=1e-5)
    torch.testing.assert_close(out.double(), reference(normed, weight), rtol=1e-5, atol=1e-4)

    gate_up = torch.randn(7, 192, generator=gen)
    residual = torch.randn(7, 40, generator=gen)
    acc = residual.clone()
    out, weight = run("int4", gate_up, w, pre=2, out=acc)
    activated = F.silu(gate_up[:, :96]) * gate_up[:, 96:]
    assert out.data_ptr() == acc.data_ptr()   # accumulated in place
    torch.testing.assert_close(out.double(), residual.double() + reference(activated, weight),
                               rtol=1e-5, atol=1e-4)


def test_rms_norm_and_silu_mul_kernels():
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(5, 576, generator=gen), torch.randn(576, generator=gen)
    expected = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    torch.testing.assert_close(ext.rms_norm(x, w, 1e-5), expected, rtol=1e-5, atol=1e-5)
    g = torch.randn(5, 200, generator=gen) * 4
    torch.testing.assert_close(ext.silu_mul(g), F.silu(g[:, :100]) * g[:, 100:],
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows,vocab", [(1, 49152), (6, 1001), (33, 7), (2, 1)])
def test_argmax_rows_matches_torch_argmax(rows, vocab):
    gen = torch.Generator().manual_seed(rows * vocab)
    x = torch.randn(rows, vocab, generator=gen)
    assert torch.equal(ext.argmax_rows(x), x.argmax(1))
    # Ties: the first index wins, in the vector part and in the scalar tail alike.
    x = torch.randint(0, 3, (rows, vocab), generator=gen).float()
    assert torch.equal(ext.argmax_rows(x), x.argmax(1))
    # A row of -inf (every token masked) gives 0, as torch does.
    x[0] = float("-inf")
    assert ext.argmax_rows(x)[0].item() == x.argmax(1)[0].item() == 0


def test_argmax_rows_nan_and_strided_rows():
    x = torch.randn(3, 100)
    x[1, 57] = float("nan")
    x[1, 80] = float("nan")
    x[2, 98] = float("nan")               # in the scalar tail past the last 8-wide block
    got = ext.argmax_rows(x)
    assert got.tolist() == x.argmax(1).tolist()
    assert got[1].item() == 57 and got[2].item() == 98
    wide = torch.randn(4, 300)
    view = wide[:, 10:210]                # rows 300 floats apart
    assert torch.equal(ext.argmax_rows(view), view.argmax(1))
    with pytest.raises(RuntimeError, match="contiguous"):
        ext.argmax_rows(wide.t())


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_packed_and_dequantized_paths_agree(mode):
    """The fallback (CUDA, no AVX2) and the kernel path compute the same projection."""
    gen = torch.Generator().manual_seed(4)
    w, x = torch.randn(72, 100, generator=gen), torch.randn(3, 100, generator=gen)
    packed = QuantizedLinear.from_weight(w, mode, "cpu", pack=True)
    plain = QuantizedLinear.from_weight(w, mode, "cpu", pack=False)
    expected = plain(x).double()
    # The kernel also rounds activations to int8: compare at the activation-rounding level.
    torch.testing.assert_close(packed(x).double(), expected, rtol=0.05,
                               atol=0.05 * expected.abs().max().item())
    assert packed.weight_bytes() < w.numel() * (2 if mode == "int8" else 1)


def _mixed_batch(shapes, heads: int, kv_heads: int, dim: int, block: int, num_blocks: int,
                 seed: int, cache_dtype: torch.dtype = torch.float32):
    """A paged batch of (context before this step, new tokens) sequences with their new K/V
    written to a random cache: (qkv, cache, plan, the torch path's attention output)."""
    from workers.model.attention import (AttentionMetadata, paged_attention, prepare_attention,
                                         write_kv)
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(2, num_blocks, block, kv_heads, dim, generator=gen).to(cache_dtype)
    width = max(-(-(c + n) // block) for c, n in shapes)
    tables, slots, starts = [], [], [0]
    free = iter(torch.randperm(num_blocks, generator=gen).tolist())
    for context, new in shapes:
        table = [next(free) for _ in range(-(-(context + new) // block))]
        tables.append(table + [0] * (width - len(table)))
        slots += [table[p // block] * block + p % block for p in range(context, context + new)]
        starts.append(starts[-1] + new)
    total = starts[-1]
    meta = AttentionMetadata(torch.tensor(slots), torch.tensor(starts),
                             torch.tensor([c + n for c, n in shapes]), torch.tensor(tables),
                             max_seq_len=max(c + n for c, n in shapes),
                             max_query_len=max(n for _, n in shapes))
    plan = prepare_attention(meta, block)
    qkv = torch.randn(total, (heads + 2 * kv_heads) * dim, generator=gen)
    q, k, v = qkv.split((heads * dim, kv_heads * dim, kv_heads * dim), dim=-1)
    q = q.reshape(total, heads, dim)
    k, v = k.reshape(total, kv_heads, dim), v.reshape(total, kv_heads, dim)
    write_kv(cache, plan.slot_mapping, k, v)
    # The torch path attends a fresh prompt over its own K/V, not the cache's: as rounded there.
    k, v = k.to(cache_dtype).float(), v.to(cache_dtype).float()
    expected = paged_attention(q, k, v, cache, plan).reshape(total, heads * dim)
    return qkv, cache, plan, expected


def test_fused_attention_matches_torch_paged_attention_on_a_mixed_batch():
    """Decode tokens, a prompt chunk with earlier context and a fresh prompt in one batch:
    the C++ op (used on CPU) and the torch path (used elsewhere) agree."""
    from workers.model.attention import fused_paged_attention
    heads, kv_heads = 6, 2
    # (context before this step, new tokens): two decodes, a chunk after 9 tokens, a fresh prompt
    qkv, cache, plan, expected = _mixed_batch([(6, 1), (13, 1), (9, 5), (0, 7)], heads, kv_heads,
                                              dim=16, block=4, num_blocks=40, seed=5)
    out = fused_paged_attention(ext, qkv, cache, plan, heads, kv_heads)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.fixture(params=["avx2", "avx512"])
def attention_isa(request):
    """The head_dim-64 decode attention's loops on AVX2, and on AVX-512 where the CPU has it
    (attention_avx512.cpp, the default there)."""
    from workers.model.kernels import _cpu_flags
    has = {"avx512f", "avx512bw", "avx512dq", "avx512vl"} <= _cpu_flags()
    if request.param == "avx512" and not has:
        pytest.skip("CPU has no AVX-512")
    ext.set_tunable("attention_avx512", float(request.param == "avx512"))
    yield request.param
    ext.set_tunable("attention_avx512", float(has))


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("dim", [64, 16])
def test_fused_attention_over_an_fp16_cache_matches_torch_over_the_same_cache(
        cache_dtype, dim, attention_isa):
    """The kernels widen an fp16 cache as they load (decode rows, prompt spans, the generic
    head size): the same result as the torch path over the same fp16 values, in fp32."""
    from workers.model.attention import fused_paged_attention
    shapes = [(30, 1), (37, 20), (0, 45), (12, 5), (100, 1), (3, 130)]
    qkv, cache, plan, expected = _mixed_batch(shapes, 9, 3, dim=dim, block=16, num_blocks=64,
                                              seed=13, cache_dtype=cache_dtype)
    assert cache.dtype == cache_dtype
    out = fused_paged_attention(ext, qkv, cache, plan, 9, 3)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


def test_rope_write_kv_rounds_into_an_fp16_cache_as_torch_does():
    """The fused RoPE + cache write stores fp16 by round-to-nearest, what the torch path's
    write_kv (a cast) stores: the same values at the same slots, nothing elsewhere."""
    from workers.model.attention import write_kv
    from workers.model.llama import apply_rotary
    gen = torch.Generator().manual_seed(2)
    heads, kv_heads, dim, tokens = 4, 2, 64, 5
    qkv = 4 * torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen)
    positions = torch.tensor([0, 3, 7, 8, 20])
    half = dim // 2
    inv = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float32) / half))
    angles = torch.arange(32, dtype=torch.float32)[:, None] * inv[None, :]
    cos, sin = angles.cos().contiguous(), angles.sin().contiguous()
    slots = torch.tensor([1, 6, 9, 2, 14])
    fused = torch.zeros(2, 4, 4, kv_heads, dim, dtype=torch.float16)
    ext.rope_write_kv(qkv.clone(), positions, cos, sin, fused, slots, heads, kv_heads)
    q, k, v = qkv.split((heads * dim, kv_heads * dim, kv_heads * dim), dim=-1)
    k = apply_rotary(k.reshape(tokens, kv_heads, dim), cos[positions][:, None],
                     sin[positions][:, None])
    ref = torch.zeros_like(fused)
    write_kv(ref, slots, k, v.reshape(tokens, kv_heads, dim))
    assert ref.abs().sum() > 0 and fused.dtype == torch.float16
    # Bit for bit but for the rare value whose fp32 rotation differs in its last bit (an FMA).
    torch.testing.assert_close(fused, ref, rtol=1e-3, atol=1e-3)
    assert (fused != ref).float().mean() < 0.01


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 2), (2, 2)])
@pytest.mark.parametrize("tiles", [True, False])
def test_prompt_spans_tiled_attention_matches_torch(heads, kv_heads, tiles, attention_isa):
    """Head size 64: prompt chunks of 8+ rows take the register-tiled span path (with and
    without earlier context, row counts that leave partial tiles), beside decodes and a short
    chunk that stay per row; both paths agree with the torch reference."""
    from workers.model.attention import fused_paged_attention
    shapes = [(30, 1), (37, 20), (0, 45), (12, 5), (0, 8), (100, 1), (3, 130)]
    qkv, cache, plan, expected = _mixed_batch(shapes, heads, kv_heads, dim=64, block=16,
                                              num_blocks=64, seed=11)
    ext.set_tunable("attention_prompt_tiles", float(tiles))
    try:
        out = fused_paged_attention(ext, qkv, cache, plan, heads, kv_heads)
    finally:
        ext.set_tunable("attention_prompt_tiles", 1.0)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("context", [40, 300])
@pytest.mark.parametrize("split_k", [True, False])
def test_fused_attention_batch_one_split_over_keys(context, split_k, attention_isa):
    """A lone decode token (head_dim 64) with two threads: its keys are split into ranges that
    the threads attend separately, then merged (flash decoding); same result as torch."""
    from workers.model.attention import (AttentionMetadata, fused_paged_attention,
                                         paged_attention, prepare_attention, write_kv)
    gen = torch.Generator().manual_seed(context)
    heads, kv_heads, dim, block, blocks = 9, 3, 64, 16, 40
    cache = torch.randn(2, blocks, block, kv_heads, dim, generator=gen)
    table = torch.randperm(blocks, generator=gen)[:-(-(context + 1) // block)].tolist()
    slot = table[context // block] * block + context % block
    meta = AttentionMetadata(torch.tensor([slot]), torch.tensor([0, 1]),
                             torch.tensor([context + 1]), torch.tensor([table]),
                             max_seq_len=context + 1, max_query_len=1)
    plan = prepare_attention(meta, block)
    qkv = 3 * torch.randn(1, (heads + 2 * kv_heads) * dim, generator=gen)
    q, k, v = qkv.split((heads * dim, kv_heads * dim, kv_heads * dim), dim=-1)
    write_kv(cache, plan.slot_mapping, k.reshape(1, kv_heads, dim), v.reshape(1, kv_heads, dim))
    expected = paged_attention(q.reshape(1, heads, dim), k.reshape(1, kv_heads, dim),
                               v.reshape(1, kv_heads, dim), cache, plan).reshape(1, heads * dim)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    ext.set_tunable("attention_split_k", float(split_k))
    try:
        out = fused_paged_attention(ext, qkv, cache, plan, heads, kv_heads)
    finally:
        ext.set_tunable("attention_split_k", 1.0)
        torch.set_num_threads(threads)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_the_attention_prefetch_distance_changes_no_output(attention_isa):
    """How many keys ahead decode attention prefetches (24 by default; 1 and more than the
    context for A/B) moves no result; out-of-range distances are refused."""
    from workers.model.attention import (AttentionMetadata, fused_paged_attention,
                                         prepare_attention)
    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, dim, block, blocks, lens = 9, 3, 64, 16, 40, [300, 17, 90, 5]
    cache = torch.randn(2, blocks, block, kv_heads, dim, generator=gen)
    tables, start = [], 0
    for n in lens:
        tables.append(list(range(start, start + -(-n // block))))
        start += len(tables[-1])
    width = max(map(len, tables))
    meta = AttentionMetadata(torch.tensor([t[(n - 1) // block] * block + (n - 1) % block
                                           for t, n in zip(tables, lens)]),
                             torch.arange(len(lens) + 1), torch.tensor(lens),
                             torch.tensor([t + [0] * (width - len(t)) for t in tables]),
                             max_seq_len=max(lens), max_query_len=1)
    plan = prepare_attention(meta, block)
    qkv = torch.randn(len(lens), (heads + 2 * kv_heads) * dim, generator=gen)
    outs = []
    try:
        for ahead in (24.0, 1.0, 256.0):
            ext.set_tunable("attention_ahead", ahead)
            outs.append(fused_paged_attention(ext, qkv, cache, plan, heads, kv_heads))
        for bad in (0.0, 257.0):
            with pytest.raises(RuntimeError, match="attention_ahead"):
                ext.set_tunable("attention_ahead", bad)
    finally:
        ext.set_tunable("attention_ahead", 24.0)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def _tiny_quantized_model(mode: str):
    from workers.model import ModelConfig, build_random_model
    from workers.model.quantize import quantize_model
    config = ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0,
                         rms_norm_eps=1e-5, max_position_embeddings=64,
                         tie_word_embeddings=True, bos_token_id=None, eos_token_id=0)
    model = build_random_model(config, seed=3)
    quantize_model(model, mode, device="cpu", dtype=torch.float32)
    assert model.decoder_stack is not None
    return model


def _stack_and_layers(model):
    """(prompt, decode) outputs through the C++ stack, then through the Python layers: one
    sequence's 6-token prompt in blocks 3 and 1, then a decode token at position 6."""
    from workers.model import allocate_kv_caches
    from workers.model.attention import AttentionMetadata
    prompt = AttentionMetadata(torch.tensor([12, 13, 14, 15, 4, 5]), torch.tensor([0, 6]),
                               torch.tensor([6]), torch.tensor([[3, 1]]), 6, 6)
    decode = AttentionMetadata(torch.tensor([6]), torch.tensor([0, 1]), torch.tensor([7]),
                               torch.tensor([[3, 1]]), 7, 1)
    outputs = []
    for stack in (model.decoder_stack, None):
        model.decoder_stack = stack
        caches = allocate_kv_caches(model.config, 5, 4, "cpu", torch.float32)
        with torch.inference_mode():
            first = model(torch.tensor([5, 9, 2, 7, 1, 3]), torch.arange(6), caches, prompt)
            second = model(torch.tensor([8]), torch.tensor([6]), caches, decode)
        outputs.append((first, second))
    return outputs


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_decoder_stack_matches_the_python_layers(mode, isa):
    """The one-call C++ stack runs the same kernels in the same order as llama.py's layers."""
    (stack_first, stack_second), (ref_first, ref_second) = _stack_and_layers(
        _tiny_quantized_model(mode))
    torch.testing.assert_close(torch.cat((stack_first, stack_second)),
                               torch.cat((ref_first, ref_second)), rtol=1e-6, atol=1e-6)

def test_a_kernels_only_attention_plan_is_refused_by_the_torch_path():
    """prepare_attention(torch_path=False) skips the torch path's masks and gathered tables;
    handing such a plan to the torch attention is an error, not a silent empty result."""
    from workers.model.attention import AttentionMetadata, paged_attention, prepare_attention
    meta = AttentionMetadata(torch.tensor([4]), torch.tensor([0, 1]), torch.tensor([1]),
                             torch.tensor([[1]]), 1, 1)
    full, lean = prepare_attention(meta, 4), prepare_attention(meta, 4, torch_path=False)
    assert full.decode_block_tables is not None and lean.decode_block_tables is None
    for a, b in zip((full.token_rows, full.token_table_rows, full.token_lens),
                    (lean.token_rows, lean.token_table_rows, lean.token_lens)):
        assert torch.equal(a, b)
    q, kv = torch.randn(1, 2, 16), torch.randn(1, 1, 16)
    cache = torch.zeros(2, 2, 4, 1, 16)
    assert paged_attention(q, kv, kv, cache, full).shape == (1, 2, 16)
    with pytest.raises(ValueError, match="CPU kernels only"):
        paged_attention(q, kv, kv, cache, lean)


def test_decoder_stack_refuses_a_token_outside_the_vocabulary():
    """forward_ids looks the embedding rows up itself: an id past the table is an error that
    names it, never a read past the table (F.embedding's IndexError on the Python path)."""
    from workers.model.attention import AttentionMetadata, allocate_kv_caches
    model = _tiny_quantized_model("int4")
    caches = allocate_kv_caches(model.config, 5, 4, "cpu", torch.float32)
    meta = AttentionMetadata(torch.tensor([4]), torch.tensor([0, 1]), torch.tensor([1]),
                             torch.tensor([[1]]), 1, 1)
    with torch.inference_mode():
        assert model(torch.tensor([95]), torch.tensor([0]), caches, meta).shape == (1, 64)
        with pytest.raises(RuntimeError, match=r"input_ids\[0\] = 96 is outside the vocabulary"):
            model(torch.tensor([96]), torch.tensor([0]), caches, meta)
        with pytest.raises(RuntimeError, match="outside the vocabulary"):
            model(torch.tensor([-1]), torch.tensor([0]), caches, meta)


@pytest.mark.parametrize("pre", [0, 1, 2])
@pytest.mark.parametrize("accumulate", [False, True])
def test_dense_prefill_gemm_matches_fp32_to_bf16_precision(pre, accumulate):
    """qgemm_dense (bf16 copy of the weight, one oneDNN GEMM) keeps the packed GEMM's contract:
    the same pre-op, the same in-place residual add."""
    torch.manual_seed(pre)
    m, k, n = 24, 96, 40
    w = torch.randn(n, k) * 0.05
    x = torch.randn(m, 2 * k if pre == 2 else k)
    norm = torch.rand(k) + 0.5
    if pre == 1:
        inp = F.rms_norm(x, (k,), norm, 1e-5)
    elif pre == 2:
        inp = F.silu(x[:, :k]) * x[:, k:]
    else:
        inp = x
    expected = inp @ w.t()
    residual = torch.randn(m, n)
    out = residual.clone() if accumulate else torch.empty(m, n)
    got = ext.qgemm_dense(x, w.to(torch.bfloat16).contiguous(), pre, norm if pre == 1 else None,
                          1e-5, out, accumulate)
    assert got.data_ptr() == out.data_ptr()
    if accumulate:
        expected = expected + residual
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())


needs_amx = pytest.mark.skipif(ext is None or not ext.amx_available(),
                               reason="CPU has no AMX-BF16 (or Linux refused the tile state)")


@needs_amx
@pytest.mark.parametrize("pre", [0, 1, 2])
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("m", [1, 17, 40])
def test_amx_gemm_is_exact_on_bf16_inputs(pre, accumulate, m):
    """qgemm_amx keeps the packed GEMM's contract (pre-op, in-place residual add) for any row
    count (the tiles take 32 rows at a time): the pre-op's output rounded to bf16, times the
    bf16 weight, summed in fp32, which is what the reference computes."""
    from workers.model.kernels import pack_amx
    torch.manual_seed(pre * 100 + m)
    k, n = 96, 48   # two output tiles and one left over: the single-tile tail runs too
    w = (torch.randn(n, k) * 0.05).to(torch.bfloat16)
    x = torch.randn(m, 2 * k if pre == 2 else k)
    norm = torch.rand(k) + 0.5
    inp = {0: lambda: x, 1: lambda: F.rms_norm(x, (k,), norm, 1e-5),
           2: lambda: F.silu(x[:, :k]) * x[:, k:]}[pre]()
    expected = inp.to(torch.bfloat16).float() @ w.float().t()
    residual = torch.randn(m, n)
    out = residual.clone() if accumulate else torch.empty(m, n)
    got = ext.qgemm_amx(x, pack_amx(w), n, k, pre, norm if pre == 1 else None, 1e-5, out,
                        accumulate)
    assert got.data_ptr() == out.data_ptr()
    if accumulate:
        expected = expected + residual
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    with pytest.raises(RuntimeError, match="K % 32"):
        ext.qgemm_amx(x[:, :80] if pre != 2 else x, pack_amx(w)[:, :2], n, 80, 0, None, 0.0,
                      None, False)


@needs_amx
@pytest.mark.parametrize("amx", ["on", "off"])
def test_on_an_amx_cpu_the_stack_and_the_output_layer_take_the_amx_tiles(amx, monkeypatch):
    """With AMX the bf16 copies are packed for our tiles (decode batches from 16 rows, and the
    output layer's many-row calls) and match the packed tiles to bf16 precision; LLMMESH_AMX=off
    keeps the plain copies for oneDNN and an output layer without one."""
    from workers.model import kernels
    monkeypatch.setenv("LLMMESH_AMX", amx)
    monkeypatch.setenv("LLMMESH_DENSE_PREFILL_MIN_ROWS", "4")
    kernels.dense_prefill_min_rows.cache_clear()
    try:
        model = _tiny_quantized_model("int4")
        copy = model.layers[0].mlp.down_proj.dense_copy
        assert copy.dim() == (5 if amx == "on" else 2)
        head = model.lm_head
        assert (head.amx_copy is not None) == (amx == "on")
        (first, second), (ref_first, ref_second) = _stack_and_layers(model)
        scale = ref_first.abs().max().item()
        torch.testing.assert_close(first, ref_first, rtol=3e-2, atol=3e-2 * scale)
        assert not torch.equal(first, ref_first)
        hidden = torch.randn(6, model.config.hidden_size)
        monkeypatch.setattr(head, "amx_min_rows", 10**9)   # the int8 tiles, for reference
        tiles = head(hidden)
        monkeypatch.setattr(head, "amx_min_rows", 4)
        torch.testing.assert_close(head(hidden), tiles, rtol=3e-2,
                                   atol=3e-2 * tiles.abs().max().item())
    finally:
        kernels.dense_prefill_min_rows.cache_clear()


@needs_amx
def test_dense_prefill_off_leaves_no_amx_copy_on_the_output_layer(monkeypatch):
    """LLMMESH_DENSE_PREFILL=off means no bf16 copies: the output layer got one anyway, used
    from 0 rows (every decode step's logits through 2x the bytes), before this was checked."""
    from workers.model import kernels
    monkeypatch.setenv("LLMMESH_DENSE_PREFILL", "off")
    kernels.dense_prefill_min_rows.cache_clear()
    try:
        model = _tiny_quantized_model("int4")
        assert model.lm_head.amx_copy is None
        assert model.layers[0].mlp.down_proj.dense_copy is None
    finally:
        kernels.dense_prefill_min_rows.cache_clear()


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_decoder_stack_dense_prefill_path_matches_the_python_layers(mode, monkeypatch):
    """Prefill-sized calls through bf16 copies give the layers' result to bf16 precision, and
    decode-sized calls below the threshold still take the packed tiles exactly."""
    from workers.model import kernels
    monkeypatch.setenv("LLMMESH_DENSE_PREFILL", "on")
    monkeypatch.setenv("LLMMESH_DENSE_PREFILL_MIN_ROWS", "4")
    kernels.dense_prefill_min_rows.cache_clear()
    try:
        model = _tiny_quantized_model(mode)
        assert model.layers[0].mlp.down_proj.dense_copy is not None
        assert model.lm_head.dense_copy is None
        (dense_first, dense_second), (ref_first, ref_second) = _stack_and_layers(model)
        scale = ref_first.abs().max().item()
        torch.testing.assert_close(dense_first, ref_first, rtol=3e-2, atol=3e-2 * scale)
        assert not torch.equal(dense_first, ref_first)           # the bf16 path really ran
        torch.testing.assert_close(dense_second, ref_second, rtol=3e-2, atol=3e-2 * scale)
    finally:
        kernels.dense_prefill_min_rows.cache_clear()


def _side_stream_run(model, lens: list[int], side_prefetch: int):
    """One prefill step of len(lens) prompts through the C++ stack, with the next layer's KV
    prefetched during each layer's projections (side_prefetch.h) or not: (logits input, the
    stream's (lines planned, lines prefetched), the lines the stream should hold)."""
    from workers.model import allocate_kv_caches
    from workers.model.attention import AttentionMetadata
    ext, block = cpu_kernels(), 4
    tables = [[7 - i, 12 + i] for i in range(len(lens))]   # scattered blocks, two per prompt
    slots = [t[p // block] * block + p % block for t, n in zip(tables, lens) for p in range(n)]
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(torch.tensor(slots), torch.tensor(starts), torch.tensor(lens),
                             torch.tensor(tables), max(lens), max(lens))
    ids = torch.arange(starts[-1]) % model.config.vocab_size
    positions = torch.cat([torch.arange(n) for n in lens])
    caches = allocate_kv_caches(model.config, 20, block, "cpu", torch.float32)
    ext.set_tunable("side_prefetch", side_prefetch)
    ext.set_tunable("side_adaptive", 0)   # every eligible call streams (no probes)
    try:
        with torch.inference_mode():
            out = model(ids, positions, caches, meta)
    finally:
        ext.set_tunable("side_prefetch", 3)
        ext.set_tunable("side_adaptive", 1)
    c = model.config
    token_bytes = c.num_kv_heads * c.head_dim * 4
    per_layer = sum(2 * -(-min(block, n - b) * token_bytes // 64)   # K and V, whole lines
                    for n in lens for b in range(0, n, block))
    return out, tuple(model.decoder_stack.side_prefetch_lines()), per_layer * (c.num_layers - 1)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_the_next_layers_kv_is_prefetched_during_the_projections(mode, isa):
    """Every K/V line the next layer's attention reads is put in the side stream and prefetched
    by the GEMMs in between, once; the outputs are the same with it off."""
    model = _tiny_quantized_model(mode)
    on, (planned, issued), expected = _side_stream_run(model, [5, 3, 6, 2], 3)
    assert planned == issued == expected > 0
    off, lines_off, _ = _side_stream_run(model, [5, 3, 6, 2], 0)
    assert lines_off == (0, 0)
    torch.testing.assert_close(on, off, rtol=0, atol=0)


def test_small_batches_get_no_side_stream():
    """Under kSideMinRows (4) rows the projections stream their weights from DRAM and nothing
    is prefetched beside them (batch-1 and 2 decode measured no faster with it)."""
    model = _tiny_quantized_model("int4")
    _, lines, _ = _side_stream_run(model, [2, 1], 3)
    assert lines == (0, 0)
    _, (planned, issued), expected = _side_stream_run(model, [2, 2], 3)
    assert planned == issued == expected > 0
    with pytest.raises(RuntimeError, match="side_prefetch"):
        cpu_kernels().set_tunable("side_prefetch", 7)


def _drive(controller, seconds_on: float, seconds_off: float, calls: int, rows: int = 32):
    """`calls` calls of `rows` rows taking seconds_on with the stream, seconds_off without:
    the decisions made."""
    decisions = []
    for _ in range(calls):
        on = controller.begin()
        controller.end(rows, seconds_on if on else seconds_off)
        decisions.append(on)
    return decisions


def test_the_side_stream_controller_keeps_it_only_while_it_pays():
    """Probe pairs (one call with the stream, one without, after every 8 calls) steer the calls in
    between: on while the stream is faster, off once it is slower, and back when it pays again."""
    c = cpu_kernels().SideController()
    first = _drive(c, 0.030, 0.034, 64)
    assert c.pairs() == 7 and c.score() < 0 and c.on()   # the 8th pair ends on call 65
    assert first.count(False) == 7       # only one call of each probe pair without it
    slower = _drive(c, 0.036, 0.030, 64)
    assert not c.on() and c.score() > 0
    assert 1 <= slower[-16:].count(True) <= 2   # only probes still try it, one call a pair
    _drive(c, 0.030, 0.036, 64)
    assert c.on()


def test_the_side_stream_controller_drops_a_pair_of_different_batches():
    c = cpu_kernels().SideController()
    for _ in range(8):
        for rows in (32, 31):   # every pair straddles a batch change
            on = c.begin()
            c.end(rows, 0.01 if on else 1.0)
    assert c.pairs() == 0 and c.score() == 0.0


@pytest.mark.parametrize("flags,setting,dense", [
    ({"avx2", "fma", "f16c", "avx512_bf16", "avx512_vnni"}, "auto", False),   # a Zen 4
    ({"avx2", "fma", "f16c", "avx512_bf16", "amx_bf16"}, "auto", True),       # an AMX Xeon
    ({"avx2", "fma", "f16c", "avx512_bf16", "avx512_vnni"}, "on", True),
    ({"avx2", "fma", "f16c", "avx512_bf16", "amx_bf16"}, "off", False),
])
def test_dense_prefill_by_default_only_where_the_cpu_has_amx(flags, setting, dense, monkeypatch):
    """Prompts take the bf16 copies only on AMX CPUs by default: with AVX-512 bf16 alone the
    VNNI tiles measured 40-60% faster for prefill (kernels.dense_prefill_min_rows)."""
    from workers.model import kernels
    monkeypatch.setattr(kernels, "_cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(kernels, "uses_amx", lambda: False)
    monkeypatch.setenv("LLMMESH_DENSE_PREFILL", setting)
    kernels.dense_prefill_min_rows.cache_clear()
    try:
        assert (kernels.dense_prefill_min_rows() > 0) == dense
    finally:
        kernels.dense_prefill_min_rows.cache_clear()
