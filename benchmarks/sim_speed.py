"""Simulator speed and memory at scale, through the code path of ``servesim run --no-plots``.

Two workloads on one llama-3.1-8b replica with the chunked scheduler:

- ``sharegpt``: ShareGPT-like lengths (lognormal prompts mean 1000, outputs mean 250) on an
  h100-sxm near saturation (22 req/s, 256 seqs, 8192-token steps): big batches, a prefill chunk in
  most steps.
- ``conv``: conversation lengths shaped like the Splitwise / Azure 2023 conversation trace
  (lognormal prompts mean 1155, outputs mean 211) at 6 req/s on an a100-80g with 512-token chunks:
  low load, small batches, many steps per request as first set up; since the roofline prices the
  A100's chunk steps as FA2's varlen kernel runs them (sim/varlen_attention.py) the replica runs
  near its capacity there (~3 steps per request, mixed steps of ~77 rows).

The run is ``simulate`` (the workload generated inside, as ``servesim run`` does) then
``write_results`` without plots into a temporary folder; the wall time includes loading the
compiled step loops that ``simulate`` turns on for large runs (sim/row_kernels.py) and, in the
compiled engine's class (both workloads here), the compiled engine (sim/compiled_engine.py);
``--engine python`` measures the Python engine on the same run. Prints wall
and CPU seconds (simulate + write; on a shared machine the CPU seconds move less), peak RSS
(ru_maxrss), engine steps, and wall µs per step and per request.

``--preset NAME`` replaces the chunked scheduler with an engine preset at its defaults (its own
KV block size and prefix caching: SGLang's page size 1, Transformers' 256-token blocks), the same
traffic otherwise. ``--replicas N`` puts N such replicas behind ``--router`` (default
round_robin); ``--rate`` is then the cluster's (give N times a replica's rate for the same load
per replica). ``--async-scheduling`` turns vLLM V1's async scheduling on (the scheduler's or
the preset's ``async_scheduling``).

    python benchmarks/sim_speed.py --workload sharegpt|conv [--requests 100000] [--rate R] [--profile]
        [--iterations auto|full|binned|off] [--plain] [--engine auto|python|compiled]
        [--preset vllm-v1|sglang|tensorrt-llm|...]
        [--replicas N] [--router round_robin|least_outstanding|...] [--async-scheduling]
"""

from __future__ import annotations

import argparse
import cProfile
import inspect
import pstats
import resource
import tempfile
import time

from servesim.sim.scenario import scenario_from_dict
from servesim.sim.simulate import simulate, write_results

WORKLOADS = {
    "sharegpt": {
        "hardware": "h100-sxm",
        "scheduler": {"type": "chunked", "max_num_seqs": 256, "max_num_batched_tokens": 8192},
        "rate": 22.0,
        "prompt_len": {"dist": "lognormal", "mean": 1000, "std": 1000, "min": 4, "max": 16000},
        "output_len": {"dist": "lognormal", "mean": 250, "std": 250, "min": 1, "max": 4000},
    },
    "conv": {
        "hardware": "a100-80g",
        "scheduler": {"type": "chunked", "max_num_seqs": 256, "max_num_batched_tokens": 512},
        "rate": 6.0,
        "prompt_len": {"dist": "lognormal", "mean": 1155, "std": 1109, "min": 4, "max": 16000},
        "output_len": {"dist": "lognormal", "mean": 211, "std": 240, "min": 1, "max": 4000},
    },
}


def scenario(workload: str, n: int, rate: float | None, preset: str | None = None, replicas: int = 1,
             router: str = "round_robin", async_scheduling: bool = False):
    w = WORKLOADS[workload]
    sched = {"preset": preset} if preset else dict(w["scheduler"])
    if async_scheduling:
        sched["async_scheduling"] = True
    return scenario_from_dict({
        "cluster": {"num_replicas": replicas, "router": router},
        "name": f"sim-speed-{workload}",
        "seed": 0,
        "model": "llama-3.1-8b",
        "hardware": w["hardware"],
        "scheduler": sched,
        "workload": {
            "num_requests": n,
            "arrival": {"process": "poisson", "rate": rate or w["rate"]},
            "prompt_len": w["prompt_len"],
            "output_len": w["output_len"],
        },
    })


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="sharegpt")
    ap.add_argument("--requests", type=int, default=100_000)
    ap.add_argument("--rate", type=float, default=None, help="requests/s (default: the workload's)")
    ap.add_argument("--iterations", choices=["auto", "full", "binned", "off"], default=None,
                    help="iterations.parquet mode (default: simulate's, full; servesim run's is auto)")
    ap.add_argument("--plain", action="store_true",
                    help="the Python engine without fast-forward: every step through schedule/update")
    ap.add_argument("--engine", choices=["auto", "python", "compiled"], default="auto",
                    help="auto: what simulate picks (servesim run's path); python / compiled: that engine")
    ap.add_argument("--profile", action="store_true", help="cProfile the run and print the top functions")
    ap.add_argument("--preset", default=None, help="an engine preset at its defaults instead of the chunked scheduler")
    ap.add_argument("--replicas", type=int, default=1, help="replicas behind the router (--rate is the cluster's)")
    ap.add_argument("--router", default="round_robin", help="the cluster's router (with --replicas)")
    ap.add_argument("--async-scheduling", action="store_true",
                    help="vLLM V1's async scheduling on (the chunked scheduler's or the preset's knob)")
    args = ap.parse_args()
    try:
        sc = scenario(args.workload, args.requests, args.rate, args.preset, args.replicas, args.router,
                      args.async_scheduling)
    except ValueError as e:  # a ScenarioError: an unknown preset, a bad rate
        raise SystemExit(f"sim_speed.py: {e}") from None
    if args.plain and args.engine == "compiled":
        raise SystemExit("sim_speed.py: --plain runs the Python engine; drop --engine compiled")
    sim_kw: dict = {"fast_forward": False, "compiled": False} if args.plain else {}
    if args.engine != "auto":
        if "compiled" not in inspect.signature(simulate).parameters:
            raise SystemExit("this servesim has no compiled engine")
        sim_kw["compiled"] = args.engine == "compiled"
    if args.iterations is not None:
        if "iterations" not in inspect.signature(simulate).parameters:
            raise SystemExit("this servesim has no --iterations")
        sim_kw["iterations"] = args.iterations
    prof = cProfile.Profile() if args.profile else None
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        c0 = time.process_time()
        if prof:
            prof.enable()
        res = simulate(sc, progress=False, **sim_kw)
        t_sim = time.perf_counter() - t0
        write_results(res, tmp, plots=False)
        if prof:
            prof.disable()
        wall = time.perf_counter() - t0
        cpu = time.process_time() - c0
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    s = res.summary
    steps = s["num_iterations"]
    print(f"{'workload':>9} {'requests':>9} {'steps':>9} {'sim s':>7} {'wall s':>7} {'cpu s':>7} {'peak MB':>8} "
          f"{'us/step':>8} {'us/req':>8}")
    print(f"{args.workload:>9} {args.requests:>9} {steps:>9} {t_sim:>7.2f} {wall:>7.2f} {cpu:>7.2f} {rss_mb:>8.0f} "
          f"{1e6 * wall / max(steps, 1):>8.2f} {1e6 * wall / args.requests:>8.1f}")
    print(f"simulated {s['duration_s']:.0f} s of traffic: {s['request_throughput']:.2f} req/s served, "
          f"mean batch {s['mean_batch_size']:.1f}, p99 TTFT {s['p99_ttft_ms']:.0f} ms, "
          f"p99 TPOT {s['p99_tpot_ms']:.1f} ms, preemptions {s['num_preemptions']}")
    try:  # (older commits have no compiled loops)
        from servesim.sim import row_kernels
        print(f"compiled step loops: {'on' if row_kernels.ON else 'off'} (sim/row_kernels.py; SERVESIM_JIT); "
              f"engine: {getattr(res, 'engine', 'python')}")
    except ImportError:
        pass
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
