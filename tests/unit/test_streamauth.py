"""Result-stream events reach a client only from the request's current attempt and its router
(llmmesh.streamauth): each kind of writer that is not, refused; the ones that are, accepted."""
from __future__ import annotations

import json

from llmmesh import queue, streamauth
from llmmesh.streamauth import StreamCheck, attempt_key, attempt_number, router_key

KEY = streamauth.new_stream_key()


def _chunk(index, ids, attempt, key=None, end=None):
    return queue.tokens_event(index, ids, end=end, attempt=attempt,
                              key=attempt_key(KEY, attempt) if key is None else key)


def test_the_current_attempts_chunks_and_the_routers_final_are_relayed():
    check = StreamCheck(KEY)
    a = attempt_number(1, 0)
    assert check.accept(_chunk(0, [5, 6], a))["ids"] == [5, 6]
    assert check.accept(_chunk(2, [7], a))["ids"] == [7]
    final = check.accept(queue.final_event("stop", {"completion_tokens": 3}, router_key(KEY)))
    assert final["kind"] == "final" and check.refused == 0


def test_unsigned_forged_and_other_requests_chunks_are_refused():
    check = StreamCheck(KEY)
    a = attempt_number(1, 0)
    other = streamauth.new_stream_key()
    assert check.accept(queue.tokens_event(0, [9])) is None                      # unsigned
    assert check.accept(queue.tokens_event(0, [9], attempt=a)) is None           # named, no MAC
    forged = queue.tokens_event(0, [9], attempt=a, key=b"guessed")
    assert check.accept(forged) is None
    assert check.accept(_chunk(0, [9], a, key=attempt_key(other, a))) is None    # another request's
    tampered = _chunk(0, [5], a)
    tampered["d"] = tampered["d"].replace("[5]", "[9]")                           # MAC kept, ids changed
    assert check.accept(tampered) is None
    assert check.refused == 5
    assert check.accept(_chunk(0, [5], a))["ids"] == [5]                         # the real one still goes


def test_a_replaced_attempt_is_refused_once_its_successor_wrote():
    check = StreamCheck(KEY)
    first, second = attempt_number(1, 0), attempt_number(1, 1)
    assert check.accept(_chunk(0, [1, 2], first)) is not None
    assert check.accept(_chunk(2, [3], second)) is not None
    assert check.accept(_chunk(3, [4], first)) is None       # the replaced worker writes on
    assert check.accept(_chunk(3, [4], second)) is not None
    # A router that took the entry over (delivery 2) numbers after everything delivery 1 handed out.
    assert attempt_number(2, 0) > attempt_number(1, streamauth.ATTEMPTS_PER_DELIVERY - 1)
    assert check.accept(_chunk(4, [5], attempt_number(2, 0))) is not None


def test_a_worker_cannot_end_the_request_and_chunks_must_continue_in_order():
    check = StreamCheck(KEY)
    a = attempt_number(1, 0)
    # A final signed with an attempt key (what a worker holds) is not the router's.
    assert check.accept(queue.final_event("stop", {}, attempt_key(KEY, a))) is None
    assert check.accept(queue.error_event("INTERNAL", "x")) is None
    assert check.accept(_chunk(1, [1], a)) is None           # a gap: index 0 is next
    assert check.accept(_chunk(0, [1], a)) is not None
    assert check.accept(_chunk(0, [1], a)) is None           # the same index twice
    assert check.accept({"d": "not json"}) is None
    assert check.accept({"d": json.dumps({"kind": "bogus"})}) is None
    assert check.refused == 6


def test_an_entry_from_a_gateway_without_stream_keys_is_relayed_unchecked():
    check = StreamCheck("")
    assert check.accept(queue.tokens_event(0, [1]))["ids"] == [1]
    assert check.accept(queue.final_event("stop", {}))["kind"] == "final"
    assert check.accept(queue.tokens_event(5, [1])) is None  # order still holds


def test_whatever_a_writer_puts_in_an_entry_is_dropped_never_raised():
    """A worker may XADD anything: a non-ASCII or short tag, bytes that are not UTF-8, JSON
    that is not an object, a chunk whose ids are not a list. Each is refused and counted."""
    check = StreamCheck(KEY)
    a = attempt_number(1, 0)
    good = _chunk(0, [1], a)
    for fields in ({"d": good["d"], "m": "é" * 32}, {"d": good["d"], "m": "ab"},
                   {b"d": b"\xff\xfe{", b"m": b"\xff"}, {"d": "[1, 2]"}, {"d": "null"},
                   {"d": json.dumps({"kind": "tokens", "index": 0, "ids": 5, "a": a})},
                   {"d": json.dumps({"kind": "final"}), "m": 7}):
        assert check.accept(fields) is None
    assert check.refused == 7
    assert check.accept(good)["ids"] == [1]
    # A chunk refused for its index does not make its attempt the current one.
    later = attempt_number(1, 1)
    assert check.accept(_chunk(9, [2], later)) is None
    assert check.accept(_chunk(1, [2], a)) is not None
