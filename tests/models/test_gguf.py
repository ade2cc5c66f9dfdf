"""`.gguf` files become cached checkpoint folders: weights, tokenizer and chat template survive,
the engine matches transformers on them, a changed file is converted again, bad files fail in
one line, concurrent conversions convert once, and a file's name never leaves its key's folder."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf_fixture import SPECIALS, write_tiny_gguf
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvmesh import LLM, SamplingParams
from kvmesh.engine.errors import InvalidParameterError
from kvmesh.models.gguf import convert_gguf, gguf_cache_name, gguf_checkpoint
from kvmesh.models.resolve import resolve_model_path

KVMESH = [sys.executable, "-m", "kvmesh.cli.main"]
ROOT = Path(__file__).resolve().parents[2]
Q8_TOLERANCE = 0.01  # Q8_0 rounding of weights drawn with std 0.2


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.Q8_0.gguf"
    return path, write_tiny_gguf(path, seed=0)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KVMESH_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "models"


def test_conversion_keeps_weights_tokenizer_and_template(
    tiny_gguf: tuple[Path, Any], cache: Path
) -> None:
    file, source = tiny_gguf
    folder = gguf_checkpoint(file)
    assert folder.parent.parent == cache and folder.name == "tiny-llama.Q8_0"
    loaded = AutoModelForCausalLM.from_pretrained(folder)
    assert loaded.dtype == torch.float32
    assert not hasattr(loaded.config, "quantization_config")
    expected = source.state_dict()
    for name, tensor in loaded.state_dict().items():  # q/k rows back in transformers' order
        assert (tensor - expected[name]).abs().max() < Q8_TOLERANCE, name
    tokenizer = AutoTokenizer.from_pretrained(folder)
    chat = [{"role": "user", "content": "hi"}]
    text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.convert_tokens_to_ids(list(SPECIALS)) == [257, 258]
    assert tokenizer.decode(tokenizer.encode("a tiny test")) == "a tiny test"
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert resolve_model_path(str(file)) == folder  # reused, not converted again
    assert resolve_model_path(str(file.parent)) == folder  # a folder holding one .gguf
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp


def test_engine_matches_transformers_on_a_converted_file(
    tiny_gguf: tuple[Path, Any], tmp_path: Path
) -> None:
    # Converted outside the cache: the engine's CPU kernels are built into the real kvmesh cache.
    folder = convert_gguf(tiny_gguf[0], tmp_path / "converted")
    prompts = [[257, 104, 105, 10], list(range(3, 40))]
    llm = LLM(str(folder), num_kv_blocks=32, max_model_len=256)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    ours = [list(out.outputs[0].token_ids) for out in llm.generate(prompts, params)]
    reference = AutoModelForCausalLM.from_pretrained(folder).eval()
    for prompt, tokens in zip(prompts, ours, strict=True):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = reference.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None)
        assert tokens == out[0, len(prompt) :].tolist()
    assert len(set(ours[1])) > 2  # not a degenerate repeat


def test_a_changed_file_is_converted_again(tmp_path: Path, cache: Path) -> None:
    file = tmp_path / "m.gguf"
    write_tiny_gguf(file, seed=1)
    first = gguf_checkpoint(file)
    write_tiny_gguf(file, seed=2)
    second = gguf_checkpoint(file)
    assert second != first and second.parent.parent == first.parent.parent
    a, b = (AutoModelForCausalLM.from_pretrained(p).lm_head.weight for p in (first, second))
    assert not torch.equal(a, b)


def test_unreadable_gguf_fails_in_one_line_and_caches_nothing(tmp_path: Path) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    env = {**os.environ, "KVMESH_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run([*KVMESH, "model", "convert", str(bad)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert "Traceback" not in done.stderr
    assert lines[-1].startswith("kvmesh model convert: model: ") and str(bad) in lines[-1]
    assert "cannot convert" in lines[-1]
    cached = [p for p in (tmp_path / "cache" / "models").rglob("*") if p.is_file()]
    assert [p.name for p in cached] == [".broken.lock"]
    with pytest.raises(InvalidParameterError, match="no such GGUF file"):
        gguf_checkpoint(tmp_path / "missing.gguf")


def test_two_processes_convert_once(tiny_gguf: tuple[Path, Any], tmp_path: Path) -> None:
    env = {**os.environ, "KVMESH_CACHE_DIR": str(tmp_path)}
    argv = [*KVMESH, "model", "convert", str(tiny_gguf[0])]
    procs = [
        subprocess.Popen(
            argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    results = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in results]
    outs = [out.strip() for out, _ in results]
    assert outs[0] == outs[1]
    assert sum("converted tiny-llama.Q8_0.gguf" in err for _, err in results) == 1
    folders = [p for p in (tmp_path / "models").glob("*/*") if not p.name.endswith(".lock")]
    assert [str(p) for p in folders] == [outs[0]]


def test_convert_into_a_new_folder(tiny_gguf: tuple[Path, Any], tmp_path: Path) -> None:
    from kvmesh.cli.main import main

    out = tmp_path / "converted"
    assert main(["model", "convert", str(tiny_gguf[0]), str(out)]) == 0
    assert (out / "config.json").is_file() and (out / "chat_template.jinja").is_file()
    assert main(["model", "convert", str(tiny_gguf[0]), str(out)]) == 2  # exists: untouched
    assert main(["model", "convert", str(tmp_path / "none.gguf"), str(tmp_path / "x")]) == 2
    assert not (tmp_path / "x").exists()


def test_a_file_whose_stem_is_dots_converts_into_its_own_folder(
    tiny_gguf: tuple[Path, Any], tmp_path: Path, cache: Path
) -> None:
    """`...gguf` (stem `..`) and `..gguf` (stem `.`) would name the key's parent or the key's
    folder itself: the checkpoint is named `model` instead, inside its key's folder."""
    for name in ("...gguf", "..gguf"):
        file = tmp_path / name
        file.write_bytes(tiny_gguf[0].read_bytes())
        folder = gguf_checkpoint(file)
        assert folder.name == "model" and folder.parent.parent == cache
        assert folder.resolve().parent.parent == cache.resolve()
        assert (folder / "config.json").is_file()


def test_the_key_is_the_whole_content_not_its_size_mtime_and_ends(tmp_path: Path) -> None:
    """Two files alike in name, size, mtime and first and last MiB (`cp -p` of a model whose
    middle differs) get different conversions; a copy with another mtime reuses one."""
    size, stamp = 4 << 20, 1_700_000_000_000_000_000
    files = []
    for folder, middle in (("a", 1), ("b", 2)):
        data = bytearray(size)
        data[size // 2] = middle
        file = tmp_path / folder / "m.gguf"
        file.parent.mkdir()
        file.write_bytes(bytes(data))
        os.utime(file, ns=(stamp, stamp))
        files.append((file, bytes(data)))
    names = [gguf_cache_name(file) for file, _ in files]
    assert names[0] != names[1]
    for name, (_, data) in zip(names, files, strict=True):
        assert name == f"gguf-v2-{hashlib.sha256(data).hexdigest()[:16]}/m"
    copy = tmp_path / "c" / "m.gguf"
    copy.parent.mkdir()
    copy.write_bytes(files[0][1])
    assert gguf_cache_name(copy) == names[0]
