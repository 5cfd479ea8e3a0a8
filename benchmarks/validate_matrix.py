"""Sim-vs-live fidelity matrix: ``servesim validate`` for each live-cpu scheduler at three loads.

For each scenario (static, continuous, chunked on the same traffic) it first finds the rate the
replica sustains — the simulated request throughput with every request queued at once
(1000 requests, ``workload.arrival.rate`` huge), using the scenario's fitted profile — then runs
``servesim validate`` at 50 %, 80 % and 95 % of that rate. Each run folder goes under
``results/validation/SCHEDULER-LOADpct/``; the table printed at the end (and written to
``results/validation/summary.md``) has the relative errors the issue's targets are about.

    python benchmarks/validate_matrix.py [--loads 0.5,0.8,0.95] [--requests 400] [--repeats 1] [--out results/validation]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from servesim.calibration.validate import validate
from servesim.sim.scenario import load_scenario
from servesim.sim.simulate import simulate

SCENARIOS = {"static": "scenarios/live-cpu-static.yaml", "continuous": "scenarios/live-cpu-continuous.yaml",
             "chunked": "scenarios/live-cpu-chunked.yaml"}
KEYS = ["median_tpot_ms", "p90_tpot_ms", "median_e2el_ms", "p90_e2el_ms", "median_ttft_ms", "p90_ttft_ms",
        "median_itl_ms", "request_throughput"]
TARGETS = {"tpot": 3.0, "e2el": 3.0, "ttft": 8.0}


def sustained_rate(path: str, requests: int = 1000) -> float:
    """Simulated request throughput with the whole workload queued at t = 0 (the replica's capacity)."""
    sc = load_scenario(path, [f"workload.num_requests={requests}", "workload.arrival.rate=100000"])
    return float(simulate(sc, progress=False).summary["request_throughput"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--loads", default="0.5,0.8,0.95")
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--schedulers", default="static,continuous,chunked")
    ap.add_argument("--out", default="results/validation")
    ap.add_argument("--repeats", type=int, default=1, help="live runs per point (validate --repeats)")
    args = ap.parse_args()
    out = Path(args.out)
    rows = []
    for name in args.schedulers.split(","):
        path = SCENARIOS[name]
        capacity = sustained_rate(path)
        for load in (float(x) for x in args.loads.split(",")):
            rate = round(load * capacity, 3)
            sets = [f"workload.num_requests={args.requests}", f"workload.arrival.rate={rate}"]
            sc = load_scenario(path, sets)
            res = validate(sc, out / f"{name}-{round(100 * load)}pct", source=path, overrides=sets, progress=False,
                           log=None, repeats=args.repeats)
            err = dict(zip(res.table["metric"], res.table["error_pct"], strict=True))
            spread = dict(zip(res.table["metric"], res.table.get("live_spread_pct", [float("nan")] * len(res.table)),
                              strict=True))
            check = res.step_check.get("all", {})
            rows.append({"scheduler": name, "load": load, "capacity_req_s": round(capacity, 3), "rate_req_s": rate,
                         **{k: round(float(err[k]), 2) for k in KEYS},
                         "step_check_bias_pct": round(check.get("bias_pct", float("nan")), 2),
                         "live_spread_median_tpot_pct": round(float(spread["median_tpot_ms"]), 2),
                         "live_spread_median_e2el_pct": round(float(spread["median_e2el_ms"]), 2)})
            print(json.dumps(rows[-1]), flush=True)
    header = ["scheduler", "load", "rate req/s", *KEYS, "step check"]
    if args.repeats > 1:
        header += ["live spread p50 TPOT", "live spread p50 E2E"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        lines.append("| " + " | ".join([r["scheduler"], f"{100 * r['load']:.0f} % of {r['capacity_req_s']:.2f}",
                                        f"{r['rate_req_s']:.2f}", *(f"{r[k]:+.1f} %" for k in KEYS),
                                        f"{r['step_check_bias_pct']:+.1f} %",
                                        *([f"{r['live_spread_median_tpot_pct']:.1f} %",
                                           f"{r['live_spread_median_e2el_pct']:.1f} %"] if args.repeats > 1 else [])])
                     + " |")
    within = sum(abs(r[f"{p}_{m}_ms"]) <= t for r in rows for m, t in TARGETS.items() for p in ("median", "p90"))
    lines.append("")
    lines.append("Relative error (sim - live) / live of each run's summary; step check: the profile's prediction of "
                 "the live run's own steps (from their shapes) / their measured durations - 1."
                 + (f" With {args.repeats} live runs per point the live value is each metric's median and the spread "
                    "its range (max - min) / median; the step check is the first run's." if args.repeats > 1 else ""))
    lines.append(f"{within} of {len(rows) * 6} p50/p90 TPOT, E2E and TTFT figures are within target (3 %, 3 %, 8 %).")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    (out / "summary.json").write_text(json.dumps(rows, indent=2) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
