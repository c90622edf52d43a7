"""Service logs: JSON lines carrying the current span's trace_id / span_id, a level per service."""
from __future__ import annotations

import io
import json
import logging

import pytest
from opentelemetry.sdk.trace import TracerProvider

from llmmesh.server import configure_logging


@pytest.fixture(autouse=True)
def _restore_root_logger():
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:], root.level = handlers, level


def _lines(stream: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_json_lines_carry_the_span_they_were_written_in(monkeypatch):
    monkeypatch.delenv("LLMMESH_LOG_FORMAT", raising=False)
    stream = io.StringIO()
    configure_logging("gateway", "INFO", stream)
    log = logging.getLogger("gateway.test")
    tracer = TracerProvider().get_tracer("test")
    with tracer.start_as_current_span("chat m") as span:
        log.info('admitted "%s"', "acme/r1")
    log.warning("outside any span")
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("failed")
    inside, outside, failed = _lines(stream)
    ctx = span.get_span_context()
    assert inside["trace_id"] == f"{ctx.trace_id:032x}" and inside["span_id"] == f"{ctx.span_id:016x}"
    assert inside["message"] == 'admitted "acme/r1"' and inside["service"] == "gateway"
    assert inside["level"] == "INFO" and inside["logger"] == "gateway.test"
    assert "trace_id" not in outside and outside["level"] == "WARNING"
    assert "ValueError: boom" in failed["exception"]


def test_the_level_is_set_per_service(monkeypatch):
    monkeypatch.setenv("LLMMESH_LOG_LEVEL", "INFO")
    monkeypatch.setenv("LLMMESH_ROUTER_LOG_LEVEL", "warning")
    stream = io.StringIO()
    configure_logging("router", stream=stream)
    logging.getLogger("router.x").info("quiet")
    logging.getLogger("router.x").warning("loud")
    assert [line["message"] for line in _lines(stream)] == ["loud"]
    stream = io.StringIO()
    configure_logging("gateway", stream=stream)        # no gateway-specific level: the mesh's
    logging.getLogger("gateway.x").info("heard")
    assert [line["message"] for line in _lines(stream)] == ["heard"]


def test_text_format_on_request(monkeypatch):
    monkeypatch.setenv("LLMMESH_LOG_FORMAT", "text")
    stream = io.StringIO()
    configure_logging("costd", "INFO", stream)
    logging.getLogger("costd.x").info("plain")
    assert stream.getvalue().rstrip().endswith("costd INFO costd.x: plain")
