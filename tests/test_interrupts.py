"""Ctrl-C and SIGTERM end a run with exit 130 and one line, and never leave a folder that looks complete."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from servesim.sim import metrics
from servesim.sim.scenario import load_scenario
from servesim.sim.simulate import simulate, write_results

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = ROOT / "scenarios" / "quickstart.yaml"


def start_cli(*args: str) -> subprocess.Popen:
    # a shell starts background jobs with SIGINT ignored, and Python then keeps ignoring it: undo that
    return subprocess.Popen([sys.executable, "-m", "servesim.sim.cli", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def wait_for_stderr(proc: subprocess.Popen, text: str, timeout_s: float = 90.0) -> str:
    """Read the child's stderr until ``text`` shows (e.g. a progress bar: tqdm shows it after 2 s of work)."""
    fd = proc.stderr.fileno()
    os.set_blocking(fd, False)
    deadline, seen = time.monotonic() + timeout_s, b""
    while time.monotonic() < deadline:
        try:
            seen += os.read(fd, 65536)
        except BlockingIOError:
            pass
        if text.encode() in seen:
            return seen.decode(errors="replace")
        if proc.poll() is not None:
            raise AssertionError(f"finished before it could be interrupted: {seen[-2000:]!r}")
        time.sleep(0.1)
    proc.kill()
    raise AssertionError(f"no {text!r} on stderr within {timeout_s} s")


def finish(proc: subprocess.Popen, timeout_s: float = 60.0) -> str:
    """Wait for the child; its whole stderr (what ``wait_for_stderr`` did not read yet)."""
    os.set_blocking(proc.stderr.fileno(), True)
    try:
        _, err = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
    return err.decode(errors="replace")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupted_run_exits_130_and_writes_no_summary(tmp_path, sig):
    out = tmp_path / "run"
    proc = start_cli("run", str(QUICKSTART), "--set", "workload.num_requests=200000", "--out", str(out), "--no-plots")
    try:
        wait_for_stderr(proc, "req")
        proc.send_signal(sig)
    finally:
        err = finish(proc)
    assert proc.returncode == 130, err
    last = err.strip().splitlines()[-1].split("\r")[-1].strip()
    assert last == f"servesim run: interrupted during the simulation; nothing written to {out}/", err
    assert "Traceback" not in err
    assert not list(tmp_path.rglob("summary.json"))


def test_write_cut_short_leaves_no_summary_even_over_an_old_run(tmp_path, monkeypatch):
    sc = load_scenario(QUICKSTART, ["workload.num_requests=50"])
    result = simulate(sc, progress=False)
    out = write_results(result, tmp_path / "run", plots=False)
    assert (out / "summary.json").exists()

    real = metrics.write_parquet
    calls = []

    def interrupted_on_second_table(df, path):
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(df, path)

    monkeypatch.setattr(metrics, "write_parquet", interrupted_on_second_table)
    with pytest.raises(KeyboardInterrupt):
        write_results(result, out, plots=False)
    assert not (out / "summary.json").exists()  # the old run's marker went first, the new one never came
    assert not [p.name for p in out.iterdir() if ".tmp-" in p.name]  # no temporary file left behind
    monkeypatch.setattr(metrics, "write_parquet", real)
    write_results(result, out, plots=False)
    assert (out / "summary.json").exists()
