"""Draft pairs: the start-up validation, lookups, and refusal of pairs that cannot share tokens."""

from __future__ import annotations

import pytest

from gateway.config import DraftPair, DraftSection
from gateway.core.costmodel import MODELS, ModelSpec
from gateway.core.draftpairs import (
    DraftRegistry,
    IncompatibleDraftError,
    check_pair,
    incompatibility,
    tokenizer_family,
    validate_pairs,
)


def test_the_default_config_pairs_validate_and_look_up() -> None:
    reg = validate_pairs(DraftSection().pairs)
    assert len(reg) == len(DraftSection().pairs)
    assert reg.draft_for("Qwen3-32B") == "Qwen3-1.7B"
    assert reg.draft_for("Llama-3-70B") == "Llama-3.2-1B"
    assert reg.draft_for("Qwen3-1.7B") is None
    assert reg.targets_for("Qwen3-0.6B") == ("Qwen3-14B", "Qwen3-8B")
    assert reg.targets_for("nothing") == ()
    assert ("Qwen3-8B", "Qwen3-0.6B") in reg.pairs


def test_tuples_are_accepted_too() -> None:
    reg = validate_pairs([("Qwen3-8B", "Qwen3-0.6B")])
    assert reg.draft_for("Qwen3-8B") == "Qwen3-0.6B"


def test_tokenizer_families() -> None:
    assert {tokenizer_family(m) for m in MODELS if m.startswith("Qwen3")} == {"qwen3"}
    assert {tokenizer_family(m) for m in MODELS if m.startswith("Llama")} == {"llama3"}
    assert tokenizer_family("Mistral-7B") is None


def test_a_cross_family_pair_is_refused_naming_both_models_and_why() -> None:
    with pytest.raises(IncompatibleDraftError) as info:
        validate_pairs([DraftPair("Qwen3-8B", "Qwen3-0.6B"), DraftPair("Qwen3-32B", "Llama-3.2-1B")])
    msg = str(info.value)
    assert "Qwen3-32B" in msg and "Llama-3.2-1B" in msg
    assert "vocabulary sizes differ" in msg and "151936" in msg and "128256" in msg
    assert info.value.index == 1 and info.value.target == "Qwen3-32B" and info.value.draft == "Llama-3.2-1B"
    assert isinstance(info.value, ValueError)


def test_same_vocabulary_size_but_another_tokenizer_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(MODELS, "Other-0.5B", ModelSpec("Other-0.5B", 0.5e9, 24, 1024, 96 * 1024, 151936, 1))
    why = incompatibility("Qwen3-8B", "Other-0.5B")
    assert why is not None and "tokenizers differ" in why and "unknown" in why


@pytest.mark.parametrize(
    ("target", "draft", "reason"),
    [
        ("Qwen3-8B", "Qwen3-8B", "cannot draft for itself"),
        ("Qwen3-8B", "Qwen3-32B", "not smaller"),
        ("Qwen3-9000B", "Qwen3-0.6B", "unknown target model preset"),
        ("Qwen3-8B", "tiny", "unknown draft model preset"),
        ("Llama-3.1-8B", "Qwen3-0.6B", "vocabulary sizes differ"),
    ],
)
def test_bad_pairs_are_refused(target: str, draft: str, reason: str) -> None:
    with pytest.raises(IncompatibleDraftError, match=reason):
        check_pair(target, draft)


def test_one_draft_model_per_target() -> None:
    with pytest.raises(IncompatibleDraftError, match=r"already drafts with Qwen3-0\.6B"):
        DraftRegistry([("Qwen3-8B", "Qwen3-0.6B"), ("Qwen3-8B", "Qwen3-1.7B")])
    # the same pair twice is harmless
    assert len(DraftRegistry([("Qwen3-8B", "Qwen3-0.6B")] * 2)) == 1
