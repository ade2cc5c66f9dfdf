"""Random allocate / free / evict-spill / hit-reload / swap (and swap-in refused) / corrupt-file
/ restart sequences over a device pool with host and disk tiers: after every step the
cross-tier integrity check holds (one copy per block hash, every slot in one state, index ==
files) and every sequence reads back exactly the KV of its own context."""

from __future__ import annotations

import itertools
import shutil
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tests.memory.tiers_harness import TieredRig

BASES = [[7] * 16, list(range(16)), [5, 6] * 8, [9, 1, 9, 2] * 4]
prompts = st.builds(
    lambda base, cut, tail: BASES[base][:cut] + tail,
    st.integers(0, len(BASES) - 1),
    st.sampled_from([5, 9, 13]),
    st.lists(st.integers(0, 3), max_size=2),
)


class TieredMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.folder = Path(tempfile.mkdtemp(prefix="kvmesh-tiers-"))
        (self.folder / "hash-seed").write_bytes(b"s" * 16)  # same file names every run
        self.rig = TieredRig(5, 3, self.folder, 6, persist=True)
        self.live: dict[str, list[int]] = {}
        self.swapped: dict[str, list[int]] = {}
        self.ids = itertools.count()

    def teardown(self) -> None:
        self.rig.close()
        shutil.rmtree(self.folder, ignore_errors=True)

    @rule(tokens=prompts)
    def admit(self, tokens: list[int]) -> None:
        seq_id = f"s{next(self.ids)}"
        if self.rig.run_prompt(seq_id, tokens) is not None:
            self.live[seq_id] = tokens

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.live)))
        self.rig.manager.free(seq_id)
        del self.live[seq_id]

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def swap_out(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.live)))
        if self.rig.manager.swap_out(seq_id):
            self.swapped[seq_id] = self.live.pop(seq_id)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data(), drop=st.booleans())
    def swap_in(self, data: st.DataObject, drop: bool) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.swapped)))
        if drop:
            self.rig.manager.free(seq_id)
            del self.swapped[seq_id]
        elif self.rig.manager.swap_in(seq_id):
            self.rig.store.prepare_step()
            self.live[seq_id] = self.swapped.pop(seq_id)
            self.rig.verify(seq_id, self.live[seq_id])

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in_refused(self, data: st.DataObject) -> None:
        """Swapped in, then refused its first chunk and freed before any step (the scheduler's
        admission does this): the copies queued into its fresh blocks are dropped."""
        seq_id = data.draw(st.sampled_from(sorted(self.swapped)))
        if self.rig.manager.swap_in(seq_id):
            self.rig.manager.free(seq_id)
            del self.swapped[seq_id]

    @rule(data=st.data(), truncate=st.booleans())
    def damage_file(self, data: st.DataObject, truncate: bool) -> None:
        files = sorted(self.folder.glob("*.kvblock"))
        if not files:
            return
        path = data.draw(st.sampled_from(files))
        raw = bytearray(path.read_bytes())
        if not raw:
            return
        if truncate:
            raw = raw[: len(raw) // 2]
        else:  # a file truncated again and again gets short
            raw[-1 - data.draw(st.integers(0, min(100, len(raw) - 1)))] ^= 0x40
        path.write_bytes(bytes(raw))

    @rule(tokens=prompts)
    def prefetch(self, tokens: list[int]) -> None:
        store = self.rig.store
        store.prefetch(self.rig.manager.block_hashes(tokens))
        for future in list(store._reads.values()):  # finished reads: a reproducible state
            future.result(timeout=10)

    @rule()
    def restart(self) -> None:
        """A new process on the same folder: device, host and sequences are gone."""
        self.rig.close()
        self.rig = TieredRig(5, 3, self.folder, 6, persist=True)
        self.live.clear()
        self.swapped.clear()

    @invariant()
    def integrity(self) -> None:
        self.rig.manager.check_integrity()
        for seq_id, tokens in self.live.items():
            self.rig.verify(seq_id, tokens)


TestTiered = TieredMachine.TestCase
TestTiered.settings = settings(
    max_examples=40,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
