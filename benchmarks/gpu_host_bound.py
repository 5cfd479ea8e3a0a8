"""Is servesim's live engine host-bound on this GPU? Step wall time against its two parts.

For a few prefill, decode and mixed shapes of a model with random weights on the GPU (the live
executor's own ``ModelRunner`` and Triton kernels) it measures, per shape:

- ``wall_ms``: one engine step as ``servesim calibrate`` times it (right after an untimed run of the
  same shape; input preparation, the forward, the greedy tokens back on the host);
- ``enqueue_ms``: the host's part: input preparation and the forward's kernel launches, stopped
  before anything waits for the GPU (the step is host-bound when this is close to ``wall_ms``);
- ``gpu_ms``: the GPU's part: the same forward captured once in a CUDA graph and replayed, timed with
  CUDA events (kernels back to back, no launch gaps: what a CUDA-graph engine such as vLLM's decode
  path would pay for these kernels);

under each of the given torch CPU thread counts (``live.threads`` / ``calibrate --threads``), and
what came before a step changes its host time: ``idle_<G>ms_ms`` is the step right after the host
sat idle G ms (``--gaps``), ``burst_ms`` the step after 20 back-to-back steps of the same shape (on
the H200's lease D an eager mixed step's host part was 26.8 ms between CUDA-graph replays and
43.7 ms between eager steps; README "H200"). A table is printed and a CSV written under ``--out``.

    python benchmarks/gpu_host_bound.py --out /tmp/host_bound           # needs a CUDA GPU
    python benchmarks/gpu_host_bound.py --cpu-smoke --out /tmp/hb       # the plumbing, tiny model, no GPU
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

SHAPES = {  # name: (q per row, ctx per row)
    "prefill 128": ((128,), (0,)),
    "prefill 512": ((512,), (0,)),
    "prefill 2048": ((2048,), (0,)),
    "prefill 8192": ((8192,), (0,)),
    "decode 1 x 1024": ((1,), (1024,)),
    "decode 8 x 1024": ((1,) * 8, (1024,) * 8),
    "decode 32 x 1024": ((1,) * 32, (1024,) * 32),
    "decode 64 x 1024": ((1,) * 64, (1024,) * 64),
    "decode 128 x 1024": ((1,) * 128, (1024,) * 128),
    "decode 256 x 1024": ((1,) * 256, (1024,) * 256),
    "mixed 512 + 32 x 1024": ((512, *(1,) * 32), (0, *(1024,) * 32)),
    "chunk 512 over 1536": ((512,), (1536,)),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for host_bound.csv")
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--threads", type=int, nargs="+", default=[2, 16], help="torch CPU thread counts (2 16)")
    ap.add_argument("--reps", type=int, default=5, help="timed steps per shape and thread count (5)")
    ap.add_argument("--gaps", type=float, nargs="*", default=[0.0, 10.0, 50.0],
                    help="idle gaps (ms) before a timed step (0 10 50); none: skip")
    ap.add_argument("--burst", type=int, default=20, help="back-to-back steps before burst_ms (20; 0: skip)")
    ap.add_argument("--gap-max-tokens", type=int, default=2048,
                    help="idle/burst columns only for shapes of at most this many tokens (2048: the bigger "
                         "ones are GPU-bound)")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="tiny model, torch kernels on the CPU, no graph timing: checks the script, not a GPU")
    args = ap.parse_args(argv)
    import torch

    cuda = not args.cpu_smoke
    if cuda and not torch.cuda.is_available():
        print("no CUDA device: this benchmark measures a GPU (--cpu-smoke checks the script)", file=sys.stderr)
        return 2
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    from servesim.calibration.grid import Shape
    from servesim.calibration.profile import make_bench, stepped, time_shape
    from servesim.sim.cost_model import classify_step
    from servesim.sim.presets import get_model

    shapes = {name: Shape(classify_step(np.array(q)), q, c) for name, (q, c) in SHAPES.items()}
    if args.cpu_smoke:
        shapes = {name: Shape(s.regime, s.q[:4], tuple(min(c, 64) for c in s.ctx[:4])) for name, s in shapes.items()
                  if s.num_tokens <= 512}
        bench = make_bench(get_model("tiny"), shapes.values(), backend="torch", device="cpu", dtype="float32",
                           block_size=16)
    else:
        bench = make_bench(get_model(args.model), shapes.values(), backend="triton", device="cuda",
                           dtype="bfloat16", block_size=16)
    runner = bench.executor.runner
    rng = np.random.default_rng(0)
    rows = []

    def gpu_ms(shape: Shape) -> float:
        """Median of 5 CUDA-graph replays of the shape's forward; NaN if it cannot be captured."""
        if not cuda:
            return float("nan")
        with stepped(bench, shape, rng) as (batch, reqs):
            try:
                ids, pos, md = runner.prepare(batch, [bench.kv.block_table(r) for r in reqs])
                kv = runner.kv_cache.tensor
                runner.model.forward(ids, pos, md, kv)  # compile and allocate outside the capture
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    runner.model.forward(ids, pos, md, kv)
                times = []
                for _ in range(6):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    graph.replay()
                    end.record()
                    end.synchronize()
                    times.append(start.elapsed_time(end))
                del graph
                return statistics.median(times[1:])
            except Exception as e:  # noqa: BLE001 - a shape that cannot be captured is reported, not fatal
                print(f"  graph capture failed: {type(e).__name__}: {e}", file=sys.stderr)
                return float("nan")

    def enqueue_ms(shape: Shape) -> float:
        """The host's part of one step: ``ModelRunner.execute_timed``'s launch moment, as live mode records it."""
        with stepped(bench, shape, rng) as (batch, reqs):
            tables = [bench.kv.block_table(r) for r in reqs]
            sync()
            t0 = time.perf_counter()
            _, launched = runner.execute_timed(batch, tables)
            return (launched - t0) * 1e3

    def after_ms(shape: Shape, idle_s: float = 0.0, burst: int = 0) -> float:
        """One whole step (inputs, forward, greedy tokens) right after ``burst`` untimed steps of the
        same shape (at least one) and then ``idle_s`` seconds of the host doing nothing."""
        with stepped(bench, shape, rng) as (batch, reqs):
            tables = [bench.kv.block_table(r) for r in reqs]
            for _ in range(max(burst, 1)):
                runner.execute(batch, tables)
            sync()
            if idle_s:
                time.sleep(idle_s)
            t0 = time.perf_counter()
            runner.execute(batch, tables)  # .tolist() of the tokens waits for the device
            return (time.perf_counter() - t0) * 1e3

    graph_ms = {name: gpu_ms(s) for name, s in shapes.items()}
    extra = [f"idle_{gap:g}ms_ms" for gap in args.gaps] + (["burst_ms"] if args.burst else [])
    print(f"{'shape':<24} {'threads':>7} {'wall_ms':>8} {'enqueue_ms':>10} {'gpu_ms':>7} {'host-bound':>10}"
          + "".join(f" {c:>14}" for c in extra))
    for threads in args.threads:
        torch.set_num_threads(threads)
        for name, s in shapes.items():
            wall = [time_shape(bench, s, rng) * 1e3 for _ in range(args.reps)]
            enq = [enqueue_ms(s) for _ in range(args.reps)]
            row = {"shape": name, "threads": threads, "tokens": s.num_tokens, "rows": len(s.q),
                   "wall_ms": statistics.median(wall), "wall_min_ms": min(wall), "wall_max_ms": max(wall),
                   "enqueue_ms": statistics.median(enq), "gpu_ms": graph_ms[name]}
            small = s.num_tokens <= args.gap_max_tokens
            for gap in args.gaps:
                row[f"idle_{gap:g}ms_ms"] = (statistics.median(after_ms(s, gap / 1e3) for _ in range(args.reps))
                                             if small else float("nan"))
            if args.burst:
                row["burst_ms"] = (statistics.median(after_ms(s, burst=args.burst) for _ in range(args.reps))
                                   if small else float("nan"))
            rows.append(row)
            print(f"{name:<24} {threads:>7} {row['wall_ms']:>8.2f} {row['enqueue_ms']:>10.2f} {row['gpu_ms']:>7.2f} "
                  f"{'yes' if row['enqueue_ms'] > row['gpu_ms'] else 'no':>10}"
                  + "".join(f" {row[c]:>14.2f}" for c in extra), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_csv(out / "host_bound.csv", index=False, na_rep="nan")
    print(f"device {torch.cuda.get_device_name() if cuda else 'cpu'}; torch {torch.__version__}; wrote {out / 'host_bound.csv'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
