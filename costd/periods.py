"""Charge periods (UTC): how a billing range [start, end) is cut into hours, days or months."""
from __future__ import annotations

from datetime import datetime, timezone
from enum import StrEnum

NS_PER_S = 1_000_000_000
HOUR_NS = 3600 * NS_PER_S
DAY_NS = 24 * HOUR_NS


class Granularity(StrEnum):
    TOTAL = "total"  # one period: the whole billing range
    HOUR = "hour"
    DAY = "day"
    MONTH = "month"  # calendar months, UTC


def _month_bounds(unix_ns: int) -> tuple[int, int]:
    moment = datetime.fromtimestamp(unix_ns // NS_PER_S, tz=timezone.utc)
    first = datetime(moment.year, moment.month, 1, tzinfo=timezone.utc)
    year, month = (moment.year + 1, 1) if moment.month == 12 else (moment.year, moment.month + 1)
    following = datetime(year, month, 1, tzinfo=timezone.utc)
    return int(first.timestamp()) * NS_PER_S, int(following.timestamp()) * NS_PER_S


def period_of(hour: int, start_ns: int, end_ns: int,
              granularity: Granularity) -> tuple[int, int]:
    """The charge period holding hour number `hour`, clipped to the billing range."""
    hour_ns = hour * HOUR_NS
    if granularity is Granularity.TOTAL:
        return start_ns, end_ns
    if granularity is Granularity.HOUR:
        first, last = hour_ns, hour_ns + HOUR_NS
    elif granularity is Granularity.DAY:
        first = hour_ns - hour_ns % DAY_NS
        last = first + DAY_NS
    else:
        first, last = _month_bounds(hour_ns)
    return max(first, start_ns), min(last, end_ns)


def iso(unix_ns: int) -> str:
    """ISO 8601 in UTC with a Z, to the second when whole (FOCUS date-times), else to the µs."""
    seconds, rest_ns = divmod(unix_ns, NS_PER_S)
    moment = datetime.fromtimestamp(seconds, tz=timezone.utc)
    text = moment.strftime("%Y-%m-%dT%H:%M:%S")
    if rest_ns:
        text += f".{rest_ns // 1000:06d}"
    return text + "Z"


def parse_iso(text: str) -> int:
    """Unix ns from ISO 8601 (a date alone means its midnight UTC; no offset means UTC)."""
    moment = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    delta = moment - datetime(1970, 1, 1, tzinfo=timezone.utc)
    return (delta.days * 86_400 + delta.seconds) * NS_PER_S + delta.microseconds * 1000
