"""Output ids to client text, with OpenAI-style stop strings.

A stop string may arrive split over several deltas (or inside one multi-byte character that is still
incomplete). The detokenizer therefore holds back the longest tail of the text that could still grow
into a stop string and releases it only once it cannot; a stop string can thus never start inside
text already released. On a match the text is cut before the stop string and nothing more is released.
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.server.api.tokenizer import Tokenizer


class Detokenizer:
    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self._decoder = tokenizer.incremental_decoder()
        self._stop = tuple(stop)
        self._held = ""  # released to nobody yet: a proper prefix of some stop string
        self.matched: str | None = None  # the stop string that ended the text, once one has
        self.finished = False

    def feed(self, ids: Sequence[int]) -> str:
        """The text now safe to show for `ids`; "" while characters or stop prefixes are pending."""
        if self.finished:
            return ""
        if not self._stop:
            return self._decoder.step(ids)
        return self._release(self._held + self._decoder.step(ids), final=False)

    def finish(self) -> str:
        """Release everything still held; call once, when the generation has ended."""
        if self.finished:
            return ""
        text = self._release(self._held + self._decoder.finish(), final=True)
        self.finished = True
        return text

    def _release(self, text: str, *, final: bool) -> str:
        cut, matched = self._first_stop(text)
        if matched is not None:
            self.matched = matched
            self.finished = True
            self._held = ""
            return text[:cut]
        keep = 0 if final else self._stop_prefix_len(text)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def _first_stop(self, text: str) -> tuple[int, str | None]:
        best: tuple[int, str | None] = (len(text), None)
        for s in self._stop:
            at = text.find(s)
            if 0 <= at < best[0] or (at == best[0] and best[1] is not None and len(s) > len(best[1])):
                best = (at, s)
        return best

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        longest = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:n]):
                    longest = n
                    break
        return longest
