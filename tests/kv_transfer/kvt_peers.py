"""Drive `python -m kv_transfer.peer` processes from tests: JSON lines with deadlines."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SPEC = {"num_blocks": 64, "layers": 2, "block_size": 8, "heads": 2, "head_dim": 16}


class Peer:
    """One peer process; every reply is awaited with a timeout (no test can hang)."""

    def __init__(self, backend: str, store: dict[str, Any], **config: Any) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        arg = json.dumps({"backend": backend, "store": store, **config})
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kv_transfer.peer", arg],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=env,
        )
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.address: str = self.read(60)["address"]

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)

    def read(self, timeout: float = 30) -> dict[str, Any]:
        try:
            return json.loads(self._lines.get(timeout=timeout))
        except queue.Empty:
            raise AssertionError(f"peer gave no answer within {timeout}s") from None

    def call(self, op: str, timeout: float = 30, **args: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        return self.read(timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(AssertionError, BrokenPipeError, OSError):
                self.call("quit", timeout=0.1)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
