"""Tiny checkpoints load and generate with transformers; the byte tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvmesh.cli.main import main
from kvmesh.engine.errors import InvalidParameterError
from kvmesh.models import build_tiny_model
from kvmesh.models.tiny import ARCHS, TINY_SIZES, tiny_config
from kvmesh.models.tokenizer import BOS_TOKEN_ID, EOS_TOKEN_ID, PAD_TOKEN_ID


def greedy(model_dir: Path, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None)
    return out[:, prompt.shape[1] :]  # [batch, new_tokens]


@pytest.mark.parametrize("arch", ARCHS)
def test_checkpoint_matches_table_and_generates_varied_tokens(tmp_path: Path, arch: str) -> None:
    out = build_tiny_model(tmp_path / arch, arch, "test", seed=0)
    files = {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"}
    assert files <= {p.name for p in out.iterdir()}
    config = json.loads((out / "config.json").read_text())
    dims = TINY_SIZES["test"]
    assert config["model_type"] == arch
    assert config["vocab_size"] == dims.vocab_size
    assert config["hidden_size"] == dims.hidden_size
    assert config["intermediate_size"] == dims.intermediate_size
    assert config["num_hidden_layers"] == dims.num_hidden_layers
    assert config["num_attention_heads"] == dims.num_attention_heads
    assert config["num_key_value_heads"] == dims.num_key_value_heads
    assert config["max_position_embeddings"] == dims.max_position_embeddings
    assert config["tie_word_embeddings"] is False
    assert (config["bos_token_id"], config["eos_token_id"]) == (BOS_TOKEN_ID, EOS_TOKEN_ID)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    prompt = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    tokens = greedy(out, prompt, new_tokens=24)
    for row in tokens.tolist():
        assert len(set(row)) > len(row) // 2, f"greedy output collapsed: {row}"


def test_same_seed_same_weights_other_seed_differs(tmp_path: Path) -> None:
    paths = [
        build_tiny_model(tmp_path / str(i), "qwen2", "test", seed)
        for i, seed in enumerate((0, 0, 1))
    ]
    blobs = [(p / "model.safetensors").read_bytes() for p in paths]
    assert blobs[0] == blobs[1]
    assert blobs[0] != blobs[2]


def last_logits(model_dir: Path, prompt: torch.Tensor) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        return model(prompt).logits[:, -1]  # [batch, vocab]


def test_mistral_sliding_window_is_crossed_by_long_prompts(tmp_path: Path) -> None:
    window = TINY_SIZES["test"].sliding_window
    mistral = build_tiny_model(tmp_path / "m", "mistral", "test", 0)
    assert json.loads((mistral / "config.json").read_text())["sliding_window"] == window
    llama = build_tiny_model(tmp_path / "l", "llama", "test", 0)  # same weights, no window
    gen = torch.Generator().manual_seed(2)
    short = torch.randint(0, 256, (1, window), generator=gen)
    long = torch.randint(0, 256, (1, window + 40), generator=gen)
    assert torch.allclose(last_logits(mistral, short), last_logits(llama, short), atol=1e-5)
    assert not torch.allclose(last_logits(mistral, long), last_logits(llama, long), atol=1e-2)


def test_qwen3_has_explicit_head_dim_and_qk_norms() -> None:
    config = tiny_config("qwen3", "bench")
    assert config.head_dim == config.hidden_size // config.num_attention_heads
    assert config.vocab_size == TINY_SIZES["bench"].vocab_size
    model = AutoModelForCausalLM.from_config(tiny_config("qwen3", "test"))
    assert any("q_norm" in name for name, _ in model.named_parameters())


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"arch": "gpt2"}, "arch"), ({"size": "huge"}, "size"), ({"seed": -1}, "seed")],
)
def test_bad_builder_input_names_the_field(tmp_path: Path, kwargs: dict, field: str) -> None:
    args = {"arch": "llama", "size": "test", "seed": 0, **kwargs}
    with pytest.raises(InvalidParameterError, match=f"^{field}:") as info:
        build_tiny_model(tmp_path, **args)
    assert info.value.field == field


@pytest.mark.parametrize(
    "text", ["hello world", "héllo wörld — 日本語 🙂", "tabs\tand\nnewlines  ", "\x00\x7f"]
)
def test_tokenizer_round_trips_utf8(tmp_path: Path, text: str) -> None:
    out = build_tiny_model(tmp_path, "llama", "test", 0)
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = tokenizer.encode(text)
    assert ids[0] == BOS_TOKEN_ID
    assert ids[1:] == list(text.encode("utf-8"))
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (BOS_TOKEN_ID, EOS_TOKEN_ID)
    assert tokenizer.pad_token_id == PAD_TOKEN_ID
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == tokenizer.eos_token_id


def test_cli_writes_checkpoint(tmp_path: Path) -> None:
    assert main(["model", "tiny", str(tmp_path / "q"), "--arch", "qwen3", "--seed", "3"]) == 0
    assert json.loads((tmp_path / "q" / "config.json").read_text())["model_type"] == "qwen3"
