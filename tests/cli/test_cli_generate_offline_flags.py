"""`kvmesh generate` offline reads every sampling flag the `--target` path sends (one reading,
`sampling_from_args`): each reaches the engine's SamplingParams, and an invalid value exits 2
naming the field instead of being ignored."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvmesh.cli.generate import request_from_args
from kvmesh.cli.generate_remote import SAMPLING_FLAGS
from kvmesh.cli.main import build_parser
from kvmesh.models.tiny import build_tiny_model

PROMPT = "5,17,300,41,99,7,12"
# flag -> (its arguments, the SamplingParams field and value they give)
SET: dict[str, tuple[list[str], str, Any]] = {
    "--max-tokens": (["7"], "max_tokens", 7),
    "--temperature": (["0.5"], "temperature", 0.5),
    "--top-p": (["0.5"], "top_p", 0.5),
    "--top-k": (["4"], "top_k", 4),
    "--min-p": (["0.25"], "min_p", 0.25),
    "--seed": (["9"], "seed", 9),
    "--n": (["3"], "n", 3),
    "--repetition-penalty": (["1.25"], "repetition_penalty", 1.25),
    "--presence-penalty": (["0.5"], "presence_penalty", 0.5),
    "--frequency-penalty": (["-0.5"], "frequency_penalty", -0.5),
    "--min-tokens": (["2"], "min_tokens", 2),
    "--logprobs": (["3"], "logprobs", 3),
    "--stop": (["end"], "stop", ("end",)),
    "--stop-token-ids": (["5,6"], "stop_token_ids", (5, 6)),
    "--ignore-eos": ([], "ignore_eos", True),
    "--include-stop-str-in-output": ([], "include_stop_str_in_output", True),
    "--keep-special-tokens": ([], "skip_special_tokens", False),
}
INVALID = [
    ("--repetition-penalty", "50", "repetition_penalty"),
    ("--presence-penalty", "3", "presence_penalty"),
    ("--frequency-penalty", "-3", "frequency_penalty"),
    ("--n", "0", "n"),
    ("--min-tokens", "-1", "min_tokens"),
    ("--logprobs", "21", "logprobs"),
    ("--top-k", str(2**63), "top_k"),
]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("m"), "llama", "test", seed=0)


def params_of(*argv: str) -> Any:
    args = build_parser().parse_args(["generate", "--prompt-ids", PROMPT, *argv])
    return request_from_args(args)[1]


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    args = build_parser().parse_args(argv)
    code = args.func(args)
    out, err = capsys.readouterr()
    return code, out, err


def test_every_sampling_flag_reaches_the_offline_params() -> None:
    """Each flag `--target` sends sets its field offline too; unset flags keep the command's
    defaults (greedy, 64 tokens)."""
    assert set(SET) == set(SAMPLING_FLAGS)
    default = params_of()
    assert (default.temperature, default.max_tokens, default.n) == (0.0, 64, 1)
    for flag, (values, field, expected) in SET.items():
        assert getattr(params_of(flag, *values), field) == expected, flag
        assert getattr(default, field) != expected, flag


@pytest.mark.parametrize(("flag", "value", "field"), INVALID)
def test_an_invalid_flag_exits_2_naming_the_field(
    model: Path, capsys: pytest.CaptureFixture[str], flag: str, value: str, field: str
) -> None:
    argv = ["generate", "--model", str(model), "--prompt-ids", PROMPT, flag, value]
    code, _, err = run(argv, capsys)
    assert code == 2 and f"kvmesh generate: {field}:" in err


def test_offline_stop_token_ids_and_n_apply(
    model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--stop-token-ids ends the completion at the id; --n 2 answers two completions."""
    base = ["generate", "--model", str(model), "--prompt-ids", PROMPT, "--max-tokens", "6"]
    code, out, err = run([*base, "--ignore-eos", "--json"], capsys)
    assert code == 0, err
    first = json.loads(out.strip().splitlines()[-1])["token_ids"][0]
    code, out, err = run([*base, "--stop-token-ids", str(first), "--json"], capsys)
    assert code == 0, err
    line = json.loads(out.strip().splitlines()[-1])
    assert (line["token_ids"], line["finish_reason"], line["stop_reason"]) == (
        [first],
        "stop",
        first,
    )
    code, out, err = run([*base, "--n", "2", "--temperature", "1", "--seed", "1", "--json"], capsys)
    assert code == 0, err
    completions = json.loads(out.strip().splitlines()[-1])["completions"]
    assert [c["index"] for c in completions] == [0, 1]
