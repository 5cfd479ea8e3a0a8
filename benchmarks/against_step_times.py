"""Where a ``validate --against`` run's simulated step time departs from the measured one, by regime.

The measured runs hold no per-step log, but two of their files pin step time down without using the
latency figures that are being validated:

- **saturated seconds** (``timeseries.csv``, 128 running): each 1 s tick holds gen/128 decode steps
  and its prompt tokens, so ``1 s = steps x a + prompt tokens x b`` gives the measured time of a
  full decode step (a) and the marginal cost of a prompt token added to it (b). The simulation's
  own steps are cut into the same 1 s ticks (``sim_ticks``) and go through the same fit: a least-squares
  line through the simulated steps' durations (what this script did before) is another estimator,
  which bends both numbers by the fixed cost of a mixed step (its decode rows run in the prefill
  kernel: ~45 ms a step on Qwen3-32B tp2), so the two sides were not comparable.
- **the drain** (after the last first token the batch only shrinks, decode-only): every request
  makes one token per step, so its tokens between first and last token are the integral of the
  step rate over its lifetime. NNLS over bins of W seconds recovers the step rate per bin from the
  300 requests' first/last token times and token counts (``per_request.csv``), and the requests
  between their first and last token give the bin's rows. Each measured bin is compared with the
  simulation's own decode-only steps of the same batch size (``sim/iterations.parquet``), not with
  the simulation at the same wall time: the two drains are shifted in time, and comparing bins by
  time compares different batch sizes. The estimator run on the simulated side against its actual
  step durations gives its own error.

- **steps timed from the engine's timestamps** (``requests.jsonl``'s ``queued_ts``,
  ``scheduled_ts``, ``first_token_ts``, ``last_token_ts``): decode and mixed steps of the ramp and
  the mixed steps of requests admitted to a freed seat, read as ``calibration/run_steps.py`` explains
  (with or without vLLM's async scheduling, as ``validate --against`` takes the run), each against
  the profile's price of the same rows. The ramp's mixed
  steps' extra cost is also fitted as a fixed amount a step and as a share of the chunk's token cost.

For a tensor-parallel run whose profile prices the all-reduce with a link (``allreduce.type: link``),
the same decode-only points also measure that link: each point's all-reduce time is what the
measured step leaves after the simulated step less the profile's own all-reduce, and the latency
per all-reduce that fits them (median over points, the bandwidth held at the profile's) is printed.
Decode-only steps move at most ``max_num_seqs`` tokens per all-reduce (1.3 MB for Qwen3-32B), so
this says nothing about the large messages of prefill chunks.

Reads the folders ``benchmarks/validate_against_runs.py`` writes (``results/validation/gpu/RUN-profile``)
and writes ``results/validation/gpu/step_times.md``.

    python benchmarks/against_step_times.py [--results DIR] [--runs DIR] [--bin 2]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pandas as pd
from scipy.optimize import nnls
from servesim.calibration.measured_run import MeasuredRun, read_run
from servesim.calibration.run_steps import engine_times, step_timing
from servesim.calibration.validate_against import async_by_default
from servesim.sim.cost_model import load_profile, resolve_profile_path
from servesim.sim.layer_cost_model import allreduce_seconds


def window_fit(ts: pd.DataFrame, seats: int, windows: tuple[int, ...] = (1, 2, 3)) -> dict[int, tuple]:
    """Per window width w: (seconds of a full decode step, seconds per prompt token, windows used) from
    w consecutive saturated 1 s ticks of ``ts`` (``t``, ``gen_throughput``, ``prompt_throughput``,
    ``running``): ``w s = gen / seats x a + prompt tokens x b`` by least squares. b holds everything a
    mixed step costs beyond a decode step, spread over its prompt tokens (the decode rows that run in
    the prefill kernel as well as the chunk's own GEMMs and all-reduces)."""
    sat = ts[ts["running"] == seats]
    out = {}
    for w in windows:
        run_id = (sat["t"].diff() != 1).cumsum()  # consecutive saturated ticks
        key = [run_id, sat.groupby(run_id).cumcount() // w]
        g = sat.groupby(key).agg(gen=("gen_throughput", "sum"), prompt=("prompt_throughput", "sum"), n=("t", "size"))
        g = g[g["n"] == w]
        (a, b), *_ = np.linalg.lstsq(np.c_[g["gen"] / seats, g["prompt"]], g["n"].to_numpy(dtype=float), rcond=None)
        out[w] = (a, b, len(g))
    return out


def sim_ticks(it: pd.DataFrame, pr: pd.DataFrame, seats: int) -> pd.DataFrame:
    """The simulation's steps as vLLM's 1 s log ticks (what ``timeseries.csv`` holds): each step in the
    tick it ends in; generated tokens = decode rows + first tokens; a prompt's tokens in the tick of
    its first token (vLLM counts them when the prefill ends); ``running`` as the last step of the tick
    left it (vLLM logs a snapshot at the tick)."""
    end = (it["start"] + it["duration"]).to_numpy()
    tick = np.floor(end).astype(int) + 1
    first = np.floor((pr["arrival_time"] + pr["sim_ttft"]).to_numpy()).astype(int) + 1
    n = int(max(tick.max(), first.max())) + 1
    gen = np.bincount(tick, weights=it["num_decode_tokens"].to_numpy(dtype=float), minlength=n)
    gen += np.bincount(first, minlength=n)
    prompt = np.bincount(first, weights=pr["prompt_len"].to_numpy(dtype=float), minlength=n)
    running = np.zeros(n)
    running[tick] = it["num_running"].to_numpy(dtype=float)  # steps are in time order: the last one wins
    t = np.arange(n)
    return pd.DataFrame({"t": t.astype(float), "gen_throughput": gen, "prompt_throughput": prompt,
                         "running": running})[t >= 1]


def saturated(ts: pd.DataFrame, it: pd.DataFrame, pr: pd.DataFrame, seats: int,
              windows: tuple[int, ...] = (1, 2, 3)) -> dict:
    """Seconds of a full decode step and per prompt token, measured (``timeseries.csv``) and simulated
    (the simulation's own steps as ticks, ``sim_ticks``) by the same estimator, ``window_fit``. The
    simulation's actual decode-only steps with all seats taken are given beside (``sim_decode``).

    Both sides must go through the same estimator: a least-squares line through the simulation's
    step durations against their prompt tokens (what this script did before) bends the per-token
    slope and the decode-step intercept by the fixed cost of a mixed step (the decode rows in the
    prefill kernel), which the tick fit folds into the per-token figure instead."""
    sim = window_fit(sim_ticks(it, pr, seats), seats, windows)
    s = it[it["num_running"] == seats]
    dec = s.loc[s["num_prefill_tokens"] == 0, "duration"]
    return {"measured": window_fit(ts, seats, windows), "sim": sim, "steps": len(s),
            "sim_decode": float(dec.mean()), "meas_step": window_fit(ts, seats, windows[:1])[windows[0]][0],
            "sim_step": sim[windows[0]][0]}


def deconvolve(first: np.ndarray, last: np.ndarray, tokens: np.ndarray, edges: np.ndarray) -> tuple[np.ndarray, ...]:
    """Per bin of ``edges``: step time (s; NNLS on tokens = sum over bins of overlap x step rate), the
    time-averaged number of requests between their first and last token (the decode rows), and how
    many requests span the bin."""
    overlap = np.clip(np.minimum(last[:, None], edges[None, 1:]) - np.maximum(first[:, None], edges[None, :-1]),
                      0.0, None)
    rate, _ = nnls(overlap, tokens)
    with np.errstate(divide="ignore"):
        step = 1.0 / rate
    return step, overlap.sum(axis=0) / np.diff(edges), (overlap > 0).sum(axis=0)


def drain(pr: pd.DataFrame, it: pd.DataFrame, width: float) -> tuple[pd.DataFrame, float]:
    """Bins after the last first token (decode-only, the batch shrinking): the measured rows and step
    time (ms) beside the simulated step time at the same number of rows (the simulation's own
    decode-only steps of that batch size, interpolated), and the estimator's median error on the
    simulated side (deconvolved against actual step durations)."""
    pr = pr[pr["output_len"] > 1]
    tokens = (pr["output_len"] - 1).to_numpy(dtype=float)
    out = {}
    for side in ("measured", "sim"):
        first = (pr["arrival_time"] + pr[f"{side}_ttft"]).to_numpy()
        last = (pr["arrival_time"] + pr[f"{side}_e2e"]).to_numpy()
        edges = np.arange(0.0, last.max() + width, width)
        step, rows, alive = deconvolve(first, last, tokens, edges)
        # decode-only bins, and spanned by 5 requests at least (fewer do not determine a bin)
        keep = (edges[:-1] >= first.max()) & (alive >= 5) & np.isfinite(step)
        out[side] = pd.DataFrame({"t_s": edges[:-1], "rows": rows, "step_ms": 1e3 * step})[keep]
    last_prefill = it.loc[it["num_prefill_tokens"] > 0, "start"].max()
    dec = it[(it["start"] > last_prefill)].groupby("batch_size")["duration"].median()
    at = lambda rows: 1e3 * np.interp(rows, dec.index.to_numpy(dtype=float), dec.to_numpy())  # noqa: E731
    check = float(np.median(np.abs(out["sim"]["step_ms"] / at(out["sim"]["rows"]) - 1)))
    m = out["measured"]
    return m.assign(sim_ms=at(m["rows"])), check


def link_latency(link: dict, rows: np.ndarray, measured_s: np.ndarray, sim_s: np.ndarray) -> float:
    """Seconds per all-reduce that the decode-only points imply, the link's bandwidth held (see docstring)."""
    model = allreduce_seconds(link, rows)
    implied = measured_s - (sim_s - model)
    ring = 2 * (int(link["tp"]) - 1) / int(link["tp"])
    per = implied / float(link["count"]) - ring * rows * float(link["bytes_per_token"]) / float(link["bandwidth"])
    return float(np.median(per))


def excess_line(ramp: pd.DataFrame, cost) -> str:
    """What the ramp's mixed steps cost beyond the profile's price, as a fixed amount per step or as a
    share of the chunk's own token cost (its GEMMs above the decode rows'): which explains it better."""
    r = ramp[np.isfinite(ramp["mixed_ms"])]
    extra = (r["mixed_ms"] - r["mixed_priced_ms"]).to_numpy()
    chunk = np.array([1e3 * (cost.token_cost(p + n) - cost.token_cost(n)) for p, n in zip(r["prompt"], r["rows"],
                                                                                        strict=True)])
    (a, b), *_ = np.linalg.lstsq(np.c_[np.ones(len(r)), chunk], extra, rcond=None)
    share = float(extra @ chunk / (chunk @ chunk))
    return (f"The ramp's mixed steps cost {extra.mean():.2f} ms more than priced on average (sd {extra.std():.2f}); "
            f"least squares on the chunk's token cost: {a:.2f} ms + {b:.3f} x it. As a fixed amount a step the "
            f"residual sd is {np.std(extra - extra.mean()):.2f} ms, as a share of the chunk's token cost alone "
            f"({share:.3f}) {np.std(extra - share * chunk):.2f} ms.")


def timestamp_lines(run: MeasuredRun, profile_path: str, seats: int) -> list[str]:
    """The markdown section of ``run_steps.step_timing`` for one run, with the ramp's steps one by one
    (its loop as ``validate --against`` takes it: async scheduling as the run says, else its vLLM's default)."""
    cost = load_profile(profile_path)
    ahead = run.scheduler.get("async_scheduling", async_by_default(run.vllm_version))
    timing = step_timing(engine_times(run.requests), cost, int(run.scheduler["max_num_batched_tokens"]), seats,
                         ahead)
    lines = ["Steps timed from the engine's timestamps (`calibration/run_steps.py`; `servesim validate --against` "
             "prints the same figures), measured / the profile's price of the same rows:", "", *timing.markdown()]
    ramp = timing.ramp
    if len(ramp):
        lines += ["", "| at s | decode rows | prompt tokens | decode ms measured / profile | mixed ms measured / profile |",
                  "|---:|---:|---:|---:|---:|"]
        for r in ramp.itertuples():
            dec = f"{r.decode_ms:.2f} / {r.decode_priced_ms:.2f}" if np.isfinite(r.decode_ms) else "-"
            mix = (f"{r.mixed_ms:.2f} / {r.mixed_priced_ms:.2f}" if np.isfinite(r.mixed_ms)
                   else f"(with the decode step) {r.pair_ms:.2f} / {r.decode_priced_ms + r.mixed_priced_ms:.2f}")
            lines.append(f"| {r.at_s:.2f} | {r.rows} | {r.prompt} | {dec} | {mix} |")
        lines += ["", excess_line(ramp, cost)]
    else:
        lines.append("- ramp: no request arrived while only decode steps ran (its steps are too long for that).")
    lines.append("")
    return lines


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
        pr = pd.read_csv(folder / "per_request.csv")
        s = saturated(ts, it, pr, seats)
        dr, check = drain(pr, it, args.bin)
        lines += [f"## {run.name}", "",
                  f"Saturated ({seats} running; the simulation's {s['steps']} steps, whose decode-only ones take "
                  f"{1e3 * s['sim_decode']:.2f} ms): full decode step and each prompt token added to it, "
                  "simulated / measured by the same fit over windows of saturated ticks (simulated error in "
                  "brackets):", "",
                  "| window | ticks sim / measured | full decode step ms | per prompt token ms |",
                  "|---:|---:|---:|---:|"]
        for w, (a, b, k) in s["measured"].items():
            a2, b2, k2 = s["sim"][w]
            lines.append(f"| {w} s | {k2} / {k} | {1e3 * a2:.2f} / {1e3 * a:.2f} ({100 * (a2 / a - 1):+.1f} %) | "
                         f"{1e3 * b2:.4f} / {1e3 * b:.4f} ({100 * (b2 / b - 1):+.1f} %) |")
        lines += ["",
                  f"Drain (decode-only, the batch shrinking; {args.bin:g} s bins; the estimator, run on the "
                  f"simulated side, is off its actual step times by {100 * check:.1f} % median):", "",
                  "| from s | rows | measured step ms | simulated step ms at those rows | simulated / measured |",
                  "|---:|---:|---:|---:|---:|"]
        for r in dr.itertuples():
            lines.append(f"| {r.t_s:g} | {r.rows:.0f} | {r.step_ms:.2f} | {r.sim_ms:.2f} | {r.sim_ms / r.step_ms:.3f} |")
        lines.append("")
        meta = read_run(run)
        profile_path = resolve_profile_path(f"{meta.hardware}-{meta.model}-tp{meta.tensor_parallel}.json")
        profile = json.loads(Path(profile_path).read_text())
        lines += timestamp_lines(meta, str(profile_path), seats)
        link = profile.get("allreduce") or {}
        if link.get("type") == "link":
            rows = np.r_[dr["rows"].to_numpy(), seats]
            lat = link_latency(link, rows, 1e-3 * np.r_[dr["step_ms"].to_numpy(), 1e3 * s["meas_step"]],
                               1e-3 * np.r_[dr["sim_ms"].to_numpy(), 1e3 * s["sim_step"]])
            lines += [f"All-reduce link of the profile: {1e-9 * float(link['bandwidth']):g} GB/s, "
                      f"{1e6 * float(link['latency_s']):g} us per all-reduce, {link['count']} per step. The "
                      f"{len(rows) - 1} decode-only points above and the full decode step imply "
                      f"**{1e6 * lat:.1f} us** per all-reduce at that bandwidth (median).", ""]
    out = res / "step_times.md"
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"written to {out}")


if __name__ == "__main__":
    main()
