"""How long a torch `TCPStore` client takes to connect to a fresh store on loopback.

The gloo backend's rendezvous is a `TCPStore` (`kv_transfer.backends.gloo`): a sender makes a
client of the receiver's store for every new link, and the receiver's accept loop makes its own
clients. Each trial here starts a store, connects `--clients` clients to it, the first blocked
in `queue_pop` (as the accept loop's waiter is), stops that store, starts another and times one
client's connect to it, for
each server backend (`use_libuv` on and off). It prints every connect over `--slow` seconds and
a summary (JSON) per backend: trials, slow connects, median and worst seconds.

Run: `.venv/bin/python bench/store_connect.py --trials 60 [--clients 3]`
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import threading
import time
from typing import Any

import torch.distributed as dist

TIMEOUT = datetime.timedelta(seconds=30)


def new_store(libuv: bool) -> Any:
    return dist.TCPStore(
        "127.0.0.1", 0, None, True, TIMEOUT, wait_for_workers=False, use_libuv=libuv
    )


def block_in_pop(client: Any) -> None:
    """A client waiting on the store's queue until its server goes away (or 3 s pass)."""
    client.set_timeout(datetime.timedelta(seconds=3))
    try:
        client.queue_pop("queue")
    except Exception:  # the store stopped under it: expected
        return


def one_trial(libuv: bool, clients: int) -> float:
    """Seconds one client took to connect to a store started right after another stopped."""
    old = new_store(libuv)
    held = [old.clone() for _ in range(clients)]
    threading.Thread(target=block_in_pop, args=(held[0],), daemon=True).start()
    time.sleep(0.05)
    del old  # the server stops with its clients still connected
    fresh = new_store(libuv)
    started = time.monotonic()
    client = dist.TCPStore("127.0.0.1", fresh.port, None, False, TIMEOUT, wait_for_workers=False)
    took = time.monotonic() - started
    del client, fresh, held
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=60)
    parser.add_argument("--slow", type=float, default=1.0, help="seconds that count as slow")
    parser.add_argument("--clients", type=int, default=1, help="clients of the stopped store")
    args = parser.parse_args()
    for libuv in (True, False):
        times = []
        for trial in range(args.trials):
            took = one_trial(libuv, max(1, args.clients))
            times.append(took)
            if took > args.slow:
                print(f"libuv={libuv} trial {trial}: connect took {took:.3f} s", flush=True)
        summary = {
            "use_libuv": libuv,
            "trials": args.trials,
            "clients": args.clients,
            "slow": sum(t > args.slow for t in times),
            "median_s": round(statistics.median(times), 4),
            "worst_s": round(max(times), 3),
        }
        print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
