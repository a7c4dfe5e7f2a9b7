"""Target -> draft pairs and the vocabulary check that keeps an incompatible pair from ever running.

Speculative decoding compares draft ids with target ids position by position, so target and draft must
share one tokenizer: the same vocabulary size is necessary but not sufficient (two tokenizers of one
size can still number their tokens differently), hence the tokenizer family as well. The families are
those of the cost-model presets: every Qwen3 size shares one tokenizer, the Llama 3.x models another.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from gateway.core.costmodel import MODELS

# preset-name prefix -> tokenizer family; the longest matching prefix wins
TOKENIZER_FAMILIES: dict[str, str] = {
    "Qwen3-": "qwen3",
    "Llama-3": "llama3",
}


class DraftError(ValueError):
    """Base of the draft-pair errors."""


class IncompatibleDraftError(DraftError):
    """A target -> draft pair that cannot speculate together; the message names both and why."""

    def __init__(self, target: str, draft: str, why: str, index: int | None = None) -> None:
        where = f"draft pair #{index} " if index is not None else "draft pair "
        super().__init__(f"{where}{target} -> {draft}: {why}")
        self.target = target
        self.draft = draft
        self.why = why
        self.index = index


class PairLike(Protocol):
    """The shape of the config's DraftPair (`target`, `draft` attributes)."""

    @property
    def target(self) -> str: ...

    @property
    def draft(self) -> str: ...


def tokenizer_family(model: str) -> str | None:
    best = ""
    for prefix in TOKENIZER_FAMILIES:
        if model.startswith(prefix) and len(prefix) > len(best):
            best = prefix
    return TOKENIZER_FAMILIES[best] if best else None


def incompatibility(target: str, draft: str) -> str | None:
    """Why `draft` cannot draft for `target`, or None when the pair is fine."""
    for role, name in (("target", target), ("draft", draft)):
        if name not in MODELS:
            return f"unknown {role} model preset {name!r} (known: {', '.join(sorted(MODELS))})"
    if target == draft:
        return "a model cannot draft for itself"
    t, d = MODELS[target], MODELS[draft]
    if t.vocab_size != d.vocab_size:
        return f"vocabulary sizes differ ({target}: {t.vocab_size}, {draft}: {d.vocab_size})"
    t_fam, d_fam = tokenizer_family(target), tokenizer_family(draft)
    if t_fam is None or d_fam is None or t_fam != d_fam:
        return f"tokenizers differ ({target}: {t_fam or 'unknown'}, {draft}: {d_fam or 'unknown'})"
    if d.params >= t.params:
        return (
            f"the draft ({d.params / 1e9:g}B parameters) is not smaller than the target ({t.params / 1e9:g}B)"
        )
    return None


def check_pair(target: str, draft: str, index: int | None = None) -> None:
    """Raise IncompatibleDraftError unless `draft` can draft for `target`."""
    why = incompatibility(target, draft)
    if why is not None:
        raise IncompatibleDraftError(target, draft, why, index)


class DraftRegistry:
    """Validated target -> draft pairs; built once at start-up (`validate_pairs`)."""

    __slots__ = ("_by_target",)

    def __init__(self, pairs: Iterable[tuple[str, str]]) -> None:
        self._by_target: dict[str, str] = {}
        for i, (target, draft) in enumerate(pairs):
            check_pair(target, draft, i)
            known = self._by_target.get(target)
            if known is not None and known != draft:
                raise IncompatibleDraftError(
                    target, draft, f"{target} already drafts with {known}; one draft model per target", i
                )
            self._by_target[target] = draft

    def draft_for(self, target: str) -> str | None:
        return self._by_target.get(target)

    def targets_for(self, draft: str) -> tuple[str, ...]:
        """The targets a worker holding `draft` can assist, in configuration order."""
        return tuple(t for t, d in self._by_target.items() if d == draft)

    @property
    def pairs(self) -> tuple[tuple[str, str], ...]:
        return tuple(self._by_target.items())

    def __len__(self) -> int:
        return len(self._by_target)


def validate_pairs(pairs: Iterable[PairLike | tuple[str, str]]) -> DraftRegistry:
    """The start-up check: every pair compatible, one draft per target. Raises IncompatibleDraftError."""
    flat: list[tuple[str, str]] = []
    for p in pairs:
        if isinstance(p, tuple):
            flat.append((p[0], p[1]))
        else:
            flat.append((p.target, p.draft))
    return DraftRegistry(flat)
