"""KV capacity planner: seed checks (000 §1.2, 001 §2.2), weights from headers, errors."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save_file

from kvmesh.memory.planner import (
    KVModelShape,
    PlannerError,
    parse_bytes,
    plan_kv_capacity,
    safetensors_weights_bytes,
)

KIB = 1024
GIB = 1024**3


def llama2_7b() -> dict[str, Any]:
    return {
        "model_type": "llama",
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "hidden_size": 4096,
        "torch_dtype": "float16",
        "max_position_embeddings": 4096,
    }


def llama2_70b() -> dict[str, Any]:
    return {
        "model_type": "llama",
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "hidden_size": 8192,
        "torch_dtype": "float16",
        "max_position_embeddings": 4096,
    }


def plan_for(config: dict[str, Any], **kwargs: Any) -> Any:
    kwargs.setdefault("memory_bytes", 80 * GIB)
    return plan_kv_capacity(KVModelShape.from_config(config), **kwargs)


def test_llama2_7b_needs_512_kib_per_token() -> None:
    assert plan_for(llama2_7b()).kv_bytes_per_token == 512 * KIB


def test_llama2_70b_gqa_needs_320_kib_not_the_naive_2_5_mib() -> None:
    per_token = plan_for(llama2_70b()).kv_bytes_per_token
    naive = 2 * 80 * 8192 * 2
    assert per_token == 320 * KIB
    assert naive == 2560 * KIB and per_token * 8 == naive


def test_mqa_stores_one_kv_head() -> None:
    config = {**llama2_7b(), "num_key_value_heads": 1}
    assert plan_for(config).kv_bytes_per_token == 2 * 32 * 1 * 128 * 2


def test_explicit_head_dim_and_nested_text_config() -> None:
    text = {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2}
    nested = {**text, "head_dim": 96}
    config = {"model_type": "vlm", "torch_dtype": "bfloat16", "text_config": nested}
    shape = KVModelShape.from_config(config)
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim) == (4, 2, 96)
    assert shape.dtype == "bfloat16"


def test_blocks_tokens_and_concurrency_follow_the_budget() -> None:
    plan = plan_for(llama2_7b(), memory_bytes=24 * GIB, utilization=0.5, weights_bytes=2 * GIB)
    budget = 12 * GIB - 2 * GIB
    assert plan.kv_budget_bytes == budget
    assert plan.block_bytes == 16 * 512 * KIB
    assert plan.num_blocks == budget // (16 * 512 * KIB) == 1280
    assert plan.token_capacity == 1280 * 16
    assert plan.max_model_len == 4096
    assert plan.max_concurrency == 1280 // 256 == 5
    assert plan.contiguous_max_concurrency == budget // (4096 * 512 * KIB) == 5


def test_paged_concurrency_rounds_each_sequence_up_to_whole_blocks() -> None:
    plan = plan_for(llama2_7b(), memory_bytes=24 * GIB, max_model_len=1000, block_size=32)
    blocks_per_sequence = math.ceil(1000 / 32)
    assert plan.max_concurrency == plan.num_blocks // blocks_per_sequence
    assert plan.contiguous_max_concurrency == plan.kv_budget_bytes // (1000 * 512 * KIB)
    assert plan.max_concurrency <= plan.contiguous_max_concurrency


def test_int8_kv_halves_fp16_plus_a_float32_scale_per_head() -> None:
    fp16 = plan_for(llama2_70b(), kv_dtype="float16").kv_bytes_per_token
    int8 = plan_for(llama2_70b(), kv_dtype="int8")
    assert int8.scale_bytes_per_token_head == 4
    assert int8.kv_bytes_per_token == fp16 // 2 + 2 * 80 * 8 * 4
    no_scale = plan_for(llama2_70b(), kv_dtype="fp8", scale_bytes_per_token_head=0)
    assert no_scale.kv_bytes_per_token == fp16 // 2


def test_kv_dtype_auto_uses_model_dtype_and_float32_default() -> None:
    config = {k: v for k, v in llama2_7b().items() if k != "torch_dtype"}
    assert plan_for(config).kv_dtype == "float32"
    assert plan_for(config).kv_bytes_per_token == 1024 * KIB
    assert plan_for({**config, "dtype": "bfloat16"}).kv_dtype == "bfloat16"


def test_parse_bytes_units() -> None:
    assert parse_bytes("80GiB") == 80 * GIB
    assert parse_bytes("80GB") == 80 * 10**9
    assert parse_bytes("512MiB") == 512 * 1024**2
    assert parse_bytes("1.5TiB") == 3 * 1024**4 // 2
    assert parse_bytes("4096") == 4096
    assert parse_bytes(123) == 123


@pytest.mark.parametrize("prefix", ["k", "M", "G", "T", "P"])
def test_parse_bytes_iec_is_binary_and_si_decimal_as_kubernetes_reads_them(prefix: str) -> None:
    power = "kMGTP".index(prefix) + 1
    for spelling in (f"3{prefix}i", f"3{prefix}iB", f"3 {prefix.lower()}ib", f"3{prefix.upper()}I"):
        assert parse_bytes(spelling) == 3 * 1024**power, spelling
    for spelling in (f"3{prefix}", f"3{prefix}B", f"3 {prefix.lower()}b", f"3{prefix.upper()}"):
        assert parse_bytes(spelling) == 3 * 1000**power, spelling


@pytest.mark.parametrize("text", ["", "lots", "80XiB", "-1GiB", "0", "iB", "1" + "0" * 400])
def test_parse_bytes_rejects_nonsense_naming_the_field(text: str) -> None:
    with pytest.raises(PlannerError, match=r"^gpu_memory:"):
        parse_bytes(text, "gpu_memory")


def write_weights(folder: Path, name: str, arrays: dict[str, np.ndarray]) -> int:
    save_file(arrays, str(folder / name))
    return sum(array.nbytes for array in arrays.values())


def test_weights_bytes_from_a_single_safetensors_file(tmp_path: Path) -> None:
    arrays: dict[str, np.ndarray] = {
        "a": np.zeros((3, 5), np.float32),
        "b": np.zeros(7, np.float16),
    }
    expected = write_weights(tmp_path, "model.safetensors", arrays)
    assert expected == 3 * 5 * 4 + 7 * 2
    assert safetensors_weights_bytes(tmp_path) == expected


def test_weights_bytes_counts_only_shards_named_by_the_index(tmp_path: Path) -> None:
    first = write_weights(tmp_path, "s1.safetensors", {"a": np.zeros(100, np.float32)})
    second = write_weights(tmp_path, "s2.safetensors", {"b": np.zeros((2, 9), np.int8)})
    write_weights(tmp_path, "stray.safetensors", {"c": np.zeros(1000, np.float32)})
    index = {"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert safetensors_weights_bytes(tmp_path) == first + second == 418


def test_weights_bytes_is_zero_without_safetensors(tmp_path: Path) -> None:
    assert safetensors_weights_bytes(tmp_path) == 0


def test_corrupt_safetensors_header_names_weights(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"\x05\x00")
    with pytest.raises(PlannerError, match=r"^weights:"):
        safetensors_weights_bytes(tmp_path)


def test_from_config_reads_a_folder_or_a_file(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(llama2_70b()))
    assert KVModelShape.from_config(tmp_path) == KVModelShape.from_config(tmp_path / "config.json")
    assert KVModelShape.from_config(str(tmp_path)).num_kv_heads == 8


def without(key: str) -> dict[str, Any]:
    return {k: v for k, v in llama2_70b().items() if k != key}


@pytest.mark.parametrize(
    ("config", "field"),
    [
        (without("num_hidden_layers"), "num_hidden_layers"),
        (without("num_attention_heads"), "num_attention_heads"),
        (without("hidden_size"), "hidden_size"),
        ({**llama2_70b(), "num_hidden_layers": 0}, "num_hidden_layers"),
        ({**llama2_70b(), "num_key_value_heads": -8}, "num_key_value_heads"),
        ({**llama2_70b(), "num_key_value_heads": 0}, "num_key_value_heads"),
        ({**llama2_70b(), "num_key_value_heads": 7}, "num_key_value_heads"),
        ({**llama2_70b(), "hidden_size": 8191}, "hidden_size"),
        ({**llama2_70b(), "head_dim": 0}, "head_dim"),
        ({**llama2_70b(), "torch_dtype": "float12"}, "torch_dtype"),
        ({**llama2_70b(), "max_position_embeddings": -1}, "max_position_embeddings"),
    ],
)
def test_bad_config_names_its_field(config: dict[str, Any], field: str) -> None:
    with pytest.raises(PlannerError, match=rf"^{field}:"):
        KVModelShape.from_config(config)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"weights_bytes": 80 * GIB}, "weights_bytes"),
        ({"weights_bytes": -1}, "weights_bytes"),
        ({"memory_bytes": 0}, "memory_bytes"),
        ({"utilization": 1.5}, "utilization"),
        ({"utilization": 0.0}, "utilization"),
        ({"block_size": 0}, "block_size"),
        ({"kv_dtype": "int3"}, "kv_dtype"),
        ({"max_model_len": 0}, "max_model_len"),
        ({"scale_bytes_per_token_head": -4}, "scale_bytes_per_token_head"),
        ({"activation_reserve_bytes": -1}, "activation_reserve_bytes"),
    ],
)
def test_bad_plan_input_names_its_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(PlannerError, match=rf"^{field}:"):
        plan_for(llama2_70b(), **kwargs)


def test_missing_max_model_len_is_named() -> None:
    with pytest.raises(PlannerError, match=r"^max_model_len:"):
        plan_for(without("max_position_embeddings"))


def test_missing_or_invalid_config_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(PlannerError, match=r"^config:"):
        KVModelShape.from_config(tmp_path / "nothing.json")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(PlannerError, match=r"^config:"):
        KVModelShape.from_config(tmp_path)
