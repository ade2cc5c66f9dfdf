"""Requests of the serving benchmark: the workloads of docs/BENCHMARK_SUITE.md, or a JSONL trace.

Synthetic prompts are token ids drawn with `random.Random(seed)` (`randrange(10, vocab - 10)`),
so their lengths are exact on any server that accepts token-id prompts; `as_text` decodes them
with the server's tokenizer where a text prompt is needed (chat). Every request is greedy with
EOS ignored, so it generates exactly `output_len` tokens.

- w1: prompt `randint(32, 512)`, output `randint(16, 256)`.
- w2: prompt `randint(64, 1024)`, output `randint(64, 1024)` (W2's length mix on a real server).
- w3: one 500-token system prompt + a unique suffix of `randint(16, 128)`, output 32;
  w3-unique: the same shape with every prompt unique.
- w4: `steady` requests (prompt 128, output 512) at time 0, then `long` prompts of 2048 tokens
  (output 16) one every `interval` seconds: its own arrival schedule (`BenchRequest.at`).
- trace: one JSON object a line: `prompt` (text or token ids) or `prompt_len` (synthetic ids),
  `output_len` (or `max_tokens`), optional `at` (seconds after the start).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

WORKLOADS = ("w1", "w2", "w3", "w3-unique", "w4", "trace")


class WorkloadError(ValueError):
    """A workload or trace that cannot be built; the message names the flag or trace line."""


@dataclass(frozen=True)
class BenchRequest:
    """One request to send: token ids or text, the exact number of tokens to generate, and
    (for workloads with a schedule of their own) when to send it."""

    prompt: list[int] | str
    output_len: int
    prompt_len: int
    at: float | None = None  # seconds after the start; None: the arrival process decides
    group: str = "all"  # W4: "steady" or "long"


@dataclass(frozen=True)
class W4Shape:
    steady: int = 16
    steady_prompt: int = 128
    steady_output: int = 512
    long: int = 8
    long_prompt: int = 2048
    long_output: int = 16
    interval: float = 2.0

    def scaled(self, scale: float) -> W4Shape:
        """Every prompt and output length multiplied by `scale` (at least 1 token)."""

        def s(n: int) -> int:
            return max(1, round(n * scale))

        return replace(self, steady_prompt=s(self.steady_prompt),
                       steady_output=s(self.steady_output), long_prompt=s(self.long_prompt),
                       long_output=s(self.long_output))  # fmt: skip


def _ids(rng: random.Random, vocab: int, n: int) -> list[int]:
    return [rng.randrange(10, vocab - 10) for _ in range(n)]


def _plain(prompt: list[int], output_len: int, group: str = "all") -> BenchRequest:
    return BenchRequest(prompt, output_len, len(prompt), group=group)


def mixed(vocab: int, count: int, prompt: tuple[int, int], output: tuple[int, int], seed: int,
          scale: float) -> list[BenchRequest]:  # fmt: skip
    """W1/W2: for each request in order a prompt length, an output length, then the ids."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        prompt_len, output_len = rng.randint(*prompt), rng.randint(*output)
        ids = _ids(rng, vocab, max(1, round(prompt_len * scale)))
        out.append(_plain(ids, max(1, round(output_len * scale))))
    return out


def shared_prefix(
    vocab: int, count: int, shared: bool, seed: int, scale: float
) -> list[BenchRequest]:
    """W3 (shared 500-token system prompt) or W3-unique (every head unique)."""
    rng = random.Random(seed)
    head_len = max(1, round(500 * scale))
    system = _ids(rng, vocab, head_len)
    out = []
    for _ in range(count):
        head = system if shared else _ids(rng, vocab, head_len)
        suffix = _ids(rng, vocab, max(1, round(rng.randint(16, 128) * scale)))
        out.append(_plain(head + suffix, max(1, round(32 * scale))))
    return out


def w4(vocab: int, shape: W4Shape, seed: int) -> list[BenchRequest]:
    """W4: steady decoders at time 0, long prompts every `interval` seconds from time 0."""
    rng = random.Random(seed)
    steady = [replace(_plain(_ids(rng, vocab, shape.steady_prompt), shape.steady_output,
                             "steady"), at=0.0) for _ in range(shape.steady)]  # fmt: skip
    long = [replace(_plain(_ids(rng, vocab, shape.long_prompt), shape.long_output, "long"),
                    at=i * shape.interval) for i in range(shape.long)]  # fmt: skip
    return steady + long


def build(
    name: str, vocab: int, count: int | None = None, seed: int = 0, scale: float = 1.0,
    shape: W4Shape | None = None, trace: str | None = None,
) -> list[BenchRequest]:  # fmt: skip
    """The requests of workload `name` (WorkloadError for an unknown name or a bad trace)."""
    if scale <= 0:
        raise WorkloadError(f"--scale must be > 0, got {scale}")
    if count is not None and count <= 0:
        raise WorkloadError(f"--num-requests must be > 0, got {count}")
    builders: dict[str, Callable[[], list[BenchRequest]]] = {
        "w1": lambda: mixed(vocab, count or 64, (32, 512), (16, 256), seed, scale),
        "w2": lambda: mixed(vocab, count or 64, (64, 1024), (64, 1024), seed, scale),
        "w3": lambda: shared_prefix(vocab, count or 64, True, seed, scale),
        "w3-unique": lambda: shared_prefix(vocab, count or 64, False, seed, scale),
        "w4": lambda: w4(vocab, (shape or W4Shape()).scaled(scale), seed),
        "trace": lambda: load_trace(trace, vocab, seed, count),
    }
    if name not in builders:
        raise WorkloadError(f"--workload must be one of {', '.join(WORKLOADS)}; got {name!r}")
    return builders[name]()


def load_trace(path: str | None, vocab: int, seed: int, count: int | None) -> list[BenchRequest]:
    """Requests of a JSONL trace (see the module docstring), at most `count` of them."""
    if not path:
        raise WorkloadError("--workload trace needs --trace FILE")
    rng = random.Random(seed)
    out = []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as error:
        raise WorkloadError(f"--trace {path}: {error.strerror}") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            out.append(_trace_request(json.loads(line), rng, vocab))
        except (ValueError, TypeError, KeyError) as error:
            raise WorkloadError(f"--trace {path} line {number}: {error}") from None
        if count is not None and len(out) == count:
            break
    if not out:
        raise WorkloadError(f"--trace {path}: no requests")
    return out


def _trace_request(item: dict[str, Any], rng: random.Random, vocab: int) -> BenchRequest:
    output_len = int(item.get("output_len", item.get("max_tokens", 0)))
    if output_len <= 0:
        raise ValueError("output_len (or max_tokens) must be a positive integer")
    prompt = item.get("prompt")
    if prompt is None:
        prompt = _ids(rng, vocab, int(item["prompt_len"]))
    if not prompt or not (isinstance(prompt, str) or all(isinstance(t, int) for t in prompt)):
        raise ValueError("prompt must be non-empty text or a list of token ids")
    at = item.get("at")
    prompt_len = int(item.get("prompt_len", len(prompt)))
    return BenchRequest(prompt, output_len, prompt_len, None if at is None else float(at))


def as_text(requests: list[BenchRequest], tokenizer: Any) -> list[BenchRequest]:
    """Token-id prompts decoded to text with `tokenizer` (prompt_len kept: the ids drawn)."""
    return [r if isinstance(r.prompt, str) else replace(r, prompt=tokenizer.decode(r.prompt))
            for r in requests]  # fmt: skip


def vocab_of(model_dir: str) -> int:
    """The vocabulary size of a checkpoint folder's config.json."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return int(config["vocab_size"])
