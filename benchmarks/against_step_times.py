"""Where a ``validate --against`` run's simulated step time departs from the measured one, by regime.

The measured runs hold no per-step log, but two of their files pin step time down without using the
latency figures that are being validated:

- **saturated seconds** (``timeseries.csv``, 128 running): each 1 s tick holds gen/128 decode steps
  and its prompt tokens, so ``1 s = steps x a + prompt tokens x b`` gives the measured time of a
  full decode step (a) and the marginal cost of a prompt token added to it (b). The simulation's
  own steps in the same state (every step with 128 running) give the same two numbers by least
  squares on their durations.
- **the drain** (after the last admission the batch only shrinks, decode-only): every request
  makes one token per step, so its tokens between first and last token are the integral of the
  step rate over its lifetime. NNLS over bins of W seconds recovers the step rate per bin from the
  300 requests' first/last token times and token counts (``per_request.csv``), the same way for the
  measured and the simulated side; the simulated side's actual step durations
  (``sim/iterations.parquet``) show the estimator's own error.

Reads the folders ``benchmarks/validate_against_runs.py`` writes (``results/validation/gpu/RUN-profile``)
and writes ``results/validation/gpu/step_times.md``.

    python benchmarks/against_step_times.py [--results DIR] [--runs DIR] [--bin 2]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pandas as pd
from scipy.optimize import nnls


def saturated(ts: pd.DataFrame, it: pd.DataFrame, seats: int) -> dict[str, float]:
    """Seconds of a full decode step and per prompt token, measured (1 s ticks) and simulated (steps)."""
    sat = ts[ts["running"] == seats]
    (a, b), *_ = np.linalg.lstsq(np.c_[sat["gen_throughput"] / seats, sat["prompt_throughput"]],
                                 np.ones(len(sat)), rcond=None)
    s = it[it["num_running"] == seats]
    (a2, b2), *_ = np.linalg.lstsq(np.c_[np.ones(len(s)), s["num_prefill_tokens"]], s["duration"].to_numpy(),
                                   rcond=None)
    return {"ticks": len(sat), "steps": len(s), "meas_step": a, "meas_token": b, "sim_step": a2, "sim_token": b2}


def step_rate(first: np.ndarray, last: np.ndarray, tokens: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Steps per second in each bin of ``edges``: NNLS on tokens = sum over bins of overlap x rate."""
    overlap = np.clip(np.minimum(last[:, None], edges[None, 1:]) - np.maximum(first[:, None], edges[None, :-1]),
                      0.0, None)
    rate, _ = nnls(overlap, tokens)
    return rate


def drain(pr: pd.DataFrame, it: pd.DataFrame, width: float) -> pd.DataFrame:
    """Per bin after the last admission: rows, measured and simulated step time (ms) and their ratio."""
    m = pr["output_len"] > 1
    pr = pr[m]
    first_m, last_m = (pr["arrival_time"] + pr["measured_ttft"]).to_numpy(), (pr["arrival_time"] + pr["measured_e2e"]).to_numpy()
    first_s, last_s = (pr["arrival_time"] + pr["sim_ttft"]).to_numpy(), (pr["arrival_time"] + pr["sim_e2e"]).to_numpy()
    edges = np.arange(0.0, max(last_m.max(), last_s.max()) + width, width)
    tokens = (pr["output_len"] - 1).to_numpy(dtype=float)
    with np.errstate(divide="ignore"):
        meas = 1e3 / step_rate(first_m, last_m, tokens, edges)
        sim = 1e3 / step_rate(first_s, last_s, tokens, edges)
    # a bin that fewer than 5 requests span on either side is not determined by the data
    alive = np.minimum(*((np.minimum(last[:, None], edges[None, 1:]) > np.maximum(first[:, None], edges[None, :-1]))
                         .sum(axis=0) for first, last in ((first_m, last_m), (first_s, last_s))))
    it = it.assign(bin=(it["start"] // width).astype(int))
    g = it.groupby("bin").agg(rows=("batch_size", "mean"), prefill=("num_prefill_tokens", "sum"),
                              actual=("duration", "mean"))
    out = pd.DataFrame({"t_s": edges[:-1], "measured_ms": meas, "sim_ms": sim, "alive": alive}).join(g)
    out["actual"] *= 1e3
    start = it.loc[it["num_prefill_tokens"] > 0, "start"].max()  # the last simulated prefill
    return out[(out["t_s"] > start) & (out["prefill"] == 0) & np.isfinite(out["measured_ms"]) & (out["alive"] >= 5)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default="results/validation/gpu")
    ap.add_argument("--runs", default="results/validation/gpu/runs")
    ap.add_argument("--bin", type=float, default=2.0, help="drain bin width, seconds")
    args = ap.parse_args()
    res = Path(args.results)
    lines = ["# Step time in the measured runs against the simulation", "",
             "`python benchmarks/against_step_times.py` (method in its docstring) on the folders of "
             "`benchmarks/validate_against_runs.py`. No latency figure is used: only the runs' token "
             "throughput per second (`timeseries.csv`) and each request's first/last token time and token count.", ""]
    for run in sorted(p for p in Path(args.runs).iterdir() if (p / "timeseries.csv").is_file()):
        folder = res / f"{run.name}-profile"
        it = pd.read_parquet(folder / "sim" / "iterations.parquet")
        ts = pd.read_csv(run / "timeseries.csv")
        seats = int(ts["running"].max())
        s = saturated(ts, it, seats)
        lines += [f"## {run.name}", "",
                  f"Saturated ({seats} running; {s['ticks']} measured ticks, {s['steps']} simulated steps): "
                  f"full decode step measured {1e3 * s['meas_step']:.2f} ms, simulated {1e3 * s['sim_step']:.2f} ms "
                  f"({100 * (s['sim_step'] / s['meas_step'] - 1):+.1f} %); each prompt token added to it measured "
                  f"{1e3 * s['meas_token']:.4f} ms, simulated {1e3 * s['sim_token']:.4f} ms "
                  f"({100 * (s['sim_token'] / s['meas_token'] - 1):+.1f} %).", "",
                  f"Drain (decode-only, the batch shrinking; {args.bin:g} s bins):", "",
                  "| from s | rows (sim) | measured step ms | simulated step ms (estimator) | simulated ms (actual) | actual / measured |",
                  "|---:|---:|---:|---:|---:|---:|"]
        for r in drain(pd.read_csv(folder / "per_request.csv"), it, args.bin).itertuples():
            lines.append(f"| {r.t_s:g} | {r.rows:.0f} | {r.measured_ms:.2f} | {r.sim_ms:.2f} | {r.actual:.2f} | "
                         f"{r.actual / r.measured_ms:.3f} |")
        lines.append("")
    out = res / "step_times.md"
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"written to {out}")


if __name__ == "__main__":
    main()
