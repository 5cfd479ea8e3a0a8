"""A sweep survives interruption: SIGTERM mid-sweep, then ``--resume``, gives the table of a sweep
that nothing interrupted; a worker process killed mid-task (local or Ray) costs nothing but time."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import pytest
import yaml
from servesim.sim.cli import main
from servesim.sim.verbs.sweep import POINTS_FILE, WALL_COLUMNS
from test_sweep import RAW

ROOT = Path(__file__).resolve().parent.parent
# 8 points of about half a second each: long enough to stop a sweep in the middle
SLOW_RAW = {**RAW, "workload": {**RAW["workload"], "num_requests": 1500}}
GRID = ["--grid", "scheduler.type=continuous,chunked", "--grid", "seed=0,1,2,3"]
HAS_RAY = importlib.util.find_spec("ray") is not None


@pytest.fixture(scope="module")
def scenario(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("scenario") / "s.yaml"
    path.write_text(yaml.safe_dump(SLOW_RAW))
    return path


@pytest.fixture(scope="module")
def reference(scenario, tmp_path_factory) -> tuple[Path, str]:
    """The sweep run start to finish with nothing interrupted: its folder and its printed table."""
    out = tmp_path_factory.mktemp("reference") / "sweep"
    stdout = run_cli_here(["sweep", str(scenario), *GRID, "--workers", "2", "--quiet", "--no-plots", "--out", str(out)])
    return out, printed_table(stdout)


def run_cli_here(argv: list[str]) -> str:
    """``main(argv)`` in this process; its stdout (exit status must be 0)."""
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(argv)
    assert code == 0, buf.getvalue()
    return buf.getvalue()


def printed_table(stdout: str) -> str:
    """The table lines of sweep's output (between the header line and the 'results in' line; Ray may
    print a line of its own about the retried task before them)."""
    lines = stdout.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("servesim sweep:"))
    return "\n".join(lines[head + 1:-1])


def table_bytes(folder: Path) -> bytes:
    """sweep.csv without the wall-clock column: what must be identical between equal sweeps."""
    df = pd.read_csv(folder / "sweep.csv")
    return df.drop(columns=list(WALL_COLUMNS)).to_csv(index=False).encode()


def recorded_points(folder: Path, filename: str = POINTS_FILE) -> list[dict]:
    lines = (folder / filename).read_text().splitlines()
    return [json.loads(line) for line in lines[1:]]


def start_cli_at(argv: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "servesim.sim.cli", *argv], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def start_sweep(scenario: Path, out: Path, *extra: str) -> subprocess.Popen:
    return start_cli_at(["sweep", str(scenario), *GRID, "--quiet", "--no-plots", "--out", str(out), *extra])


def wait_for_points(proc: subprocess.Popen, out: Path, n: int, timeout_s: float = 120.0,
                    filename: str = POINTS_FILE) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (out / filename).exists() and len(recorded_points(out, filename)) >= n:
            return
        if proc.poll() is not None:
            raise AssertionError(f"the sweep ended before {n} points: {proc.communicate()}")
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"fewer than {n} points recorded within {timeout_s} s")


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def children(pid: int) -> list[int]:
    """Live child processes of ``pid`` (Linux /proc)."""
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            kids.append(int(stat.parent.name))
    return kids


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        kids = children(todo.pop())
        out += kids
        todo += kids
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def stop_midway(proc: subprocess.Popen, out: Path, n: int, filename: str = POINTS_FILE,
                before: Callable[[], object] = lambda: None) -> tuple[str, object]:
    """SIGTERM ``proc`` once ``n`` tasks are recorded (``before()`` runs just before); its stderr and
    what ``before`` returned."""
    try:
        wait_for_points(proc, out, n, filename=filename)
        seen = before()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    return err, seen


def local_workers(parent: int) -> list[int]:
    """The pool's worker processes: the children of the sweep's fork server."""
    servers = [p for p in descendants(parent) if "forkserver" in cmdline(p)]
    return [w for s in servers for w in children(s)]


def test_sigterm_mid_sweep_then_resume_gives_the_uninterrupted_table(scenario, reference, tmp_path):
    out = tmp_path / "sweep"
    proc = start_sweep(scenario, out, "--workers", "2")
    err, workers = stop_midway(proc, out, 2, before=lambda: local_workers(proc.pid))
    assert workers, "expected a pool of worker processes"
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "Exception ignored" not in err, err
    done = len(recorded_points(out))
    assert 2 <= done < 8, "the sweep was meant to be stopped in the middle"
    assert err.strip().splitlines()[-1] == (
        f"servesim sweep: interrupted: {done} of 8 points finished, recorded in {out / POINTS_FILE}; "
        f"the same command with --resume runs the other {8 - done}"), err
    assert not (out / "sweep.csv").exists() and not (out / "sweep.parquet").exists()
    assert not [w for w in workers if alive(w)], "worker processes outlived the sweep"

    first = recorded_points(out)
    stdout = run_cli_here(["sweep", str(scenario), *GRID, "--workers", "2", "--quiet", "--no-plots", "--out", str(out),
                           "--resume"])
    assert f"resumed: {done} points from points.jsonl" in stdout.splitlines()[0]
    assert recorded_points(out)[:done] == first  # the finished points were not run again
    assert len(recorded_points(out)) == 8
    ref_out, ref_table = reference
    assert table_bytes(out) == table_bytes(ref_out)
    assert printed_table(stdout) == ref_table


def test_resume_refuses_a_folder_that_recorded_another_sweep(scenario, reference, tmp_path, capsys):
    ref_out, _ = reference
    other_grid = ["--grid", "scheduler.type=continuous,chunked", "--grid", "seed=0,1,2"]
    code = main(["sweep", str(scenario), *other_grid, "--quiet", "--no-plots", "--out", str(ref_out), "--resume"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "records a different sweep (grid differ)" in err
    code = main(["sweep", str(scenario), *GRID, "--set", "seed=5", "--quiet", "--no-plots", "--out", str(ref_out),
                 "--resume"])
    assert code == 2 and "(--set overrides differ)" in capsys.readouterr().err
    assert main(["sweep", str(scenario), *GRID, "--quiet", "--no-plots", "--out", str(tmp_path / "none"),
                 "--resume"]) == 2
    assert "nothing to resume" in capsys.readouterr().err
    assert (ref_out / "sweep.csv").exists() and len(recorded_points(ref_out)) == 8  # a refusal changes nothing


def test_a_torn_last_line_is_dropped_and_that_point_run_again(scenario, reference, tmp_path):
    ref_out, ref_table = reference
    out = tmp_path / "sweep"
    out.mkdir()
    lines = (ref_out / POINTS_FILE).read_text().splitlines(keepends=True)
    (out / POINTS_FILE).write_text("".join(lines[:4]) + lines[4][: len(lines[4]) // 2])  # killed mid-write
    stdout = run_cli_here(["sweep", str(scenario), *GRID, "--workers", "1", "--quiet", "--no-plots", "--out", str(out),
                           "--resume"])
    assert "resumed: 3 points" in stdout.splitlines()[0]
    assert table_bytes(out) == table_bytes(ref_out) and printed_table(stdout) == ref_table


def test_a_killed_local_worker_is_retried_and_the_table_is_complete(scenario, reference, tmp_path):
    out = tmp_path / "sweep"
    proc = start_sweep(scenario, out, "--workers", "2")
    try:
        wait_for_points(proc, out, 1)
        victim = local_workers(proc.pid)[0]
        os.kill(victim, signal.SIGKILL)
        stdout, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert not alive(victim)
    ref_out, ref_table = reference
    assert table_bytes(out) == table_bytes(ref_out)
    assert printed_table(stdout) == ref_table


@pytest.mark.slow
@pytest.mark.skipif(not HAS_RAY, reason="ray is an optional extra (pip install -e '.[ray]')")
def test_a_ray_worker_killed_mid_task_is_retried_and_the_table_is_identical(scenario, reference, tmp_path):
    out = tmp_path / "sweep"
    proc = start_sweep(scenario, out, "--ray")
    try:
        deadline, victim = time.monotonic() + 180, None
        while victim is None and time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()
            busy = [p for p in descendants(proc.pid) if cmdline(p).startswith("ray::guarded")]
            victim = busy[0] if busy else None
            time.sleep(0.05)
        assert victim is not None, "no Ray worker ran a sweep point"
        before = len(recorded_points(out)) if (out / POINTS_FILE).exists() else 0
        os.kill(victim, signal.SIGKILL)  # mid-task: its title says it is running one
        stdout, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert before < 8
    assert proc.returncode == 0, err
    assert "Task guarded failed" in stdout + err  # Ray saw the worker die and ran the task again
    ref_out, ref_table = reference
    assert table_bytes(out) == table_bytes(ref_out)
    assert printed_table(stdout) == ref_table
