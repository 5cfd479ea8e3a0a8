"""Live decode steps by batch size, and sim vs live, across `servesim validate` run folders.

For each validation folder (``validation.json`` + ``live/iterations.parquet``, and ``live-2/`` ...
when it was run with ``--repeats``) it prints the median duration of the live run's decode-only
steps per batch-size bucket, of its mixed steps, the host part of both where the run recorded it
(``host_s``), the median TPOT live and simulated, and the step check's forward
bias (the profile's prediction for the live steps' own shapes, predicted / measured - 1). Used on
the H200 runs under results/gpu/h200/live/ (README "H200: servesim's own engine, measured"):

    python benchmarks/live_steps_by_batch.py results/gpu/h200/live/*/
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd

BUCKETS = [0, 8, 16, 32, 48, 64, 128, 256, 1 << 20]


def decode_medians(run: Path) -> dict[str, float]:
    it = pd.read_parquet(run / "iterations.parquet")
    dec = it[it["num_prefill_tokens"] == 0]
    groups = dec.groupby(pd.cut(dec["batch_size"], BUCKETS), observed=True)["duration"].median() * 1e3
    out = {f"batch {iv.left + 1}-{iv.right}" if iv.right < BUCKETS[-1] else f"batch > {iv.left}": v
           for iv, v in groups.items()}
    mixed = it[(it["num_prefill_tokens"] > 0) & (it["num_decode_tokens"] > 0)]
    row = {**out, "decode, all": float(dec["duration"].median() * 1e3),
           "mixed, all": float(mixed["duration"].median() * 1e3) if len(mixed) else float("nan")}
    # the executor's host part (runs since host_s was recorded): how host-bound each kind of step was
    for name, steps in (("decode", dec), ("mixed", mixed)):
        row[f"{name} host part (ms)"] = (float(steps["host_s"].median() * 1e3) if "host_s" in it and len(steps)
                                         else float("nan"))
    return {**row, "steps": float(len(it))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folders", nargs="+", type=Path, help="servesim validate output folders")
    args = ap.parse_args(argv)
    cols, extra = {}, {}
    for folder in args.folders:
        v = json.loads((folder / "validation.json").read_text())
        lives = sorted(p for p in folder.iterdir() if p.is_dir() and (p.name == "live" or p.name.startswith("live-")))
        tpot = next(m for m in v["metrics"] if m["metric"] == "median_tpot_ms")
        forward = v["step_check"].get("forward", {})
        biases = forward.get("bias_pct_by_run", [forward.get("bias_pct", float("nan"))])
        for k, run in enumerate(lives):
            name = folder.name + (f" #{k + 1}" if len(lives) > 1 else "")
            cols[name] = decode_medians(run)
            extra[name] = {"median TPOT live (ms)": tpot["live"] if len(lives) == 1 else float("nan"),
                           "median TPOT sim (ms)": tpot["sim"],
                           "step check, forward (%)": biases[k] if k < len(biases) else float("nan")}
        if len(lives) > 1:  # the table's live column is the median over the repeats
            extra[folder.name + " #1"]["median TPOT live (ms)"] = tpot["live"]
    table = pd.concat([pd.DataFrame(cols), pd.DataFrame(extra)])
    print("median live step duration (ms): decode by batch size, mixed; the executor's host part; sim vs live "
          "(--repeats: the median over runs)")
    print(table.round(1).to_string(na_rep="-"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
