"""Engine with host and disk KV tiers under a device pool too small for the shared prefixes:
greedy output is the transformers output, with blocks spilled and reloaded; a persistent disk
tier serves hits after a restart; a prefix is reloaded for its own cache salt only."""

from __future__ import annotations

import gc
import itertools
import random
import shutil
import subprocess
import sys
import threading
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from kvmesh import LLM, SamplingParams
from kvmesh.engine import disagg
from kvmesh.engine.errors import InvalidParameterError
from kvmesh.models.tiny import build_tiny_model
from kvmesh.telemetry.tier_metrics import register_tier_metrics
from tests.memory.tiers_harness import file_size_limit

MAX_NEW = 6
BLOCK_BYTES = 16384  # the tiny llama: 2 layers x (K, V) x 16 tokens x 2 heads x 32 x 4 bytes
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
SALTED_IDS = itertools.count()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("llama"), "llama", "test", seed=0)


def make_prompts() -> list[list[int]]:
    """Two 48-token shared prefixes (3 blocks each), each with two different tails."""
    rng = random.Random(5)
    prefixes = [[rng.randrange(10, 1000) for _ in range(48)] for _ in range(2)]
    return [p + [rng.randrange(10, 1000) for _ in range(9)] for p in prefixes for _ in range(2)]


@pytest.fixture(scope="module")
def expected(checkpoint: Path) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(str(checkpoint), attn_implementation="sdpa")
    result = []
    for prompt in make_prompts():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW,
            do_sample=False, pad_token_id=0,
        )  # fmt: skip
        result.append(out[0, len(prompt) :].tolist())
    return result


def gib(blocks: int) -> float:
    return blocks * BLOCK_BYTES / 2**30


def run_each(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """One request at a time (so each evicts the previous prefix from the 5-block pool)."""
    outputs = [llm.generate([p], GREEDY)[0] for p in prompts]
    return [o.outputs[0].token_ids for o in outputs], [o.num_cached_tokens for o in outputs]


def tiers_of(llm: LLM) -> dict[str, Any]:
    store = llm.engine.parts.tiers
    assert store is not None
    llm.engine.scheduler.block_manager.check_integrity()
    return {s.tier: s for s in store.metrics()}


def test_host_tier_spills_and_reloads_with_identical_greedy_output(
    checkpoint: Path, expected: list[list[int]]
) -> None:
    llm = LLM(str(checkpoint), num_kv_blocks=5, host_kv_gib=gib(32))
    order = [0, 2, 1, 3]  # prefix 0, prefix 1, then each again: the device holds only one
    tokens, cached = run_each(llm, [make_prompts()[i] for i in order])
    assert tokens == [expected[i] for i in order]
    assert cached[2:] == [48, 48]
    host = tiers_of(llm)["host"]
    assert host.spills >= 3 and host.hits >= 3 and host.reloads >= 3
    registry = CollectorRegistry()  # what a worker's metrics port serves
    register_tier_metrics(registry, lambda: llm.engine)
    text = generate_latest(registry).decode()
    assert f'kvmesh_kv_tier_capacity_bytes{{tier="host"}} {32 * BLOCK_BYTES}.0' in text
    assert f'kvmesh_kv_tier_hits_total{{tier="host"}} {float(host.hits)}' in text
    assert 'kvmesh_preemptions_total{mode="swap"} 0.0' in text


def persistent_tiers(folder: Path, host_blocks: int = 2) -> dict[str, Any]:
    """Engine options of a 5-block device, a host tier of `host_blocks` blocks and a
    persistent disk tier in `folder`."""
    return {
        "num_kv_blocks": 5,
        "host_kv_gib": gib(host_blocks),
        "disk_kv_dir": str(folder),
        "disk_kv_persist": True,
    }


def test_persistent_disk_tier_serves_hits_after_restart(
    checkpoint: Path, expected: list[list[int]], tmp_path: Path
) -> None:
    options = persistent_tiers(tmp_path)
    first = LLM(str(checkpoint), **options)
    tokens, _ = run_each(first, [make_prompts()[0], make_prompts()[2]])
    assert tokens == [expected[0], expected[2]]
    assert tiers_of(first)["disk"].spills >= 1
    first.engine.close()
    del first
    again = LLM(str(checkpoint), **options)
    tokens, cached = run_each(again, [make_prompts()[1]])
    assert tokens == [expected[1]] and cached[0] > 0
    assert tiers_of(again)["disk"].hits >= 1


def test_an_engine_dropped_without_close_gives_its_disk_folder_back(
    checkpoint: Path, expected: list[list[int]], tmp_path: Path
) -> None:
    """An engine let go without `close` (`del llm`, as notebooks and test loops do) releases
    its disk folder once collected: another engine in this process starts on the folder and
    serves the transformers output, and the dropped tier's block files are gone (they could
    never hit again)."""
    options = {"num_kv_blocks": 5, "host_kv_gib": gib(2), "disk_kv_dir": str(tmp_path)}
    first = LLM(str(checkpoint), **options)
    run_each(first, [make_prompts()[0], make_prompts()[2]])
    assert tiers_of(first)["disk"].used_blocks >= 1
    del first
    gc.collect()
    assert list(tmp_path.glob("*.kvblock")) == []
    again = LLM(str(checkpoint), **options)
    tokens, _ = run_each(again, [make_prompts()[1], make_prompts()[3]])
    assert tokens == [expected[1], expected[3]]


def test_a_disk_folder_that_cannot_be_made_is_refused_by_name(
    checkpoint: Path, tmp_path: Path
) -> None:
    """A disk tier folder the engine cannot create or lock (a file in its place here; a
    read-only mount, no permission) fails the start naming `disk_kv_dir`, as a folder in use
    does: the option error a worker reports as `--disk-kv-dir: ...`, not an OSError."""
    taken = tmp_path / "taken"
    taken.write_bytes(b"")
    for folder in (taken, taken / "kv"):
        with pytest.raises(InvalidParameterError, match="cannot be used") as error:
            LLM(str(checkpoint), num_kv_blocks=5, disk_kv_dir=str(folder))
        assert error.value.field == "disk_kv_dir"


def test_an_llm_writes_its_persistent_tier_down_when_dropped_or_closed(
    checkpoint: Path, expected: list[list[int]], tmp_path: Path
) -> None:
    """With `disk_kv_persist` the device's and host's cached blocks are written down to disk
    when the offline LLM goes away: dropped without `close` (collected; the finalizer holds
    the engine, not the LLM) or left in a `with` block. Before, only `LLMEngine.close` wrote
    them, and a restart after the usual `del llm` (or the end of a script) found nothing."""
    options = persistent_tiers(tmp_path, host_blocks=8)
    first = LLM(str(checkpoint), **options)
    run_each(first, [make_prompts()[0]])
    assert not list(tmp_path.glob("*.kvblock"))  # nothing overflowed to disk while running
    dropped = weakref.ref(first)
    del first
    gc.collect()
    assert dropped() is None
    assert len(list(tmp_path.glob("*.kvblock"))) >= 3  # the prompt's full blocks
    with LLM(str(checkpoint), **options) as again:
        tokens, cached = run_each(again, [make_prompts()[1]])  # prefix 0, another tail
        assert tokens == [expected[1]] and cached == [48]
        reloaded = len(list(tmp_path.glob("*.kvblock")))
    assert again.closed and len(list(tmp_path.glob("*.kvblock"))) > reloaded
    again.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        again.generate([make_prompts()[1]], GREEDY)


def test_an_llm_alive_at_interpreter_exit_writes_its_persistent_tier_down(
    checkpoint: Path, tmp_path: Path
) -> None:
    """A script that ends with its LLM still referenced (never closed, never collected)
    writes the cached blocks down at interpreter exit."""
    script = (
        "import sys\n"
        "from kvmesh import LLM, SamplingParams\n"
        "llm = LLM(sys.argv[1], num_kv_blocks=5, host_kv_gib=0.001, disk_kv_dir=sys.argv[2],"
        " disk_kv_persist=True)\n"
        "llm.generate([list(range(10, 60))], SamplingParams(max_tokens=2, ignore_eos=True))\n"
    )
    subprocess.run(
        [sys.executable, "-c", script, str(checkpoint), str(tmp_path)],
        check=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert len(list(tmp_path.glob("*.kvblock"))) >= 3  # the prompt's full blocks


def test_a_hash_seed_that_cannot_be_read_is_refused_by_name(
    checkpoint: Path, tmp_path: Path
) -> None:
    """A persistent disk folder whose `hash-seed` can be neither read nor written (a
    directory in its place here; an I/O error, a full disk) fails the start naming
    `disk_kv_dir`, not with a raw OSError."""
    (tmp_path / "hash-seed").mkdir()
    with pytest.raises(InvalidParameterError, match="hash seed") as error:
        LLM(str(checkpoint), num_kv_blocks=5, disk_kv_dir=str(tmp_path), disk_kv_persist=True)
    assert error.value.field == "disk_kv_dir"


def salted_cached_tokens(llm: LLM, prompt: list[int], salt: bytes | None) -> int:
    """Run `prompt` under cache salt `salt` (as a worker builds requests); its cached tokens."""
    engine = llm.engine
    request_id = f"salted-{next(SALTED_IDS)}"
    request = disagg.build_request(engine, request_id, prompt, GREEDY, extra_key=salt)
    disagg.add_request(engine, request)
    while engine.scheduler.get_request(request_id) is not None:
        engine.step()
    engine.forget_request(request_id)
    return request.seqs[0].num_cached_tokens


def test_salts_stay_apart_in_the_host_and_disk_tiers_and_after_a_restart(
    checkpoint: Path, tmp_path: Path
) -> None:
    """A prefix spilled to the host and disk tiers (and kept across a restart) is reloaded for
    its own cache salt only: another salt, or none, computes it afresh."""
    options = persistent_tiers(tmp_path)
    prompts = make_prompts()
    first = LLM(str(checkpoint), **options)
    assert salted_cached_tokens(first, prompts[0], b"a") == 0
    assert salted_cached_tokens(first, prompts[2], b"a") == 0  # evicts prefix 0 to the tiers
    assert salted_cached_tokens(first, prompts[1], b"b") == 0
    assert salted_cached_tokens(first, prompts[3], None) == 0
    assert salted_cached_tokens(first, prompts[3], b"a") == 48
    first.engine.close()
    del first
    again = LLM(str(checkpoint), **options)
    assert [salted_cached_tokens(again, prompts[1], salt) for salt in (b"c", None)] == [0, 0]
    assert salted_cached_tokens(again, prompts[1], b"a") == 48
    assert tiers_of(again)["disk"].hits >= 1


def test_a_checkpoint_rewritten_in_place_never_reads_the_old_kv(tmp_path: Path) -> None:
    """A persistent disk tier outlives the weights that computed it: after the checkpoint is
    rebuilt in the same folder (retrained, re-converted), a restart serves the new weights'
    output from an empty tier, never KV of the old weights under the same path."""
    folder = tmp_path / "model"
    options = persistent_tiers(tmp_path / "kv")
    prompts = make_prompts()
    first = LLM(str(build_tiny_model(folder, "llama", "test", seed=0)), **options)
    run_each(first, [prompts[0], prompts[2]])
    assert tiers_of(first)["disk"].spills >= 1
    first.engine.close()
    del first
    shutil.rmtree(folder)
    checkpoint = build_tiny_model(folder, "llama", "test", seed=1)
    reference, _ = run_each(LLM(str(checkpoint), num_kv_blocks=16), [prompts[1]])
    again = LLM(str(checkpoint), **options)
    tokens, cached = run_each(again, [prompts[1]])
    assert tokens == reference and cached == [0]
    assert tiers_of(again)["disk"].hits == 0


def test_a_disk_that_refuses_writes_costs_hits_not_requests(
    checkpoint: Path, expected: list[list[int]], tmp_path: Path
) -> None:
    """Disk full (a file size limit here): the blocks demoted from the host are dropped, the
    requests whose allocations demoted them run on with the transformers output."""
    llm = LLM(str(checkpoint), num_kv_blocks=5, host_kv_gib=gib(2), disk_kv_dir=str(tmp_path))
    run_each(llm, [[5] * 20])  # anything built lazily is built before the limit
    order = [0, 2, 1, 3]
    with file_size_limit(4096):
        tokens, _ = run_each(llm, [make_prompts()[i] for i in order])
    assert tokens == [expected[i] for i in order]
    tiers = tiers_of(llm)
    assert tiers["host"].dropped >= 1 and tiers["disk"].used_blocks == 0
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


@pytest.mark.parametrize("mode", ["swap", "auto"])
def test_swap_preemption_keeps_greedy_output(
    checkpoint: Path, expected: list[list[int]], mode: str
) -> None:
    """Preempted sequences come back with the same greedy tokens (a roomy engine's, whose first
    tokens are transformers'; decodes grow past their prompt's blocks, so the pool of 9 blocks
    runs out while they decode: prompt work alone never preempts). `swap` swaps every one (the
    host has room); `auto` picks by the rates it measures on this machine, so which way it goes
    depends on the load (the rule itself is tested on its own): every swapped block returns."""
    longer = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)  # decodes grow
    roomy = LLM(str(checkpoint), num_kv_blocks=64).generate(make_prompts(), longer)
    assert [o.outputs[0].token_ids[:MAX_NEW] for o in roomy] == expected
    llm = LLM(
        str(checkpoint), num_kv_blocks=9, host_kv_gib=gib(32), preemption=mode,
        max_num_batched_tokens=64,
    )  # fmt: skip
    outputs = llm.generate(make_prompts(), longer)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in roomy]
    chooser = llm.engine.scheduler.state.chooser
    assert chooser is not None and llm.engine.scheduler.num_preemptions > 0
    assert chooser.num_swap + chooser.num_recompute == llm.engine.scheduler.num_preemptions
    if mode == "swap":
        assert chooser.num_swap > 0 and chooser.num_recompute == 0
    store = llm.engine.parts.tiers
    assert store is not None
    assert store.swap_stats.swapped_in == store.swap_stats.swapped_out
    assert store.swap_stats.swapped_out > 0 or mode == "auto"
    llm.engine.scheduler.block_manager.check_integrity()


def prefill_blocks(llm: LLM, request_id: str, prompt: list[int]) -> tuple[torch.Tensor, int]:
    """Run `prompt` prefill-only (as a prefill worker does) and return the KV of its full
    blocks as the sender would gather it, and the tokens it found cached."""
    engine = llm.engine
    engine.add_request(request_id, prompt, GREEDY, prefill_only=True)
    for _ in range(50):
        if engine.scheduler.num_prefilled:
            break
        engine.step()
    assert engine.scheduler.num_prefilled == 1
    table = engine.scheduler.block_manager.block_table(request_id)
    full = len(prompt) // 16
    data = engine.runner.kv_cache.data[torch.tensor(table[:full])].clone()
    cached = engine.scheduler.get_request(request_id).seqs[0].num_cached_tokens  # type: ignore[union-attr]
    engine.scheduler.release_prefilled(request_id)
    return data, cached


def test_prefill_worker_ships_a_prefix_reloaded_from_the_host_tier(checkpoint: Path) -> None:
    prompts = make_prompts()
    reference, _ = prefill_blocks(LLM(str(checkpoint), num_kv_blocks=5), "ref", prompts[0])
    llm = LLM(str(checkpoint), num_kv_blocks=5, host_kv_gib=gib(16))
    run_each(llm, [prompts[1], prompts[2]])  # prefix 0, then prefix 1 evicts it to the host
    shipped, cached = prefill_blocks(llm, "p", prompts[0])
    assert cached == 48 and tiers_of(llm)["host"].hits >= 1
    torch.testing.assert_close(shipped, reference)


def test_a_cache_moved_into_shared_memory_takes_its_tiers_along(
    checkpoint: Path, expected: list[list[int]]
) -> None:
    """As a decode worker does for registered memory: after the move, spills read and reloads
    write the cache the engine serves from, so greedy output stays the transformers output."""
    from kv_transfer.registered import shared_tensors

    llm = LLM(str(checkpoint), num_kv_blocks=5, host_kv_gib=gib(32))
    old = llm.engine.runner.kv_cache
    scales = None if old.scales is None else tuple(old.scales.shape)
    data, shared_scales, _region = shared_tensors(tuple(old.data.shape), old.data.dtype, scales)
    llm.engine.move_kv_cache(data, shared_scales)
    assert llm.engine.runner.kv_cache.data.data_ptr() == data.data_ptr()
    order = [0, 2, 1, 3]
    tokens, cached = run_each(llm, [make_prompts()[i] for i in order])
    assert tokens == [expected[i] for i in order]
    assert cached[2:] == [48, 48] and tiers_of(llm)["host"].reloads >= 3


def test_a_workers_built_request_prefetches_its_disk_blocks(
    checkpoint: Path, tmp_path: Path
) -> None:
    """The workers queue built requests (`disagg.add_request`); their prefix blocks on disk
    are read by the tier's reader thread from arrival, as `LLM.generate`'s are (they were all
    read on the engine's thread inside the step, holding up the whole batch)."""
    llm = LLM(str(checkpoint), num_kv_blocks=5, host_kv_gib=gib(4), disk_kv_dir=str(tmp_path))
    prompts = make_prompts()
    third = list(range(100, 157))  # a third prefix pushes prefix 0 from the host to the disk
    run_each(llm, [prompts[0], prompts[2], third])
    assert tiers_of(llm)["disk"].used_blocks >= 1
    store = llm.engine.parts.tiers
    assert store is not None and store.disk is not None
    readers: list[str] = []
    read = store.disk.read

    def recorded(block_hash: int) -> bytes | None:
        readers.append(threading.current_thread().name)
        return read(block_hash)

    store.disk.read = recorded  # type: ignore[method-assign]  # the real read, observed
    engine = llm.engine
    request = disagg.build_request(engine, "built", prompts[1], GREEDY)
    disagg.add_request(engine, request)
    while engine.scheduler.get_request("built") is not None:
        engine.step()
    engine.forget_request("built")
    assert request.seqs[0].num_cached_tokens == 48
    # Read ahead from arrival (up to half the host's slots; any rest is read in the step).
    assert readers and readers[0].startswith("kvmesh-tier-read"), readers
