"""``servesim validate --against`` on every shipped measured run, with its GPU profile and with the roofline.

For each run folder under ``results/validation/gpu/runs/`` (LLMServingSim's real vLLM runs) the
profile is the one the run's GPU, model and TP name (``calibration/profiles/HW-MODEL-tpN.json``).
Each comparison's folder goes to ``results/validation/gpu/RUN-COSTMODEL/``; the key figures of all
of them, beside LLMServingSim's own error on the same run and the issue's targets, go to
``results/validation/gpu/summary.md``.

    python benchmarks/validate_against_runs.py [--runs DIR] [--out DIR] [--no-plots]
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pandas as pd
from servesim.calibration.measured_run import read_run
from servesim.calibration.run_steps import StepTiming, quartiles_text
from servesim.calibration.validate_against import validate_against
from servesim.sim.cost_model import resolve_profile_path

# |error| targets of issue 13, in percent: p50 and p90 of TPOT and E2E 2 %, of TTFT 5 %
TARGETS = {f"{s}_{m}_ms": t for m, t in (("ttft", 5.0), ("tpot", 2.0), ("e2el", 2.0)) for s in ("median", "p90")}


def row(run_name: str, cost: str, result) -> list[str]:  # noqa: ANN001 - AgainstResult
    t = result.table.set_index("metric")
    cells = [run_name, cost]
    for key, target in TARGETS.items():
        err, ref = t.loc[key, "error_pct"], t.loc[key, "llmservingsim_error_pct"]
        ok = abs(err) <= target and (math.isnan(ref) or abs(err) <= abs(ref))
        cells.append(f"{err:+.2f} ({ref:+.1f}) {'ok' if ok else 'MISS'}")
    return cells


def measured_runs(runs: str | Path) -> Iterator[tuple[Path, str]]:
    """Each measured run folder under ``runs`` (one with a ``requests.jsonl``), in name order, with
    the shipped profile its GPU, model and TP name."""
    for folder in sorted(p for p in Path(runs).iterdir() if (p / "requests.jsonl").is_file()):
        run = read_run(folder)
        yield folder, f"{run.hardware}-{run.model}-tp{run.tensor_parallel}.json"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default="results/validation/gpu/runs")
    ap.add_argument("--out", default="results/validation/gpu")
    ap.add_argument("--no-plots", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    rows, timed = [], []
    for folder, profile in measured_runs(args.runs):
        for cost, prof in (("profile", profile), ("roofline", None)):
            if prof is not None:
                resolve_profile_path(prof)  # a missing profile is an error, not a silent roofline
            # without --profile, validate --against picks the shipped profile itself: the roofline is asked for
            overrides = [] if prof is not None else ["cost_model.type=roofline"]
            result = validate_against(folder, out / f"{folder.name}-{cost}", profile=prof, overrides=overrides,
                                      plots=not args.no_plots, log=None, progress=False)
            rows.append(row(folder.name, cost if prof is None else f"profile {prof}", result))
            if result.step_timing is not None:
                timed.append(timing_row(folder.name, cost, result.step_timing.summary()))
            print(" | ".join(rows[-1]), flush=True)
    head = ["run", "cost model", *(f"{k} ({v:g} %)" for k, v in TARGETS.items())]
    lines = ["# validate --against: the shipped measured runs", "",
             "Error % of the simulation against the measured vLLM 0.19 run, (LLMServingSim's own error on the same "
             "run, from its summary file), and `ok` when |error| is within the target in the column head and no "
             "larger than LLMServingSim's. `python benchmarks/validate_against_runs.py` regenerates this file.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    lines += ["", "## By arrival, with the profile", "",
              "Requests in arrival order, in tenths: medians of simulated / measured TPOT, and how much later the "
              "measured first and last tokens came than the simulated ones (s; same aligned clock). Where a "
              "percentile misses, this says in which phase of the run (`per_request.csv` of each folder).", ""]
    for folder in sorted(out.glob("*-profile")):
        lines += by_arrival(folder)
    if timed:
        head = ["run", "cost model", "ramp decode", "ramp mixed", f"freed seat mixed, rows <= {StepTiming.long_row:,}",
                f"freed seat mixed, a row > {StepTiming.long_row:,}"]
        lines += ["## Steps timed from the runs' engine timestamps", "",
                  "Measured / priced step time, median (quartiles, steps), as `validate --against` reads it "
                  "(`calibration/run_steps.py`; every step in each folder's `step_timing.csv`).", "",
                  "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(r) + " |" for r in timed] + [""]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print(f"summary in {out / 'summary.md'}")


def timing_row(run_name: str, cost: str, summary: dict) -> list[str]:
    """One row of the step-timing table from ``StepTiming.summary``."""
    def cell(key: str) -> str:
        q = summary.get(key) or {"n": 0}
        return quartiles_text(q) if q["n"] else "-"

    long = StepTiming.long_row
    return [run_name, cost, cell("ramp_decode"), cell("ramp_mixed"), cell(f"seat_mixed_rows_at_most_{long}"),
            cell(f"seat_mixed_a_row_over_{long}")]


def by_arrival(folder: Path) -> list[str]:
    """The per-request comparison of one validate --against folder, in tenths of the arrival order."""
    d = pd.read_csv(folder / "per_request.csv").sort_values("arrival_time").reset_index(drop=True)
    out = [f"### {folder.name.removesuffix('-profile')}", "",
           "| requests | arrivals s | TPOT sim / measured | first token measured - sim s | last token measured - sim s |",
           "|---|---|---|---|---|"]
    for part in np.array_split(np.arange(len(d)), 10):
        g = d.iloc[part]
        first = (g["measured_ttft"] - g["sim_ttft"]).median()
        last = (g["measured_e2e"] - g["sim_e2e"]).median()
        out.append(f"| {part[0]}-{part[-1]} | {g['arrival_time'].iloc[0]:.1f}-{g['arrival_time'].iloc[-1]:.1f} | "
                   f"{(g['sim_tpot'] / g['measured_tpot']).median():.3f} | {first:+.2f} | {last:+.2f} |")
    return out + [""]


if __name__ == "__main__":
    main()
