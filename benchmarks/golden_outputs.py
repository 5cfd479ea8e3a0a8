"""Golden outputs: every shipped scenario simulated, its run folder compared with a reference.

A refactor that must not change behaviour runs this twice: once on the base commit to write the
reference, once on the change to compare. Each scenario in `scenarios/*.yaml`,
`scenarios/engines/*.yaml` and `scenarios/gpu/*.yaml` is simulated with `servesim run --no-plots
--quiet` (the `live-cpu-*` ones too: simulated, not run live), one run folder per scenario under OUT.

Comparison, per scenario:
- `summary.json`: parsed, equal key by key; keys named with --new-key may appear only in OUT.
  With no new keys the files must also be byte-identical.
- `requests.parquet`, `iterations.parquet`: byte-identical. If the bytes differ (the parquet
  writer's metadata can) the frames are compared for exact equality of columns, dtypes and
  values, and the report says which of the two held.

    python benchmarks/golden_outputs.py run /tmp/golden-base            # write a reference
    python benchmarks/golden_outputs.py run /tmp/golden-new --against /tmp/golden-base \\
        --new-key prefix_cache_hit_rate --new-key prefix_cache_hit_tokens
    python benchmarks/golden_outputs.py compare /tmp/golden-base /tmp/golden-new

Exit status 0 when every scenario matches, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
TABLES = ("requests.parquet", "iterations.parquet")


def scenarios() -> list[Path]:
    """Every shipped scenario, in a stable order."""
    return [p for sub in ("", "engines", "gpu", "cluster") for p in sorted((ROOT / "scenarios" / sub).glob("*.yaml"))]


def folder_name(path: Path) -> str:
    rel = path.relative_to(ROOT / "scenarios").with_suffix("")
    return "__".join(rel.parts)


def run_one(path: Path, out: Path) -> tuple[str, float, str]:
    dest = out / folder_name(path)
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "servesim.sim.cli", "run", str(path), "--out", str(dest), "--no-plots", "--quiet"],
        cwd=ROOT, capture_output=True, text=True)
    err = "" if proc.returncode == 0 else (proc.stderr.strip().splitlines() or ["failed"])[-1]
    return folder_name(path), time.perf_counter() - t0, err


def run_all(out: Path, jobs: int) -> bool:
    out.mkdir(parents=True, exist_ok=True)
    paths = scenarios()
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        results = list(pool.map(lambda p: run_one(p, out), paths))
    ok = True
    for name, secs, err in results:
        print(f"  ran {name:<36} {secs:6.1f} s {'FAILED: ' + err if err else ''}")
        ok = ok and not err
    return ok


def compare_summary(ref: Path, new: Path, new_keys: set[str]) -> str | None:
    a = json.loads(ref.read_text())
    b = json.loads(new.read_text())
    extra = set(b) - set(a)
    if extra - new_keys:
        return f"summary.json: unexpected new keys {sorted(extra - new_keys)}"
    if set(a) - set(b):
        return f"summary.json: keys gone {sorted(set(a) - set(b))}"
    changed = [k for k in a if a[k] != b[k]]
    if changed:
        k = changed[0]
        return f"summary.json: {len(changed)} values differ, e.g. {k}: {a[k]!r} -> {b[k]!r}"
    if not extra and ref.read_bytes() != new.read_bytes():
        return "summary.json: same values, different bytes"
    return None


def compare_table(ref: Path, new: Path) -> tuple[str, str | None]:
    """('bytes' | 'values', error or None)."""
    if ref.read_bytes() == new.read_bytes():
        return "bytes", None
    a, b = pd.read_parquet(ref), pd.read_parquet(new)
    if list(a.columns) != list(b.columns):
        return "values", f"{ref.name}: columns {list(a.columns)} -> {list(b.columns)}"
    if list(a.dtypes) != list(b.dtypes):
        return "values", f"{ref.name}: dtypes differ"
    try:
        pd.testing.assert_frame_equal(a, b, check_exact=True)
    except AssertionError as e:
        return "values", f"{ref.name}: {str(e).splitlines()[0]}"
    return "values", None


def compare_all(ref: Path, new: Path, new_keys: set[str]) -> bool:
    names = sorted(p.name for p in ref.iterdir() if p.is_dir())
    missing = sorted({folder_name(p) for p in scenarios()} - set(names))
    ok = True
    if missing:
        print(f"  reference lacks {missing}")
        ok = False
    for name in names:
        errors, how = [], []
        if not (new / name).is_dir():
            print(f"  {name:<36} MISSING in {new}")
            ok = False
            continue
        err = compare_summary(ref / name / "summary.json", new / name / "summary.json", new_keys)
        if err:
            errors.append(err)
        for table in TABLES:
            kind, err = compare_table(ref / name / table, new / name / table)
            how.append(f"{table.split('.')[0]}={kind}")
            if err:
                errors.append(err)
        status = "ok" if not errors else "DIFFERS: " + "; ".join(errors)
        print(f"  {name:<36} {' '.join(how):<36} {status}")
        ok = ok and not errors
    print("all scenarios identical" if ok else "SOME SCENARIOS DIFFER")
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="simulate every shipped scenario into OUT")
    r.add_argument("out", type=Path)
    r.add_argument("--against", type=Path, help="then compare OUT with this reference folder")
    r.add_argument("--jobs", type=int, default=2)
    c = sub.add_parser("compare", help="compare two folders written by `run`")
    c.add_argument("ref", type=Path)
    c.add_argument("new", type=Path)
    for p in (r, c):
        p.add_argument("--new-key", action="append", default=[], help="a summary key allowed only in the new run")
    args = ap.parse_args()
    if args.cmd == "run":
        if not run_all(args.out, args.jobs):
            return 1
        if args.against is None:
            return 0
        return 0 if compare_all(args.against, args.out, set(args.new_key)) else 1
    return 0 if compare_all(args.ref, args.new, set(args.new_key)) else 1


if __name__ == "__main__":
    sys.exit(main())
