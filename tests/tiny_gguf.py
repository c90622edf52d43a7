"""A small Llama-architecture GGUF, generated for tests: other shapes and another vocabulary
than SmolLM2 (a 256-byte BPE alphabet, a few merges and ChatML control tokens), random fp32
weights. Workers load it like any catalog model; its outputs tell it apart from SmolLM2."""
from __future__ import annotations

import numpy as np

from llmmesh.tokenizer import _byte_alphabet

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_MERGES = ("Ġ t", "h e", "Ġt he", "i n", "e r", "a n", "o n", "Ġ a", "r e", "Ġ s")
CHAT_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
                 "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def write_tiny_llama(path: str, *, hidden: int = 64, layers: int = 2, heads: int = 4,
                     kv_heads: int = 2, intermediate: int = 128, context: int = 2048,
                     seed: int = 0) -> str:
    import gguf

    alphabet = _byte_alphabet()
    tokens = list(SPECIALS) + [alphabet[b] for b in range(256)]
    tokens += ["".join(m.split(" ")) for m in _MERGES]
    token_types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    vocab = len(tokens)
    head_dim = hidden // heads
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("tiny-llama-test")
    writer.add_context_length(context)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(intermediate)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(list(_MERGES))
    writer.add_eos_token_id(2)   # <|im_end|>
    writer.add_bos_token_id(0)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    rng = np.random.default_rng(seed)

    def w(*shape):
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    writer.add_tensor("token_embd.weight", w(vocab, hidden))
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    writer.add_tensor("output.weight", w(vocab, hidden))
    for i in range(layers):
        p = f"blk.{i}."
        writer.add_tensor(p + "attn_q.weight", w(heads * head_dim, hidden))
        writer.add_tensor(p + "attn_k.weight", w(kv_heads * head_dim, hidden))
        writer.add_tensor(p + "attn_v.weight", w(kv_heads * head_dim, hidden))
        writer.add_tensor(p + "attn_output.weight", w(hidden, heads * head_dim))
        writer.add_tensor(p + "ffn_gate.weight", w(intermediate, hidden))
        writer.add_tensor(p + "ffn_up.weight", w(intermediate, hidden))
        writer.add_tensor(p + "ffn_down.weight", w(hidden, intermediate))
        writer.add_tensor(p + "attn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(p + "ffn_norm.weight", np.ones(hidden, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
