"""Routing: which prefill and decode workers serve a request.

Prefill: rendezvous hashing on the prompt's first block (salted by the cache salt) picks the
worker most likely to hold that prefix in its cache, unless its queue exceeds the least-loaded
worker's by more than `affinity_slack`; then the least-loaded one wins. A text or chat prompt
is routed before anyone tokenizes it, on its leading characters (`text_prefix_key`, about the
characters of the first block), as SGLang's cache-aware router does. Decode: workers with
enough free blocks for prompt + max_tokens first, then most free blocks, fewest running.
A prefill and a decode worker are paired only when their KV layouts are equal.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from control_plane.registry import WorkerRecord
from kvmesh.v1.transfer import BACKENDS

AFFINITY_BLOCKS = 1
CHARS_PER_TOKEN = 4  # a rough tokenizer average: how many characters a block's key covers
DEFAULT_TRANSFER_BACKENDS = BACKENDS  # every backend, in order of preference


class NoRouteError(Exception):
    """No worker set can serve the request; `code` is the gRPC status name to answer with."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code

    @property
    def status_name(self) -> str:
        return self.code


@dataclass(frozen=True)
class RoutingConfig:
    # Extra queued requests the affine prefill worker may carry over the least-loaded one.
    affinity_slack: int = 4
    affinity_blocks: int = AFFINITY_BLOCKS
    transfer_backends: tuple[str, ...] = DEFAULT_TRANSFER_BACKENDS


def prefix_key(prompt_ids: Sequence[int], block_size: int, salt: bytes, blocks: int = 1) -> bytes:
    """Digest of the prompt's first `blocks` full blocks (or the whole short prompt)."""
    head = list(prompt_ids[: max(1, block_size) * blocks])
    digest = hashlib.blake2b(salt, digest_size=16)
    digest.update(struct.pack(f"<{len(head)}i", *head))
    return digest.digest()


def text_prefix_key(parts: Sequence[str], block_size: int, salt: bytes, blocks: int = 1) -> bytes:
    """Digest of the first characters of a prompt given as text `parts` (the text; or a
    conversation's roles and contents in order), about as many as `blocks` blocks of tokens."""
    budget = max(1, block_size) * blocks * CHARS_PER_TOKEN
    digest = hashlib.blake2b(salt, digest_size=16, person=b"text")
    for part in parts:
        head = part[:budget].encode()
        digest.update(struct.pack("<I", len(head)) + head)
        budget -= min(budget, len(part))
        if budget == 0:
            break
    return digest.digest()


def rendezvous_order(key: bytes, workers: Sequence[WorkerRecord]) -> list[WorkerRecord]:
    """Highest-random-weight order: stable per key, minimal movement when workers change."""

    def weight(worker: WorkerRecord) -> bytes:
        return hashlib.blake2b(key + worker.worker_id.encode(), digest_size=8).digest()

    return sorted(workers, key=weight, reverse=True)


def order_prefill(
    workers: Sequence[WorkerRecord], key: bytes, config: RoutingConfig
) -> list[WorkerRecord]:
    """Prefill candidates, best first: the affine worker unless overloaded, then by load."""
    if not workers:
        return []
    affine = rendezvous_order(key, workers)[0]
    by_load = sorted(workers, key=lambda w: (w.load.queue, w.worker_id))
    if affine.load.queue - by_load[0].load.queue > config.affinity_slack:
        return by_load
    return [affine, *[w for w in by_load if w is not affine]]


def affinity_key(
    prompt_ids: Sequence[int],
    text: Sequence[str],
    block_size: int,
    salt: bytes,
    config: RoutingConfig,
) -> bytes:
    """The prefix-affinity key of a prompt: its leading `text` when given (not yet tokenized),
    else its first token ids."""
    if text:
        return text_prefix_key(text, block_size, salt, config.affinity_blocks)
    return prefix_key(prompt_ids, block_size, salt, config.affinity_blocks)


def order_colocated(
    workers: Sequence[WorkerRecord],
    prompt_ids: Sequence[int],
    salt: bytes,
    config: RoutingConfig,
    text: Sequence[str] = (),
) -> list[WorkerRecord]:
    """Colocated candidates, best first, ordered as prefill workers are: the worker affine to
    the prompt's prefix (whose prefix cache holds it) unless it is overloaded, then by load."""
    if not workers:
        return []
    block_size = workers[0].layout.block_size
    return order_prefill(workers, affinity_key(prompt_ids, text, block_size, salt, config), config)


def order_decode(workers: Sequence[WorkerRecord], needed_blocks: int) -> list[WorkerRecord]:
    """Decode candidates, best first: enough free blocks, most free blocks, fewest running."""
    return sorted(
        workers,
        key=lambda w: (
            w.load.free_blocks < needed_blocks,
            -w.load.free_blocks,
            w.load.queue,
            w.worker_id,
        ),
    )


def common_backend(
    prefill: WorkerRecord, decode: WorkerRecord, preference: Sequence[str]
) -> str | None:
    """First preferred backend the decode worker receives on (and the prefill worker lists,
    when it lists any)."""
    offered = prefill.info.transfer_endpoints
    for backend in preference:
        if backend in decode.info.transfer_endpoints and (not offered or backend in offered):
            return backend
    return None


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // max(1, block_size))


def order_pairs(
    prefills: Sequence[WorkerRecord],
    decodes: Sequence[WorkerRecord],
    prompt_ids: Sequence[int],
    max_tokens: int,
    salt: bytes,
    config: RoutingConfig,
    text: Sequence[str] = (),
) -> list[tuple[WorkerRecord, WorkerRecord]]:
    """Compatible (prefill, decode) pairs, best first: equal layouts and a common transfer
    backend. Prefill affinity is on `prompt_ids`, or on `text` (a prompt not yet tokenized).

    Raises NoRouteError: UNAVAILABLE when a role has no live worker, FAILED_PRECONDITION when
    no prefill worker's layout equals any decode worker's, or they share no transfer backend.
    """
    if not prefills or not decodes:
        missing = "prefill" if not prefills else "decode"
        raise NoRouteError("UNAVAILABLE", f"no live {missing} worker is registered")
    block_size = prefills[0].layout.block_size
    key = affinity_key(prompt_ids, text, block_size, salt, config)
    ordered_decodes = order_decode(decodes, blocks_needed(len(prompt_ids) + max_tokens, block_size))
    pairs = [
        (p, d)
        for p in order_prefill(prefills, key, config)
        for d in ordered_decodes
        if p.layout == d.layout
    ]
    if not pairs:
        raise NoRouteError(
            "FAILED_PRECONDITION",
            "worker.layout: no prefill worker's KV cache layout matches a decode worker's",
        )
    pairs = [(p, d) for p, d in pairs if common_backend(p, d, config.transfer_backends)]
    if not pairs:
        raise NoRouteError(
            "FAILED_PRECONDITION",
            "worker.transfer_endpoints: no prefill and decode worker share a KV transfer backend",
        )
    return pairs
