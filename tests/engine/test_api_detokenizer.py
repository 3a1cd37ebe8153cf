"""Incremental detokenization and stop strings: streamed text must equal the whole decode."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.api_server.detokenizer import IncrementalDetokenizer, StopChecker
from engine.api_server.tokenizer import Tokenizer, TokenizerError
from tests.local_deployment import with_test_tokenizer

TEXTS = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40) | st.sampled_from(
    ["Hello 😀 你好 wörld", "🇫🇷🇯🇵 — ≈ ∑ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "a\u0301e\u0301 e\u0308 ﬁ"])


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory):
    model = tmp_path_factory.mktemp("m")
    (model / "config.json").write_text(json.dumps({"vocab_size": 256}))
    return Tokenizer.from_dir(with_test_tokenizer(model, model / "with-tokenizer"))


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from engine.model.default_model import default_model_dir
    return Tokenizer.from_dir(default_model_dir())


def stream(tokenizer: Tokenizer, prompt: list[int], outputs: list[int]) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tokenizer.decode, prompt)
    deltas = [detok.add(t) for t in outputs]
    return deltas, "".join(deltas) + detok.flush()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=TEXTS, prompt=st.sampled_from(["", "Say:", "你"]))
def test_streamed_text_is_the_text_and_never_a_broken_character(smollm2_tokenizer, text, prompt):
    tokenizer = smollm2_tokenizer  # byte-level BPE: an emoji or a CJK character is several tokens
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas, whole = stream(tokenizer, tokenizer.encode(prompt, add_special_tokens=False), ids)
    assert whole == tokenizer.decode(ids)
    assert whole == text or not text.isprintable()  # it may not know a control character
    assert not any(d.endswith("\ufffd") for d in deltas)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=st.lists(st.integers(0, 255), max_size=30))
def test_any_token_sequence_streams_to_its_whole_decode(tiny_tokenizer, ids):
    # the bytes of é, 😀 and 你 in any order: U+FFFD where the whole decode has it, never more
    # (the prompt ends on a whole character, as any text prompt does)
    assert stream(tiny_tokenizer, tiny_tokenizer.encode("Say 😀"), ids)[1] == tiny_tokenizer.decode(ids)


def test_special_tokens_are_skipped_and_multibyte_waits_for_its_last_byte(tiny_tokenizer):
    detok = IncrementalDetokenizer(tiny_tokenizer.decode, [1, 104])
    smiley = tiny_tokenizer.encode("😀")
    assert len(smiley) == 4
    assert [detok.add(t) for t in [2, *smiley, 4]] == ["", "", "", "", "😀", "!"]


def chunks_of(text: str, cuts: list[int]) -> list[str]:
    cuts = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in zip(cuts, cuts[1:])]


def run_checker(stop: list[str], pieces: list[str], include: bool = False) -> tuple[str, bool]:
    checker = StopChecker(stop, include)
    out, stopped = "", False
    for i, piece in enumerate(pieces):
        emitted, stopped = checker.feed(piece, final=i == len(pieces) - 1)
        out += emitted
        if stopped:
            break
    if not pieces:
        out += checker.feed("", final=True)[0]
    return out, stopped


def expected(text: str, stop: list[str], include: bool) -> tuple[str, bool]:
    """The stop string completed first (then the one starting first) ends the text."""
    hits = [(i + len(s), i, s) for s in stop if s and (i := text.find(s)) >= 0]
    if not hits:
        return text, False
    end, start, _ = min(hits)
    return text[:end if include else start], True


@settings(max_examples=300, deadline=None)
@given(text=st.text("abc😀", max_size=30), stop=st.lists(st.text("abc😀", min_size=1, max_size=4), max_size=3),
       cuts=st.lists(st.integers(0, 40), max_size=12), include=st.booleans())
def test_stop_strings_end_the_text_whatever_the_chunking(text, stop, cuts, include):
    assert run_checker(stop, chunks_of(text, cuts), include) == expected(text, stop, include)


@given(before=st.text("ab", max_size=12), after=st.text("ab", max_size=6), cuts=st.lists(st.integers(0, 25), max_size=8))
def test_no_part_of_a_stop_string_is_ever_emitted_before_it_is_ruled_out(before, after, cuts):
    stop = "abba"
    text = before + stop + after
    checker, emitted = StopChecker([stop]), ""
    for piece in chunks_of(text, cuts):
        emitted += checker.feed(piece)[0]
        assert text[:text.index(stop)].startswith(emitted)
    assert emitted == text[:text.index(stop)]


def test_chat_template_renders_like_transformers(smollm2_tokenizer):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = smollm2_tokenizer.apply_chat_template(messages)
    assert prompt == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                      "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                      "<|im_start|>assistant\n")
    ids = smollm2_tokenizer.encode(prompt, add_special_tokens=False)
    assert ids[0] == 1 and smollm2_tokenizer.decode(ids, skip_special_tokens=False) == prompt


def test_unencodable_text_and_template_errors_are_tokenizer_errors(tiny_tokenizer):
    with pytest.raises(TokenizerError):
        tiny_tokenizer.encode("lone surrogate \ud800")
    strict = Tokenizer(tiny_tokenizer.tokenizer, {}, "{{ raise_exception('roles must alternate') }}")
    with pytest.raises(TokenizerError, match="roles must alternate"):
        strict.apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(TokenizerError, match="no chat template"):
        Tokenizer(tiny_tokenizer.tokenizer).apply_chat_template([{"role": "user", "content": "hi"}])
