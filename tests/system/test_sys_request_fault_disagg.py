"""One request that raises in the prefill worker's step after its KV transfer began (chunked
prefill with overlap: earlier chunks' blocks already went to the decode worker), on a real
`kvmesh up` (1 prefill + 1 decode worker): that request ends 500 naming it, a request beside it
finishes, and afterwards no block is held on either worker and no ledger entry is left.

The trigger is the one of tests/engine/test_engine_request_fault.py: the tiny Llama with
transformers' ByT5Tokenizer, a prompt id (500) in the model's vocabulary but not the
tokenizer's, near the prompt's end so that the first token's detokenization reads it."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest
from sys_harness import CONTROL_ARGS, WORKER_ARGS, idle, used_blocks, wait_until

from kvmesh.cli.up import LocalSystem, UpConfig
from tests.checkpoints import BYT5_TOKENIZER_IDS, byt5_checkpoint

# the good request's tokens stay decodable
BIAS = {str(i): -100 for i in range(BYT5_TOKENIZER_IDS, 1024)}
GOOD_PROMPT = [40 + i % 50 for i in range(200)]
BAD_PROMPT = [*GOOD_PROMPT[:-3], 500, 33, 34]


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSystem]:
    folder = byt5_checkpoint(tmp_path_factory.mktemp("sys-byt5"))
    config = UpConfig(
        model=str(folder),
        port=0,
        http_port=0,
        startup_timeout=240.0,
        drain_seconds=2.0,
        control_args=CONTROL_ARGS,
        worker_args=WORKER_ARGS,
        role_args={"prefill": ("--max-num-batched-tokens", "32")},  # 7 chunks per prompt
    )
    with LocalSystem(config) as started:
        yield started


def complete(client: openai.OpenAI, prompt: list[int], **extra: Any) -> Any:
    try:
        return client.completions.create(
            model=client.models.list().data[0].id,
            prompt=prompt,
            max_tokens=8,
            temperature=0.0,
            extra_body={"ignore_eos": True, **extra},
        )
    except openai.APIStatusError as error:
        return error


def test_a_prefill_failing_after_its_transfer_began_leaves_nothing_held(
    system: LocalSystem,
) -> None:
    client = openai.OpenAI(base_url=f"{system.http_url}/v1", api_key="unused", max_retries=0)
    alone = complete(client, GOOD_PROMPT, logit_bias=BIAS)
    assert not isinstance(alone, openai.APIStatusError), alone
    with ThreadPoolExecutor(2) as pool:
        good = pool.submit(complete, client, GOOD_PROMPT, logit_bias=BIAS)
        bad = pool.submit(complete, client, BAD_PROMPT)
        good_result, bad_result = good.result(), bad.result()
    assert isinstance(bad_result, openai.APIStatusError), bad_result
    assert bad_result.status_code == 500, bad_result
    assert "ValueError" in str(bad_result.message), bad_result.message
    assert not isinstance(good_result, openai.APIStatusError), good_result
    assert good_result.choices[0].text == alone.choices[0].text
    wait_until(lambda: idle(system), 10.0, f"nothing held: {used_blocks(system)}")
    again = complete(client, GOOD_PROMPT, logit_bias=BIAS)
    assert not isinstance(again, openai.APIStatusError), again
    assert again.choices[0].text == alone.choices[0].text
