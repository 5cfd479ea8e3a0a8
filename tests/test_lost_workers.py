"""Workers that die or are misconfigured: one line each, and never a point silently missing."""

from __future__ import annotations

import importlib.util
import os
import threading
import time
from pathlib import Path

import pytest
import yaml
from servesim.sim.cli import main
from servesim.sim.verbs import sweep as sweep_mod
from servesim.sim.verbs.parallel import Outcome, TaskRunner, guarded
from servesim.sim.verbs.sweep import POINTS_FILE, parse_grid, run_sweep
from test_sweep import RAW

HAS_RAY = importlib.util.find_spec("ray") is not None


def die_on_odd(x: int) -> int:
    """A task whose worker process dies (like an OOM kill) on odd inputs."""
    if x % 2:
        os._exit(9)
    return x * 10


def test_a_task_whose_worker_dies_twice_comes_back_lost_and_the_others_finish():
    finished = []
    with TaskRunner("local", workers=2, progress=False) as runner:
        outcomes = runner.map(die_on_odd, [0, 1, 2, 3, 4], on_done=lambda i, o: finished.append(i))
    assert [o.value for o in outcomes if o.ok] == [0, 20, 40]
    assert [o.lost for o in outcomes] == [False, True, False, True, False]
    assert all(o.error.startswith("its worker process died, also when run alone (killed or out of memory)") for o in outcomes if o.lost)
    assert sorted(finished) == [0, 1, 2, 3, 4]  # every task reported once, the lost ones too


def sleep_then(x: int) -> int:
    time.sleep(30)
    return x


def test_an_interrupted_pool_leaves_no_thread_behind_for_the_exit_hook():
    # A pool manager thread still running at interpreter exit races the exit hook for its wake-up
    # pipe: the "Exception ignored ... Bad file descriptor" traceback CI once printed after sweep's
    # "interrupted" line. Interrupting a runner must join it.
    from concurrent.futures import process

    before = set(threading.enumerate())
    with pytest.raises(KeyboardInterrupt):
        with TaskRunner("local", workers=2, progress=False) as runner:
            runner._pool.submit(sleep_then, 1)
            time.sleep(1.0)  # the task is running in a worker
            raise KeyboardInterrupt
    left = [t for t in process._threads_wakeups if t.is_alive() and t not in before]
    assert not left, f"pool threads still running after the interrupt: {left}"


class LosesPointOne(TaskRunner):
    """Runs in this process, but the second task's worker 'dies' every time."""

    def map(self, fn, tasks, desc=None, on_done=None):  # noqa: ANN001, ANN201 - the parent's signature
        out = []
        for i, t in enumerate(tasks):
            o = Outcome(error="its worker process died, also when run alone", lost=True) \
                if i == 1 else guarded(fn, t)
            on_done(i, o)
            out.append(o)
        return out


def test_a_lost_point_is_a_row_saying_so_and_resume_runs_it(tmp_path: Path, monkeypatch):
    grid = parse_grid(["seed=0,1,2"])
    monkeypatch.setattr(sweep_mod, "TaskRunner", LosesPointOne)
    df = run_sweep(RAW, grid, workers=1, progress=False, out_dir=tmp_path)
    assert list(df["status"]) == ["ok", "lost", "ok"] and df.loc[1, "error"].startswith("its worker process died")
    assert len((tmp_path / POINTS_FILE).read_text().splitlines()) == 1 + 2  # spec + the two that finished
    monkeypatch.undo()
    df = run_sweep(RAW, grid, workers=1, progress=False, out_dir=tmp_path, resume=True)
    assert list(df["status"]) == ["ok"] * 3 and df.attrs["resumed_points"] == 2


@pytest.mark.parametrize("verb", ["sweep", "plan", "compare"])
def test_workers_zero_is_a_one_line_error_not_auto(verb, tmp_path: Path, capsys):
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(RAW))
    args = {"sweep": ["sweep", str(path), "--grid", "seed=0,1"], "plan": ["plan", str(path)],
            "compare": ["compare", str(path), str(path)]}[verb]
    assert main([*args, "--workers", "0", "--quiet", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err == (f"servesim {verb}: error: --workers 0: give 1 or more worker processes (1 runs in this "
                   f"process), or leave it out for one per CPU core ({os.cpu_count() and len(os.sched_getaffinity(0))})\n")
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(not HAS_RAY, reason="ray is an optional extra (pip install -e '.[ray]')")
def test_ray_auto_with_no_cluster_running_is_one_line(tmp_path: Path, capsys, monkeypatch):
    import ray

    if ray.is_initialized() or Path("/tmp/ray/ray_current_cluster").exists():
        pytest.skip("a Ray cluster is running here, and --ray auto would join it")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(RAW))
    code = main(["sweep", str(path), "--grid", "seed=0,1", "--ray", "auto", "--quiet", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("servesim sweep: error: --ray auto: no Ray cluster to join")
    assert not (tmp_path / "o").exists()  # nothing written for a sweep that never started
