"""Client text from token ids: stop strings cut exactly, never shown, even across tokens."""
from __future__ import annotations

import pytest

from gateway.textstream import TextStream
from llmmesh.models import resolve_model
from llmmesh.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_gguf(resolve_model().gguf_path)


def _stream(tok, text, stop, per_token=True):
    ids = tok.encode(text)
    ts = TextStream(tok, stop)
    pieces = [ts.push([i]) for i in ids] if per_token else [ts.push(ids)]
    pieces.append(ts.flush())
    return "".join(pieces), pieces


def test_no_stop_gives_the_whole_text(tok):
    text = "Paris is the capital of France. Ünïcödé ✓ too."
    assert _stream(tok, text, [])[0] == text


def test_stop_string_and_everything_after_it_are_cut(tok):
    text = "One, two, three. END and more words after"
    assert _stream(tok, text, ["END"])[0] == "One, two, three. "
    assert _stream(tok, text, ["END"], per_token=False)[0] == "One, two, three. "


def test_earliest_of_several_stops_wins(tok):
    assert _stream(tok, "alpha beta gamma delta", ["delta", "beta"])[0] == "alpha "


def test_text_that_only_looks_like_a_stop_prefix_is_released_at_the_end(tok):
    full, pieces = _stream(tok, "the answer is ST", ["STOP"])
    assert full == "the answer is ST"
    assert "ST" not in "".join(pieces[:-1])[-2:]  # held back until the stream ended
