"""Registered receiver memory: one copy into the receiver's shared cache, grant and commit.

In-process tests drive `ReceiverCore` directly (the checks a commit must pass); the process
tests run the shm backend between two real peers; the early-BEGIN tests run a sender and a
receiver over a real Unix socket, the sender's transfer thread held back."""

from __future__ import annotations

import contextlib
import fcntl
import gc
import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch
from kvt_peers import SPEC, Peer

from kv_transfer.backends import shm
from kv_transfer.blocks import BlockStore
from kv_transfer.control import recv_msg, send_msg, unix_path
from kv_transfer.errors import (
    ChecksumError,
    DeadlineExpiredError,
    FrameError,
    StaleEpochError,
    TransferError,
)
from kv_transfer.header import FLAG_IN_PLACE, FLAG_NO_CHECKSUM, FrameHeader, MsgType, frame_header
from kv_transfer.interface import StreamSendHandle
from kv_transfer.layout import KVLayout
from kv_transfer.peer import make_store
from kv_transfer.receiver_core import WINDOW_GRACE_SECONDS, ReceiveHandle, ReceiverCore
from kv_transfer.registered import Grant, shared_tensors, write_granted
from kv_transfer.state import TransferRequest, TransferState

SHAPE = (16, 2, 2, 4, 2, 8)  # [num_blocks, L, 2, bs, H, D]
BLOCK_BYTES = 2 * 2 * 4 * 2 * 8 * 4  # float32 KV of one block


def stores(scales: bool = False) -> tuple[BlockStore, BlockStore]:
    """(receiver store in shared memory, sender store with random blocks)."""
    scales_shape = SHAPE[:5] if scales else None
    cache, cache_scales, region = shared_tensors(SHAPE, torch.float32, scales_shape)
    receiver = BlockStore(cache, cache_scales, region=region)
    src_scales = torch.rand(SHAPE[:5]) if scales else None
    return receiver, BlockStore(torch.randn(SHAPE), src_scales)


def begin(core: ReceiverCore, tid: bytes, epoch: int, dst: list[int]) -> Grant:
    payload = torch.tensor(dst, dtype=torch.int32).numpy().tobytes()
    return Grant.decode(core.grant(frame_header(MsgType.BEGIN, tid, epoch, payload), payload))


def raw_registered(address: str, layout: KVLayout) -> tuple[socket.socket, int]:
    """A bare registered-mode connection to the shm receiver at `address` (a peer of our
    making): the socket after HELLO_ACK, and the cache's descriptor it was passed."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(unix_path(address))
    hello = layout.to_bytes() + b"\0" + json.dumps({"mode": "registered"}).encode()
    send_msg(conn, frame_header(MsgType.HELLO, bytes(16), 0, hello), hello)
    header, _ = recv_msg(conn, time.monotonic() + 10)
    assert header.msg_type is MsgType.HELLO_ACK
    _, fds, _, _ = socket.recv_fds(conn, 1, 1)
    assert len(fds) == 1
    return conn, fds[0]


def commit(
    tid: bytes, epoch: int, lo: int, n: int, checksum: int | None = None, size: int = BLOCK_BYTES
) -> FrameHeader:
    """The sender's commit of blocks lo..lo+n-1 (`size` bytes each)."""
    flags = FLAG_IN_PLACE | (FLAG_NO_CHECKSUM if checksum is None else 0)
    return FrameHeader(
        MsgType.FRAME, tid, epoch, frame_index=lo, frame_count=16, block_offset=lo,
        num_blocks=n, payload_len=n * size, checksum=checksum or 0, flags=flags,
    )  # fmt: skip


@pytest.mark.parametrize("scales", [False, True])
def test_one_copy_lands_bit_exact_and_only_in_granted_blocks(scales: bool) -> None:
    receiver, sender = stores(scales)
    core, tid, dst, src = ReceiverCore(receiver), os.urandom(16), [3, 9, 4], [7, 0, 15]
    before = receiver.cache.clone()
    handle = core.expect(TransferRequest(tid, 5), dst, time.monotonic() + 10)
    grant = begin(core, tid, 5, dst)
    kv, sc = receiver.region_offsets(torch.tensor(dst))  # the sender learns only these
    assert torch.equal(grant.kv, kv) and (sc is None or torch.equal(grant.scales, sc))
    assert receiver.region is not None
    ids = torch.tensor(src)
    digest = write_granted(sender.row_views(), receiver.region.bytes, grant, ids, 0, True)
    core.on_written(commit(tid, 5, 0, 3, digest, receiver.layout.bytes_per_block))
    core.on_end(frame_header(MsgType.END, tid, 5))
    assert handle.wait(1).state is TransferState.COMPLETED
    assert torch.equal(receiver.cache[dst], sender.cache[src])
    others = [i for i in range(16) if i not in dst]
    assert torch.equal(receiver.cache[others], before[others])
    if scales:
        assert receiver.scales is not None and sender.scales is not None
        assert torch.equal(receiver.scales[dst], sender.scales[src])


def _live(core: ReceiverCore, dst: list[int], seconds: float = 10) -> tuple:
    receiver_tid = os.urandom(16)
    handle = core.expect(TransferRequest(receiver_tid, 5), dst, time.monotonic() + seconds)
    return receiver_tid, handle, begin(core, receiver_tid, 5, dst)


@pytest.mark.parametrize(
    ("case", "error"),
    [
        ("stale_epoch", StaleEpochError),
        ("outside_window", FrameError),
        ("bad_checksum", ChecksumError),
        ("after_lease", DeadlineExpiredError),
    ],
)
def test_refused_commit_changes_nothing(case: str, error: type[TransferError]) -> None:
    receiver, sender = stores()
    core = ReceiverCore(receiver)
    tid, handle, grant = _live(core, [2, 3], seconds=0.3 if case == "after_lease" else 10)
    assert receiver.region is not None
    write_granted(sender.row_views(), receiver.region.bytes, grant, torch.tensor([5, 6]), 0, False)
    header = {
        "stale_epoch": commit(tid, 4, 0, 2),
        "outside_window": commit(tid, 5, 1, 2),
        "bad_checksum": commit(tid, 5, 0, 2, checksum=12345),
        "after_lease": commit(tid, 5, 0, 2),
    }[case]
    if case == "after_lease":
        time.sleep(0.35)
    with pytest.raises(error):
        core.on_written(header)
    expected = TransferState.EXPIRED if case == "after_lease" else TransferState.IN_FLIGHT
    assert handle.state is expected  # the lease ended it; a refused commit never does
    res = core._reservations.get(tid)
    assert res is None or (res.blocks_written == 0 and not res.frames_seen)
    if case != "after_lease":  # the honest commit still completes the transfer
        core.on_written(commit(tid, 5, 0, 2))
        core.on_end(frame_header(MsgType.END, tid, 5))
        assert handle.wait(1).state is TransferState.COMPLETED


def test_sender_stops_writing_when_its_window_expires() -> None:
    receiver, sender = stores()
    core = ReceiverCore(receiver)
    _, _, grant = _live(core, [1], seconds=0.03)  # less than the safety margin left
    assert receiver.region is not None
    before = receiver.cache.clone()
    with pytest.raises(TransferError, match="write window expired"):
        write_granted(sender.row_views(), receiver.region.bytes, grant, torch.tensor([0]), 0, False)
    assert torch.equal(receiver.cache, before)


def test_grant_needs_a_shared_cache() -> None:
    core = ReceiverCore(BlockStore(torch.zeros(SHAPE)))
    tid = os.urandom(16)
    core.expect(TransferRequest(tid, 1), [0], time.monotonic() + 5)
    with pytest.raises(FrameError, match="not in shared memory"):
        begin(core, tid, 1, [0])


def test_registered_mode_between_processes_and_staging_fallback() -> None:
    """A peer whose cache is shared serves registered mode (one copy into it); one whose cache
    is not refuses it (BackendUnavailableError), and `auto` falls back to staging slots."""
    spec = {**SPEC, "dtype": "bfloat16"}
    shared = Peer("shm", {**spec, "seed": 1})
    private = Peer("shm", {**spec, "seed": 2, "shared": False})
    try:
        refused = shared.call("connect", address=private.address, options={"mode": "registered"})
        assert refused["error"] == "BackendUnavailableError", refused
        for receiver, sender, mode in ((shared, private, "registered"), (private, shared, "auto")):
            connected = sender.call("connect", address=receiver.address, options={"mode": mode})
            assert connected == {"ok": True}
            t, src, dst = os.urandom(16).hex(), [1, 5, 2, 60], [7, 8, 9, 33]
            receiver.call("expect", tid=t, epoch=2, dst=dst, seconds=10)
            sent = sender.call("send", tid=t, epoch=2, src=src, dst=dst, seconds=10)
            assert sent["state"] == "COMPLETED", sent
            assert receiver.call("wait", tid=t)["state"] == "COMPLETED"
            assert receiver.call("digest", ids=dst) == sender.call("digest", ids=src)
    finally:
        shared.close()
        private.close()


def test_one_commit_of_many_pieces_between_processes() -> None:
    """By default one commit covers the whole transfer (sent with END) while the copy goes in
    pieces of 3 blocks: runs and scattered ids arrive exactly; a stale epoch is refused at
    BEGIN and writes nothing."""
    spec = {**SPEC, "dtype": "bfloat16"}
    receiver, sender = Peer("shm", {**spec, "seed": 1}), Peer("shm", {**spec, "seed": 2})
    try:
        options = {"mode": "registered", "piece_bytes": 3 * 2048}  # 3 blocks a piece
        assert sender.call("connect", address=receiver.address, options=options) == {"ok": True}
        src, dst = [*range(20, 36), 3, 1, 9], [*range(40, 50), 5, 7, *range(10, 17)]
        before = receiver.call("digest", ids=dst)
        t = os.urandom(16).hex()
        receiver.call("expect", tid=t, epoch=4, dst=dst, seconds=10)
        stale = sender.call("send", tid=t, epoch=3, src=src, dst=dst, seconds=10)
        assert (stale["state"], stale["error"]) == ("FAILED", "StaleEpochError"), stale
        assert receiver.call("digest", ids=dst) == before
        sender.call("connect", address=receiver.address, options=options)
        sent = sender.call("send", tid=t, epoch=4, src=src, dst=dst, seconds=10)
        assert sent["state"] == "COMPLETED", sent
        assert receiver.call("wait", tid=t)["state"] == "COMPLETED"
        assert receiver.call("digest", ids=dst) == sender.call("digest", ids=src) != before
    finally:
        sender.close()
        receiver.close()


def test_a_peer_cannot_resize_the_receivers_shared_cache() -> None:
    """The cache's memfd, which every same-uid sender is passed at the handshake, is sealed at
    its size: a peer's ftruncate is refused (shrunk, the receiver died of SIGBUS at its next
    touch of its own cache), and so is a seal of the peer's own (one barring writes would stop
    later senders from mapping the cache); the receiver goes on serving."""
    receiver = Peer("shm", SPEC)
    try:
        before = receiver.call("digest", ids=[0, 63])
        conn, fd = raw_registered(receiver.address, make_store({**SPEC, "shared": False}).layout)
        try:
            size = os.fstat(fd).st_size
            for smaller_or_larger in (0, size // 2, size * 2):
                with pytest.raises(PermissionError):
                    os.ftruncate(fd, smaller_or_larger)
            with pytest.raises(PermissionError):
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
            assert os.fstat(fd).st_size == size
        finally:
            os.close(fd)
            conn.close()
        assert receiver.call("digest", ids=[0, 63]) == before
    finally:
        receiver.close()


def test_cancel_revokes_a_granted_window_but_not_a_completed_one() -> None:
    receiver, _ = stores()
    core = ReceiverCore(receiver)
    revoked: list[bytes] = []
    handles = {}
    for name in ("cancelled", "completed"):
        tid = os.urandom(16)
        handles[name] = (
            tid,
            core.expect(TransferRequest(tid, 5), [name == "completed"], time.monotonic() + 10),
        )
        payload = torch.tensor([name == "completed"], dtype=torch.int32).numpy().tobytes()
        begin_header = frame_header(MsgType.BEGIN, tid, 5, payload)
        core.grant(begin_header, payload, revoke=lambda t=tid: revoked.append(t))
    tid, handle = handles["completed"]
    core.on_written(commit(tid, 5, 0, 1))
    core.on_end(frame_header(MsgType.END, tid, 5))
    for _, handle in handles.values():
        handle.cancel()
    assert revoked == [handles["cancelled"][0]]


@pytest.fixture
def early() -> Iterator[tuple[shm.Sender, shm.Receiver, threading.Event]]:
    """A registered-mode sender connected to a receiver on a Unix socket, whose transfer
    threads wait for the returned gate before they run at all."""
    receiver_store, sender_store = stores()
    receiver = shm.Receiver(receiver_store)
    sender = shm.Sender(sender_store, receiver.address, mode="registered")
    gate = threading.Event()
    drive = sender._drive
    sender._drive = lambda *args: (gate.wait(10), drive(*args))  # type: ignore[method-assign]
    yield sender, receiver, gate
    gate.set()
    sender.close()
    receiver.close()


def _named(
    sender: shm.Sender, receiver: shm.Receiver, seconds: float = 10
) -> tuple[bytes, ReceiveHandle, StreamSendHandle]:
    """A streamed transfer into blocks [3, 9, 4] started on `sender`, granted before its
    transfer thread ran (BEGIN went out from the starting thread)."""
    tid = os.urandom(16)
    got = receiver.expect(TransferRequest(tid, 5), [3, 9, 4], time.monotonic() + seconds)
    sent = sender.start_stream(TransferRequest(tid, 5), [3, 9, 4], deadline=time.monotonic() + 10)
    deadline = time.monotonic() + 5
    while got.state is TransferState.PENDING and time.monotonic() < deadline:
        time.sleep(0.005)
    assert got.state is TransferState.IN_FLIGHT  # the window is granted
    return tid, got, sent


def test_a_streamed_begin_is_granted_before_the_transfer_thread_runs(early: tuple) -> None:
    sender, receiver, gate = early
    _, got, sent = _named(sender, receiver)
    gate.set()
    sent.add(0, [7, 0, 15])
    sent.finish()
    assert sent.wait(5).ok and got.wait(5).ok
    assert torch.equal(receiver.store.cache[[3, 9, 4]], sender.store.cache[[7, 0, 15]])


def test_an_early_grant_cancelled_before_any_part_writes_nothing(early: tuple) -> None:
    """The producer fails after BEGIN, before any block: both sides end CANCELLED, the window
    is gone (a commit for it is refused) and no block changed."""
    sender, receiver, gate = early
    before = receiver.store.cache.clone()
    tid, got, sent = _named(sender, receiver)
    sent.cancel()
    gate.set()
    assert sent.wait(5).state is TransferState.CANCELLED
    assert got.wait(5).state is TransferState.CANCELLED
    with pytest.raises(TransferError):
        receiver.core.on_written(commit(tid, 5, 0, 3, size=receiver.layout.bytes_per_block))
    assert torch.equal(receiver.store.cache, before)


def test_an_early_grant_is_revoked_at_lease_end(early: tuple) -> None:
    """The lease ends while the producer still computes: the reservation expires, dropping it
    revokes the grant (the sender is told), and the parts that come later write nothing."""
    sender, receiver, gate = early
    before = receiver.store.cache.clone()
    tid, got, sent = _named(sender, receiver, seconds=0.3)
    gate.set()
    assert got.wait(5).state is TransferState.EXPIRED
    got.cancel()  # what the decode worker does with an expired reservation
    sent.add(0, [7, 0, 15])
    sent.finish()
    assert sent.wait(5).state is TransferState.CANCELLED  # the revoke, read before any write
    with pytest.raises(TransferError):
        receiver.core.on_written(commit(tid, 5, 0, 3, size=receiver.layout.bytes_per_block))
    assert torch.equal(receiver.store.cache, before)


def test_a_dead_connection_falls_back_to_begin_from_the_transfer_thread() -> None:
    """The early BEGIN cannot be written (the receiver went away while the sender was idle):
    the transfer thread reconnects and begins itself."""
    receiver_store, sender_store = stores()
    first = shm.Receiver(receiver_store)
    sender = shm.Sender(sender_store, first.address, mode="registered")
    assert sender._conn is not None
    sender._conn.shutdown(socket.SHUT_WR)  # writes on this connection now fail at once
    tid = os.urandom(16)
    try:
        got = first.expect(TransferRequest(tid, 5), [3], time.monotonic() + 10)
        sent = sender.start_stream(TransferRequest(tid, 5), [3], deadline=time.monotonic() + 10)
        sent.add(0, [8])
        sent.finish()
        assert sent.wait(5).ok and got.wait(5).ok
        assert torch.equal(receiver_store.cache[3], sender_store.cache[8])
    finally:
        sender.close()
        first.close()


def test_a_cancelled_window_stays_open_until_its_sender_stops() -> None:
    """Cancelling a granted transfer only asks its sender to stop: the handle is not `quiet`
    (its blocks may still change) until the sender's END, CANCEL or closed connection, or the
    lease plus the grace; a transfer never granted, or completed, is quiet at once."""
    receiver, _ = stores()
    core = ReceiverCore(receiver)
    woken: list[str] = []

    def granted(name: str, seconds: float = 10) -> tuple[bytes, ReceiveHandle]:
        tid = os.urandom(16)
        handle = core.expect(TransferRequest(tid, 5), [3], time.monotonic() + seconds)
        begin(core, tid, 5, [3])
        handle.when_quiet(lambda: woken.append(name))
        return tid, handle

    tid, handle = granted("stopped")
    assert not handle.quiet and handle.cancel() and not handle.quiet and woken == []
    core.window_closed(tid)  # the sender's CANCEL (or its connection closing) arrived
    assert handle.quiet and woken == ["stopped"]
    _, lapsed = granted("lapsed", seconds=0.5)
    lapsed.cancel()
    deadline = time.monotonic() + 0.5
    assert not lapsed.close_window_if_due(deadline + WINDOW_GRACE_SECONDS - 0.01)
    assert lapsed.close_window_if_due(deadline + WINDOW_GRACE_SECONDS + 0.01)
    assert woken == ["stopped", "lapsed"]
    tid, done = granted("completed")
    core.on_written(commit(tid, 5, 0, 1))
    core.on_end(frame_header(MsgType.END, tid, 5))
    assert done.quiet and woken[-1] == "completed"
    never = core.expect(TransferRequest(os.urandom(16), 5), [4], time.monotonic() + 10)
    never.cancel()
    assert never.quiet


def test_no_write_lands_after_a_cancelled_window_closes() -> None:
    """A sender process stopped in the middle of a copy into its window is cancelled: the
    window stays open while it cannot know, and once it closes (the sender read the revoke,
    finished the copy under way and stopped) no byte of the blocks changes any more."""
    shape = (96, 16, 2, 16, 8, 128)  # 1 MiB bfloat16 blocks: a copy spans many of them
    cache, _, region = shared_tensors(shape, torch.bfloat16)
    receiver = shm.Receiver(BlockStore(cache, None, model_id="test-model", region=region))
    spec = {"num_blocks": 96, "layers": 16, "block_size": 16, "heads": 8, "head_dim": 128}
    sender = Peer("shm", {**spec, "seed": 3, "shared": False, "dtype": "bfloat16"})
    rows = cache.view(96, -1)
    caught_open = 0
    try:
        for _ in range(4):
            caught_open += _cancel_mid_copy(receiver, sender, rows)
    finally:
        sender.close()
        receiver.close()
    assert caught_open  # the sender was stopped inside its window at least once


def _cancel_mid_copy(receiver: shm.Receiver, sender: Peer, rows: torch.Tensor) -> int:
    """One transfer cancelled with its sender paused as its copy began; 1 when the window was
    still open at the cancel. Asserts that nothing changes once the window closed."""
    sender.call("connect", address=receiver.address, options={"mode": "registered"})
    rows.zero_()
    tid = os.urandom(16)
    got = receiver.expect(TransferRequest(tid, 7), list(range(96)), time.monotonic() + 60)
    quiet = threading.Event()
    got.when_quiet(quiet.set)
    src = list(reversed(range(96)))  # not one run: a gathered copy, the slower kind
    sender.call("start", tid=tid.hex(), epoch=7, src=src, dst=list(range(96)), seconds=60)
    limit = time.monotonic() + 10
    while not bool(rows[0].any()) and time.monotonic() < limit:  # the first copy began
        pass
    os.kill(sender.proc.pid, signal.SIGSTOP)
    try:
        got.cancel()
        was_open = not got.quiet
    finally:
        os.kill(sender.proc.pid, signal.SIGCONT)
    assert quiet.wait(10)  # the sender stopped (and said so) well within its lease
    snapshot = rows.clone()
    time.sleep(0.3)
    assert torch.equal(rows, snapshot)
    return int(was_open)


def test_a_begin_of_a_partial_id_is_refused_and_ends_the_transfer() -> None:
    """A BEGIN whose destination ids are not whole int32 values is refused naming the field
    (a FrameError the connection answers, not a crash of its thread) and the transfer ends."""
    receiver, _ = stores()
    core = ReceiverCore(receiver)
    tid = os.urandom(16)
    handle = core.expect(TransferRequest(tid, 5), [3], time.monotonic() + 10)
    payload = b"\x03\x00\x00"
    with pytest.raises(FrameError, match="dst_block_ids"):
        core.grant(frame_header(MsgType.BEGIN, tid, 5, payload), payload)
    assert handle.state is TransferState.FAILED and handle.quiet


def _mapped_caches() -> int:
    """Descriptors of shared KV caches open in this process (a mapping holds one)."""
    found = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            found += "kvmesh-kv" in os.readlink(f"/proc/self/fd/{fd}")
    return found


def test_a_cancelled_transfer_unmaps_the_receivers_cache_when_its_sender_closes() -> None:
    """A sender whose transfer was cancelled unmaps the receiver's cache as it closes, not at
    some later full garbage collection (rare in a worker with a large heap: every request
    cancelled mid-transfer would keep another mapping of the whole cache until then)."""
    receiver_store, sender_store = stores()
    receiver = shm.Receiver(receiver_store)
    gc.disable()
    try:
        before = _mapped_caches()
        for _ in range(10):
            sender = shm.Sender(sender_store, receiver.address, mode="registered")
            _, _, sent = _named(sender, receiver)
            sent.cancel()
            assert sent.wait(5).state is TransferState.CANCELLED
            assert sent.thread is not None
            sent.thread.join(5)
            sender.close()
            del sender, sent
        assert _mapped_caches() == before
    finally:
        gc.enable()
        receiver.close()


class _ClosesWhileRead:
    """A reservation's `window_open` that, on its first read inside `when_quiet`, lets another
    thread close the window (the sender's reply to the CANCEL arriving right then), waiting
    for that thread at most `wait` s: a close that must wait for the record's lock stays
    behind the read."""

    def __init__(self, core: ReceiverCore, tid: bytes, wait: float) -> None:
        self.core, self.tid, self.wait = core, tid, wait
        self.closer: threading.Thread | None = None

    def read(self, res: object, open_now: bool) -> bool:
        if self.closer is None:
            self.closer = threading.Thread(target=self.core.window_closed, args=(self.tid,))
            self.closer.start()
            self.closer.join(self.wait)
        return open_now


def test_a_window_closing_while_a_quiet_callback_is_added_still_calls_it() -> None:
    """The decode worker fences a dropped request's blocks and lifts the fence from
    `when_quiet`: a window closed by the sender's connection thread between that call's check
    and its registration must still call it (before, the callback was lost and the blocks
    stayed fenced for good)."""
    receiver, _ = stores()
    core = ReceiverCore(receiver)
    tid = os.urandom(16)
    handle = core.expect(TransferRequest(tid, 5), [3], time.monotonic() + 10)
    begin(core, tid, 5, [3])
    handle.cancel()
    assert not handle.quiet
    res = handle._res
    hook = _ClosesWhileRead(core, tid, wait=0.5)
    real = type(res)

    class Hooked(real):  # type: ignore[misc, valid-type]
        def __getattribute__(self, name: str) -> object:
            value = super().__getattribute__(name)
            if name == "window_open" and sys._getframe(1).f_code.co_name == "settle":
                return hook.read(self, bool(value))
            return value

    res.__class__ = Hooked
    woken: list[int] = []
    handle.when_quiet(lambda: woken.append(1))
    assert hook.closer is not None
    hook.closer.join(5)
    res.__class__ = real
    assert handle.quiet and woken == [1]


def test_a_refused_cancel_from_another_connection_leaves_the_live_window_open() -> None:
    """A second registered sender naming a live transfer under an older generation is refused
    at BEGIN and sends CANCEL: that must change nothing (before, it closed the live sender's
    window and failed its transfer, so the blocks looked quiet while still being written)."""
    receiver_store, sender_store = stores()
    receiver = shm.Receiver(receiver_store)
    live = shm.Sender(sender_store, receiver.address, mode="registered")
    stale = shm.Sender(sender_store, receiver.address, mode="registered")
    tid = os.urandom(16)
    try:
        got = receiver.expect(TransferRequest(tid, 5), [3, 4], time.monotonic() + 30)
        sent = live.start_stream(TransferRequest(tid, 5), [3, 4], deadline=time.monotonic() + 30)
        wait_for(lambda: got.state is TransferState.IN_FLIGHT)
        refused = stale.start_stream(TransferRequest(tid, 4), [3, 4], deadline=time.monotonic() + 5)
        assert refused.wait(5).state is not TransferState.COMPLETED
        time.sleep(0.2)  # the CANCEL that followed the refusal was read by now
        assert got.state is TransferState.IN_FLIGHT and not got.quiet
        sent.add(0, [1, 2])
        sent.finish()
        assert sent.wait(5).state is TransferState.COMPLETED
        assert got.wait(5).state is TransferState.COMPLETED
        assert torch.equal(receiver_store.cache[[3, 4]], sender_store.cache[[1, 2]])
    finally:
        live.close()
        stale.close()
        receiver.close()


def wait_for(ready: Callable[[], bool], seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not ready():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)
