"""Bad input through the front door: INVALID_ARGUMENT naming the field, and nothing held."""

from __future__ import annotations

import math
from typing import Any

import pytest
from sys_harness import idle, ledger_entries, used_blocks

from kvmesh.cli.up import LocalSystem
from kvmesh.client import Client, InvalidArgument, NotFound

# (prompt, sampling keywords, pattern the message must contain); vocab/len filled in below.
CASES: list[tuple[str, Any, dict[str, Any], str]] = [
    ("empty text", "", {}, "text"),
    ("empty ids", [], {}, "token_ids"),
    ("negative temperature", "hi", {"temperature": -0.5}, "temperature"),
    ("nan temperature", "hi", {"temperature": math.nan}, "temperature"),
    ("top_p zero", "hi", {"top_p": 0.0}, "top_p"),
    ("top_p above one", "hi", {"top_p": 1.5}, "top_p"),
    ("nan top_p", "hi", {"top_p": math.nan}, "top_p"),
    ("top_k negative", "hi", {"top_k": -7}, "top_k"),
    ("min_p above one", "hi", {"min_p": 2.0}, "min_p"),
    ("repetition_penalty zero", "hi", {"repetition_penalty": 0.0}, "repetition_penalty"),
    ("presence_penalty", "hi", {"presence_penalty": 3.0}, "presence_penalty"),
    ("frequency_penalty nan", "hi", {"frequency_penalty": math.nan}, "frequency_penalty"),
    ("max_tokens zero", "hi", {"max_tokens": 0}, "max_tokens"),
    ("max_tokens negative", "hi", {"max_tokens": -3}, "max_tokens"),
    ("n zero", "hi", {"n": 0}, "n"),
    ("too many stop strings", "hi", {"stop": [f"s{i}" for i in range(17)]}, "stop"),
    ("stop string too long", "hi", {"stop": ["x" * 257]}, "stop"),
    ("empty stop string", "hi", {"stop": [""]}, "stop"),
    ("logprobs too many", "hi", {"logprobs": 1000}, "logprobs"),
]


@pytest.fixture(scope="module")
def client(shm_system: tuple[LocalSystem, str]) -> Client:
    return Client(shm_system[1], timeout=30)


@pytest.mark.parametrize(("prompt", "sampling", "field"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])  # fmt: skip
def test_invalid_sampling_and_prompt(
    client: Client, prompt: Any, sampling: dict[str, Any], field: str
) -> None:
    with pytest.raises(InvalidArgument, match=field):
        client.complete(prompt, **sampling)


def test_ids_outside_vocabulary_and_too_long_prompts(client: Client) -> None:
    info = client.model_info()
    vocab, max_len = info.vocab_size, info.max_model_len
    with pytest.raises(InvalidArgument, match=r"token_ids|prompt"):
        client.complete([1, 2, vocab])
    with pytest.raises(InvalidArgument, match=r"token_ids|prompt"):
        client.complete([-1, 2])
    with pytest.raises(InvalidArgument, match="stop_token_ids"):
        client.complete([1, 2], stop_token_ids=[vocab + 5])
    with pytest.raises(InvalidArgument, match=r"prompt|max_model_len|token_ids"):
        client.complete([1] * (max_len + 1))


def test_abort_of_unknown_id_is_not_found(client: Client) -> None:
    with pytest.raises(NotFound, match="no-such-request"):
        client.abort("no-such-request")


def test_rejections_leave_no_state(shm_system: tuple[LocalSystem, str], client: Client) -> None:
    """After every rejection above: no worker holds blocks, the ledger is empty."""
    for _, prompt, sampling, _field in CASES:
        with pytest.raises(InvalidArgument):
            client.complete(prompt, **sampling)
    system = shm_system[0]
    assert not any(used_blocks(system).values())
    assert ledger_entries(system) == 0
    assert idle(system)
    # and the system still serves
    assert client.complete([1, 2, 3], max_tokens=3, temperature=0).finish_reason is not None
