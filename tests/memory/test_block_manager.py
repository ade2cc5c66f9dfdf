"""BlockManager unit tests with exact block ids."""

from __future__ import annotations

import pytest

from kvmesh.memory import (
    AllocResult,
    BlockManager,
    CapacityError,
    SequenceExistsError,
    UnknownSequenceError,
)


def make(num_blocks: int = 8, block_size: int = 4, **kwargs: object) -> BlockManager:
    return BlockManager(num_blocks, block_size, hash_seed=b"test", **kwargs)  # type: ignore[arg-type]


def run_prompt(m: BlockManager, seq_id: str, tokens: list[int], extra_key: bytes | None = None):
    """Lookup, allocate the prompt, commit it as computed; return (cached tokens, result)."""
    cached = m.lookup_prefix(seq_id, tokens, extra_key)
    result = m.allocate(seq_id, len(tokens))
    assert result is not None
    m.commit(seq_id, tokens, len(tokens), extra_key)
    m.check_integrity()
    return cached, result


def test_allocation_order_tables_and_slots() -> None:
    m = make()
    assert m.allocate("a", 6) == AllocResult([0, 1], [])
    assert m.allocate("b", 4) == AllocResult([2], [])
    assert m.allocate("a", 8) == AllocResult([], [])
    assert m.allocate("a", 9) == AllocResult([3], [])
    assert m.block_table("a") == [0, 1, 3]
    assert m.slot_mapping("a", 6, 9) == [6, 7, 12]
    assert m.slot_mapping("b", 0, 4) == [8, 9, 10, 11]
    assert m.num_tokens("a") == 9 and m.num_free_blocks == 4
    m.check_integrity()


def test_allocate_at_or_below_current_count_is_a_noop() -> None:
    m = make()
    m.allocate("a", 6)
    assert m.allocate("a", 3) == AllocResult([], [])
    assert m.num_tokens("a") == 6 and m.block_table("a") == [0, 1]


def test_free_releases_tail_first() -> None:
    m = make(num_blocks=3)
    m.allocate("a", 12)
    m.free("a")
    assert not m.has("a")
    assert m.allocate("b", 4) == AllocResult([2], [])
    assert m.allocate("c", 8) == AllocResult([1, 0], [])
    m.check_integrity()


def test_fork_then_append_copies_shared_partial_block() -> None:
    m = make()
    m.allocate("p", 6)
    m.fork("p", "c")
    assert (m.ref_count(0), m.ref_count(1)) == (2, 2)
    assert m.allocate("c", 7) == AllocResult([2], [(1, 2)])
    assert m.block_table("c") == [0, 2] and m.block_table("p") == [0, 1]
    assert m.ref_count(1) == 1
    assert m.allocate("p", 7) == AllocResult([], [])
    assert m.metrics().cow_copies == 1
    m.check_integrity()


def test_fork_at_block_boundary_needs_no_copy() -> None:
    m = make()
    m.allocate("p", 8)
    m.fork("p", "c")
    assert m.allocate("c", 9) == AllocResult([2], [])
    assert m.block_table("c") == [0, 1, 2]


def test_cow_with_growth_reports_copy_first() -> None:
    m = make()
    m.allocate("p", 5)
    m.fork("p", "c")
    assert m.allocate("c", 10) == AllocResult([2, 3], [(1, 2)])
    assert m.block_table("c") == [0, 2, 3]


def test_prefix_hit_reuses_committed_blocks() -> None:
    m = make()
    tokens = list(range(10))
    assert run_prompt(m, "a", tokens) == (0, AllocResult([0, 1, 2], []))
    m.free("a")
    assert m.lookup_prefix("b", tokens) == 8
    assert m.block_table("b") == [0, 1]
    assert m.allocate("b", 10) == AllocResult([3], [])
    metrics = m.metrics()
    assert (metrics.prefix_queries, metrics.prefix_query_tokens) == (2, 20)
    assert metrics.prefix_hit_tokens == 8 and metrics.prefix_hit_rate == pytest.approx(0.4)
    m.check_integrity()


def test_lookup_never_returns_the_whole_prompt() -> None:
    m = make()
    run_prompt(m, "a", list(range(8)))
    m.free("a")
    assert m.lookup_prefix("b", list(range(8))) == 4
    assert m.lookup_prefix("c", list(range(9))) == 8


def test_lookup_shares_blocks_of_running_sequence() -> None:
    m = make()
    run_prompt(m, "a", list(range(8)))
    assert m.lookup_prefix("b", [*range(8), 99]) == 8
    assert m.ref_count(0) == 2 and m.ref_count(1) == 2
    m.check_integrity()


def test_lru_eviction_order_tail_of_oldest_first() -> None:
    m = make(num_blocks=4)
    run_prompt(m, "a", list(range(8)))
    m.free("a")
    run_prompt(m, "b", list(range(100, 108)))
    m.free("b")
    assert m.metrics().evictable_blocks == 4
    assert m.allocate("c", 4) == AllocResult([1], [])
    assert m.metrics().evictions == 1
    assert m.lookup_prefix("a2", list(range(9))) == 4
    assert m.allocate("d", 4) == AllocResult([3], [])
    assert m.lookup_prefix("b2", list(range(100, 109))) == 4
    m.check_integrity()


def test_protected_prefix_survives_flood_of_unique_prompts() -> None:
    hot = list(range(1000, 1008))
    survivors = {}
    for policy in ("slru", "lru"):
        m = make(num_blocks=6, admission=policy)
        for seq_id in ("h1", "h2"):
            run_prompt(m, seq_id, [*hot, 1])
            m.free(seq_id)
        for i in range(10):
            run_prompt(m, f"u{i}", list(range(i * 10, i * 10 + 8)))
            m.free(f"u{i}")
        survivors[policy] = m.lookup_prefix("h3", [*hot, 1])
        m.check_integrity()
    assert survivors == {"slru": 8, "lru": 0}


def test_forced_hash_collision_is_never_served() -> None:
    m = make(hash_fn=lambda parent, tokens, key: 7)
    run_prompt(m, "a", [1, 2, 3, 4, 5])
    m.free("a")
    assert m.lookup_prefix("b", [9, 9, 9, 9, 5]) == 0
    assert m.block_table("b") == []
    assert m.metrics().hash_collisions == 1
    assert m.lookup_prefix("c", [1, 2, 3, 4, 5]) == 4
    m.check_integrity()


def test_extra_key_separates_tenants() -> None:
    m = make()
    tokens = list(range(9))
    run_prompt(m, "a", tokens, extra_key=b"tenant-1")
    m.free("a")
    assert m.lookup_prefix("b", tokens, extra_key=b"tenant-2") == 0
    assert m.lookup_prefix("c", tokens) == 0
    assert m.lookup_prefix("d", tokens, extra_key=b"tenant-1") == 8
    assert m.block_hashes(tokens, b"tenant-1") != m.block_hashes(tokens, b"tenant-2")


def test_identical_block_committed_twice_is_published_once() -> None:
    m = make()
    tokens = list(range(9))
    for seq_id in ("a", "b"):
        m.lookup_prefix(seq_id, tokens)
        m.allocate(seq_id, 9)
    m.commit("a", tokens, 9)
    m.commit("b", tokens, 9)
    m.commit("b", tokens, 9)
    assert m.metrics().cached_blocks == 2
    m.free("b")
    m.free("a")
    metrics = m.metrics()
    assert (metrics.evictable_blocks, metrics.free_blocks) == (2, 6)
    m.check_integrity()


def test_capacity_error_names_the_numbers() -> None:
    m = make(num_blocks=4)
    with pytest.raises(CapacityError, match=r"num_tokens=17 needs 5 blocks.*only 4 blocks"):
        m.allocate("a", 17)
    assert not m.has("a")
    m.allocate("a", 16)
    with pytest.raises(CapacityError):
        m.allocate("a", 17)


def test_exhaustion_returns_none_and_changes_nothing() -> None:
    m = make(num_blocks=4)
    m.allocate("a", 10)
    m.fork("a", "f")
    m.allocate("b", 4)
    before = (m.metrics(), m.block_table("a"), m.block_table("f"))
    assert m.allocate("c", 8) is None
    assert m.allocate("a", 13) is None
    assert m.allocate("f", 11) is None
    assert not m.has("c") and m.num_tokens("a") == 10 and m.num_tokens("f") == 10
    assert (m.metrics(), m.block_table("a"), m.block_table("f")) == before
    m.check_integrity()


def test_prefix_caching_disabled() -> None:
    m = make(enable_prefix_caching=False)
    run_prompt(m, "a", list(range(9)))
    m.free("a")
    assert m.lookup_prefix("b", list(range(9))) == 0
    assert m.allocate("b", 9) is not None
    assert m.metrics().cached_blocks == 0 and m.metrics().prefix_queries == 2


def test_bad_input_raises_typed_errors_naming_the_field() -> None:
    m = make()
    m.allocate("a", 4)
    with pytest.raises(UnknownSequenceError, match="seq_id 'zz'"):
        m.free("zz")
    with pytest.raises(SequenceExistsError, match="seq_id 'a'"):
        m.lookup_prefix("a", [1, 2])
    with pytest.raises(SequenceExistsError, match="child_id 'a'"):
        m.fork("a", "a")
    with pytest.raises(ValueError, match="num_computed"):
        m.commit("a", list(range(8)), 8)
    with pytest.raises(ValueError, match="start/end"):
        m.slot_mapping("a", 0, 5)
    with pytest.raises(ValueError, match="num_tokens"):
        m.allocate("b", -1)
    with pytest.raises(ValueError, match="admission"):
        BlockManager(4, 4, admission="mru")
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, 4)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(4, 0)


def test_commit_contradicting_a_shared_block_is_rejected() -> None:
    m = make()
    m.lookup_prefix("p", list(range(5)))
    m.allocate("p", 5)
    m.fork("p", "c")
    m.commit("p", list(range(5)), 5)
    with pytest.raises(ValueError, match="block 0"):
        m.commit("c", [9, 9, 9, 9, 9], 5)


def test_metrics_usage_and_counts() -> None:
    m = make(num_blocks=10)
    run_prompt(m, "a", list(range(9)))
    metrics = m.metrics()
    assert (metrics.in_use_blocks, metrics.free_blocks, metrics.cached_blocks) == (3, 7, 2)
    assert metrics.usage == pytest.approx(0.3)
    assert metrics.as_dict()["total_blocks"] == 10


def test_integrity_check_detects_corruption() -> None:
    m = make()
    m.allocate("a", 6)
    m._pool._refs[0] += 1
    with pytest.raises(AssertionError, match="block 0: ref count 2 != 1"):
        m.check_integrity()


def test_collision_with_same_tokens_under_another_parent_is_not_served() -> None:
    m = make(hash_fn=lambda parent, tokens, key: sum(tokens) % 5)
    repeated = [1, 2, 3, 4, 1, 2, 3, 4, 9]
    run_prompt(m, "a", repeated)
    assert m.metrics().cached_blocks == 1
    m.free("a")
    assert m.lookup_prefix("b", repeated) == 4
    assert m.block_table("b") == [0]
    m.check_integrity()


def test_commit_brings_a_trailing_slot_count_up_within_held_blocks() -> None:
    m = make()
    m.allocate("a", 5)  # two blocks of 4; slots 5..7 written later without allocate
    m.commit("a", list(range(8)), 8)
    assert m.num_tokens("a") == 8
    assert m.metrics().cached_blocks == 2
    m.check_integrity()
    with pytest.raises(ValueError, match="num_computed"):
        m.commit("a", list(range(12)), 9)  # past the blocks it holds
    assert m.num_tokens("a") == 8


def test_a_refused_argument_changes_nothing() -> None:
    """lookup_prefix hashes before it takes anything: a token that does not fit 64 bits (in
    the first block, or after a block it would hit) raises ValueError naming token_ids and
    leaves no sequence, reference or count behind; allocate refuses a num_tokens that is not
    an int on a tracked sequence as on a new one."""
    m = make()
    run_prompt(m, "p", [1, 2, 3, 4, 5])
    m.free("p")
    before = m.metrics()
    for prompt in ([1, 2, 3, 2**64, 5], [1, 2, 3, 4, 2**64, 6, 7, 8, 9]):
        with pytest.raises(ValueError, match="token_ids"):
            m.lookup_prefix("a", prompt)
        assert not m.has("a") and m.metrics() == before
        m.check_integrity()
    m.allocate("a", 5)
    for bad in (6.5, 3.5):
        with pytest.raises(ValueError, match="num_tokens"):
            m.allocate("a", bad)  # type: ignore[arg-type]
        assert m.num_tokens("a") == 5
    m.check_integrity()


def test_an_orphaned_publication_gives_way_to_its_chain_computed_again() -> None:
    """Two requests compute one prompt at once: A publishes block p, B's own p stays an
    unpublished twin and B publishes x after A's p. Once A's p is evicted, B's x is an orphan
    no lookup can reach; C computing p + x again publishes its x in the orphan's place (no
    collision: the hash inputs are equal), so D hits both blocks."""
    m = make(num_blocks=10)
    p, x = [1, 2, 3, 4], [5, 6, 7, 8]
    m.lookup_prefix("A", [*p, 9])
    m.allocate("A", 5)
    m.lookup_prefix("B", [*p, *x, 9])
    m.allocate("B", 9)
    m.commit("A", [*p, 9], 5)
    m.commit("B", [*p, *x, 9], 9)
    m.free("A")
    assert m.allocate("F", 28) is not None  # evicts A's p
    m.free("F")
    m.free("B")
    assert run_prompt(m, "C", [*p, *x, 9])[0] == 0
    m.free("C")
    assert m.lookup_prefix("D", [*p, *x, 9]) == 8
    assert m.metrics().hash_collisions == 0
    m.check_integrity()


def test_a_lookup_counts_in_the_metrics_once_its_allocation_succeeds() -> None:
    """An admission that finds no room (lookup, allocate None, free) and is retried counts
    one prefix query, with the hits of the lookup that was admitted."""
    m = make(num_blocks=4)
    run_prompt(m, "a", list(range(9)))  # holds 3 blocks, 2 published
    prompt = [*range(8), 50, 51, 52, 53, 54]
    for _ in range(3):
        assert m.lookup_prefix("b", prompt) == 8
        assert m.allocate("b", len(prompt)) is None  # 2 more blocks, 1 free
        m.free("b")
    assert m.metrics().prefix_queries == 1
    m.free("a")
    assert m.lookup_prefix("b", prompt) == 8 and m.allocate("b", len(prompt)) is not None
    metrics = m.metrics()
    assert (metrics.prefix_queries, metrics.prefix_query_tokens) == (2, 9 + len(prompt))
    assert metrics.prefix_hit_tokens == 8
    m.check_integrity()


def test_a_lookup_without_promote_leaves_its_hits_probationary() -> None:
    """SLRU promotes a block when another request hits it; `promote=False` (a request hitting
    its own blocks again) leaves them where they were."""
    m = make()
    run_prompt(m, "a", list(range(9)))
    m.free("a")
    assert m.lookup_prefix("b", list(range(9)), promote=False) == 8
    m.free("b")
    assert m.metrics().protected_blocks == 0
    assert m.lookup_prefix("c", list(range(9))) == 8
    m.free("c")
    assert m.metrics().protected_blocks == 2
    m.check_integrity()
