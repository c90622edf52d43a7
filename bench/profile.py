"""Traffic profiles: editable TOML files in bench/profiles/, validated into frozen values."""
from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

PROFILES_DIR = Path(__file__).resolve().parent / "profiles"
CLASSES = ("interactive", "batch")


@dataclass(frozen=True, slots=True)
class Slo:
    """A request counts towards goodput when it meets both bounds (DistServe's definition)."""
    ttft_s: float
    tpot_s: float

    def __post_init__(self) -> None:
        if self.ttft_s <= 0 or self.tpot_s <= 0:
            raise ValueError(f"SLO bounds must be > 0, got ttft_s={self.ttft_s} tpot_s={self.tpot_s}")


@dataclass(frozen=True, slots=True)
class Stream:
    """One tenant's traffic of one shape; a profile mixes one or more."""
    name: str
    tenant: str
    request_class: str
    rate_rps: float
    prompt_tokens: tuple[int, int]
    completion_tokens: tuple[int, int]
    system_prompt_tokens: int = 0
    task: str = "chat"  # "chat": a question; "summarise": a document to summarise
    hourly: tuple[float, ...] = ()  # a compressed day: rate multiplier per hour, 24 values

    def __post_init__(self) -> None:
        if self.request_class not in CLASSES:
            raise ValueError(f"stream {self.name}: request_class must be one of {CLASSES}")
        if self.rate_rps <= 0:
            raise ValueError(f"stream {self.name}: rate_rps must be > 0")
        for what, (low, high) in (("prompt_tokens", self.prompt_tokens),
                                  ("completion_tokens", self.completion_tokens)):
            if not 1 <= low <= high:
                raise ValueError(f"stream {self.name}: {what} must be [low, high] with 1 <= low <= high")
        if self.hourly and (len(self.hourly) != 24 or min(self.hourly) < 0 or max(self.hourly) <= 0):
            raise ValueError(f"stream {self.name}: hourly needs 24 multipliers >= 0, one > 0")
        if self.task not in ("chat", "summarise"):
            raise ValueError(f"stream {self.name}: task must be chat or summarise")

    def rate_at(self, fraction: float) -> float:
        """Arrival rate at `fraction` of the run (the compressed day), before any sweep factor."""
        if not self.hourly:
            return self.rate_rps
        return self.rate_rps * self.hourly[min(int(fraction * 24), 23)]

    @property
    def peak_rate_rps(self) -> float:
        return self.rate_rps * (max(self.hourly) if self.hourly else 1.0)


@dataclass(frozen=True, slots=True)
class ClosedLoop:
    """A concurrency sweep: `concurrency` requests always in flight, fixed shapes (the curve)."""
    concurrency: tuple[int, ...]
    requests_per_slot: int
    prompt_tokens: int
    completion_tokens: int
    curve_name: str = ""  # set: a run against the worker writes bench/curves/<curve_name>.json

    def __post_init__(self) -> None:
        if not self.concurrency or list(self.concurrency) != sorted(set(self.concurrency)) \
                or self.concurrency[0] < 1:
            raise ValueError("closed_loop.concurrency must be distinct, sorted and >= 1")
        if min(self.requests_per_slot, self.prompt_tokens, self.completion_tokens) < 1:
            raise ValueError("closed_loop counts must be >= 1")


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    description: str
    duration_s: float
    max_requests: int
    seed: int
    rates: tuple[float, ...]  # the sweep: multipliers of every stream's rate
    slo: dict[str, Slo]
    streams: tuple[Stream, ...] = ()
    alone: str = ""  # a stream also replayed by itself, for "its latency alone vs mixed"
    closed_loop: ClosedLoop | None = None
    scale: float = 1.0
    drain_s: float = 120.0  # after the last arrival, how long in-flight requests may finish
    targets: tuple[str, ...] = ()  # the profile's default targets; () = all

    def __post_init__(self) -> None:
        if self.duration_s <= 0 or self.max_requests < 1 or self.scale <= 0:
            raise ValueError(f"profile {self.name}: duration_s, max_requests and scale must be > 0")
        if not self.streams and self.closed_loop is None:
            raise ValueError(f"profile {self.name}: needs [[streams]] or [closed_loop]")
        if not self.rates or min(self.rates) <= 0:
            raise ValueError(f"profile {self.name}: rates must be > 0")
        if self.alone and self.alone not in {s.name for s in self.streams}:
            raise ValueError(f"profile {self.name}: alone names no stream: {self.alone!r}")
        for cls in {s.request_class for s in self.streams}:
            if cls not in self.slo:
                raise ValueError(f"profile {self.name}: no [slo.{cls}]")


def load_profile(name_or_path: str, scale: float = 1.0, duration_s: float | None = None) -> Profile:
    """A profile by name (bench/profiles/NAME.toml) or path; `scale` multiplies every rate."""
    path = Path(name_or_path)
    if not path.suffix:
        path = PROFILES_DIR / f"{name_or_path}.toml"
    if not path.exists():
        known = ", ".join(sorted(p.stem for p in PROFILES_DIR.glob("*.toml")))
        raise FileNotFoundError(f"no profile {name_or_path!r} (known: {known})")
    data = tomllib.loads(path.read_text())
    streams = tuple(_stream(s) for s in data.get("streams", []))
    closed = data.get("closed_loop")
    return Profile(
        name=path.stem, description=data.get("description", "").strip(),
        duration_s=float(duration_s or data.get("duration_s", 60)),
        max_requests=int(data.get("max_requests", 10_000)), seed=int(data.get("seed", 1)),
        rates=tuple(float(r) for r in data.get("rates", [1.0])),
        slo={k: Slo(float(v["ttft_s"]), float(v["tpot_s"])) for k, v in data.get("slo", {}).items()},
        streams=streams, alone=data.get("alone", ""), scale=scale,
        drain_s=float(data.get("drain_s", 120)), targets=tuple(data.get("targets", ())),
        closed_loop=ClosedLoop(tuple(closed["concurrency"]), int(closed.get("requests_per_slot", 2)),
                               int(closed["prompt_tokens"]), int(closed["completion_tokens"]),
                               str(closed.get("curve_name", ""))) if closed else None)


def _stream(data: dict) -> Stream:
    return Stream(name=data["name"], tenant=data["tenant"], request_class=data["request_class"],
                  rate_rps=float(data["rate_rps"]),
                  prompt_tokens=tuple(data["prompt_tokens"]),
                  completion_tokens=tuple(data["completion_tokens"]),
                  system_prompt_tokens=int(data.get("system_prompt_tokens", 0)),
                  task=data.get("task", "chat"), hourly=tuple(float(x) for x in data.get("hourly", ())))
