"""`kvmesh generate --chat` offline: the conversation goes through the model's chat template
(same tokens as `LLM.chat`); a model without a template exits 2 naming the field."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from kvmesh import LLM, SamplingParams
from kvmesh.cli.main import build_parser
from kvmesh.models.tiny import build_tiny_model
from kvmesh.models.tokenizer import set_chat_template

FLAGS = ["--max-tokens", "5", "--ignore-eos", "--json"]


@pytest.fixture(scope="module")
def plain_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("plain"), "llama", "test", seed=0)


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    args = build_parser().parse_args(argv)
    code = args.func(args)
    out, err = capsys.readouterr()
    return code, out, err


def test_chat_offline_matches_llm_chat(
    plain_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "chat-model"
    shutil.copytree(plain_model, model)
    set_chat_template(model)
    argv = ["generate", "--model", str(model), "--chat", "Hi 世界", "--system", "Be brief."]
    code, out, err = run([*argv, *FLAGS], capsys)
    assert code == 0, err
    line: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    llm = LLM(str(model), num_kv_blocks=32, num_threads=1)
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi 世界"},
    ]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    expected = llm.chat(conversation, params)[0]
    assert line["token_ids"] == expected.outputs[0].token_ids
    assert line["prompt_tokens"] == len(expected.prompt_token_ids)


def test_chat_offline_without_template_exits_2(
    plain_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run(["generate", "--model", str(plain_model), "--chat", "Hi", *FLAGS], capsys)
    assert code == 2
    assert "chat: this model has no chat template" in err


def test_system_needs_chat_and_chat_excludes_a_prompt(
    plain_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit, match="--system needs --chat"):
        run(["generate", "--model", str(plain_model), "hello", "--system", "x"], capsys)
    code, _, err = run(["generate", "--model", str(plain_model), "hi", "--chat", "x"], capsys)
    assert code == 2 and "prompt" in err
