"""Engine text: `SamplingParams.detokenize=False` gives the same token ids and no text (vLLM's
option); streamed pieces join to the final text; stop strings over several tokens and with
min_tokens."""

from __future__ import annotations

from typing import Any

import pytest

from kvmesh import LLM, SamplingParams
from kvmesh.models.tiny import build_tiny_model


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    checkpoint = build_tiny_model(tmp_path_factory.mktemp("llama"), "llama", "test", seed=0)
    return LLM(model=str(checkpoint), num_kv_blocks=64)


def test_detokenize_off_keeps_ids_and_skips_text(llm: LLM) -> None:
    prompts = [[65, 66, 67, 68], [70, 71]]
    on = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
    off = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True, detokenize=False)
    with_text = llm.generate(prompts, on)
    without = llm.generate(prompts, off)
    for a, b in zip(with_text, without, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert len(b.outputs[0].token_ids) == 9
        assert b.outputs[0].text == "" and b.outputs[0].finish_reason == "length"
    assert any(a.outputs[0].text for a in with_text)  # the byte tokenizer decodes something


def test_streamed_text_joins_to_the_full_decode(llm: LLM) -> None:
    """Random bytes sampled from the random model (partial characters included): the streamed
    pieces join to the completion's text, which is the tokenizer's decode of its ids."""
    engine, tokenizer = llm.engine, llm.get_tokenizer()
    for seed in range(6):
        params = SamplingParams(temperature=1.5, seed=seed, max_tokens=20, ignore_eos=True)
        engine.add_request(f"stream-{seed}", "é世", params)
        pieces, last = [], None
        while engine.has_unfinished():
            for output in engine.step():
                pieces.append(output.outputs[0].new_text)
                last = output
        assert last is not None and last.finished
        completion = last.outputs[0]
        assert "".join(pieces) == completion.text
        assert completion.text == tokenizer.decode(completion.token_ids, skip_special_tokens=True)


def streamed(llm: LLM, request_id: str, prompt: str, params: SamplingParams) -> tuple[str, Any]:
    """The joined new_text of every step's output, and the final output."""
    engine, pieces, last = llm.engine, [], None
    engine.add_request(request_id, prompt, params)
    while engine.has_unfinished():
        for output in engine.step():
            pieces.append(output.outputs[0].new_text)
            last = output
    assert last is not None and last.finished
    return "".join(pieces), last.outputs[0]


def test_a_stop_string_over_two_tokens_is_cut_whole_streamed_or_not(llm: LLM) -> None:
    """Every 2-character stop string of a greedy completion (two byte tokens) ends it right
    before its first occurrence: in the final text and in the joined stream alike."""
    greedy = {"temperature": 0.0, "max_tokens": 24, "ignore_eos": True}
    full = llm.generate(["The quick"], SamplingParams(**greedy))[0].outputs[0].text
    stops = {full[i : i + 2] for i in range(1, len(full) - 1) if "\ufffd" not in full[i : i + 2]}
    assert stops
    for i, stop in enumerate(sorted(stops)):
        joined, out = streamed(llm, f"stop-{i}", "The quick", SamplingParams(stop=stop, **greedy))
        assert joined == out.text == full[: full.index(stop)], (full, stop)
        assert (out.finish_reason, out.stop_reason) == ("stop", stop)


def test_min_tokens_defers_stop_strings(llm: LLM) -> None:
    """A stop string ending within the first min_tokens tokens does not stop the completion;
    the first one ending after them does."""
    greedy = {"temperature": 0.0, "max_tokens": 24, "ignore_eos": True}
    done = llm.generate(["The quick"], SamplingParams(**greedy))[0].outputs[0]
    full, stop = done.text, done.text[1]
    assert stop != "\ufffd"
    deferred = len(llm.get_tokenizer().decode(done.token_ids[:10]).rstrip("\ufffd"))
    assert full.index(stop) < deferred  # an early match the deferral skips
    later = full.find(stop, deferred)
    params = SamplingParams(stop=stop, min_tokens=10, **greedy)
    joined, out = streamed(llm, "min", "The quick", params)
    assert joined == out.text == (full if later < 0 else full[:later])
    assert len(out.token_ids) >= 10


def test_a_stop_token_leaves_its_text_out_unless_included(llm: LLM) -> None:
    """The token that stops a completion (EOS with special tokens kept, a stop token id) is in
    its token ids but not its text, streamed or not; include_stop_str_in_output keeps it (as
    vLLM answers)."""
    eos, x = 257, ord("x")  # the byte tokenizer's <eos>, and "x"
    greedy = {"temperature": 0.0, "max_tokens": 6}
    cases = [
        (SamplingParams(logit_bias={eos: 100}, skip_special_tokens=False, **greedy), eos, ""),
        (SamplingParams(logit_bias={x: 100}, stop_token_ids=[x], **greedy), x, ""),
        (
            SamplingParams(
                logit_bias={x: 100}, stop_token_ids=[x], include_stop_str_in_output=True, **greedy
            ),
            x,
            "x",
        ),
    ]
    for i, (params, token, text) in enumerate(cases):
        joined, out = streamed(llm, f"stop-token-{i}", "The quick", params)
        assert out.token_ids == [token] and out.finish_reason == "stop"
        assert joined == out.text == text
