"""TOML configuration files the services validate strictly and reload when they change.

Shared by the tenants file (gateway) and the model catalog (gateway, workers): a refusal names
file, line and key; a broken edit at reload keeps the last good contents (it must not lock
every caller out, or silently drop a limit) and says so in the log.
"""
from __future__ import annotations

import logging
import os
import re
import time
from typing import Callable, Generic, TypeVar

log = logging.getLogger("llmmesh.config")
T = TypeVar("T")


class ConfigFileError(ValueError):
    """A configuration file that must not be used; the message names file, line and key."""


def line_of(text: str, table: str | None, key: str | None) -> int:
    """The line of `key` inside `[table]` (of the table's header when key is None); 0 if unseen."""
    lines, inside = text.splitlines(), table is None
    for n, line in enumerate(lines, 1):
        stripped = line.strip()
        if stripped.startswith("["):
            inside = stripped.strip("[] ").replace('"', "") == table
            if inside and key is None:
                return n
        elif inside and key and re.match(rf"^{re.escape(key)}\s*=", stripped):
            return n
    return 0


def failure(path: str, text: str, table: str | None, key: str | None, why: str,
            error: type[ConfigFileError] = ConfigFileError) -> ConfigFileError:
    line = line_of(text, table, key) or (line_of(text, table, None) if table else 0)
    where = f"{path}:{line}" if line else path
    name = ".".join(p for p in (table, key) if p)
    return error(f"{where}: {name}: {why}")


class WatchedFile(Generic[T]):
    """`load(path)` parsed once now (a bad file raises: start-up stops) and again whenever the
    file's mtime changes, checked at most every `check_s` seconds."""

    def __init__(self, path: str, load: Callable[[str], T], *, what: str, check_s: float = 0.0):
        self.path, self._load, self.what, self.check_s = path, load, what, check_s
        self.value: T = load(path)
        self._mtime_ns = os.stat(path).st_mtime_ns
        self._checked = time.monotonic()
        self.reloads = 0

    def current(self) -> T:
        now = time.monotonic()
        if now - self._checked >= self.check_s:
            self._checked = now
            self._reload_if_changed()
        return self.value

    def _reload_if_changed(self) -> None:
        why = ""
        try:
            mtime_ns = os.stat(self.path).st_mtime_ns
        except OSError as exc:
            mtime_ns, why = -1, f"unreadable ({exc})"
        if mtime_ns == self._mtime_ns:
            return
        self._mtime_ns = mtime_ns     # tried once per change, not once per call
        try:
            if mtime_ns == -1:
                raise ConfigFileError(why)
            self.value = self._load(self.path)
            self.reloads += 1
            log.info("%s %s reloaded", self.what, self.path)
        except (ConfigFileError, OSError) as exc:
            log.error("%s not reloaded, keeping the last good one: %s", self.what, exc)
