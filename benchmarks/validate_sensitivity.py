"""How much each ``validate --against`` figure moves when every simulated step costs a little more or less.

A diagnostic, not a fit: each shipped measured run (``results/validation/gpu/runs/``) is replayed
with its GPU profile as ``benchmarks/validate_against_runs.py`` does, once per factor, with every
step's time from the profile (``LayerCostModel.iteration_time``) multiplied by that factor. The
table says how precisely the step cost must be known for a figure to land within its target: a
figure that moves several points per 1 % of step cost (a percentile that sits where the queue for a
seat begins) needs the cost model to be right to a fraction of a percent there, and a figure that a
uniform factor cannot bring within target at the same time as the others points at an error in
one phase or regime of the run rather than in the overall level.

    python benchmarks/validate_sensitivity.py [--factors 0.98,0.99,1,1.01,1.02] [--runs DIR] [--out FILE]
"""

from __future__ import annotations

import argparse
import tempfile
from contextlib import contextmanager
from pathlib import Path

from servesim.calibration.validate_against import validate_against
from servesim.sim import layer_cost_model
from validate_against_runs import TARGETS, measured_runs  # (this script's folder is on sys.path)


@contextmanager
def step_cost_scaled(factor: float):
    """Every ``LayerCostModel`` step time multiplied by ``factor`` while inside."""
    cls = layer_cost_model.LayerCostModel
    original = cls.iteration_time

    def scaled(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        return factor * original(self, *args, **kwargs)

    cls.iteration_time = scaled
    try:
        yield
    finally:
        cls.iteration_time = original


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--factors", default="0.98,0.99,0.995,1,1.005,1.01,1.02")
    ap.add_argument("--runs", default="results/validation/gpu/runs")
    ap.add_argument("--out", default="results/validation/gpu/sensitivity.md")
    args = ap.parse_args()
    factors = [float(f) for f in args.factors.split(",")]
    head = ["run", "step cost x", *TARGETS]
    lines = ["# validate --against: sensitivity to the step cost", "",
             "Error % of the simulation against each measured run, with every step's time from the run's GPU "
             "profile multiplied by the factor (a diagnostic, not a fit; `python benchmarks/validate_sensitivity.py` "
             "regenerates this file). `*` marks a figure within its target (TTFT 5 %, TPOT and E2E 2 %).", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for folder, profile in measured_runs(args.runs):
        for factor in factors:
            with step_cost_scaled(factor), tempfile.TemporaryDirectory() as tmp:
                result = validate_against(folder, Path(tmp), profile=profile, overrides=[], plots=False, log=None,
                                          progress=False)
            t = result.table.set_index("metric")
            cells = [folder.name, f"{factor:g}"]
            for key, target in TARGETS.items():
                err = float(t.loc[key, "error_pct"])
                ok = abs(err) <= target
                cells.append(f"{err:+.2f}{' *' if ok else ''}")
            lines.append("| " + " | ".join(cells) + " |")
            print(" | ".join(cells), flush=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
