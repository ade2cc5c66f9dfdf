"""What a gloo link's handshake leaves in the receiver's `TCPStore`, and how each side proves
the cluster token in it.

Keys of link `ID`, all under `scope(ID)`: `hello` (the sender's HELLO), `ack` (the receiver's
answer) and the keys the two-rank group's rendezvous writes through its `PrefixStore`
(`GROUP_KEYS`). Whoever reaches the store can read and write them: the store has no
authentication of its own.

Proof of the token (version 1, only where both sides hold one): a HELLO's extras (the JSON
object after the layout's NUL) and the ack (a JSON object) each carry
`"auth": {"v": 1, "mac": HEX}`, an HMAC-SHA256 keyed with the token over what it answers for
(`hello` or `ack`), the link id, the layout bytes (HELLO) and the object without `"auth"` in
canonical JSON (sorted keys, no spaces). A side without a token adds none and checks none; a
side with one accepts only a valid entry of this version. A signed HELLO also carries its
sender's wall-clock time (`"t"`, `stamped`): the receiver takes it only within REPLAY_SECONDS of
its own clock and only once per link id (`Served`), so a HELLO read from the store and pushed
again is dropped. The proof keeps out whoever does not hold the token; it does not hide or bind
what travels after it (the group's rendezvous keys, the frames), and a HELLO popped from the
queue before the receiver saw it can still be used once, within the window.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import time
from typing import Any

import torch

AUTH_VERSION = 1
# What a two-rank gloo group's rendezvous leaves in its PrefixStore (each rank's address);
# measured on torch 2.13. NCCL groups write theirs at their first operation, not listed here.
GROUP_KEYS = ("0/0", "0/1")


# How far a signed HELLO's time may be from the receiver's clock (hosts' clocks agree to well
# within it), and so how long the receiver remembers the link ids it served.
REPLAY_SECONDS = 60.0


def stamped(fields: dict[str, Any]) -> dict[str, Any]:
    """`fields` with the sender's wall-clock time, to be signed with them."""
    return {**fields, "t": time.time()}


def fresh(fields: dict[str, Any], now: float) -> bool:
    """Whether a HELLO's signed time `t` lies within REPLAY_SECONDS of `now` (wall clock)."""
    sent = fields.get("t")
    ok_type = isinstance(sent, (int, float)) and not isinstance(sent, bool)
    return ok_type and abs(now - float(sent)) <= REPLAY_SECONDS  # type: ignore[arg-type]


class Served:
    """The link ids a receiver accepted a HELLO for, each kept while a copy of that HELLO could
    still be fresh (twice REPLAY_SECONDS); used by the receiver's one accept thread."""

    def __init__(self) -> None:
        self._seen: dict[str, float] = {}  # link id -> monotonic time first accepted

    def first(self, link_id: str, now: float) -> bool:
        """Record `link_id` at monotonic `now`; False when it was already accepted."""
        horizon = now - 2 * REPLAY_SECONDS
        for old in [k for k, at in self._seen.items() if at < horizon]:
            del self._seen[old]
        if link_id in self._seen:
            return False
        self._seen[link_id] = now
        return True


def scope(link_id: str) -> str:
    """The prefix of every key of link `link_id`."""
    return f"kvmesh/link/{link_id}/"


def forget(client: Any, link_id: str) -> None:
    """Delete what link `link_id` left in the store `client` reaches: its HELLO, its ack and its
    group's rendezvous keys. Never raises (a store that stopped took them along)."""
    prefix = scope(link_id)
    with contextlib.suppress(Exception):
        for key in ("hello", "ack"):
            client.delete_key(prefix + key)
        group = torch.distributed.PrefixStore(prefix, client)
        for key in GROUP_KEYS:
            group.delete_key(key)


def _mac(token: str, what: str, link_id: str, head: bytes, fields: dict[str, Any]) -> str:
    rest = {k: v for k, v in fields.items() if k != "auth"}
    body = json.dumps(rest, sort_keys=True, separators=(",", ":")).encode()
    message = b"\0".join([f"kvmesh-gloo-{what}-v{AUTH_VERSION}".encode(), link_id.encode(),
                          head, body])  # fmt: skip
    return hmac.new(token.encode(), message, hashlib.sha256).hexdigest()


def sign(
    token: str | None, what: str, link_id: str, head: bytes, fields: dict[str, Any]
) -> dict[str, Any]:
    """`fields` with the proof of `token` for `what` ("hello" or "ack") of `link_id` added;
    `fields` unchanged when `token` is None."""
    if not token:
        return fields
    return {**fields, "auth": {"v": AUTH_VERSION, "mac": _mac(token, what, link_id, head, fields)}}


def verified(
    token: str | None, what: str, link_id: str, head: bytes, fields: dict[str, Any]
) -> bool:
    """Whether `fields` prove `token` for `what` of `link_id` (constant-time comparison);
    always True when `token` is None."""
    if not token:
        return True
    auth = fields.get("auth")
    if not isinstance(auth, dict) or auth.get("v") != AUTH_VERSION:
        return False
    mac = auth.get("mac")
    expected = _mac(token, what, link_id, head, fields)
    return isinstance(mac, str) and hmac.compare_digest(mac.encode(), expected.encode())
