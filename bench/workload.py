"""The exact requests of one run: arrival times, prompts and token ids, the same for every target.

Everything is drawn from seeded generators keyed by (profile seed, level, stream), so two targets
(or two machines) replay identical traffic, and the chat stream replayed alone in the mixed
profile keeps the arrivals it had in the mix.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

from bench.profile import ClosedLoop, Profile, Stream
from llmmesh.tokenizer import Tokenizer

# Plain English words for filler text: real words keep the model writing prose (and so using
# its max_tokens) rather than stopping early on gibberish.
_WORDS = """time year people way day man thing woman life child world school state family student
group country problem hand part place case week company system program question work government
number night point home water room mother area money story fact month lot right study book eye
job word business issue side kind head house service friend father power hour game line end
member law car city community name president team minute idea kid body information back parent
face others level office door health person art war history party result change morning reason
research girl guy moment air teacher force education river mountain garden engine market energy
light music ocean forest village bridge island harbour winter summer planet machine language
history travel letter museum train bread coffee weather science theory""".split()
_CHAT_ASKS = ("Write a long, detailed answer about", "Explain step by step, in detail,",
              "Tell me a long story about", "Describe at length")


@dataclass(frozen=True, slots=True)
class RequestSpec:
    index: int
    at_s: float  # arrival, seconds after the level starts (0 for closed loop)
    stream: str
    tenant: str
    request_class: str
    messages: tuple[tuple[str, str], ...]  # (role, content): what the gateway gets
    prompt_token_ids: tuple[int, ...]  # what the worker and llama-server get (same tokens)
    max_tokens: int


def _text(rng: random.Random, tok: Tokenizer, num_tokens: int) -> str:
    """Sentences of about `num_tokens` tokens (cut on a token boundary)."""
    words = []
    while len(words) < num_tokens * 1.2 + 8:
        sentence = [rng.choice(_WORDS) for _ in range(rng.randint(6, 14))]
        words.append(sentence[0].capitalize())
        words.extend(sentence[1:-1])
        words.append(sentence[-1] + ".")
    ids = tok.encode(" ".join(words))[:num_tokens]
    return tok.decode(ids).strip()


def _messages(shape: random.Random, words: random.Random, tok: Tokenizer, stream: Stream,
              system: str):
    """Lengths from `shape`, text from `words`: two runs can share every length and arrival
    yet no prompt (so neither warms the other's prefix cache)."""
    num_tokens = shape.randint(*stream.prompt_tokens)
    if stream.task == "summarise":
        user = "Summarise the following document in detail.\n\n" + _text(words, tok, num_tokens)
    else:
        user = f"{shape.choice(_CHAT_ASKS)} {_text(words, tok, num_tokens)}"
    return ((("system", system),) if system else ()) + (("user", user),)


def _arrivals(rng: random.Random, stream: Stream, factor: float, duration_s: float) -> list[float]:
    """A (non-homogeneous) Poisson process by thinning: candidates at the peak rate, each kept
    with probability rate(t) / peak, so the diurnal shape needs no special case."""
    peak = stream.peak_rate_rps * factor
    times, t = [], 0.0
    while True:
        t += rng.expovariate(peak)
        if t >= duration_s:
            return times
        if rng.random() * peak <= stream.rate_at(t / duration_s) * factor:
            times.append(t)


def system_prompt(profile: Profile, stream: Stream, tok: Tokenizer) -> str:
    if not stream.system_prompt_tokens:
        return ""
    rng = random.Random(f"{profile.seed}:system:{stream.name}")
    return "You are a helpful assistant. " + _text(rng, tok, stream.system_prompt_tokens)


def open_loop(profile: Profile, tok: Tokenizer, level: int, factor: float,
              streams: tuple[str, ...] = (), variant: str = "") -> list[RequestSpec]:
    """One offered load: every stream's arrivals at rate × factor × scale, merged by time.
    Another `variant` keeps arrivals and lengths but draws other words."""
    drawn = []
    for stream in profile.streams:
        shape = random.Random(f"{profile.seed}:{level}:{stream.name}")
        words = random.Random(f"{profile.seed}:{level}:{stream.name}:words{variant}")
        system = system_prompt(profile, stream, tok)
        for at_s in _arrivals(shape, stream, factor * profile.scale, profile.duration_s):
            drawn.append((at_s, stream, _messages(shape, words, tok, stream, system),
                          shape.randint(*stream.completion_tokens)))
    drawn = [d for d in drawn if not streams or d[1].name in streams]
    drawn.sort(key=lambda d: d[0])
    return [_spec(i, at_s, s, msgs, max_tokens, tok)
            for i, (at_s, s, msgs, max_tokens) in enumerate(drawn[:profile.max_requests])]


def closed_loop(profile: Profile, tok: Tokenizer, concurrency: int) -> list[RequestSpec]:
    """Fixed-shape requests with distinct documents: only the chat template's opening block
    and the instruction are shared (the curve counts uncached prompt tokens only)."""
    loop: ClosedLoop = profile.closed_loop
    rng = random.Random(f"{profile.seed}:closed:{concurrency}")
    stream = Stream("curve", "acme", "interactive", 1.0, (loop.prompt_tokens,) * 2,
                    (loop.completion_tokens,) * 2, task="summarise")
    return [_spec(i, 0.0, stream, _messages(rng, rng, tok, stream, ""), loop.completion_tokens,
                  tok) for i in range(concurrency * loop.requests_per_slot)]


def _spec(index: int, at_s: float, stream: Stream, messages, max_tokens: int,
          tok: Tokenizer) -> RequestSpec:
    text = tok.apply_chat_template([{"role": r, "content": c} for r, c in messages])
    return RequestSpec(index, at_s, stream.name, stream.tenant, stream.request_class, messages,
                       tuple(tok.encode(text)), max_tokens)


def offered_rps(profile: Profile, factor: float, streams: tuple[str, ...] = ()) -> float:
    """Mean offered request rate of one level (the diurnal mean, not its peak)."""
    total = 0.0
    for s in profile.streams:
        if streams and s.name not in streams:
            continue
        mean = math.fsum(s.hourly) / 24 if s.hourly else 1.0
        total += s.rate_rps * mean * factor * profile.scale
    return total


def warmup(profile: Profile, tok: Tokenizer, num_requests: int) -> list[RequestSpec]:
    """Short requests drawn apart from every level (no level's prompt gets cached early); they
    do warm the shared system prompt, which is hot in any steady state anyway."""
    if profile.closed_loop is not None:
        specs = _closed_warmup(profile, tok, num_requests)
    else:
        specs = open_loop(profile, tok, -1, max(profile.rates))[:num_requests]
    return [RequestSpec(i, 0.0, s.stream, s.tenant, s.request_class, s.messages,
                        s.prompt_token_ids, min(s.max_tokens, 16)) for i, s in enumerate(specs)]


def _closed_warmup(profile: Profile, tok: Tokenizer, num_requests: int) -> list[RequestSpec]:
    rng = random.Random(f"{profile.seed}:warmup")
    loop = profile.closed_loop
    stream = Stream("warmup", "acme", "interactive", 1.0, (loop.prompt_tokens,) * 2,
                    (loop.completion_tokens,) * 2, task="summarise")
    return [_spec(i, 0.0, stream, _messages(rng, rng, tok, stream, ""), 16, tok)
            for i in range(num_requests)]
