"""Scheduler + bookkeeping cost per iteration at a given number of running sequences.

Live mode spends this CPU time between forward passes, so it must stay far below a step's
duration. Drives the chunked (and continuous) scheduler with N decoding requests and times
schedule() + update() over many steps; no model, no SimPy. Target (issue 4): < 1 ms per
iteration at 256 running sequences.

    python benchmarks/sched_overhead.py [--running 64 256] [--steps 2000]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from servesim.sim.kv_cache import BlockManager
from servesim.sim.request import Request
from servesim.sim.schedulers import make_scheduler, policy_config


def measure(kind: str, running: int, steps: int) -> tuple[float, float]:
    kv = BlockManager(200_000, 16)
    sched = make_scheduler(policy_config(type=kind, max_num_seqs=running, max_num_batched_tokens=8192), kv)
    rng = np.random.default_rng(0)
    # outputs long enough that nobody finishes during the measurement; a few prefills join too
    for i in range(running):
        sched.add(Request(i, 0.0, int(rng.integers(64, 512)), steps + 10))
    now = 0.0
    while sched.num_waiting:  # admit and prefill everyone first
        batch = sched.schedule(now)
        now += 0.01
        sched.update(batch, now)
    times = np.empty(steps)
    for k in range(steps):
        t0 = time.perf_counter()
        batch = sched.schedule(now)
        now += 0.01
        sched.update(batch, now)
        times[k] = time.perf_counter() - t0
        assert batch.size == running
    return float(np.median(times) * 1e3), float(np.percentile(times, 99) * 1e3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--running", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--steps", type=int, default=2000)
    args = ap.parse_args()
    print(f"{'scheduler':<11} {'running':>7} {'median ms/iter':>15} {'p99 ms/iter':>12}")
    for kind in ("chunked", "continuous"):
        for n in args.running:
            med, p99 = measure(kind, n, args.steps)
            print(f"{kind:<11} {n:>7} {med:>15.3f} {p99:>12.3f}")


if __name__ == "__main__":
    main()
