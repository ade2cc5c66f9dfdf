"""`SamplingParams.detokenize=False`: the same token ids, no text (vLLM's option)."""

from __future__ import annotations

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
