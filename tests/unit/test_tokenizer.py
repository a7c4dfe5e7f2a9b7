"""Tokenizers, incremental detokenization and stop strings, and chat templates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFRaw
from tokenizers import decoders, models, pre_tokenizers, trainers

from gateway.config import ConfigError, TokenizerSection
from gateway.server.api.chat_template import ChatMessage, ChatTemplate
from gateway.server.api.detokenize import Detokenizer
from gateway.server.api.errors import GatewayError, InvalidRequest
from gateway.server.api.tokenizer import EOS_ID, ByteTokenizer, HFTokenizer, Tokenizer, make_tokenizer

CORPUS = ["hello world", "héllo wörld 世界", "the quick brown fox jumps", "emoji 🎉 party"]


def stream_text(tok: Tokenizer, ids: list[int], per: int = 1) -> list[str]:
    dec = tok.incremental_decoder()
    out = [dec.step(ids[i : i + per]) for i in range(0, len(ids), per)]
    out.append(dec.finish())
    return out


# --------------------------------------------------------------------------------------------------
# byte tokenizer


def test_byte_round_trip_and_specials() -> None:
    tok = ByteTokenizer()
    assert tok.vocab_size == 259 and tok.eos_token_ids == (EOS_ID,) and tok.eos_token_id == 257
    assert tok.encode("hi") == [104, 105]
    assert tok.encode("<|bos|>a<|eos|>") == [256, 97, 257]
    assert tok.decode([256, 104, 105, 257, 258, 9999]) == "hi"  # specials and unknown ids are skipped


@given(st.text().filter(lambda t: "<|" not in t))
def test_byte_round_trip_any_text(text: str) -> None:
    # special-token markers such as "<|bos|>" are parsed as special ids (chat templates emit them),
    # which decode skips; any other text round-trips
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert "".join(stream_text(tok, ids)) == text


def test_byte_incremental_never_splits_a_character() -> None:
    tok = ByteTokenizer()
    text = "a世🎉é"
    pieces = stream_text(tok, tok.encode(text))
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert pieces[:4] == ["a", "", "", "世"]


def test_byte_incomplete_tail_is_replaced_only_at_finish() -> None:
    tok = ByteTokenizer()
    dec = tok.incremental_decoder()
    assert dec.step([0xE4, 0xB8]) == ""  # first two bytes of 世
    assert dec.finish() == "\ufffd"
    dec = tok.incremental_decoder()
    assert dec.step([0xFF, 0x41]) == "\ufffdA"  # a byte that can never be valid is replaced at once


def test_make_tokenizer_kinds(tmp_path: Path) -> None:
    assert isinstance(make_tokenizer(TokenizerSection()), ByteTokenizer)
    path = tiny_hf_tokenizer(tmp_path)
    assert isinstance(make_tokenizer(TokenizerSection(kind="hf", path=str(path))), HFTokenizer)
    with pytest.raises(ConfigError, match=r"tokenizer\.kind"):
        make_tokenizer(TokenizerSection(kind="sentencepiece"))


# --------------------------------------------------------------------------------------------------
# HF tokenizer (built here: no downloads)


def tiny_hf_tokenizer(tmp_path: Path, config: dict[str, object] | None = None) -> Path:
    raw = HFRaw(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<s>", "</s>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    raw.train_from_iterator(CORPUS, trainer)
    d = tmp_path / "tiny"
    d.mkdir(exist_ok=True)
    raw.save(str(d / "tokenizer.json"))
    if config is not None:
        (d / "tokenizer_config.json").write_text(json.dumps(config))
    return d / "tokenizer.json"


@pytest.fixture
def hf(tmp_path: Path) -> HFTokenizer:
    return HFTokenizer.from_file(tiny_hf_tokenizer(tmp_path))


@pytest.mark.parametrize("text", [*CORPUS, "unseen wörds 世界🎉 mixed"])
def test_hf_round_trip(hf: HFTokenizer, text: str) -> None:
    ids = hf.encode(text)
    assert hf.decode(ids) == text
    for per in (1, 2, 3):
        assert "".join(stream_text(hf, ids, per)) == text


def test_hf_incremental_holds_split_characters(hf: HFTokenizer) -> None:
    ids = hf.encode("🎉")
    assert len(ids) > 1  # the emoji's bytes are spread over several tokens in this tiny vocabulary
    pieces = stream_text(hf, ids)
    assert pieces[:-2] == [""] * (len(ids) - 1) and pieces[-2] == "🎉" and pieces[-1] == ""
    dec = hf.incremental_decoder()
    assert dec.step(ids[:-1]) == ""
    assert dec.finish() == "\ufffd"


def test_hf_eos_from_special_tokens(hf: HFTokenizer) -> None:
    eos = hf.eos_token_ids
    assert [hf._tok.id_to_token(i) for i in eos] == ["</s>", "<|im_end|>"]
    assert hf.eos_token_id == eos[0] and hf.eos_token == "</s>"
    assert hf.decode([eos[0], *hf.encode("hi")]) == "hi"
    assert hf.vocab_size == hf._tok.get_vocab_size()


def test_hf_eos_from_config_files(tmp_path: Path) -> None:
    path = tiny_hf_tokenizer(tmp_path, {"eos_token": {"content": "<|im_end|>"}, "bos_token": "<s>"})
    (path.parent / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2]}))
    tok = HFTokenizer.from_file(path)
    assert tok.eos_token_ids == (2, 1)  # tokenizer_config's first, then generation_config's, no repeats
    assert tok.eos_token == "<|im_end|>" and tok.bos_token == "<s>" and tok.name == "tiny"


def test_hf_unloadable_file_is_a_config_error(tmp_path: Path) -> None:
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match=r"tokenizer\.path"):
        HFTokenizer.from_file(bad)


# --------------------------------------------------------------------------------------------------
# stop strings


def detok_all(stop: tuple[str, ...], text: str, per: int = 1) -> tuple[list[str], str | None]:
    tok = ByteTokenizer()
    det = Detokenizer(tok, stop)
    ids = tok.encode(text)
    out = [det.feed(ids[i : i + per]) for i in range(0, len(ids), per)]
    out.append(det.finish())
    return out, det.matched


@pytest.mark.parametrize("per", [1, 2, 5, 100])
def test_stop_string_across_chunks(per: int) -> None:
    pieces, matched = detok_all(("STOP",), "abc STxSTOP tail", per)
    assert "".join(pieces) == "abc STx" and matched == "STOP"


def test_stop_prefix_is_held_then_released() -> None:
    pieces, matched = detok_all(("abab",), "aba", 1)
    assert pieces == ["", "", "", "aba"] and matched is None  # held until the end proved it no stop


def test_earliest_of_several_stops_wins() -> None:
    pieces, matched = detok_all(("world", "o w"), "hello world", 100)
    assert "".join(pieces) == "hell" and matched == "o w"


def test_stop_string_with_multibyte_characters() -> None:
    pieces, matched = detok_all(("世界",), "hi 世界!", 1)
    assert "".join(pieces) == "hi " and matched == "世界"


@given(
    st.text(alphabet="ab世", max_size=30), st.text(alphabet="ab世", min_size=1, max_size=4), st.integers(1, 4)
)
def test_stop_matches_batch_semantics(text: str, stop: str, per: int) -> None:
    pieces, matched = detok_all((stop,), text, per)
    cut = text.find(stop)
    assert "".join(pieces) == (text if cut < 0 else text[:cut])
    assert matched == (None if cut < 0 else stop)


def test_empty_stop_string_is_refused() -> None:
    with pytest.raises(ValueError):
        Detokenizer(ByteTokenizer(), ("",))


# --------------------------------------------------------------------------------------------------
# chat templates


MSGS = (ChatMessage("system", "be brief"), ChatMessage("user", "hi"))


def test_default_template_is_role_tagged() -> None:
    tpl = ChatTemplate.load("", ByteTokenizer())
    assert tpl.render(MSGS) == "<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n"
    assert tpl.render(MSGS, add_generation_prompt=False) == "<|system|>\nbe brief\n<|user|>\nhi\n"


def test_jinja_template_file(tmp_path: Path) -> None:
    src = (
        "{{ bos_token }}{% for m in messages %}"
        "{% if m.role == 'system' and not loop.first %}"
        "{{ raise_exception('system must come first') }}{% endif %}"
        "[{{ m.role }}]{{ m.content }}{{ eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    path = tmp_path / "t.jinja"
    path.write_text(src)
    tpl = ChatTemplate.load(str(path), ByteTokenizer())
    assert tpl.render(MSGS) == "<|bos|>[system]be brief<|eos|>[user]hi<|eos|>[assistant]"
    with pytest.raises(InvalidRequest, match="system must come first") as exc:
        tpl.render((*MSGS, ChatMessage("system", "late")))
    assert exc.value.param == "messages"


def test_template_from_tokenizer_config(tmp_path: Path) -> None:
    path = tmp_path / "tokenizer_config.json"
    path.write_text(json.dumps({"chat_template": "{% for m in messages %}{{ m.content }}|{% endfor %}"}))
    assert ChatTemplate.load(str(path), ByteTokenizer()).render(MSGS) == "be brief|hi|"


def test_template_errors(tmp_path: Path) -> None:
    path = tmp_path / "bad.jinja"
    path.write_text("{% for m in messages %}")
    with pytest.raises(ConfigError, match="does not compile"):
        ChatTemplate.load(str(path), ByteTokenizer())
    path.write_text("{{ messages.__class__.__mro__ }}")  # the sandbox refuses attribute escapes
    with pytest.raises(GatewayError) as exc:
        ChatTemplate.load(str(path), ByteTokenizer()).render(MSGS)
    assert exc.value.status == 500


def test_hf_token_text_for_logprobs(hf: HFTokenizer) -> None:
    """One token alone: its bytes add up to the text's (a byte-level vocabulary's own bytes, even for
    part of a character, whose text alone is U+FFFD); special tokens are shown."""
    ids = hf.encode("🎉 hi")
    texts = [hf.token_text(i) for i in ids]
    assert b"".join(t.raw for t in texts) == "🎉 hi".encode()
    assert any(t.text == "\ufffd" and t.lossless != "\ufffd" for t in texts)
    assert hf.token_text(hf.eos_token_ids[0]).text == "</s>"
    assert hf.token_text(ids[-1]) is hf.token_text(ids[-1])  # cached


def test_byte_token_text() -> None:
    tok = ByteTokenizer()
    assert [tok.token_text(i).raw for i in b"ok"] == [b"o", b"k"]
    assert tok.token_text(257).text == "<|eos|>" and tok.token_text(0xE2).text == "\ufffd"
