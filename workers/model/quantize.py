"""Turns a loaded fp32 model into a weight mode, and picks the default mode per device.

Default (measured in bench/results/engine.md): int4 on a CPU with our kernels, bf16 on CUDA
(where int8/int4 would be dequantized per call — no torchao here — and bf16 tensor cores are
the fast path). See default_quantization for the CPU evidence.
"""
from __future__ import annotations

import torch

from workers.model import hugepages
from workers.model.kernels import cpu_kernels, dense_prefill_min_rows, pack_amx, uses_amx
from workers.model.linear import QUANTIZATION_MODES, Linear, QuantizedLinear, convert_linear
from workers.model.llama import LlamaForCausalLM, RotaryEmbedding

_PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def default_quantization(device: torch.device | str, dtype: torch.dtype) -> str:
    kind = torch.device(device).type
    # int4 on a CPU with the kernels: it streams 91 MiB per decode step against int8's 129,
    # decodes faster at batch 1 and 32 on every CPU measured (AVX2 Zen 3, AVX-512 Zen 4, AMX
    # Xeon; at batch 8 and on prompts the two trade places between runs), and is the closer
    # one to the fp32 reference. The GGUF is Q4_1, so int4
    # repacks its 32-blocks almost losslessly, while int8 re-rounds them per channel. On the
    # decode path (512 tokens of the shipped text, one per step, 2026-12-01, AVX2): KL from fp32
    # 0.0050 nats/token for int4 against 0.0083 for int8, the same top-1 token at 95.3% of
    # positions for both, greedy chat answers identical to fp32's for 11 of 16 questions against
    # 8. int8 was the default until then because int4 answers "What is the capital of France?"
    # with "L'Étoile, ...": a first-token near-tie (fp32 puts 15.2% on "The" and 14.0% on "L"),
    # which the kernels' int8 activations tip one way under int4 weights and the other under
    # int8 weights; llama.cpp serving the same GGUF answers "L'Étoile" too.
    if kind == "cpu" and dtype == torch.float32 and cpu_kernels() is not None:
        return "int4"
    if kind == "cuda":
        return "bf16"
    return "fp32" if dtype == torch.float32 else "bf16"


def resolve_quantization(quantization: str | None, device: torch.device | str,
                         dtype: torch.dtype) -> str:
    """A concrete mode: None / "none" mean weights in the activations' dtype."""
    if quantization in (None, "", "none"):
        return "bf16" if dtype == torch.bfloat16 else "fp32"
    if quantization == "auto":
        return default_quantization(device, dtype)
    if quantization not in QUANTIZATION_MODES:
        raise ValueError(f"quantization must be one of {QUANTIZATION_MODES}, 'auto' or 'none', "
                         f"got {quantization!r}")
    return quantization


def quantize_model(model: LlamaForCausalLM, mode: str, *, device: torch.device | str,
                   dtype: torch.dtype) -> None:
    """In place: projections (and the output layer) stored in `mode` on `device`; norms and the
    embedding table (looked up exactly, never quantized) in `dtype` on `device`."""
    with torch.no_grad():
        for layer in model.layers:
            for path in _PROJECTIONS:
                parent_name, name = path.split(".")
                parent = getattr(layer, parent_name)
                setattr(parent, name, convert_linear(getattr(parent, name), mode, device, dtype))
        # The output layer stays int8 under int4: from this GGUF's Q8_0 embedding, 4 bits cost
        # +7.9% perplexity against +0.5% for int8 (llama.cpp's Q4 mixes keep it wider too).
        head_mode = "int8" if mode == "int4" else mode
        # The output layer sees a few rows in prefill, but a decode batch's every row: with AMX
        # it gets a bf16 copy for those (32 rows x 49k channels took 6-8 ms on the int8 tiles).
        shape = (model.embed_tokens if model.lm_head is None else model.lm_head.weight).shape
        head_copy = uses_amx() and shape[0] % 16 == 0 and shape[1] % 32 == 0
        if model.lm_head is None:   # tied: the output layer gets its own copy in `head_mode`
            head = Linear(*model.embed_tokens.shape, device="cpu", dtype=torch.float32)
            head.weight.data = model.embed_tokens.data
            model.lm_head = convert_linear(head, head_mode, device, dtype, prefill_copy=head_copy)
            if isinstance(model.lm_head, Linear):   # never share storage with the lookup table
                model.lm_head.weight.data = model.lm_head.weight.data.clone()
        else:
            model.lm_head = convert_linear(model.lm_head, head_mode, device, dtype,
                                           prefill_copy=head_copy)
        if getattr(model.lm_head, "dense_copy", None) is not None:
            # (None with LLMMESH_DENSE_PREFILL=off: no bf16 copies at all, this one included.)
            model.lm_head.use_amx_copy(dense_prefill_min_rows())
        projection_params = {id(m.weight) for m in model.modules() if isinstance(m, Linear)}
        for param in model.parameters():
            if id(param) not in projection_params:
                param.data = param.data.to(device, dtype)
        if torch.device(device).type == "cpu":
            _packed_weights_into_one_buffer(model)
    model.rotary = RotaryEmbedding(model.config, device)
    model.decoder_stack = build_decoder_stack(model)


def _packed_weights_into_one_buffer(model: LlamaForCausalLM) -> None:
    """Every packed projection's bytes and scales, then the output layer's, copied into one
    buffer on huge pages in the order a decode step reads them (hugepages.arena; decode @1
    +6-7% on a 2-core Zen 4). The per-module tensors they replace are freed."""
    modules = [getattr(getattr(layer, parent), name) for layer in model.layers
               for parent, name in (path.split(".") for path in _PROJECTIONS)]
    modules = [m for m in [*modules, model.lm_head] if isinstance(m, QuantizedLinear) and m.packed]
    if not modules:   # nothing packed (no CPU kernels here): no buffer
        return
    views = iter(hugepages.arena([t for m in modules for t in m.tensors.values()]))
    for m in modules:
        m.replace_tensors({name: next(views) for name in m.tensors})


def build_decoder_stack(model: LlamaForCausalLM):
    """The C++ DecoderStack over the model's own packed tensors (shared, not copied), or None
    when some projection is not packed for the CPU kernels."""
    ext = cpu_kernels()
    layers = [[getattr(getattr(layer, parent), name)
               for parent, name in (path.split(".") for path in _PROJECTIONS)]
              for layer in model.layers]
    if ext is None or not all(isinstance(p, QuantizedLinear) and p.packed
                              for projections in layers for p in projections):
        return None
    c = model.config
    stack = ext.DecoderStack(c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps)
    amx = uses_amx()
    for layer, projections in zip(model.layers, layers):
        stack.add_layer(layer.input_layernorm.weight.data,
                        layer.post_attention_layernorm.weight.data,
                        [p.tensors["packed"] for p in projections],
                        [p.tensors["scales"] for p in projections],
                        [p.out_features for p in projections],
                        [p.in_features for p in projections],
                        [p.mode == "int4" for p in projections])
        if all(p.dense_copy is not None for p in projections):
            if amx and all(p.out_features % 16 == 0 and p.in_features % 32 == 0
                           for p in projections):
                for p in projections:   # the packed copy replaces the plain one (same bytes)
                    p.dense_copy = pack_amx(p.dense_copy)
                stack.add_amx_weights([p.dense_copy for p in projections])
            else:
                stack.add_dense_copies([p.dense_copy for p in projections])
    stack.set_dense_min_rows(dense_prefill_min_rows())
    return stack


def weight_bytes(model: LlamaForCausalLM) -> dict[str, int]:
    """Bytes held: projections + output layer (what a decode step streams) and the lookup table."""
    streamed = sum(m.weight_bytes() for m in model.modules()
                   if isinstance(m, (Linear, QuantizedLinear)))
    copies = sum(m.copy_bytes() for m in model.modules() if isinstance(m, QuantizedLinear))
    if model.lm_head is None:
        streamed += model.embed_tokens.numel() * model.embed_tokens.element_size()
    norms = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                if "norm" in n)
    table = model.embed_tokens.numel() * model.embed_tokens.element_size()
    return {"streamed_per_step": streamed + norms, "embedding_table": table,
            "prefill_bf16_copies": copies,
            "total": streamed + norms + copies + (table if model.lm_head is not None else 0)}


def weight_mode(model: LlamaForCausalLM) -> str:
    first = model.layers[0].self_attn.qkv_proj
    return first.mode
