"""Shared by the system tests: one disaggregated system (1 prefill + 1 decode, shared memory),
tracing to a real OTLP receiver, the offline engine on the same tiny test model, for greedy parity,
a tiny model with a chat template, and a plain 1 prefill + 1 decode system on it per module."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from otlp_receiver import Receiver, otlp_receiver
from sys_harness import GREEDY, local_system

from kvmesh.cli.up import LocalSystem


@pytest.fixture(scope="session")
def otlp() -> Iterator[tuple[Receiver, dict[str, str]]]:
    """A real OTLP/gRPC receiver on loopback and the OTEL_* variables that export to it."""
    with otlp_receiver() as (receiver, endpoint):
        yield (
            receiver,
            {
                "OTEL_TRACES_EXPORTER": "otlp",
                "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
                "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
                "OTEL_BSP_SCHEDULE_DELAY": "100",
            },
        )


@pytest.fixture(scope="session")
def shm_system(otlp: tuple[Receiver, dict[str, str]]) -> Iterator[tuple[LocalSystem, str]]:
    """Traces exported to `otlp`'s receiver, JSON logs, the OpenAI HTTP door on."""
    env = {**otlp[1], "KVMESH_LOG_FORMAT": "json"}
    with pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():
            patch.setenv(key, value)
        patch.delenv("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", raising=False)
        with local_system(transfer_backend="shm", http_port=0) as started:
            yield started


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny test checkpoint (random weights, byte tokenizer, a simple chat template)."""
    from kvmesh.models.tiny import build_tiny_model
    from kvmesh.models.tokenizer import set_chat_template

    folder: Path = tmp_path_factory.mktemp("tiny-llama")
    build_tiny_model(folder, "llama", "test", 0)
    set_chat_template(folder)
    return str(folder)


@pytest.fixture(scope="module")
def openai_system(tiny_model: str) -> Iterator[LocalSystem]:
    """A real `kvmesh up` on `tiny_model`: 1 prefill + 1 decode worker, the default transfer
    backend, no tracing set up, the OpenAI HTTP door on a free port. Module scope: each test
    module that asks for it gets its own system (no prefix cache or metrics shared with another
    module), stopped after the module's last test."""
    with local_system(model=tiny_model, http_port=0) as (started, _):
        yield started


@pytest.fixture(scope="session")
def offline() -> Callable[[list[Any]], list[list[int]]]:
    """Greedy token ids (GREEDY sampling) of the offline engine for each prompt."""
    from kvmesh import LLM, SamplingParams
    from kvmesh.models.tiny import tiny_model_path

    llm = LLM(model=str(tiny_model_path()))
    params = SamplingParams(**GREEDY)

    def run(prompts: list[Any]) -> list[list[int]]:
        return [list(out.outputs[0].token_ids) for out in llm.generate(prompts, params)]

    return run
