"""The model's tokenizer and chat template, rebuilt from a GGUF file's metadata alone.

Shared by the gateway (tokenize, render chat) and the worker (detokenize a stream); it imports no
torch. Also owns the GGUF metadata reader both of them use.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Iterable, Sequence

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _BackendTokenizer

_GGUF_MAGIC = b"GGUF"
# fixed-size metadata value types (GGUF spec): id -> struct format
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?",
                   10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4
# end-of-turn spellings a chat model may emit in place of (or after) its declared eos
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<end_of_turn>")
_REPLACEMENT_CHAR = "\ufffd"


@dataclass(frozen=True, slots=True)
class GGUFMetadata:
    """A GGUF file's key/value metadata and where its tensor table starts."""
    values: dict[str, Any]
    tensor_count: int
    tensor_table_offset: int


def read_gguf_metadata(path: str) -> GGUFMetadata:
    """Parse only the metadata section.

    gguf.GGUFReader builds numpy views for every element of the 49k-entry vocab and merges arrays
    and takes ~3 s on this model; walking the bytes with struct takes ~0.1 s.
    """
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != _GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file")
        version, tensor_count, kv_count = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported")
        pos, values = 24, {}
        for _ in range(kv_count):
            key, pos = _read_string(buf, pos)
            (value_type,) = struct.unpack_from("<I", buf, pos)
            values[key], pos = _read_value(buf, pos + 4, value_type)
    return GGUFMetadata(values=values, tensor_count=tensor_count, tensor_table_offset=pos)


def _read_string(buf: Any, pos: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", buf, pos)
    start = pos + 8
    return buf[start:start + length].decode("utf-8", errors="replace"), start + length


def _read_value(buf: Any, pos: int, value_type: int) -> tuple[Any, int]:
    if value_type in _SCALAR_FORMATS:
        fmt = "<" + _SCALAR_FORMATS[value_type]
        return struct.unpack_from(fmt, buf, pos)[0], pos + struct.calcsize(fmt)
    if value_type == _STRING:
        return _read_string(buf, pos)
    if value_type != _ARRAY:
        raise ValueError(f"unknown GGUF metadata value type {value_type}")
    element_type, count = struct.unpack_from("<IQ", buf, pos)
    pos += 12
    if element_type in _SCALAR_FORMATS:
        fmt = f"<{count}{_SCALAR_FORMATS[element_type]}"
        return list(struct.unpack_from(fmt, buf, pos)), pos + struct.calcsize(fmt)
    items = []
    for _ in range(count):
        item, pos = _read_value(buf, pos, element_type)
        items.append(item)
    return items, pos


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the ByteLevel pre-tokenizer's spelling)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


def _pre_tokenizer(pre_type: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre_type == "smollm":
        # SmolLM's own tokenizer.json (and llama.cpp's "smollm" pre-type) isolate every digit
        # before the GPT-2 regex; transformers' GGUF conversion omits this step.
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre_type in ("gpt2", "default", ""):
        return byte_level
    raise ValueError(f"GGUF pre-tokenizer {pre_type!r} is not supported")


def _build_backend(meta: dict[str, Any]) -> _BackendTokenizer:
    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise ValueError(f"tokenizer model {meta.get('tokenizer.ggml.model')!r} is not supported "
                         "(only byte-level BPE, tokenizer.ggml.model=gpt2)")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    token_types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    spelling = _byte_alphabet()
    alphabet = set(spelling.values())
    # A token written outside the byte alphabet is stored as raw text; respell it as BPE sees it.
    vocab = {(t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode())): i
             for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    backend = _BackendTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    backend.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre", "gpt2"))
    backend.decoder = decoders.ByteLevel()
    special = [AddedToken(t, special=True, normalized=False)
               for t, kind in zip(tokens, token_types) if kind == _TOKEN_TYPE_CONTROL]
    user = [AddedToken(t, special=False, normalized=False)
            for t, kind in zip(tokens, token_types) if kind == _TOKEN_TYPE_USER_DEFINED]
    backend.add_special_tokens(special)
    backend.add_tokens(user)
    return backend


class Tokenizer:
    """Byte-level BPE tokenizer plus the model's chat template."""

    def __init__(self, backend: _BackendTokenizer, meta: dict[str, Any]) -> None:
        self._backend = backend
        self._tokens: list[str] = meta["tokenizer.ggml.tokens"]
        self._bos_id = int(meta.get("tokenizer.ggml.bos_token_id", -1))
        self._eos_id = int(meta["tokenizer.ggml.eos_token_id"])
        self._add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
        template = meta.get("tokenizer.chat_template")
        self._template = _compile_template(template) if template else None
        stops = [self._eos_id] + [i for i in (backend.token_to_id(t) for t in _END_OF_TURN_TOKENS)
                                  if i is not None]
        self._stop_ids = tuple(dict.fromkeys(stops))

    @classmethod
    def from_gguf(cls, path: str) -> Tokenizer:
        meta = read_gguf_metadata(path).values
        return cls(_build_backend(meta), meta)

    @property
    def eos_token_id(self) -> int:
        return self._eos_id

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_id if self._bos_id >= 0 else None

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return self._stop_ids

    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        # Special tokens written in the text (e.g. "<|im_start|>") always map to their ids:
        # rendered chat templates depend on it.
        ids = self._backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self._add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, str]],
                            add_generation_prompt: bool = True) -> str:
        if self._template is None:
            raise ValueError("this model's GGUF carries no tokenizer.chat_template")
        return self._template.render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self._token_text(self._bos_id), eos_token=self._token_text(self._eos_id))

    def _token_text(self, token_id: int) -> str:
        return self._tokens[token_id] if 0 <= token_id < len(self._tokens) else ""


def _raise_template_error(message: str) -> None:
    raise ValueError(f"chat template error: {message}")


def _compile_template(source: str) -> Any:
    # Same environment settings as transformers' apply_chat_template, so templates render alike;
    # sandboxed because the template comes from a model file, not from us.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_template_error
    return env.from_string(source)


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of text, never splitting a UTF-8 character.

    Decodes a sliding window (vLLM/TGI's prefix/read offsets) so each push costs O(window). Text
    ending in U+FFFD is an incomplete multi-byte character: everything before it is emitted, the
    character itself waits for the tokens that complete it.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0   # window start: decoding from here reproduces the text exactly
        self._read_offset = 0     # tokens before this are fully emitted
        self._emitted = 0         # characters already emitted past the read offset's text

    def push(self, token_ids: Iterable[int]) -> str:
        self._ids.extend(token_ids)
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        full_text = self._decode(self._prefix_offset, len(self._ids))
        complete = not full_text.endswith(_REPLACEMENT_CHAR)
        stable = full_text if complete else full_text.rstrip(_REPLACEMENT_CHAR)
        new_text = stable[len(prefix_text) + self._emitted:]
        if complete:
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            self._emitted = 0
        else:
            self._emitted += len(new_text)
        return new_text

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character decodes as U+FFFD)."""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        full_text = self._decode(self._prefix_offset, len(self._ids))
        self._prefix_offset = self._read_offset = len(self._ids)
        held, self._emitted = full_text[len(prefix_text) + self._emitted:], 0
        return held

    def _decode(self, start: int, end: int) -> str:
        if start >= end:
            return ""
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=self._skip_special)
