"""The real SmolLM2 GGUF through our loader and model against transformers' GGUF loader.

Both sides dequantize the same Q4_1/Q8_0 blocks to fp32 (bit-identical weights), so the logits
differ only by summation order in the matmuls and attention.
"""
from __future__ import annotations

import os

import pytest
import torch

from llmmesh.models import resolve_model
from llmmesh.tokenizer import Tokenizer
from workers.model import AttentionMetadata, allocate_kv_caches, load_model

pytestmark = pytest.mark.model
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers refuses to load GGUF without it

BLOCK_SIZE = 16


@pytest.fixture(scope="module", autouse=True)
def two_threads():
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def gguf_path() -> str:
    return resolve_model().gguf_path


@pytest.fixture(scope="module")
def tokenizer(gguf_path):
    return Tokenizer.from_gguf(gguf_path)


@pytest.fixture(scope="module")
def ours(gguf_path):
    model, _ = load_model(gguf_path, device="cpu", dtype=torch.float32)
    return model


@pytest.fixture(scope="module")
def hf(gguf_path):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path), dtype=torch.float32)
    return model.eval()


def paged_greedy(model, prompt_ids: list[int], max_new_tokens: int,
                 stop_ids: tuple[int, ...] = ()) -> tuple[list[int], torch.Tensor]:
    """Prefill the prompt into a paged cache (blocks in reverse order), then decode one by one.

    Returns the generated ids and the logits each was picked from.
    """
    total = len(prompt_ids) + max_new_tokens
    num_blocks = -(-total // BLOCK_SIZE) + 1
    caches = allocate_kv_caches(model.config, num_blocks, BLOCK_SIZE, "cpu", torch.float32)
    table = list(range(num_blocks - 1, 0, -1))  # block 0 left out, as a real pool would
    ids, generated, logits = list(prompt_ids), [], []
    step_ids = list(prompt_ids)
    with torch.inference_mode():
        while len(generated) < max_new_tokens:
            first = len(ids) - len(step_ids)
            positions = list(range(first, len(ids)))
            meta = AttentionMetadata(
                slot_mapping=torch.tensor([table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                                           for p in positions]),
                query_start_loc=torch.tensor([0, len(step_ids)]),
                seq_lens=torch.tensor([len(ids)]), block_tables=torch.tensor([table]),
                max_seq_len=len(ids), max_query_len=len(step_ids))
            hidden = model(torch.tensor(step_ids), torch.tensor(positions), caches, meta)
            logits.append(model.compute_logits(hidden[-1]))
            token = int(logits[-1].argmax())
            generated.append(token)
            if token in stop_ids:
                break
            ids.append(token)
            step_ids = [token]
    return generated, torch.stack(logits)


def test_logits_match_hf(ours, hf, tokenizer):
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog while it rains")[:10]
    assert len(ids) == 10
    with torch.inference_mode():
        expected = hf(torch.tensor([ids])).logits[0].float()
        actual = ours.compute_logits(ours(torch.tensor(ids), torch.arange(len(ids))))
    # Measured 5e-5 on logits of magnitude ~30 (fp32 reassociation only).
    assert (actual - expected).abs().max().item() < 1e-3


def test_greedy_decode_matches_hf(ours, hf, tokenizer):
    ids = tokenizer.encode("The capital of France is")
    with torch.inference_mode():
        expected = hf.generate(torch.tensor([ids]), max_new_tokens=5, do_sample=False,
                               pad_token_id=tokenizer.eos_token_id)[0, len(ids):].tolist()
    assert len(expected) == 5
    assert paged_greedy(ours, ids, 5)[0] == expected


def test_paged_path_matches_reference_path(ours, tokenizer):
    ids = tokenizer.encode("Paged attention should not change a single logit, give or take")
    generated, paged_logits = paged_greedy(ours, ids, 4)
    full = ids + generated[:-1]
    with torch.inference_mode():
        reference = ours.compute_logits(ours(torch.tensor(full), torch.arange(len(full))))
    # Measured 4e-5: the paged path only reorders fp32 sums (SDPA kernels, gathered keys).
    torch.testing.assert_close(paged_logits, reference[len(ids) - 1:], atol=5e-4, rtol=0)


def test_chat_answer_mentions_paris(ours, tokenizer):
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}])
    generated, _ = paged_greedy(ours, tokenizer.encode(prompt), 30, tokenizer.stop_token_ids)
    assert generated[-1] in tokenizer.stop_token_ids or len(generated) == 30
    assert "Paris" in tokenizer.decode(generated)
