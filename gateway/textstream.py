"""Token ids in, client text out: incremental detokenization that cuts at stop strings.

The worker stops generating when a stop string appears; the client must not see the stop
string itself, nor anything after it, so text that could still become a stop string is held
back until it can't.
"""
from __future__ import annotations

from llmmesh.tokenizer import IncrementalDetokenizer


class TextStream:
    def __init__(self, tokenizer, stop: list[str] | None = None):
        self.detok = IncrementalDetokenizer(tokenizer)
        self.stop = [s for s in (stop or []) if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.held = ""
        self.stopped = False

    def push(self, token_ids: list[int]) -> str:
        if self.stopped:
            return ""
        self.held += self.detok.push(token_ids)
        return self._release(final=False)

    def flush(self) -> str:
        if self.stopped:
            return ""
        self.held += self.detok.flush()
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        hits = [i for i in (self.held.find(s) for s in self.stop) if i >= 0]
        if hits:
            out, self.held, self.stopped = self.held[:min(hits)], "", True
            return out
        cut = len(self.held) if final else max(0, len(self.held) - self.hold)
        out, self.held = self.held[:cut], self.held[cut:]
        return out
