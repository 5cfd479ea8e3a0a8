"""Where does a validation's step-check bias come from: the cost model, or the machine's speed?

For a live-cpu scenario at a given rate it runs the live side (as ``servesim validate`` does), then,
in the same process and seconds later, re-times a sample of the live run's own steps (their exact
shapes) the way calibration times shapes, interleaved with a sample of the profile's grid shapes.
Per repeat it prints four medians of per-step ratios:

- ``now/cal``: grid shapes re-timed now / their time in the calibration (the machine's speed now);
- ``retimed/live``: a live step's shape re-timed / the executor's seconds for it during the live
  run (the same work seconds apart: machine drift plus anything live mode does differently);
- ``model/retimed``: the profile's forward prediction for the live shape / its re-timed seconds
  (the cost model's own error on the shapes live runs, at the speed of the moment);
- ``model/live``: the step check's forward part, the product of the last two.

    python benchmarks/step_decompose.py --scheduler static --rate 16.5 [--repeats 3] [--steps 150]
"""

from __future__ import annotations

import argparse

import numpy as np
import pandas as pd
from servesim.calibration.fit import parse_shape, shape_table
from servesim.calibration.grid import Shape
from servesim.calibration.profile import make_bench, time_shape
from servesim.kernels.live import run_live
from servesim.sim.cost_model import FittedCostModel, classify_step, resolve_profile_path
from servesim.sim.presets import get_model
from servesim.sim.scenario import load_scenario


def _shape(q: np.ndarray, ctx: np.ndarray) -> Shape:
    return Shape(classify_step(q), tuple(int(x) for x in q), tuple(int(x) for x in ctx))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scheduler", default="static", choices=["static", "continuous", "chunked"])
    ap.add_argument("--rate", type=float, required=True, help="arrival rate, req/s")
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=150, help="live steps re-timed per repeat")
    ap.add_argument("--grid-shapes", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--csv", help="also write every re-timed live step (shape, live, re-timed, model seconds) here")
    args = ap.parse_args()

    sc = load_scenario(f"scenarios/live-cpu-{args.scheduler}.yaml",
                       [f"workload.num_requests={args.requests}", f"workload.arrival.rate={args.rate}"])
    path = resolve_profile_path(sc.cost_model.path)
    prof = FittedCostModel.from_profile(path)
    cal = shape_table(pd.read_csv(path.with_suffix(".csv"))).set_index("shape")
    keys = list(cal.sample(min(args.grid_shapes, len(cal)), random_state=1).index)
    grid = [_shape(*parse_shape(k)) for k in keys]
    rng = np.random.default_rng(0)
    lines, per_step = [], []
    for rep in range(args.repeats):
        live = run_live(sc, progress=False)
        steps = [i for i, (q, _) in enumerate(live.step_shapes) if classify_step(q) != "empty"]
        pick = rng.choice(steps, size=min(args.steps, len(steps)), replace=False)
        shapes = [_shape(*live.step_shapes[i]) for i in pick] + grid
        bench = make_bench(get_model(sc.model), shapes, backend=sc.live.backend, device=sc.live.device,
                           dtype=sc.live.dtype, block_size=sc.kv_cache.block_size)
        times: list[list[float]] = [[] for _ in shapes]
        for _ in range(args.rounds):
            for j in rng.permutation(len(shapes)):
                times[j].append(time_shape(bench, shapes[j], rng))
        del bench
        mean = [float(np.mean(t)) for t in times]
        for k, i in enumerate(pick):
            q, ctx = live.step_shapes[i]
            per_step.append({"repeat": rep + 1, "shape": shapes[k].key, "regime": shapes[k].regime,
                             "live_s": live.step_forward_s[i], "retimed_s": mean[k],
                             "model_s": prof.iteration_time(q, ctx) - prof.loop_overhead(len(q))})
        now_cal = np.median([mean[len(pick) + k] / cal.loc[key, "seconds"] for k, key in enumerate(keys)])
        for regime in ("decode", "prefill", "mixed", "all"):
            idx = [k for k, i in enumerate(pick) if regime == "all" or shapes[k].regime == regime]
            if not idx:
                continue
            live_fwd = np.array([live.step_forward_s[pick[k]] for k in idx])
            model = np.array([prof.iteration_time(*live.step_shapes[pick[k]])
                              - prof.loop_overhead(len(shapes[k].q)) for k in idx])
            re = np.array([mean[k] for k in idx])
            lines.append({"repeat": rep + 1, "regime": regime, "steps": len(idx), "now/cal": now_cal,
                          "retimed/live": np.median(re / live_fwd), "model/retimed": np.median(model / re),
                          "model/live": np.median(model / live_fwd), "live ms": 1e3 * np.median(live_fwd)})
        print(pd.DataFrame(lines[-4:]).to_string(index=False, float_format=lambda x: f"{x:.3f}"), flush=True)
    table = pd.DataFrame(lines)
    if args.csv:
        pd.DataFrame(per_step).to_csv(args.csv, index=False)
    print(f"\n{args.scheduler} at {args.rate} req/s, {args.requests} requests, profile {path.name}; "
          "medians of per-step ratios")
    cells = [[f"{v:.3f}" if isinstance(v, float) else str(v) for v in row] for row in table.itertuples(index=False)]
    print("| " + " | ".join(table.columns) + " |\n|" + "---|" * len(table.columns))
    print("\n".join("| " + " | ".join(c) + " |" for c in cells))


if __name__ == "__main__":
    main()
