"""Random interleavings on engines short of KV memory with host and disk tiers: requests
arriving at random steps, n > 1 forks (copy on write), aborts mid-flight, swap or recompute
preemption, chunked prefill on or off, quantized KV, and a restart on the persistent disk
folder with bit-flipped block files. Every completion is the reference greedy output (float32
transformers; a roomy engine of the same KV dtype when quantized), and at the end every
device block, host slot and queued copy has come back."""

from __future__ import annotations

import gc
import random
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmesh import LLM, SamplingParams
from kvmesh.engine.engine import LLMEngine
from kvmesh.models.tiny import build_tiny_model

BLOCK_BYTES = 16384  # the tiny llama's float32 block (as in test_engine_tiers)
MAX_NEW = 20
PREFIXES = [[random.Random(i).randrange(10, 1000) for _ in range(40)] for i in range(3)]


@dataclass(frozen=True)
class Work:
    prompt: tuple[int, ...]
    max_tokens: int
    n: int
    arrival: int  # the step it is added before
    abort_at: int | None  # the step it is aborted before (if still running)


def make_work(prefix: int, cut: int, tail: int, max_tokens: int, n: int, arrival: int,
              abort_after: int | None) -> Work:  # fmt: skip
    """A request on `cut` tokens of a shared prefix and a tail of its own (seeded by `tail`)."""
    rng = random.Random(tail)
    own = [rng.randrange(10, 1000) for _ in range(tail % 17 + 1)]
    abort_at = None if abort_after is None else arrival + abort_after
    return Work(tuple(PREFIXES[prefix][:cut] + own), max_tokens, n, arrival, abort_at)


works = st.builds(
    make_work,
    st.integers(0, len(PREFIXES) - 1),
    st.sampled_from([16, 32, 40]),
    st.integers(0, 10_000),
    st.integers(6, MAX_NEW),
    st.sampled_from([1, 1, 2, 3]),
    st.integers(0, 3),
    st.one_of(st.none(), st.none(), st.integers(0, 8)),
)
engines = st.fixed_dictionaries(
    {
        "num_kv_blocks": st.sampled_from([6, 7, 8]),
        "host_kv_gib": st.sampled_from([2, 3, 4]).map(lambda b: b * BLOCK_BYTES / 2**30),
        "disk_kv_gib": st.sampled_from([2, 4, 16]).map(lambda b: b * BLOCK_BYTES / 2**30),
        "preemption": st.sampled_from(["swap", "auto", "recompute"]),
        "enable_chunked_prefill": st.booleans(),
        "max_num_seqs": st.sampled_from([3, 4]),
        "kv_dtype": st.sampled_from(["auto", "auto", "int8", "fp8"]),
    }
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("llama"), "llama", "test", seed=0)


class Reference:
    """Greedy continuations of MAX_NEW tokens, EOS included (the engine runs ignore_eos):
    transformers float32 for the model's KV dtype, a roomy engine for a quantized one."""

    def __init__(self, checkpoint: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.checkpoint = checkpoint
        self.model: Any = AutoModelForCausalLM.from_pretrained(
            str(checkpoint), attn_implementation="sdpa"
        )
        self.roomy: dict[str, LLM] = {}
        self.known: dict[tuple[str, tuple[int, ...]], list[int]] = {}

    def tokens(self, kv_dtype: str, prompt: tuple[int, ...], count: int) -> list[int]:
        key = (kv_dtype, prompt)
        if key not in self.known:
            self.known[key] = self._greedy(prompt) if kv_dtype == "auto" else self._roomy(key)
        return self.known[key][:count]

    @torch.no_grad()
    def _greedy(self, prompt: tuple[int, ...]) -> list[int]:
        ids = list(prompt)
        for _ in range(MAX_NEW):
            ids.append(int(self.model(torch.tensor([ids])).logits[0, -1].argmax()))
        return ids[len(prompt) :]

    def _roomy(self, key: tuple[str, tuple[int, ...]]) -> list[int]:
        kv_dtype, prompt = key
        if kv_dtype not in self.roomy:
            self.roomy[kv_dtype] = LLM(str(self.checkpoint), num_kv_blocks=64, kv_dtype=kv_dtype)
        params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
        return list(self.roomy[kv_dtype].generate([list(prompt)], params)[0].outputs[0].token_ids)


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> Reference:
    return Reference(checkpoint)


def drive(engine: LLMEngine, work: list[Work], tag: str) -> dict[str, list[list[int]]]:
    """Add, abort and step as `work` says until nothing is left; the completions of each
    request that was not aborted."""
    pending = sorted(enumerate(work), key=lambda item: item[1].arrival)
    done: dict[str, list[list[int]]] = {}
    aborted: set[str] = set()
    step = 0
    while pending or engine.has_unfinished():
        while pending and pending[0][1].arrival <= step:
            index, item = pending.pop(0)
            params = SamplingParams(
                temperature=0.0, max_tokens=item.max_tokens, n=item.n, ignore_eos=True
            )
            engine.add_request(f"{tag}{index}", list(item.prompt), params)
        for index, item in enumerate(work):
            request_id = f"{tag}{index}"
            live = request_id not in done and request_id not in aborted
            if item.abort_at == step and live and engine.abort_request(request_id) is not None:
                aborted.add(request_id)
        for output in engine.step():
            if output.finished and output.request_id not in aborted:
                done[output.request_id] = [list(c.token_ids) for c in output.outputs]
        step += 1
        assert step < 2000, "the engine stopped making progress"
    assert len(done) + len(aborted) == len(work), "a request never finished"
    return done


def check(engine: LLMEngine, work: list[Work], done: dict[str, list[list[int]]], tag: str,
          reference: Reference, kv_dtype: str) -> None:  # fmt: skip
    for request_id, completions in done.items():
        item = work[int(request_id.removeprefix(tag))]
        want = reference.tokens(kv_dtype, item.prompt, item.max_tokens)
        assert completions == [want] * item.n, request_id
    manager = engine.scheduler.block_manager
    manager.check_integrity()
    assert manager.metrics().in_use_blocks == 0, "a device block outlived its request"
    store = engine.parts.tiers
    assert store is not None
    host = store.host
    assert not host.parked_ids() and not store._reloads, "a swap or reload outlived its request"
    assert host.num_free + host.num_cached == host.capacity, "a host slot is still held"


@settings(
    max_examples=6,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(config=engines, work=st.lists(works, min_size=3, max_size=7), flips=st.randoms())
def test_random_interleavings_through_the_tiers_keep_greedy_output_and_return_every_block(
    checkpoint: Path, reference: Reference, config: dict[str, Any], work: list[Work],
    flips: random.Random,
) -> None:  # fmt: skip
    folder = Path(tempfile.mkdtemp(prefix="kvmesh-interleaved-"))
    options = {
        **config,
        "disk_kv_dir": str(folder),
        "disk_kv_persist": True,
        "max_model_len": 128,
        "max_num_batched_tokens": 32 if config["enable_chunked_prefill"] else 128,
    }
    kv_dtype = config["kv_dtype"]
    try:
        for phase in ("a", "b"):  # b: a restart on the folder a left, some files damaged
            llm = LLM(str(checkpoint), **options)
            done = drive(llm.engine, work, phase)
            check(llm.engine, work, done, phase, reference, kv_dtype)
            llm.engine.close()
            del llm
            gc.collect()
            for path in sorted(folder.glob("*.kvblock")):
                if flips.random() < 0.3:
                    raw = bytearray(path.read_bytes())
                    raw[flips.randrange(len(raw))] ^= 1 << flips.randrange(8)
                    path.write_bytes(bytes(raw))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
