"""The uncalibrated roofline against a fitted profile, both against the measurements behind it.

For every shape in the profile's raw CSV (``servesim calibrate`` writes it beside the JSON) it
compares three step times: measured (the shape's trimmed-mean executor time plus the measured
engine-loop overhead, i.e. what a live step costs), the fitted profile's prediction, and the
``RooflineCostModel`` of the given model and hardware presets. Prints, per regime, the median
and p90 absolute percentage error and the median ratio predicted / measured of each model.

    python benchmarks/roofline_vs_profile.py --profile calibration/profiles/cpu-tiny.json \\
        --model tiny --hardware cpu-2core
"""

from __future__ import annotations

import argparse

import numpy as np
import pandas as pd
from servesim.calibration.fit import parse_shape, shape_table
from servesim.sim.cost_model import REGIMES, FittedCostModel, RooflineCostModel
from servesim.sim.presets import get_hardware, get_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--hardware", required=True)
    ap.add_argument("--held-out-only", action="store_true", help="only the shapes the fit did not see")
    args = ap.parse_args()
    fitted = FittedCostModel.from_profile(args.profile)
    roof = RooflineCostModel(get_model(args.model), get_hardware(args.hardware))
    raw = pd.read_csv(args.profile.removesuffix(".json") + ".csv")
    table = shape_table(raw)
    if args.held_out_only:
        from servesim.calibration.fit import split_held_out

        prov = fitted.provenance
        table = table[split_held_out(table, prov.get("holdout_fraction", 0.2), prov.get("holdout_seed", 0))]
    ov = fitted.overhead
    rows = []
    for key, regime, seconds in zip(table["shape"], table["regime"], table["seconds"], strict=True):
        q, ctx = parse_shape(key)
        measured = seconds + ov.get("step_s", 0.0) + ov.get("per_seq_s", 0.0) * len(q)
        rows.append({"regime": regime, "measured": measured, "fitted": fitted.iteration_time(q, ctx),
                     "roofline": roof.iteration_time(q, ctx)})
    df = pd.DataFrame(rows)
    print(f"{len(df)} shapes of {args.profile}; roofline = {args.model} on {args.hardware} preset")
    print(f"{'regime':<8} {'n':>4} {'measured ms':>12} | {'fitted APE p50':>14} {'p90':>7} {'ratio':>6} | "
          f"{'roofline APE p50':>16} {'p90':>7} {'ratio':>6}")
    for r in (*REGIMES, "all"):
        d = df if r == "all" else df[df["regime"] == r]
        if not len(d):
            continue
        cells = []
        for model in ("fitted", "roofline"):
            ape = (d[model] - d["measured"]).abs() / d["measured"]
            cells.append((100 * np.median(ape), 100 * np.percentile(ape, 90), np.median(d[model] / d["measured"])))
        (fa, fp, fr), (ra, rp, rr) = cells
        print(f"{r:<8} {len(d):>4} {1e3 * d['measured'].median():>12.3f} | {fa:>13.2f}% {fp:>6.1f}% {fr:>6.3f} | "
              f"{ra:>15.2f}% {rp:>6.1f}% {rr:>6.3f}")


if __name__ == "__main__":
    main()
