"""Detokenization work per step is bounded when an output stops making text. A client can force
such an output (logit_bias +100 on one token): a lone UTF-8 continuation byte (every decode
ends in U+FFFD, so nothing completes), a special token that decoding skips, or an id the
tokenizer does not know (the tiny model's vocabulary is larger than its tokenizer's). The held
ids are re-decoded each step; unbounded, that work grows with the output (quadratic in total).
The text stays the tokenizer's full decode of the ids, and the streamed pieces join to it."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_engine_detokenize import streamed

from kvmesh import LLM, SamplingParams
from kvmesh.engine.detokenizer import SequenceText
from kvmesh.models.tiny import build_tiny_model
from kvmesh.models.tokenizer import save_byte_tokenizer

MAX_TOKENS = 400
IDS_PER_TOKEN = 64  # decoded ids per generated token; unbounded it grows to MAX_TOKENS / 2
CONTINUATION, PAD, UNKNOWN = 0x80, 258, 300  # a lone 0x80 byte, "<pad>", beyond the tokenizer


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    checkpoint = build_tiny_model(tmp_path_factory.mktemp("llama"), "llama", "test", seed=0)
    return LLM(model=str(checkpoint), num_kv_blocks=128)


@pytest.fixture
def decoded_ids(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Counts the ids SequenceText hands the tokenizer to decode (one element: the total)."""
    total = [0]
    decode = SequenceText._decode

    def counting(self: SequenceText, ids: Sequence[int]) -> str:
        total[0] += len(ids)
        return decode(self, ids)

    monkeypatch.setattr(SequenceText, "_decode", counting)
    yield total


@pytest.mark.parametrize("token", [CONTINUATION, PAD, UNKNOWN], ids=["byte", "special", "unknown"])
def test_an_output_that_makes_no_text_is_decoded_in_bounded_work(
    llm: LLM, decoded_ids: list[int], token: int
) -> None:
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logit_bias={token: 100.0}
    )
    joined, completion = streamed(llm, f"forced-{token}", "hello", params)
    assert completion.token_ids == [token] * MAX_TOKENS
    assert joined == completion.text
    assert completion.text == tokenizer.decode(completion.token_ids, skip_special_tokens=True)
    assert 0 < decoded_ids[0] <= IDS_PER_TOKEN * MAX_TOKENS  # counted, and bounded


@pytest.fixture(scope="module")
def byte_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("byte-tok")
    save_byte_tokenizer(out, model_max_length=256)
    return AutoTokenizer.from_pretrained(out)


# Ids that end, continue, start or break characters, or make no text; long runs of them.
PIECES = st.sampled_from(
    [
        [0x80],
        [0xBF],
        [0xE4],
        [0xF0, 0x9F],
        [0xE4, 0xB8, 0x96],  # 世
        [0xF0, 0x9F, 0x98, 0x80],  # an emoji
        [0xC3, 0xA9],  # é
        [ord("a")],
        [ord(" ")],
        [256],  # <bos>: skipped
        [258],  # <pad>: skipped
        [300],  # not in the tokenizer
    ]
)
RUNS = st.lists(st.tuples(PIECES, st.integers(1, 40)), max_size=12)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(runs=RUNS, flush_every=st.integers(1, 5))
def test_bounded_decoding_keeps_the_full_decode(
    byte_tokenizer: Any, runs: list[tuple[list[int], int]], flush_every: int
) -> None:
    """Any id sequence, appended a few ids at a time: the pieces join to the full decode."""
    ids = [i for piece, times in runs for _ in range(times) for i in piece]
    seq = SequenceText(byte_tokenizer, byte_tokenizer.encode("é世", add_special_tokens=False))
    pieces = [seq.append(ids[i : i + flush_every]) for i in range(0, len(ids), flush_every)]
    pieces.append(seq.flush())
    full = byte_tokenizer.decode(ids, skip_special_tokens=True)
    assert "".join(pieces) == seq.text == full
