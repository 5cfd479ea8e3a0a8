"""Memory and time to read a large trace file, as ``servesim run`` reads one (``load_trace``).

Writes a synthetic trace of N rows in the Azure format (datetime text, the costly case) or the
BurstGPT one (seconds) into a temporary folder, then reads it in a fresh process per format and
prints the peak RSS that reading adds over the process after importing numpy, pandas and servesim
(Linux: the peak is reset through /proc/self/clear_refs, then read as VmHWM), the arrays kept (bytes), and rows per second. Rows are shuffled in blocks of 1,000 so
the file is not in time order (the reader must sort it), unless ``--sorted``.

    python benchmarks/trace_load.py [--rows 1000000] [--format azure|burstgpt|both] [--sorted]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

READ = """
import json, sys, time
import numpy, pandas
from servesim.sim.workload import TraceConfig, load_trace

def kb(key):  # /proc/self/status, kB
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(key))

open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) restarts at the current RSS
base = kb("VmRSS:")
t0 = time.perf_counter()
tr = load_trace(TraceConfig(format=sys.argv[1], path=sys.argv[2]))
wall = time.perf_counter() - t0
kept = sum(a.nbytes for a in (tr.arrival_time, tr.prompt_len, tr.output_len))
print(json.dumps({"rows": int(tr.arrival_time.size), "wall": wall, "added_mb": (kb("VmHWM:") - base) / 1024,
                  "kept_mb": kept / 2**20}))
"""


def write_trace(path: Path, fmt: str, rows: int, in_order: bool) -> None:
    import pandas as pd

    rng = np.random.default_rng(0)
    secs = np.cumsum(rng.exponential(0.2, rows))
    if not in_order:  # blocks of 1,000 rows in a shuffled order
        blocks = np.array_split(np.arange(rows), max(1, rows // 1000))
        secs = secs[np.concatenate([blocks[i] for i in rng.permutation(len(blocks))])]
    prompt, output = rng.integers(1, 4000, rows), rng.integers(1, 500, rows)
    if fmt == "azure":
        stamps = pd.Timestamp("2023-11-16 18:15:46.6805900") + pd.to_timedelta(secs, unit="s")
        df = pd.DataFrame({"TIMESTAMP": stamps.astype(str), "ContextTokens": prompt, "GeneratedTokens": output})
    else:
        df = pd.DataFrame({"Timestamp": secs.round(3), "Model": "ChatGPT", "Request tokens": prompt,
                           "Response tokens": output, "Total tokens": prompt + output,
                           "Log Type": "Conversation log"})
    df.to_csv(path, index=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--format", choices=["azure", "burstgpt", "both"], default="both")
    ap.add_argument("--sorted", action="store_true", help="write the rows in time order")
    args = ap.parse_args()
    formats = ["azure", "burstgpt"] if args.format == "both" else [args.format]
    print(f"{'format':>9} {'rows':>9} {'file MB':>8} {'read s':>7} {'rows/s':>10} {'added MB':>9} {'kept MB':>8}")
    with tempfile.TemporaryDirectory() as tmp:
        for fmt in formats:
            path = Path(tmp) / f"{fmt}.csv"
            write_trace(path, fmt, args.rows, args.sorted)
            out = subprocess.run([sys.executable, "-c", READ, fmt, str(path)], check=True,
                                 capture_output=True, text=True).stdout
            r = json.loads(out)
            print(f"{fmt:>9} {r['rows']:>9} {path.stat().st_size / 2**20:>8.1f} {r['wall']:>7.2f} "
                  f"{r['rows'] / r['wall']:>10.0f} {r['added_mb']:>9.0f} {r['kept_mb']:>8.1f}")


if __name__ == "__main__":
    main()
