"""`kvmesh` commands default OpenMP to a bounded spin, and never override the user's choice."""

from __future__ import annotations

import os

import pytest

from kvmesh.cli.main import OMP_SPIN_DEFAULT, SHARED_CORE_COMMANDS, apply_omp_defaults


def test_bounded_spin_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    apply_omp_defaults()
    assert os.environ["GOMP_SPINCOUNT"] == OMP_SPIN_DEFAULT
    assert "OMP_WAIT_POLICY" not in os.environ


@pytest.mark.parametrize(
    ("name", "value"), [("OMP_WAIT_POLICY", "PASSIVE"), ("GOMP_SPINCOUNT", "0")]
)
def test_user_choice_wins(monkeypatch: pytest.MonkeyPatch, name: str, value: str) -> None:
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.setenv(name, value)
    apply_omp_defaults()
    assert os.environ[name] == value
    other = "GOMP_SPINCOUNT" if name == "OMP_WAIT_POLICY" else "OMP_WAIT_POLICY"
    assert other not in os.environ


def test_shared_cores_default_to_passive(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    apply_omp_defaults(shares_cores=True)
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    assert "GOMP_SPINCOUNT" not in os.environ


def test_kvmesh_up_is_the_shared_core_command() -> None:
    assert SHARED_CORE_COMMANDS == ("up",)
