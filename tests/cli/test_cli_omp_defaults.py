"""`kvmesh` commands default OpenMP to a bounded spin, and never override the user's choice."""

from __future__ import annotations

import argparse
import os

import pytest

from kvmesh.cli import main as cli_main
from kvmesh.cli.main import OMP_SPIN_DEFAULT, apply_omp_defaults


def _clear_omp_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unset both variables for the test, restored afterwards even when the code under test
    sets them (a plain delenv of an unset variable records nothing to undo)."""
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


def test_bounded_spin_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    _clear_omp_env(monkeypatch)
    apply_omp_defaults()
    assert os.environ["GOMP_SPINCOUNT"] == OMP_SPIN_DEFAULT
    assert "OMP_WAIT_POLICY" not in os.environ


@pytest.mark.parametrize(
    ("name", "value"), [("OMP_WAIT_POLICY", "PASSIVE"), ("GOMP_SPINCOUNT", "0")]
)
def test_user_choice_wins(monkeypatch: pytest.MonkeyPatch, name: str, value: str) -> None:
    _clear_omp_env(monkeypatch)
    monkeypatch.setenv(name, value)
    apply_omp_defaults()
    assert os.environ[name] == value
    other = "GOMP_SPINCOUNT" if name == "OMP_WAIT_POLICY" else "OMP_WAIT_POLICY"
    assert other not in os.environ


def test_shared_cores_default_to_passive(monkeypatch: pytest.MonkeyPatch) -> None:
    _clear_omp_env(monkeypatch)
    apply_omp_defaults(shares_cores=True)
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    assert "GOMP_SPINCOUNT" not in os.environ


@pytest.mark.parametrize(("command", "passive"), [("up", True), ("serve", False)])
def test_main_applies_the_default_for_its_command(
    monkeypatch: pytest.MonkeyPatch, command: str, passive: bool
) -> None:
    _clear_omp_env(monkeypatch)
    parser = argparse.ArgumentParser()
    commands = parser.add_subparsers(dest="command")
    for name in ("up", "serve"):
        commands.add_parser(name).set_defaults(func=lambda args: 0)
    monkeypatch.setattr(cli_main, "build_parser", lambda: parser)
    assert cli_main.main([command]) == 0
    assert (os.environ.get("OMP_WAIT_POLICY") == "PASSIVE") == passive
    assert ("GOMP_SPINCOUNT" in os.environ) != passive
