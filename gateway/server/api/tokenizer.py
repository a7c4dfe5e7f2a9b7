"""Tokenizers the gateway uses to turn text into prompt ids and output ids back into text.

The gateway tokenizes itself (DESIGN 4.2): it must know a request's prompt ids to resume it elsewhere.
Two kinds: `ByteTokenizer` for synthetic models (a byte is a token) and `HFTokenizer` around a
Hugging Face `tokenizer.json`. Streaming goes through an `IncrementalDecoder`, which never returns
half of a multi-byte character: incomplete bytes are held until they complete, and only `finish()`
turns a dangling remainder into U+FFFD.

`token_text(id)` is one token alone, for log probabilities: the text decoding it shows (special
tokens included, as SGLang's per-token `batch_decode` shows them) and its bytes (for a byte-level BPE
vocabulary the token's own bytes through the GPT-2 byte table, as SGLang's `token_id_to_bytes`; a
`<0xAB>` byte-fallback piece is that byte; otherwise the UTF-8 of its text).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import tokenizers
from tokenizers.decoders import DecodeStream

from gateway.config import ConfigError, TokenizerSection
from gateway.protocol import bytevocab
from gateway.protocol.openai.envelopes import TokenText


class IncrementalDecoder(Protocol):
    def step(self, ids: Sequence[int]) -> str:
        """Text completed by `ids` (possibly ""); incomplete characters are held back."""
        ...

    def finish(self) -> str:
        """Whatever is still held back, with incomplete characters replaced by U+FFFD."""
        ...


class Tokenizer(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends a generation by default (may be empty when undeterminable)."""
        ...

    @property
    def eos_token_id(self) -> int | None: ...

    @property
    def bos_token(self) -> str | None: ...

    @property
    def eos_token(self) -> str | None: ...

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`; special and unknown ids are skipped."""
        ...

    def incremental_decoder(self) -> IncrementalDecoder: ...

    def token_text(self, token_id: int) -> TokenText:
        """One token alone: its text (U+FFFD for part of a character, specials shown) and bytes."""
        ...


# --------------------------------------------------------------------------------------------------
# byte tokenizer (synthetic models)

EOS_ID = bytevocab.EOS_ID


class ByteTokenizer:
    """Ids 0..255 are bytes; 256 <|bos|>, 257 <|eos|>, 258 <|pad|>. Special-token text encodes to its id."""

    name = "byte"
    vocab_size = bytevocab.VOCAB_SIZE
    eos_token_ids: tuple[int, ...] = (EOS_ID,)
    eos_token_id: int | None = EOS_ID
    bos_token: str | None = "<|bos|>"
    eos_token: str | None = "<|eos|>"

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        # add_special_tokens is accepted for the protocol; synthetic models take no BOS
        return bytevocab.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return bytevocab.decode(ids)

    def incremental_decoder(self) -> IncrementalDecoder:
        return bytevocab.Utf8Stream()

    def token_text(self, token_id: int) -> TokenText:
        raw = bytevocab.token_bytes(token_id)
        return TokenText(raw.decode("utf-8", errors="replace"), raw)


# --------------------------------------------------------------------------------------------------
# Hugging Face tokenizer.json

# special tokens that end a turn or a document in common model families; used only when neither
# tokenizer_config.json nor generation_config.json names the EOS
_KNOWN_EOS = ("</s>", "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<eos>", "<|eos|>")


class _HFStreamDecoder:
    def __init__(self, tok: tokenizers.Tokenizer) -> None:
        self._tok = tok
        self._stream = DecodeStream(skip_special_tokens=True)
        self._ids: list[int] = []
        self._emitted: list[str] = []
        self._held = False  # the last id fed did not yet complete a character

    def step(self, ids: Sequence[int]) -> str:
        out: list[str] = []
        for i in ids:
            self._ids.append(i)
            piece = self._stream.step(self._tok, i)
            self._held = piece is None
            if piece:
                out.append(piece)
        text = "".join(out)
        self._emitted.append(text)
        return text

    def finish(self) -> str:
        if not self._held:
            return ""
        # the stream holds bytes that never completed: a full decode shows them as U+FFFD
        emitted = "".join(self._emitted)
        full = self._tok.decode(self._ids, skip_special_tokens=True)
        return full[len(emitted) :] if full.startswith(emitted) else ""


class HFTokenizer:
    def __init__(
        self,
        tok: tokenizers.Tokenizer,
        *,
        name: str,
        eos_token_ids: tuple[int, ...],
        bos_token: str | None,
        eos_token: str | None,
    ) -> None:
        self._tok = tok
        self.name = name
        self.vocab_size: int = tok.get_vocab_size(with_added_tokens=True)
        self.eos_token_ids = eos_token_ids
        self.eos_token_id = eos_token_ids[0] if eos_token_ids else None
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._byte_level = b'"ByteLevel"' in _decoder_state(tok)
        self._texts: dict[int, TokenText] = {}

    @classmethod
    def from_file(cls, path: str | Path) -> HFTokenizer:
        """Load `tokenizer.json`; EOS/BOS come from tokenizer_config.json and generation_config.json
        beside it when present, else from the tokenizer's special tokens."""
        p = Path(path)
        try:
            tok = tokenizers.Tokenizer.from_file(str(p))
        except Exception as exc:  # the library raises a bare Exception for unreadable files
            raise ConfigError("tokenizer.path", str(p), f"not a loadable tokenizer.json: {exc}") from exc
        tok_cfg = _read_json(p.parent / "tokenizer_config.json")
        gen_cfg = _read_json(p.parent / "generation_config.json")
        eos_token = _token_text(tok_cfg.get("eos_token"))
        bos_token = _token_text(tok_cfg.get("bos_token"))
        eos: list[int] = []
        if eos_token is not None and (tid := tok.token_to_id(eos_token)) is not None:
            eos.append(tid)
        gen_eos = gen_cfg.get("eos_token_id")
        gen_ids = gen_eos if isinstance(gen_eos, list) else [gen_eos]
        eos.extend(t for t in gen_ids if isinstance(t, int) and not isinstance(t, bool))
        if not eos:
            specials = {t.content: i for i, t in tok.get_added_tokens_decoder().items() if t.special}
            eos = [specials[t] for t in _KNOWN_EOS if t in specials]
            if eos and eos_token is None:
                eos_token = tok.id_to_token(eos[0])
        name = p.parent.name if p.name == "tokenizer.json" and p.parent.name else p.stem
        return cls(
            tok,
            name=name,
            eos_token_ids=tuple(dict.fromkeys(eos)),
            bos_token=bos_token,
            eos_token=eos_token,
        )

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        ids: list[int] = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        text: str = self._tok.decode(list(ids), skip_special_tokens=True)
        return text

    def incremental_decoder(self) -> IncrementalDecoder:
        return _HFStreamDecoder(self._tok)

    def token_text(self, token_id: int) -> TokenText:
        found = self._texts.get(token_id)
        if found is not None:
            return found
        text: str = self._tok.decode([token_id], skip_special_tokens=False)
        piece = self._tok.id_to_token(token_id)
        raw: bytes | None = None
        if piece is not None and self._byte_level:
            raw = _byte_level_bytes(piece)
        elif piece is not None and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                raw = bytes([int(piece[3:5], 16)])  # a byte-fallback piece
            except ValueError:
                raw = None
        found = TokenText(text, raw if raw else text.encode("utf-8"))
        if len(self._texts) < _TOKEN_TEXT_CACHE:
            self._texts[token_id] = found
        return found


_TOKEN_TEXT_CACHE = 1 << 18


def _decoder_state(tok: tokenizers.Tokenizer) -> bytes:
    decoder = tok.decoder
    if decoder is None:
        return b""
    try:
        state: bytes = decoder.__getstate__()
    except Exception:  # the library raises bare Exceptions
        return b""
    return state


def _gpt2_byte_table() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the character standing for each byte (`bytes_to_unicode`)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in keep}
    extra = 0
    for b in range(256):
        if b not in keep:
            table[chr(256 + extra)] = b
            extra += 1
    return table


_BYTE_LEVEL = _gpt2_byte_table()


def _byte_level_bytes(piece: str) -> bytes | None:
    """A byte-level BPE piece's bytes; None when it holds other characters (an added token)."""
    out = bytearray()
    for ch in piece:
        b = _BYTE_LEVEL.get(ch)
        if b is None:
            return None
        out.append(b)
    return bytes(out)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _token_text(value: object) -> str | None:
    """tokenizer_config.json writes a special token as a string or as {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def make_tokenizer(section: TokenizerSection) -> Tokenizer:
    if section.kind == "byte":
        return ByteTokenizer()
    if section.kind == "hf":
        return HFTokenizer.from_file(section.path)
    raise ConfigError("tokenizer.kind", section.kind, "must be one of byte, hf")
