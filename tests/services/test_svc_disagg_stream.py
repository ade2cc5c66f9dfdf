"""Per-chunk transfer overlap: a prompt spanning several prefill chunks is shipped in parts."""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from svc_harness import NUM_BLOCKS, engine_config, start_worker, svc_loop, svc_model_dir, wait_until
from test_svc_disagg import ControlDriver, backends_here

from decode_svc.main import install as install_decode
from kv_transfer.interface import StreamSendHandle
from kvmesh import LLM, SamplingParams
from kvmesh.v1 import generation_pb2, worker_pb2
from prefill_svc import service as prefill_service
from prefill_svc.main import install as install_prefill

__all__ = ["svc_loop", "svc_model_dir"]
PROMPT = [(i * 37 + 11) % 500 + 3 for i in range(150)]  # 10 blocks, 5 chunks of 32 tokens
COMBOS = [(b, m) for b in backends_here() for m in ("overlap", "whole")]
PROMPTS = [[k + 1, *PROMPT[1:]] for k in range(len(COMBOS))]  # distinct: no prefix-cache hits
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def workers(svc_loop: Any, svc_model_dir: Path) -> Any:
    backends = backends_here()
    config = engine_config(svc_model_dir, max_num_batched_tokens=32)
    overlap = start_worker(
        svc_loop,
        config,
        "prefill",
        install_prefill,
        argparse.Namespace(transfer_backend=backends, transfer_overlap=True),
    )
    whole = start_worker(
        svc_loop,
        config,
        "prefill",
        install_prefill,
        argparse.Namespace(transfer_backend=backends, transfer_overlap=False),
    )
    decode = start_worker(
        svc_loop,
        engine_config(svc_model_dir),
        "decode",
        install_decode,
        argparse.Namespace(transfer_backend=backends),
    )
    yield {"overlap": overlap, "whole": whole}, decode
    for worker in (overlap, whole, decode):
        worker.stop()


@pytest.fixture(scope="module")
def offline(svc_model_dir: Path) -> list[list[int]]:
    llm = LLM(str(svc_model_dir), num_kv_blocks=NUM_BLOCKS, max_model_len=256, num_threads=1)
    out = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    return [o.outputs[0].token_ids for o in out]


@pytest.fixture
def parts(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """(block_offset, num_blocks) of every part the prefill side handed its senders."""
    seen: list[tuple[int, int]] = []
    add = StreamSendHandle.add

    def spy(self: StreamSendHandle, block_offset: int, src_block_ids: Any) -> None:
        seen.append((block_offset, len(src_block_ids)))
        add(self, block_offset, src_block_ids)

    monkeypatch.setattr(StreamSendHandle, "add", spy)
    return seen


@pytest.mark.parametrize(("backend", "mode"), COMBOS)
def test_multi_chunk_prompt_matches_offline(
    workers: Any, offline: list[list[int]], parts: list[tuple[int, int]], backend: str, mode: str
) -> None:
    """Exact greedy equality with the offline engine, the KV shipped per chunk or whole."""
    k = COMBOS.index((backend, mode))
    prefills, decode = workers
    prefill = prefills[mode]
    driver = ControlDriver(prefill, decode, backend)
    rid = f"stream-{backend}-{mode}"
    response, stream = driver.generate(rid, PROMPTS[k], temperature=0.0, max_tokens=MAX_TOKENS)
    assert [t for r in stream for t in r.token_ids] == offline[k]
    assert response.transfer_bytes > 0
    if mode == "overlap":  # 2 blocks per 32-token chunk; the last chunk's with the first token
        assert parts == [(0, 2), (2, 2), (4, 2), (6, 2), (8, 2)]
    else:  # the same send, every block at once when the request is PREFILLED
        assert parts == [(0, 10)]
    wait_until(lambda: decode.free_blocks() == NUM_BLOCKS, 1.0, "decode blocks freed")
    wait_until(lambda: prefill.free_blocks() == NUM_BLOCKS, 1.0, "prefill blocks freed")


def start_slow_prefill(
    workers: Any,
    monkeypatch: pytest.MonkeyPatch,
    rid: str,
    first_id: int,
    generation: int,
    pause: float = 0.1,
) -> tuple[Any, Any, Any, Any, Any]:
    """Start a streamed Prefill whose engine thread pauses `pause` s after every step, and
    return once its first part has gone out: (driver, prefill, decode, call future,
    reservation)."""
    prefills, decode = workers
    prefill = prefills["overlap"]
    driver = ControlDriver(prefill, decode, backends_here()[0])
    first_part = threading.Event()
    feed = prefill_service.KVExport.__call__

    def slow(self: Any, engine: Any, request_id: str, output: Any) -> None:
        feed(self, engine, request_id, output)
        if self.parts:
            first_part.set()
        time.sleep(pause)  # engine thread: leaves time to act between chunks

    monkeypatch.setattr(prefill_service.KVExport, "__call__", slow)
    request = driver.prepare(rid, [first_id, *PROMPT[1:]], max_tokens=MAX_TOKENS)
    reservation = driver.reserve(request, generation=generation)
    target = driver.target(reservation, generation)
    call = driver.p.Prefill.future(
        worker_pb2.PrefillRequest(request=request, target=target), timeout=30
    )
    assert first_part.wait(10)
    return driver, prefill, decode, call, reservation


def test_release_between_parts_frees_both_sides(
    workers: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prefill cancelled and released after its first part left: the transfer ends on both
    sides, every block comes back, and a Decode for it is refused."""
    driver, prefill, decode, call, reservation = start_slow_prefill(
        workers, monkeypatch, "between", 900, generation=2
    )
    assert not call.done()
    call.cancel()  # as the control plane does: cancel its call, then Release every holder
    release = worker_pb2.ReleaseRequest(request_id="between", generation=2)
    driver.p.Release(release, timeout=5)
    wait_until(lambda: prefill.free_blocks() == NUM_BLOCKS, 2.0, "prefill blocks freed")
    wait_until(
        lambda: decode.role.table.get("between").handle.state.is_terminal, 2.0, "receive ended"
    )
    decode_call = driver.decode_call("between", reservation, 2)
    with pytest.raises(grpc.RpcError):
        list(decode_call)
    driver.d.Release(release, timeout=5)
    wait_until(lambda: decode.free_blocks() == NUM_BLOCKS, 1.0, "decode blocks freed")
    assert not decode.role.held()


def test_a_transfer_ended_by_the_decode_side_ends_the_prefill_at_once(
    workers: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The decode worker drops the reservation after the first part (a Release, its lease's
    reaper, or its death): the Prefill call fails as soon as its transfer has ended and frees
    its blocks, instead of computing the other chunks (2 s here) for KV with nowhere to go."""
    driver, prefill, _, call, _ = start_slow_prefill(
        workers, monkeypatch, "dropped", 902, generation=3, pause=0.5
    )
    release = worker_pb2.ReleaseRequest(request_id="dropped", generation=3)
    assert driver.d.Release(release, timeout=5).released
    released = time.monotonic()
    with pytest.raises(grpc.RpcError):
        call.result(timeout=10)
    assert time.monotonic() - released < 1.5  # the transfer's end, not the prompt's
    wait_until(lambda: prefill.free_blocks() == NUM_BLOCKS, 2.0, "prefill blocks freed")


@pytest.mark.parametrize("mode", ["overlap", "whole"])
def test_first_token_that_ends_the_request_finishes_the_send_without_kv(
    workers: Any, mode: str
) -> None:
    """The send ends with the first token alone (the chunks already out are all that moved);
    the decode worker streams it without waiting for KV that will never come."""
    prefills, decode = workers
    prefill = prefills[mode]
    driver = ControlDriver(prefill, decode, backends_here()[0])
    rid = f"one-{mode}"
    response, stream = driver.generate(rid, [901, *PROMPT[1:]], temperature=0.0, max_tokens=1)
    if mode == "whole":
        assert response.transfer_bytes == 0
    assert [t for r in stream for t in r.token_ids] == [response.first_tokens[0].token_id]
    assert stream[-1].finish_reason == generation_pb2.FINISH_REASON_LENGTH
    wait_until(lambda: decode.free_blocks() == NUM_BLOCKS, 1.0, "decode blocks freed")
    wait_until(lambda: prefill.free_blocks() == NUM_BLOCKS, 1.0, "prefill blocks freed")


def test_release_without_cancel_answers_aborted(
    workers: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Release of a prefill whose caller is still waiting ends that call with ABORTED at once
    (it never waits out its deadline) and frees every block on both sides."""
    driver, prefill, decode, call, _ = start_slow_prefill(
        workers, monkeypatch, "released", 902, generation=3
    )
    release = worker_pb2.ReleaseRequest(request_id="released", generation=3)
    assert driver.p.Release(release, timeout=5).released
    with pytest.raises(grpc.RpcError) as failure:
        call.result(timeout=5)
    assert failure.value.code() == grpc.StatusCode.ABORTED
    assert "request_id" in (failure.value.details() or "")
    wait_until(lambda: prefill.free_blocks() == NUM_BLOCKS, 2.0, "prefill blocks freed")
    driver.d.Release(release, timeout=5)
    wait_until(lambda: decode.free_blocks() == NUM_BLOCKS, 2.0, "decode blocks freed")
