"""Random allocate / append / fork / free / lookup / commit / evict sequences on small pools.

A shadow KV store plays the model runner: it applies copy-on-write pairs and writes into each
slot the context its KV depends on (every token up to that position). After every step the
integrity check must hold and every sequence must read back exactly its own contexts (no
sharing bug, no use after free, no prefix hit computed under another context).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvmesh.memory import AllocResult, BlockManager, CapacityError

BLOCK_SIZE = 4
NUM_BLOCKS = 10
BASES = [[7] * 12, list(range(12)), [5, 6] * 6]
prompts = st.builds(
    lambda base, cut, tail: BASES[base][:cut] + tail,
    st.integers(0, len(BASES) - 1),
    st.integers(0, 12),
    st.lists(st.integers(0, 2), max_size=6),
).filter(bool)


def weak_block_hash(parent: int | None, tokens: Sequence[int], extra_key: bytes | None) -> int:
    """Collides often, even across chains: it ignores the parent block."""
    return sum(tokens) % 5


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.manager = BlockManager(NUM_BLOCKS, BLOCK_SIZE, hash_seed=b"sm")
        self.tokens: dict[str, list[int]] = {}
        # slot -> the context its KV was computed under (all tokens up to that position)
        self.slots: dict[int, tuple[int, ...]] = {}
        self.ids = itertools.count()

    @initialize(
        admission=st.sampled_from(["slru", "lru"]),
        fraction=st.sampled_from([0.0, 0.5]),
        weak_hash=st.booleans(),
    )
    def configure(self, admission: str, fraction: float, weak_hash: bool) -> None:
        """A weak hash (values 0..4) makes collisions common, so the token check must hold."""
        self.manager = BlockManager(
            NUM_BLOCKS,
            BLOCK_SIZE,
            hash_seed=b"sm",
            admission=admission,
            protected_fraction=fraction,
            hash_fn=weak_block_hash if weak_hash else None,
        )

    def _write(self, seq_id: str, result: AllocResult, start: int, tokens: list[int]) -> None:
        for src, dst in result.copy_pairs:
            for offset in range(BLOCK_SIZE):
                src_slot = src * BLOCK_SIZE + offset
                if src_slot in self.slots:
                    self.slots[dst * BLOCK_SIZE + offset] = self.slots[src_slot]
        full = self.tokens.get(seq_id, [])[:start] + tokens
        for pos, slot in enumerate(self.manager.slot_mapping(seq_id, start, len(full)), start):
            self.slots[slot] = tuple(full[: pos + 1])
        self.tokens[seq_id] = full

    def _snapshot(self) -> object:
        m = self.manager
        return m.metrics(), {s: (m.block_table(s), m.num_tokens(s)) for s in self.tokens}

    @rule(prompt=prompts)
    def start_sequence(self, prompt: list[int]) -> None:
        seq_id = f"s{next(self.ids)}"
        cached = self.manager.lookup_prefix(seq_id, prompt)
        assert cached % BLOCK_SIZE == 0 and cached <= len(prompt) - 1
        self.tokens[seq_id] = prompt[:cached]
        self.check_contents()
        result = self.manager.allocate(seq_id, len(prompt))
        if result is not None:
            self._write(seq_id, result, cached, prompt[cached:])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), count=st.integers(1, 6))
    def append(self, data: st.DataObject, count: int) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        start = self.manager.num_tokens(seq_id)
        before = self._snapshot()
        try:
            result = self.manager.allocate(seq_id, start + count)
        except CapacityError:
            assert -(-(start + count) // BLOCK_SIZE) > NUM_BLOCKS
            return
        if result is None:
            assert self._snapshot() == before
            return
        new_tokens = data.draw(st.lists(st.integers(0, 2), min_size=count, max_size=count))
        self._write(seq_id, result, start, new_tokens)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from(sorted(self.tokens)))
        child = f"s{next(self.ids)}"
        self.manager.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        self.manager.free(seq_id)
        del self.tokens[seq_id]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        tokens = self.tokens[seq_id]
        computed = data.draw(st.integers(0, len(tokens)))
        self.manager.commit(seq_id, tokens, computed)

    @rule()
    def evict_under_pressure(self) -> None:
        """Taking every allocatable block must succeed and evicts all cached blocks."""
        free_now = self.manager.num_free_blocks
        if free_now == 0:
            return
        assert self.manager.allocate("pressure", free_now * BLOCK_SIZE) is not None
        assert self.manager.metrics().evictable_blocks == 0
        self.manager.free("pressure")

    @invariant()
    def check_integrity(self) -> None:
        self.manager.check_integrity()

    @invariant()
    def check_contents(self) -> None:
        for seq_id, tokens in self.tokens.items():
            slots = self.manager.slot_mapping(seq_id, 0, len(tokens))
            expected = [tuple(tokens[: pos + 1]) for pos in range(len(tokens))]
            assert [self.slots.get(slot) for slot in slots] == expected, seq_id


BlockManagerMachine.TestCase.settings = settings(
    max_examples=120,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow],
)
TestBlockManagerMachine = BlockManagerMachine.TestCase
