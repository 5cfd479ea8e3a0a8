"""How much each ``validate --against`` figure moves when every simulated step costs a little more or less.

A diagnostic, not a fit: each shipped measured run (``results/validation/gpu/runs/``) is replayed
with its GPU profile as ``benchmarks/validate_against_runs.py`` does, once per factor, with every
step's time from the profile (``LayerCostModel.iteration_time``) multiplied by that factor. The
table says how precisely the step cost must be known for a figure to land within its target: a
figure that moves several points per 1 % of step cost (a percentile that sits where the queue for a
seat begins) needs the cost model to be right to a fraction of a percent there, and a figure that a
uniform factor cannot bring within target at the same time as the others points at an error in
one phase or regime of the run rather than in the overall level.

The second table asks about one such phase: every step with a prompt row in it (a mixed or
prefill step) costs a fixed ``--mixed-ms`` more than the profile prices, decode-only steps
unchanged. The runs' engine timestamps (``calibration/run_steps.py``) time those steps 5-15 %
dearer than the eager per-layer kernel tables price them; this table says what an extra amount of
that size would do to each figure, set as a copy of the profile with ``overhead.prompt_step_s``
(the model's own term for it). Also a diagnostic, not a fit: no shipped profile carries it.

    python benchmarks/validate_sensitivity.py [--factors 0.98,0.99,1,1.01,1.02] [--mixed-ms 0,2,4,6]
        [--runs DIR] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from contextlib import contextmanager
from pathlib import Path

from servesim.calibration.validate_against import validate_against
from servesim.sim import layer_cost_model
from servesim.sim.cost_model import resolve_profile_path
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


@contextmanager
def prompt_steps_dearer(profile: str, extra_s: float):
    """A copy of ``profile`` whose ``overhead.prompt_step_s`` is ``extra_s``: every step with a prompt
    row (q > 1) that much dearer, priced by the model's own term (``LayerCostModel``)."""
    data = json.loads(resolve_profile_path(profile).read_text())
    data["overhead"] = {**(data.get("overhead") or {}), "prompt_step_s": extra_s}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / Path(profile).name
        path.write_text(json.dumps(data))
        yield str(path)


def table_row(folder: Path, profile: str, label: str) -> str:
    """One run replayed with ``profile``: its figures, ``*`` where within target."""
    with tempfile.TemporaryDirectory() as tmp:
        result = validate_against(folder, Path(tmp), profile=profile, overrides=[], plots=False, log=None,
                                  progress=False)
    t = result.table.set_index("metric")
    cells = [folder.name, label]
    for key, target in TARGETS.items():
        err = float(t.loc[key, "error_pct"])
        cells.append(f"{err:+.2f}{' *' if abs(err) <= target else ''}")
    print(" | ".join(cells), flush=True)
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--factors", default="0.98,0.99,0.995,1,1.005,1.01,1.02")
    ap.add_argument("--mixed-ms", default="0,2,4,5,6,8")
    ap.add_argument("--runs", default="results/validation/gpu/runs")
    ap.add_argument("--out", default="results/validation/gpu/sensitivity.md")
    args = ap.parse_args()
    factors = [float(f) for f in args.factors.split(",")]
    extras = [float(x) for x in args.mixed_ms.split(",")]
    head = ["run", "step cost x", *TARGETS]
    lines = ["# validate --against: sensitivity to the step cost", "",
             "Error % of the simulation against each measured run, with every step's time from the run's GPU "
             "profile multiplied by the factor (a diagnostic, not a fit; `python benchmarks/validate_sensitivity.py` "
             "regenerates this file). `*` marks a figure within its target (TTFT 5 %, TPOT and E2E 2 %).", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    runs = list(measured_runs(args.runs))
    for folder, profile in runs:
        for f in factors:
            with step_cost_scaled(f):
                lines.append(table_row(folder, profile, f"{f:g}"))
    head = ["run", "mixed step + ms", *TARGETS]
    lines += ["", "## Mixed and prefill steps only", "",
              "Error % with every step that has a prompt row in it this many milliseconds dearer than the profile "
              "prices it, decode-only steps as priced (`--mixed-ms`; the profile's `overhead.prompt_step_s`).", "",
              "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for folder, profile in runs:
        for ms in extras:
            with prompt_steps_dearer(profile, ms * 1e-3) as dearer:
                lines.append(table_row(folder, dearer, f"{ms:g}"))
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
