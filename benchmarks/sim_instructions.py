"""Instructions the simulator executes, counted by valgrind: a per-step measure that does not drift.

Wall and CPU seconds on this 2-core VM drift by ±25 % within minutes, so a change that saves
5 % of a step cannot be seen in ``sim_speed.py``'s timings. The instructions one ``simulate`` call
executes can: callgrind counts them (run to run they agree within ~0.3 %), and only inside the
call — a child process loads servesim and the compiled step loops and runs a small warm-up
simulation uninstrumented, then switches counting on around the measured ``simulate`` call with
callgrind's client requests (a 3-line C shim compiled here with ``cc``). The workloads and the
code path are ``sim_speed.py``'s (``--iterations binned``, the compiled loops on, so the compiled
engine by default; ``--engine python`` counts the Python engine's).

Each requested size is one valgrind run (~100x slower than native inside the call: 4,000
ShareGPT-like requests take ~40 s, 8,000 conv-like ones ~90 s). With two or more sizes the table
adds the marginal cost between consecutive ones, per extra request and per extra step: a run's
drain at the end and its ramp at the start weigh on small runs, and the difference leaves them
out. Compare instructions, not seconds: interpreter-bound code runs at about the same
instructions per second before and after a change, but not a change that trades instructions for
cache misses (check those with ``sim_speed.py`` at scale).

    python benchmarks/sim_instructions.py --workload sharegpt|conv [--requests 4000 8000]
        [--engine auto|python|compiled]

Needs ``valgrind`` (with its headers, ``valgrind/callgrind.h``) and a C compiler on PATH; exits 2
naming what is missing.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NoReturn

SHIM = """#include <valgrind/callgrind.h>
void servesim_count_start(void) { CALLGRIND_ZERO_STATS; CALLGRIND_START_INSTRUMENTATION; }
void servesim_count_stop(void) { CALLGRIND_STOP_INSTRUMENTATION; CALLGRIND_DUMP_STATS_AT("servesim-simulate"); }
"""
TRIGGER = "Client Request: servesim-simulate"


def _fail(msg: str) -> NoReturn:
    print(f"sim_instructions.py: {msg}", file=sys.stderr)
    raise SystemExit(2)


def child(workload: str, requests: int, shim: str, engine: str) -> None:
    """Inside valgrind: warm up uninstrumented, then count one ``simulate`` call."""
    import ctypes

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import sim_speed
    from servesim.sim.simulate import simulate

    kw = {} if engine == "auto" else {"compiled": engine == "compiled"}
    simulate(sim_speed.scenario(workload, 300, None), progress=False, iterations="binned", **kw)  # imports, loops
    sc = sim_speed.scenario(workload, requests, None)
    lib = ctypes.CDLL(shim)
    lib.servesim_count_start()
    res = simulate(sc, progress=False, iterations="binned", **kw)
    lib.servesim_count_stop()
    print(f"steps {res.summary['num_iterations']}")


def count(workload: str, requests: int, shim: str, work: Path, engine: str) -> tuple[int, int]:
    """(instructions in the simulate call, engine steps) of one instrumented run."""
    out = work / f"{workload}-{requests}"
    out.mkdir()
    env = dict(os.environ, SERVESIM_JIT="1")
    proc = subprocess.run(
        ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}/cg.%p",
         sys.executable, __file__, "--child", workload, str(requests), shim, engine],
        capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        _fail(f"the valgrind run of {requests} {workload} requests failed: {tail}")
    steps = int(proc.stdout.split("steps")[-1].split()[0])
    for dump in out.glob("cg.*"):
        text = dump.read_text(errors="replace")
        if TRIGGER in text:
            for line in text.splitlines():
                if line.startswith("totals:"):
                    return int(line.split()[1]), steps
    _fail(f"no callgrind dump of the simulate call in {out}")


def main() -> None:
    if len(sys.argv) == 6 and sys.argv[1] == "--child":
        child(sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=["sharegpt", "conv"], default="sharegpt")
    ap.add_argument("--requests", type=int, nargs="+", default=[4000, 8000])
    ap.add_argument("--engine", choices=["auto", "python", "compiled"], default="auto",
                    help="auto: what simulate picks (the compiled engine, for these workloads); python: the "
                         "Python engine (engine.py), the yardstick for its per-step work")
    args = ap.parse_args()
    if any(n < 1 for n in args.requests):
        _fail("--requests must be >= 1")
    missing = [tool for tool in ("valgrind", "cc") if shutil.which(tool) is None]
    if missing:
        _fail(f"needs {' and '.join(missing)} on PATH (Debian: apt-get install valgrind gcc)")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "shim.c").write_text(SHIM)
        shim = work / "libservesim_count.so"
        cc = subprocess.run(["cc", "-O1", "-shared", "-fPIC", "-o", str(shim), str(work / "shim.c")],
                            capture_output=True, text=True)
        if cc.returncode != 0:
            msg = (cc.stderr.strip().splitlines() or ["cc failed"])[0]
            _fail(f"cannot build the callgrind shim ({msg}); valgrind's headers (valgrind/callgrind.h) "
                  f"are needed")
        sizes = sorted(set(args.requests))
        rows = [(n, *count(args.workload, n, str(shim), work, args.engine)) for n in sizes]
    print(f"{'workload':>9} {'requests':>9} {'steps':>8} {'instr M':>9} {'marginal M/1k req':>18} "
          f"{'marginal k/step':>16}")
    prev = None
    for n, ir, steps in rows:
        extra = ("", "")
        if prev is not None:
            dn, di, ds = n - prev[0], ir - prev[1], steps - prev[2]
            extra = (f"{di / dn / 1e3:.2f}", f"{di / ds / 1e3:.1f}" if ds > 0 else "-")
        print(f"{args.workload:>9} {n:>9} {steps:>8} {ir / 1e6:>9.1f} {extra[0]:>18} {extra[1]:>16}")
        prev = (n, ir, steps)


if __name__ == "__main__":
    main()
