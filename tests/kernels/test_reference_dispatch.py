"""Backend selection, lazy import, and argument errors of the public kernel API."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import kvmesh_kernels
import pytest
import torch
from kvmesh_kernels import KVCacheSpec, allocate_kv_cache, dispatch, paged_decode_attention


@pytest.fixture(autouse=True)
def _restore_backend() -> Iterator[None]:
    yield
    kvmesh_kernels.set_backend(None)


def test_import_is_light() -> None:
    code = "import sys, kvmesh_kernels; print('torch' in sys.modules, 'triton' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_cpu_defaults_to_torch_and_override_wins() -> None:
    assert kvmesh_kernels.get_backend(torch.device("cpu")) in ("torch", dispatch._env_backend())
    kvmesh_kernels.set_backend("triton")
    assert kvmesh_kernels.get_backend(torch.device("cpu")) == "triton"
    kvmesh_kernels.set_backend("torch")
    assert kvmesh_kernels.get_backend(torch.device("cuda")) == "torch"
    with pytest.raises(ValueError, match="backend"):
        kvmesh_kernels.set_backend("cuda")


def test_missing_triton_module_raises_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(dispatch._TRITON_FUNCS, "decode", ("kvmesh_kernels.no_such_mod", "f"))
    kvmesh_kernels.set_backend("triton")
    layer = allocate_kv_cache(KVCacheSpec(4, 1, 8, 1, 64)).layer(0)
    with pytest.raises(kvmesh_kernels.BackendUnavailableError, match="no_such_mod"):
        paged_decode_attention(
            torch.randn(1, 1, 64),
            layer,
            torch.zeros(1, 2, dtype=torch.int32),
            torch.ones(1, dtype=torch.int32),
            scale=1.0,
        )


@pytest.mark.parametrize(
    "field,value",
    [
        ("num_blocks", 0),
        ("block_size", -1),
        ("head_dim", 1.5),
        ("kv_dtype", "int4"),
        ("dtype", torch.int8),
    ],
)
def test_spec_validate_names_the_field(field: str, value: object) -> None:
    fields = {"num_blocks": 4, "num_layers": 1, "block_size": 8, "num_kv_heads": 1, "head_dim": 64}
    spec = KVCacheSpec(**{**fields, field: value})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=field):
        spec.validate()


def test_bad_attention_arguments_name_the_argument() -> None:
    layer = allocate_kv_cache(KVCacheSpec(4, 1, 8, 2, 64)).layer(0)
    tables = torch.zeros(2, 2, dtype=torch.int32)
    lens = torch.tensor([3, 5], dtype=torch.int32)
    q = torch.randn(2, 4, 64)  # [batch, Hq, D]
    with pytest.raises(ValueError, match="num_q_heads"):
        paged_decode_attention(torch.randn(2, 3, 64), layer, tables, lens, scale=1.0)
    with pytest.raises(ValueError, match="head_dim"):
        paged_decode_attention(torch.randn(2, 4, 32), layer, tables, lens, scale=1.0)
    with pytest.raises(ValueError, match="seq_lens"):
        paged_decode_attention(
            q, layer, tables, torch.tensor([3, 17], dtype=torch.int32), scale=1.0
        )
    with pytest.raises(ValueError, match="query_start_loc"):
        kvmesh_kernels.paged_prefill_attention(
            q, layer, tables, lens, torch.tensor([0, 1, 3], dtype=torch.int32), scale=1.0
        )
    with pytest.raises(ValueError, match="slot_mapping"):
        kvmesh_kernels.write_kv(layer, q[:, :2], q[:, :2], torch.tensor([0, 64]))
