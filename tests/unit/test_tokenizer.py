"""The tokenizer rebuilt from GGUF metadata: round trips, special tokens, chat template, streaming
detokenization, and token-for-token agreement with transformers' own GGUF tokenizer."""
from __future__ import annotations

import os

import pytest

from llmmesh.models import resolve_model
from llmmesh.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = [
    "Hello world",
    "The capital of France is Paris.",
    "naïve café — 日本語のテキスト, émoji 🚀🎉 and ß",
    "   leading spaces\n\n\ttabs and\r\nwindows newlines  ",
    "I'm sure they'll've done it; don't ask: x = f(y) + 3.14 * 2e-5",
    "Прывітанне, свет! مرحبا بالعالم",
]


@pytest.fixture(scope="module")
def gguf_path() -> str:
    return resolve_model().gguf_path


@pytest.fixture(scope="module")
def tokenizer(gguf_path) -> Tokenizer:
    return Tokenizer.from_gguf(gguf_path)


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tokenizer, text):
    ids = tokenizer.encode(text)
    assert ids and all(0 <= i < tokenizer.vocab_size for i in ids)
    assert tokenizer.decode(ids) == text


def test_special_tokens_in_text_map_to_their_ids(tokenizer):
    im_start = tokenizer.encode("<|im_start|>")
    assert im_start == [1]
    ids = tokenizer.encode("<|im_start|>user\nHi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    # The negative: with specials skipped they vanish from the text, without they survive.
    assert tokenizer.decode(ids) == "user\nHi"
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nHi<|im_end|>"


def test_ids_and_stop_tokens(tokenizer):
    assert tokenizer.vocab_size == 49152
    assert tokenizer.bos_token_id == 1
    assert tokenizer.eos_token_id == 2  # <|im_end|>: the instruct GGUF ends turns, not documents
    assert tokenizer.stop_token_ids[0] == 2
    assert set(tokenizer.stop_token_ids) == {2, 0}  # <|im_end|> and <|endoftext|>
    # The GGUF says add_bos_token=false, so asking for special tokens adds none.
    assert tokenizer.encode("hi", add_special_tokens=True) == tokenizer.encode("hi")


def test_digits_are_split_one_by_one(tokenizer):
    # SmolLM's pre-tokenizer isolates every digit; its vocabulary has no multi-digit tokens.
    ids = tokenizer.encode("2024")
    assert len(ids) == 4
    assert [tokenizer.decode([i]) for i in ids] == ["2", "0", "2", "4"]


def test_chat_template(tokenizer):
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}])
    assert prompt == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                      "Hugging Face<|im_end|>\n<|im_start|>user\nWhat is the capital of France?"
                      "<|im_end|>\n<|im_start|>assistant\n")
    without = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        add_generation_prompt=False)
    assert without == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"


def test_incremental_detokenizer_never_emits_partial_characters(tokenizer):
    text = "naïve café — 日本語 🚀🎉! done"
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.push([token_id]) for token_id in tokenizer.encode(text)]
    pieces.append(detok.flush())
    assert "".join(pieces) == text
    assert not any("\ufffd" in piece for piece in pieces)
    # Emoji span several byte-level tokens, so some pushes must have held text back.
    assert "" in pieces[:-1]


def test_incremental_detokenizer_flushes_an_incomplete_character(tokenizer):
    emoji_ids = tokenizer.encode("🚀")
    assert len(emoji_ids) > 1
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.push(tokenizer.encode("go ") + emoji_ids[:-1]) == "go "
    assert detok.flush() == "\ufffd"  # what is left is reported, not silently dropped


def test_matches_transformers_gguf_tokenizer(gguf_path, tokenizer):
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))
    for text in TEXTS + ["<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"]:
        assert tokenizer.encode(text) == reference.encode(text, add_special_tokens=False), text
