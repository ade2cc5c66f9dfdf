"""Engine flags: one per EngineConfig field on `kvmesh serve ROLE` and `kvmesh up`, generated from
the config (defaults, choices), `KVMESH_<FLAG>` variables, aliases, `kvmesh --version`."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
from typing import Any

import pytest

from kvmesh.cli import up
from kvmesh.cli.main import build_parser, main
from kvmesh.cli.up import UP_OWN_FIELDS, worker_argv, worker_engine_values
from kvmesh.engine.config import EngineConfig
from kvmesh.memory.planner import parse_bytes
from kvmesh.service.engine_flags import EngineFlag, engine_flags, engine_values
from kvmesh.service.options import engine_config, parse, parser

ROLES = ("prefill", "decode", "colocated")


def other_value(flag: EngineFlag) -> tuple[str, Any]:
    """A valid non-default value of `flag`: (command-line text, parsed value)."""
    if flag.choices:
        value = next(c for c in reversed(flag.choices) if c != flag.default)
        return value, value
    samples = {"int": ("7", 7), "float": ("0.5", 0.5), "size": ("3MiB", 3 << 20),
               "str": ("some-model", "some-model")}  # fmt: skip
    return samples[flag.kind]


def options_of(p: Any) -> dict[str, list[str]]:
    """dest -> option strings of an argparse parser."""
    found: dict[str, list[str]] = {}
    for action in p._actions:
        found.setdefault(action.dest, []).extend(action.option_strings)
    return found


@pytest.mark.parametrize("role", ROLES)
def test_every_config_field_is_a_flag_with_the_config_default(role: str) -> None:
    options = options_of(parser(role, transfer=role != "colocated"))
    defaults = parse(role, [], transfer=role != "colocated", environ={})
    for field in dataclasses.fields(EngineConfig):
        assert options.get(field.name), f"EngineConfig.{field.name} has no flag"
        assert getattr(defaults, field.name) == field.default, field.name


def test_every_config_field_reaches_kvmesh_up() -> None:
    subparsers = argparse.ArgumentParser().add_subparsers()
    up.register(subparsers)
    options = options_of(subparsers.choices["up"])
    for field in dataclasses.fields(EngineConfig):
        dest = "threads" if field.name in UP_OWN_FIELDS else field.name
        assert options.get(dest), f"EngineConfig.{field.name} is not a flag of kvmesh up"
    assert "--num-threads" in options["threads"]


def test_every_flag_round_trips_through_serve_and_up() -> None:
    flags = engine_flags()
    values = {}
    for flag in flags:
        if flag.kind == "bool":
            values[flag.field] = not flag.default
        else:
            values[flag.field] = other_value(flag)[1]
    up_args = build_parser().parse_args(["up", *words(values, flags, UP_OWN_FIELDS)])
    up_values = worker_engine_values(up_args)
    assert up_values == {k: v for k, v in values.items() if k not in UP_OWN_FIELDS}
    argv = list(worker_argv(up_values, None))
    served = parse("decode", [*argv, "--num-threads", "7"], environ={})
    assert engine_values(served, flags) == values


def words(values: dict[str, Any], flags: list[EngineFlag], skip: tuple[str, ...]) -> list[str]:
    out: list[str] = []
    for flag in flags:
        if flag.field not in skip:
            out += flag.argv(values[flag.field])
    return out


def test_vllm_names_and_old_aliases() -> None:
    args = parse("prefill", ["--kv-dtype", "int8", "--memory-utilization", "0.5",
                             "--no-chunked-prefill", "--no-enable-prefix-caching",
                             "--kv-cache-memory", "1GiB"], environ={})  # fmt: skip
    assert (args.kv_dtype, args.memory_utilization) == ("int8", 0.5)
    assert args.enable_chunked_prefill is False and args.enable_prefix_caching is False
    new = parse("prefill", ["--kv-cache-dtype", "int8", "--gpu-memory-utilization", "0.5"],
                environ={})  # fmt: skip
    assert (new.kv_dtype, new.memory_utilization) == ("int8", 0.5)
    assert args.kv_cache_memory == 1 << 30


def test_environment_sets_defaults_and_the_command_line_wins() -> None:
    env = {"KVMESH_BLOCK_SIZE": "32", "KVMESH_ENABLE_PREFIX_CACHING": "off",
           "KVMESH_KV_CACHE_DTYPE": "fp8", "KVMESH_SERVED_MODEL_NAME": "env-name"}  # fmt: skip
    args = parse("decode", [], environ=env)
    assert (args.block_size, args.enable_prefix_caching, args.kv_dtype) == (32, False, "fp8")
    assert args.served_model_name == "env-name"
    args = parse("decode", ["--block-size", "64", "--enable-prefix-caching"], environ=env)
    assert (args.block_size, args.enable_prefix_caching) == (64, True)
    assert engine_config(args).block_size == 64


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"KVMESH_BLOCK_SIZE": "big"}, "KVMESH_BLOCK_SIZE='big': not an integer"),
        ({"KVMESH_BLOCK_SIZE": "0"}, "KVMESH_BLOCK_SIZE='0': must be a positive integer"),
        ({"KVMESH_DTYPE": "int4"}, "KVMESH_DTYPE='int4': must be one of auto, float32"),
        ({"KVMESH_ENABLE_CHUNKED_PREFILL": "maybe"}, "KVMESH_ENABLE_CHUNKED_PREFILL='maybe'"),
    ],
)
def test_invalid_environment_value_names_the_variable(
    env: dict[str, str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse("decode", [], environ=env)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_invalid_flag_value_names_the_flag(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(SystemExit):
        parse("decode", ["--gpu-memory-utilization", "1.5"], environ={})
    assert "--gpu-memory-utilization: must be in (0, 1]" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # one OS thread each: 100,000 crashed the worker
        parse("decode", ["--num-threads", "100000"], environ={})
    assert "--num-threads: must be at most 1024" in capsys.readouterr().err
    monkeypatch.setenv("KVMESH_MAX_NUM_SEQS", "-1")
    assert main(["up", "--block-size", "8"]) == 2
    assert "KVMESH_MAX_NUM_SEQS='-1': must be a positive integer" in capsys.readouterr().err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"kvmesh {importlib.metadata.version('kvmesh')}"


@pytest.mark.parametrize("role", ["prefill", "colocated"])
def test_only_a_decode_worker_takes_a_transfer_port(role: str) -> None:
    """A prefill or colocated worker receives no KV: --transfer-port is refused (it used to be
    accepted by a prefill worker and ignored), and a decode worker takes it."""
    with pytest.raises(SystemExit) as refused:
        parse(role, ["--transfer-port", "7000"], environ={})
    assert refused.value.code == 2
    assert parse("decode", ["--transfer-port", "7000"], environ={}).transfer_port == 7000


SIZES = (
    ("512MiB", 512 << 20), ("2GiB", 2 << 30), ("2Gi", 2 << 30), ("1TiB", 1 << 40),
    ("2G", 2 * 10**9), ("2GB", 2 * 10**9), ("1.5gb", 15 * 10**8), ("4096", 4096),
)  # fmt: skip


@pytest.mark.parametrize(("text", "size"), SIZES)
def test_sizes_are_binary_with_iec_suffixes_and_decimal_with_si_ones(text: str, size: int) -> None:
    """`--kv-cache-memory` and `KVMESH_KV_CACHE_MEMORY` read sizes as `kvmesh plan --gpu-memory`
    does (Kubernetes' Gi/G): the same text is the same number of bytes everywhere."""
    flag = parse("decode", ["--kv-cache-memory", text], environ={})
    env = parse("decode", [], environ={"KVMESH_KV_CACHE_MEMORY": text})
    assert engine_config(flag).kv_cache_memory == engine_config(env).kv_cache_memory == size
    assert parse_bytes(text, "gpu_memory") == size


@pytest.mark.parametrize("text", ["lots", "2X", "0", "-1GiB", "iB"])
def test_a_bad_size_names_its_flag_or_variable(
    text: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse("decode", [f"--kv-cache-memory={text}"], environ={})
    assert exit_info.value.code == 2
    assert f"argument --kv-cache-memory: invalid size value: '{text}'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        parse("decode", [], environ={"KVMESH_KV_CACHE_MEMORY": text})
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"KVMESH_KV_CACHE_MEMORY={text!r}: --kv-cache-memory: " in err
