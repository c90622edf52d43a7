"""Who may put a token in front of a client: every result-stream event is signed.

The gateway draws a secret per request (QueueEntry.stream_key) and keeps it; the router reads it
from the queue entry. Workers never see it: for each attempt the router derives an attempt key
(HMAC of the secret and the attempt's number) and gives it to the worker it runs that attempt
on, which signs every chunk it appends with it. The router signs the final and error events
with a key of its own derived from the same secret. The gateway, holding the secret, derives
every key and relays a chunk only when

- its MAC is valid for the attempt it names (a writer that was never given this request's
  attempt key, or that holds a Redis password and nothing else, cannot sign),
- its attempt is the current one: no attempt older than the newest one seen so far (a replaced
  worker that writes on is dropped once its successor wrote), and
- it continues exactly where the completion stands (its index is the next one).

The router reads the stream through the same check when it resumes a request and when a
worker's attempt ends (it bills what the stream verifiably holds, not the count the worker
reports), so it and the gateway agree on what was delivered. Whoever may XADD to result
streams (a worker's Redis user may, to every one: llmmesh.redis_acl) can still take an entry
id first — a chunk at or past the next index, or an automatic-id entry — and so fail that
request for good (UNAVAILABLE after its attempts): a denial of service, never a token or an end
shown to a client, never a bill for what the client did not get.

Entries with no stream key (written by a gateway older than this check, mid rolling upgrade)
are relayed unchecked, as before.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
from typing import Any

log = logging.getLogger("llmmesh.streamauth")

# Attempt numbers: delivery (XPENDING's count, one per router that took the entry) times this,
# plus the attempt within that router, so a router that takes a request over never reuses a
# number its dead predecessor handed out.
ATTEMPTS_PER_DELIVERY = 16
_MAC_HEX = 32   # 128-bit tags


def new_stream_key() -> str:
    return secrets.token_hex(16)


def attempt_number(delivery: int, attempt: int) -> int:
    return max(1, delivery) * ATTEMPTS_PER_DELIVERY + attempt


def attempt_key(stream_key: str, attempt: int) -> bytes:
    """The key one attempt's worker signs its chunks with; derived, so the secret stays home."""
    return hmac.new(bytes.fromhex(stream_key), b"attempt:%d" % attempt, hashlib.sha256).digest()


def router_key(stream_key: str) -> bytes:
    """The key of the router's own events (final, error); no attempt key derives it."""
    return hmac.new(bytes.fromhex(stream_key), b"router", hashlib.sha256).digest()


def sign(key: bytes, payload: str) -> str:
    return hmac.new(key, payload.encode(), hashlib.sha256).hexdigest()[:_MAC_HEX]


def signed(payload: str, key: bytes | None) -> dict[str, str]:
    """A result-stream entry's fields: the event's JSON and, when a key is given, its MAC."""
    return {"d": payload, "m": sign(key, payload)} if key else {"d": payload}


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else (value or "")


class StreamCheck:
    """Reads one request's result stream as its client may see it (see the module docstring).

    `accept(fields)` returns the decoded event when its writer may write it now, else None; the
    refusals are counted in `refused`. One per reader, fed every entry in stream order."""

    def __init__(self, stream_key: str, request_id: str = ""):
        self.stream_key = stream_key
        self.request_id = request_id
        self.attempt = -1          # the newest attempt that wrote an accepted chunk
        self.next_index = 0        # where the completion stands
        self.refused = 0
        self._attempt_keys: dict[int, bytes] = {}
        self._router_key = router_key(stream_key) if stream_key else None

    def accept(self, fields: dict) -> dict[str, Any] | None:
        try:
            return self._accept(fields)
        except Exception as exc:  # noqa: BLE001 - whatever a writer put there, never fatal here
            return self._refuse(f"malformed event ({type(exc).__name__})")

    def _accept(self, fields: dict) -> dict[str, Any] | None:
        payload = _text(fields.get("d") or fields.get(b"d"))
        try:
            event = json.loads(payload)
            kind = event["kind"]
        except (ValueError, TypeError, KeyError):
            return self._refuse("undecodable event")
        if kind == "tokens":
            if not isinstance(event.get("index"), int) or not isinstance(event.get("ids"), list):
                return self._refuse("malformed token event")
            if self.stream_key:
                attempt = event.get("a")
                if not isinstance(attempt, int) or attempt < 0:
                    return self._refuse("token event without an attempt")
                if not self._mac_ok(self._key_of(attempt), payload, fields):
                    return self._refuse(f"bad MAC for attempt {attempt}")
                if attempt < self.attempt:
                    return self._refuse(f"attempt {attempt} was replaced by {self.attempt}")
            if event["index"] != self.next_index:
                return self._refuse(f"index {event['index']} where {self.next_index} is next")
            if self.stream_key:
                self.attempt = attempt   # only an accepted chunk makes its attempt the current one
            self.next_index += len(event["ids"])
            return event
        if kind in ("final", "error"):
            if self.stream_key and not self._mac_ok(self._router_key, payload, fields):
                return self._refuse(f"{kind} event not signed by the router")
            return event
        return self._refuse(f"unknown event kind {kind!r}")

    def _key_of(self, attempt: int) -> bytes:
        key = self._attempt_keys.get(attempt)
        if key is None:
            key = self._attempt_keys[attempt] = attempt_key(self.stream_key, attempt)
        return key

    @staticmethod
    def _mac_ok(key: bytes, payload: str, fields: dict) -> bool:
        mac = _text(fields.get("m") or fields.get(b"m"))
        # compare_digest refuses non-ASCII text by raising: such a tag is simply wrong.
        return len(mac) == _MAC_HEX and mac.isascii() and hmac.compare_digest(sign(key, payload), mac)

    def _refuse(self, why: str) -> None:
        self.refused += 1
        log.warning("request %s: result-stream event dropped: %s", self.request_id or "?", why)
        return None
