"""The price book: what each device type costs per hour, from when, in one currency.

Loaded from TOML (config/prices.toml) with every number read as a Decimal, never a float, so
"4.00" stays exactly 4.00. Workers report `llmmesh.device.type` ("cpu",
"cuda:NVIDIA-H100-80GB-HBM3"); the `[aliases]` table binds those strings (shell globs, first
match wins, a device's own name always matches) to the book's devices. Prices change only on
the hour (UTC): costd sums usage per hour, so one hour never needs two prices.
"""
from __future__ import annotations

import fnmatch
import tomllib
from dataclasses import dataclass
from datetime import datetime, timezone
from decimal import Decimal, InvalidOperation
from pathlib import Path
from types import MappingProxyType
from typing import Mapping

HOUR_NS = 3_600_000_000_000


@dataclass(frozen=True, slots=True)
class Price:
    effective_from_ns: int
    per_hour: Decimal  # what we pay (contracted / effective)
    list_per_hour: Decimal  # the public list price, for FOCUS ListCost

    def __post_init__(self) -> None:
        if self.effective_from_ns % HOUR_NS:
            raise ValueError("prices must take effect on a whole hour (UTC)")
        for name in ("per_hour", "list_per_hour"):
            value = getattr(self, name)
            if not isinstance(value, Decimal) or not value.is_finite() or value < 0:
                raise ValueError(f"{name} must be a finite decimal >= 0, got {value!r}")


@dataclass(frozen=True, slots=True)
class Device:
    name: str
    description: str
    prices: tuple[Price, ...]  # sorted by effective_from_ns

    def __post_init__(self) -> None:
        if not self.prices:
            raise ValueError(f"device {self.name!r} has no prices")
        starts = [p.effective_from_ns for p in self.prices]
        if starts != sorted(set(starts)):
            raise ValueError(f"device {self.name!r}: prices must have distinct, sorted dates")

    def price_at(self, unix_ns: int) -> Price | None:
        """The price in force at `unix_ns`; None before the first one took effect."""
        current = None
        for price in self.prices:
            if price.effective_from_ns > unix_ns:
                break
            current = price
        return current


@dataclass(frozen=True, slots=True)
class PriceBook:
    currency: str
    devices: Mapping[str, Device]
    aliases: tuple[tuple[str, str], ...] = ()  # (glob on llmmesh.device.type, device name)

    def __post_init__(self) -> None:
        if len(self.currency) != 3 or not self.currency.isalpha() or not self.currency.isupper():
            raise ValueError(f"currency must be an ISO 4217 code like USD, got {self.currency!r}")
        for pattern, device in self.aliases:
            if device not in self.devices:
                raise ValueError(f"alias {pattern!r} names unknown device {device!r}")
        object.__setattr__(self, "devices", MappingProxyType(dict(self.devices)))

    def device_for(self, device_type: str) -> str | None:
        """The book's device for a worker-reported device type; None when nothing matches."""
        if device_type in self.devices:
            return device_type
        for pattern, device in self.aliases:
            if fnmatch.fnmatchcase(device_type, pattern):
                return device
        return None

    def price(self, device: str, unix_ns: int) -> Price | None:
        entry = self.devices.get(device)
        return entry.price_at(unix_ns) if entry else None

    @classmethod
    def load(cls, path: str | Path) -> PriceBook:
        try:
            return cls.parse(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError, ValueError, KeyError, TypeError) as error:
            raise ValueError(f"price book {path}: {error}") from error

    @classmethod
    def parse(cls, text: str) -> PriceBook:
        data = tomllib.loads(text, parse_float=Decimal)
        _known(data, ("currency", "aliases", "devices"), "")
        for name, entry in data.get("devices", {}).items():
            _known(entry, ("description", "prices"), f"devices.{name}.")
            for i, item in enumerate(entry.get("prices", [])):
                _known(item, ("from", "per_hour", "list_per_hour"), f"devices.{name}.prices[{i}].")
        devices = {name: _device(name, entry) for name, entry in data.get("devices", {}).items()}
        aliases = tuple((str(k), str(v)) for k, v in data.get("aliases", {}).items())
        return cls(currency=data.get("currency", "USD"), devices=devices, aliases=aliases)


def _known(table: object, keys: tuple[str, ...], where: str) -> None:
    """A misspelt key (`per_huor`) is refused, never silently priced at a default."""
    if not isinstance(table, dict):
        raise ValueError(f"{where.rstrip('.') or 'the file'} must be a table")
    for key in table:
        if key not in keys:
            raise ValueError(f"{where}{key}: unknown key; known keys: {', '.join(keys)}")


def _decimal(value: object, what: str) -> Decimal:
    if isinstance(value, bool) or not isinstance(value, (int, Decimal, str)):
        raise ValueError(f"{what} must be a decimal number, got {value!r}")
    try:
        return Decimal(value)
    except InvalidOperation as error:
        raise ValueError(f"{what} must be a decimal number, got {value!r}") from error


def _unix_ns(value: object, what: str) -> int:
    if not isinstance(value, datetime):
        raise ValueError(f"{what} must be a TOML date-time like 2025-01-01T00:00:00Z")
    if value.tzinfo is None:
        raise ValueError(f"{what} needs a UTC offset (add Z)")
    delta = value.astimezone(timezone.utc) - datetime(1970, 1, 1, tzinfo=timezone.utc)
    return (delta.days * 86_400 + delta.seconds) * 1_000_000_000 + delta.microseconds * 1000


def _device(name: str, entry: dict) -> Device:
    prices = []
    for i, item in enumerate(entry.get("prices", [])):
        what = f"devices.{name}.prices[{i}]"
        per_hour = _decimal(item["per_hour"], f"{what}.per_hour")
        list_per_hour = _decimal(item.get("list_per_hour", per_hour), f"{what}.list_per_hour")
        prices.append(Price(_unix_ns(item["from"], f"{what}.from"), per_hour, list_per_hour))
    prices.sort(key=lambda p: p.effective_from_ns)
    return Device(name, str(entry.get("description", "")), tuple(prices))
