"""Simulator speed: 100k ShareGPT-like requests through one llama-3.1-8b / h100-sxm replica.

Chunked scheduler, rate near saturation. Prints requests/s and iterations/s of simulation and
peak memory (ru_maxrss). Target (issue 2): 100k requests in under 15 s on one core, < 1 GB.

    python benchmarks/sim_speed.py [--requests 100000] [--rate 9] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import resource
import time

from servesim.sim.scenario import scenario_from_dict
from servesim.sim.simulate import simulate
from servesim.sim.workload import generate_requests


def scenario(n: int, rate: float):
    return scenario_from_dict({
        "name": "sim-speed",
        "seed": 0,
        "model": "llama-3.1-8b",
        "hardware": "h100-sxm",
        "scheduler": {"type": "chunked", "max_num_seqs": 256, "max_num_batched_tokens": 8192},
        "workload": {
            "num_requests": n,
            "arrival": {"process": "poisson", "rate": rate},
            "prompt_len": {"dist": "lognormal", "mean": 1000, "std": 1000, "min": 4, "max": 16000},
            "output_len": {"dist": "lognormal", "mean": 250, "std": 250, "min": 1, "max": 4000},
        },
    })


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=100_000)
    ap.add_argument("--rate", type=float, default=22.0, help="requests/s (near saturation by default)")
    ap.add_argument("--profile", action="store_true", help="cProfile the run and print the top functions")
    args = ap.parse_args()
    sc = scenario(args.requests, args.rate)
    t0 = time.perf_counter()
    reqs = generate_requests(sc.workload, sc.seed)
    t_gen = time.perf_counter() - t0
    prof = cProfile.Profile() if args.profile else None
    t1 = time.perf_counter()
    if prof:
        prof.enable()
    res = simulate(sc, requests=reqs, progress=False)
    if prof:
        prof.disable()
    t_sim = time.perf_counter() - t1
    iters = len(res.iterations_df)
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    s = res.summary
    print(f"{'requests':>10} {'iterations':>10} {'gen s':>7} {'sim s':>7} {'req/s':>9} {'iter/s':>9} {'peak MB':>8}")
    print(f"{args.requests:>10} {iters:>10} {t_gen:>7.2f} {t_sim:>7.2f} {args.requests / t_sim:>9.0f} "
          f"{iters / t_sim:>9.0f} {rss_mb:>8.0f}")
    print(f"simulated {s['duration_s']:.0f} s of traffic: {s['request_throughput']:.2f} req/s served "
          f"(offered {args.rate}), mean batch {s['mean_batch_size']:.1f}, p99 TTFT {s['p99_ttft_ms']:.0f} ms, "
          f"p99 TPOT {s['p99_tpot_ms']:.1f} ms, preemptions {s['num_preemptions']}")
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
