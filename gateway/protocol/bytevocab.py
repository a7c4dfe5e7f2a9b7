"""The byte vocabulary of Lumen's synthetic models: the token ids the gateway and the workers share.

Ids 0..255 are bytes of UTF-8 text; 256 `<|bos|>`, 257 `<|eos|>`, 258 `<|pad|>`. The text of a special
token encodes to its id; decoding skips the specials. The gateway's `ByteTokenizer` and the worker's
OpenAI routes both use this module, so a prompt gets the same ids whichever of them tokenises it.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable

VOCAB_SIZE = 259
BOS_ID, EOS_ID, PAD_ID = 256, 257, 258
SPECIALS = {"<|bos|>": BOS_ID, "<|eos|>": EOS_ID, "<|pad|>": PAD_ID}
_SPECIAL_TEXT = {i: t for t, i in SPECIALS.items()}


def encode(text: str) -> list[int]:
    ids: list[int] = []
    rest = text
    while rest:
        cut, special = _first_special(rest)
        ids.extend(rest[:cut].encode("utf-8"))
        if special is None:
            break
        ids.append(SPECIALS[special])
        rest = rest[cut + len(special) :]
    return ids


def token_bytes(token_id: int) -> bytes:
    """One token's bytes: the byte itself, a special token's text, b"" for an id outside the vocabulary."""
    if 0 <= token_id < 256:
        return bytes((token_id,))
    return _SPECIAL_TEXT.get(token_id, "").encode("utf-8")


def decode(ids: Iterable[int]) -> str:
    return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class Utf8Stream:
    """Output ids to text as they come: an incomplete UTF-8 tail is held until it completes."""

    def __init__(self) -> None:
        # "replace" only affects bytes that can never become valid; an incomplete tail stays buffered
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def step(self, ids: Iterable[int]) -> str:
        return self._dec.decode(bytes(i for i in ids if 0 <= i < 256))

    def finish(self) -> str:
        return self._dec.decode(b"", final=True)


def _first_special(text: str) -> tuple[int, str | None]:
    best: tuple[int, str | None] = (len(text), None)
    for tok in SPECIALS:
        at = text.find(tok)
        if 0 <= at < best[0]:
            best = (at, tok)
    return best
