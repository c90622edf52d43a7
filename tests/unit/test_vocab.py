"""llmmesh.vocab: the one spelling of request classes, finish reasons and span attributes."""
from __future__ import annotations

import ast
import pathlib

import pytest

from llmmesh import vocab
from llmmesh.v1 import common_pb2
from llmmesh.vocab import FinishReason, RequestClass
from workers.engine.request import Priority

ROOT = pathlib.Path(__file__).resolve().parents[2]
SERVICES = ("gateway", "router", "workers", "costd", "llmmesh")


def test_every_request_class_has_its_proto_value_and_back():
    proto = {v.number for v in common_pb2.RequestClass.DESCRIPTOR.values} - {
        common_pb2.REQUEST_CLASS_UNSPECIFIED}
    assert {c.proto for c in RequestClass} == proto   # neither side has one the other lacks
    for c in RequestClass:
        assert RequestClass.from_proto(c.proto) is c
    assert RequestClass.from_proto(common_pb2.REQUEST_CLASS_UNSPECIFIED) is vocab.DEFAULT_CLASS
    with pytest.raises(ValueError):
        RequestClass.from_proto(99)


def test_engine_priority_follows_the_class_order():
    assert [p.name for p in sorted(Priority)] == [c.name for c in RequestClass]
    assert Priority(RequestClass.INTERACTIVE.priority) < Priority(RequestClass.BATCH.priority)


def test_every_proto_finish_reason_is_ours_and_error_never_travels_as_a_final():
    for value in common_pb2.FinishReason.DESCRIPTOR.values:
        if value.number != common_pb2.FINISH_REASON_UNSPECIFIED:
            assert FinishReason.from_proto(value.number).proto == value.number
    assert FinishReason.ERROR.proto == common_pb2.FINISH_REASON_UNSPECIFIED
    assert FinishReason.from_proto(common_pb2.FINISH_REASON_UNSPECIFIED) is FinishReason.STOP
    assert FinishReason.of("cancelled") is FinishReason.CANCELLED
    assert FinishReason.of("no-such-reason") is FinishReason.STOP


def _string_constants(path: pathlib.Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text())
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def test_span_attribute_names_are_spelled_only_in_vocab():
    """A new attribute (or a renamed one) is one change: no service spells a name itself."""
    names = {v for k, v in vars(vocab).items() if k.isupper() and isinstance(v, str)
             and v.startswith(("llmmesh.", "gen_ai."))}
    assert len(names) > 30
    spelled = [f"{path.relative_to(ROOT)}:{line} {value}"
               for package in SERVICES for path in (ROOT / package).rglob("*.py")
               if path.name != "vocab.py" and "v1" not in path.parts
               for line, value in _string_constants(path) if value in names]
    assert spelled == []


def test_request_classes_are_named_only_in_vocab_in_the_services():
    """Class names as literals only where a class means something else (OpenAI's `batch`
    object, its `purpose`, the CLI's `batch` command)."""
    allowed = {("gateway/openai_http.py", "batch"), ("llmmesh/cli_batch.py", "batch")}
    spelled = sorted({(str(path.relative_to(ROOT)), value)
                      for package in SERVICES for path in (ROOT / package).rglob("*.py")
                      if path.name != "vocab.py" and "v1" not in path.parts
                      for _, value in _string_constants(path) if value in vocab.CLASSES}
                     - allowed)
    assert spelled == []
