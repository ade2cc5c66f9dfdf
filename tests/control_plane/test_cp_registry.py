"""Registry: registration checks, leases on an injected clock, incarnation replacement."""

from __future__ import annotations

import pytest
from cp_fixtures import FakeClock, layout, load, worker_info

from control_plane.registry import RegistrationError, Registry


def test_heartbeats_keep_a_worker_alive_and_silence_kills_it() -> None:
    clock = FakeClock()
    registry = Registry(lease_seconds=3.0, clock=clock)
    registry.register(worker_info("d0", "decode"), load(free=10))
    clock.now += 2.5
    assert registry.heartbeat("d0", 1, load(free=7, running=2))
    assert registry.get("d0").load.free_blocks == 7  # type: ignore[union-attr]
    clock.now += 2.9
    assert [r.worker_id for r in registry.alive("decode")] == ["d0"]
    assert registry.reap() == []
    clock.now += 0.2
    assert registry.alive() == []
    assert [r.worker_id for r in registry.reap()] == ["d0"]
    assert registry.get("d0") is None


def test_heartbeat_from_unknown_worker_or_old_epoch_is_not_registered() -> None:
    registry = Registry(clock=FakeClock())
    assert not registry.heartbeat("ghost", 1, load())
    registry.register(worker_info("p0", "prefill", epoch=5))
    assert not registry.heartbeat("p0", 4, load())
    assert registry.heartbeat("p0", 5, load())


def test_new_epoch_replaces_the_old_incarnation() -> None:
    registry = Registry(clock=FakeClock())
    assert registry.register(worker_info("d0", "decode", epoch=1)) is None
    assert registry.register(worker_info("d0", "decode", epoch=1)) is None  # same incarnation
    replaced = registry.register(worker_info("d0", "decode", epoch=2))
    assert replaced is not None and replaced.epoch == 1
    assert registry.is_current("d0", 2) and not registry.is_current("d0", 1)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"worker_id": ""}, "worker.worker_id"),
        ({"address": ""}, "worker.address"),
        ({"epoch": 0}, "worker.epoch"),
        ({"role": 0}, "worker.role"),
    ],
)
def test_registration_errors_name_the_field(change: dict[str, object], field: str) -> None:
    info = worker_info("w", "prefill")
    for key, value in change.items():
        setattr(info, key, value)
    with pytest.raises(RegistrationError, match=field.replace(".", r"\.")):
        Registry(clock=FakeClock()).register(info)


def test_serving_set_needs_a_compatible_pair_or_a_colocated_worker() -> None:
    registry = Registry(clock=FakeClock())
    assert not registry.has_serving_set()
    registry.register(worker_info("p0", "prefill"))
    assert not registry.has_serving_set()
    registry.register(worker_info("d0", "decode", kv_layout=layout(block_size=32)))
    assert not registry.has_serving_set()  # layouts differ
    registry.register(worker_info("d1", "decode"))
    assert registry.has_serving_set()
    registry.remove("p0")
    registry.register(worker_info("c0", "colocated"))
    assert registry.has_serving_set()


def test_registry_stores_a_copy_of_the_info() -> None:
    registry = Registry(clock=FakeClock())
    info = worker_info("p0", "prefill")
    registry.register(info)
    info.address = "elsewhere:1"
    assert registry.get("p0").address == "127.0.0.1:1"  # type: ignore[union-attr]


def test_alive_by_role_groups_live_workers_in_id_order() -> None:
    clock = FakeClock()
    registry = Registry(lease_seconds=3.0, clock=clock)
    for worker_id, role in (("d1", "decode"), ("p0", "prefill"), ("d0", "decode")):
        registry.register(worker_info(worker_id, role))
    assert [r.worker_id for r in registry.alive_by_role()["decode"]] == ["d0", "d1"]
    clock.now += 2.0
    registry.register(worker_info("p1", "prefill"))
    clock.now += 1.5  # p0, d0 and d1 lapsed; p1 still holds its lease
    assert {role: [r.worker_id for r in rs] for role, rs in registry.alive_by_role().items()} == {
        "prefill": ["p1"], "decode": [], "colocated": [],
    }  # fmt: skip
