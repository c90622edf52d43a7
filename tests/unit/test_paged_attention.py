"""Paged attention must reproduce plain causal attention exactly, whatever the batch looks like:
chunked prefill into shuffled, non-contiguous blocks, mixed prefill + decode, reordered batches."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from workers.model import (AttentionMetadata, ModelConfig, allocate_kv_caches,
                           build_random_model, kv_cache_bytes_per_block)

BLOCK_SIZE = 4
NUM_BLOCKS = 16
TABLE_WIDTH = 5  # wider than any sequence needs, so every table carries 0-padding
UNUSED_BLOCKS = (0, 2, 4, 5, 8, 10, 11, 13, 15)  # never in a table; filled with poison

CONFIG = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0,
                     rms_norm_eps=1e-5, max_position_embeddings=64, tie_word_embeddings=False,
                     bos_token_id=1, eos_token_id=2)

# Sequence A: 11-token prompt in chunks of 7 and 4, then 3 decode steps (14 tokens, 4 blocks).
# Sequence B: 6-token prompt in one chunk, then 3 decode steps (9 tokens, 3 blocks).
TOKENS = {"A": [5, 17, 33, 2, 64, 9, 71, 40, 12, 88, 3, 50, 27, 61],
          "B": [44, 8, 19, 90, 23, 7, 36, 58, 14]}
TABLES = {"A": [9, 3, 14, 6], "B": [12, 1, 7]}
# Each step: (sequence, first position, number of tokens), in batch order.
STEPS = [
    [("A", 0, 7), ("B", 0, 6)],        # two prefills, no earlier context
    [("B", 6, 1), ("A", 7, 4)],        # decode + a prefill chunk over cached context
    [("A", 11, 1), ("B", 7, 1)],       # pure decode batch (fast path)
    [("B", 8, 1), ("A", 12, 1)],       # pure decode, batch order swapped
    [("A", 13, 1)],                    # a lone decode after B finished
]


def build_metadata(step: list[tuple[str, int, int]], tables: dict[str, list[int]]
                   ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    input_ids, positions, slots, starts, seq_lens, rows = [], [], [], [0], [], []
    for name, first, count in step:
        table = tables[name]
        for pos in range(first, first + count):
            input_ids.append(TOKENS[name][pos])
            positions.append(pos)
            slots.append(table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
        starts.append(starts[-1] + count)
        seq_lens.append(first + count)
        rows.append(table + [0] * (TABLE_WIDTH - len(table)))
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(starts),
        seq_lens=torch.tensor(seq_lens), block_tables=torch.tensor(rows),
        max_seq_len=max(seq_lens), max_query_len=max(count for _, _, count in step))
    return torch.tensor(input_ids), torch.tensor(positions), meta


@pytest.fixture(scope="module")
def model():
    return build_random_model(CONFIG, "cpu", torch.float32, seed=1234)


@pytest.fixture(scope="module")
def reference_logits(model):
    with torch.inference_mode():
        return {name: model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids))))
                for name, ids in TOKENS.items()}


def poisoned_caches() -> list[torch.Tensor]:
    caches = allocate_kv_caches(CONFIG, NUM_BLOCKS, BLOCK_SIZE, "cpu", torch.float32)
    generator = torch.Generator().manual_seed(7)
    for cache in caches:
        # Finite but huge: any unmasked read of a block outside a table moves the logits.
        for block in UNUSED_BLOCKS:
            cache[:, block] = 1e3 * torch.randn(cache[:, block].shape, generator=generator)
    return caches


def run_steps(model, tables):
    caches = poisoned_caches()
    outputs = []
    with torch.inference_mode():
        for step in STEPS:
            input_ids, positions, meta = build_metadata(step, tables)
            outputs.append((step, model.compute_logits(model(input_ids, positions, caches, meta))))
    return outputs


def test_chunked_prefill_and_mixed_decode_match_reference(model, reference_logits):
    for step, logits in run_steps(model, TABLES):
        row = 0
        for name, first, count in step:
            expected = reference_logits[name][first:first + count]
            torch.testing.assert_close(logits[row:row + count], expected, atol=1e-4, rtol=0)
            row += count
        assert row == logits.shape[0]


def test_block_table_pointing_at_another_sequence_changes_logits(model, reference_logits):
    # Negative of the test above: after prefill wrote A's context through TABLES, A's decode reads
    # B's first block in place of its own second one; the comparison must notice, and B must stay
    # exact. (Swapping two of A's own full blocks would NOT be caught, and rightly: RoPE is applied
    # before caching, so attention over fully visible blocks does not depend on their order.)
    caches = poisoned_caches()
    scrambled = {"A": [9, 12, 14, 6], "B": TABLES["B"]}
    with torch.inference_mode():
        for i, step in enumerate(STEPS[:3]):
            input_ids, positions, meta = build_metadata(step, TABLES if i < 2 else scrambled)
            logits = model.compute_logits(model(input_ids, positions, caches, meta))
    assert (logits[0] - reference_logits["A"][11]).abs().max() > 1e-2
    torch.testing.assert_close(logits[1], reference_logits["B"][7], atol=1e-4, rtol=0)


def test_tied_embeddings_reuse_the_embedding_matrix():
    tied = dataclasses.replace(CONFIG, tie_word_embeddings=True)
    model = build_random_model(tied, "cpu", torch.float32, seed=3)
    assert model.lm_head is None
    hidden = torch.randn(2, CONFIG.hidden_size)
    torch.testing.assert_close(model.compute_logits(hidden), hidden @ model.embed_tokens.T)


def test_random_model_depends_only_on_seed():
    a, b = (build_random_model(CONFIG, "cpu", torch.float32, seed=5) for _ in range(2))
    c = build_random_model(CONFIG, "cpu", torch.float32, seed=6)
    assert torch.equal(a.embed_tokens, b.embed_tokens)
    assert not torch.equal(a.embed_tokens, c.embed_tokens)


def test_kv_cache_shapes_and_sizes():
    caches = allocate_kv_caches(CONFIG, NUM_BLOCKS, BLOCK_SIZE, "cpu", torch.bfloat16)
    assert len(caches) == CONFIG.num_layers
    assert caches[0].shape == (2, NUM_BLOCKS, BLOCK_SIZE, CONFIG.num_kv_heads, CONFIG.head_dim)
    assert caches[0].dtype == torch.bfloat16
    per_block = kv_cache_bytes_per_block(CONFIG, BLOCK_SIZE, torch.bfloat16)
    assert per_block == 2 * 2 * BLOCK_SIZE * 2 * 16 * 2  # K+V, layers, slots, kv heads, dim, bytes
    assert per_block * NUM_BLOCKS == sum(c.numel() * c.element_size() for c in caches)


def test_config_rejects_inconsistent_heads():
    with pytest.raises(ValueError, match="num_kv_heads"):
        dataclasses.replace(CONFIG, num_kv_heads=3)
