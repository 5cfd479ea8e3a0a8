"""The GPU-session scripts' CPU paths: gpu_host_bound and gpu_graphs --cpu-smoke, live_steps_by_batch on shipped runs."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):  # noqa: ANN202
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_host_bound_cpu_smoke_writes_one_row_per_shape_and_thread_count(tmp_path, capsys):
    hb = _load("gpu_host_bound")
    assert hb.main(["--cpu-smoke", "--reps", "1", "--threads", "1", "2", "--out", str(tmp_path)]) == 0
    rows = pd.read_csv(tmp_path / "host_bound.csv")
    assert set(rows["threads"]) == {1, 2} and len(rows) == 2 * rows["shape"].nunique()
    assert (rows["wall_ms"] > 0).all() and (rows["enqueue_ms"] > 0).all()
    assert rows["gpu_ms"].isna().all()  # no graph replay without a GPU: reported as missing, not as 0
    for col in ("idle_0ms_ms", "idle_10ms_ms", "idle_50ms_ms", "burst_ms"):  # what ran before a step
        assert (rows[col] > 0).all(), col
    assert "decode 8 x 1024" in capsys.readouterr().out


def test_host_bound_refuses_to_run_without_a_gpu_unless_told(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert _load("gpu_host_bound").main(["--out", str(tmp_path)]) == 2
    assert "--cpu-smoke" in capsys.readouterr().err


def test_live_steps_by_batch_reads_the_shipped_h200_runs(capsys):
    folders = sorted((ROOT / "results" / "gpu" / "h200" / "live").iterdir())
    assert _load("live_steps_by_batch").main([str(f) for f in folders]) == 0
    out = capsys.readouterr().out
    b = json.loads((ROOT / "results/gpu/h200/live/B-threads2/validation.json").read_text())
    tpot = next(m for m in b["metrics"] if m["metric"] == "median_tpot_ms")
    assert "B-threads2 #1" in out and "B-threads2 #2" in out and "C-threads16" in out
    assert f"{tpot['live']:.1f}" in out and f"{tpot['sim']:.1f}" in out


def test_servesim_commit_names_a_copied_tree_from_the_environment(monkeypatch):
    from servesim.calibration.validate import servesim_commit

    monkeypatch.setenv("SERVESIM_COMMIT", "0123abc")
    assert servesim_commit() == ("0123abc", None)
    monkeypatch.delenv("SERVESIM_COMMIT")
    commit, _ = servesim_commit()
    assert commit != "0123abc"


def test_graphs_cpu_smoke_compares_the_padded_path_with_the_eager_one(tmp_path, capsys):
    assert _load("gpu_graphs").main(["--cpu-smoke", "--reps", "1", "--out", str(tmp_path)]) == 0
    rows = pd.read_csv(tmp_path / "graphs.csv")
    assert len(rows) == 6 and (rows["padded"] >= rows["rows"]).all() and set(rows["padded"]) == {1, 4, 8}
    assert (rows["max_rel_diff"] < 1e-4).all() and (rows["same_tokens"] == 1.0).all()
    assert (rows["eager_ms"] > 0).all() and (rows["graph_ms"] > 0).all()
    assert "captured=False" in capsys.readouterr().out
    assert _load("gpu_graphs").main(["--cpu-smoke", "--piecewise", "--reps", "1", "--out", str(tmp_path)]) == 0
    rows = pd.read_csv(tmp_path / "graphs.csv")
    steps = rows[rows["chunk"] > 0]  # a 20-token prefill and a 40-token chunk beside 3 decodes, at 2 contexts
    assert len(steps) == 4 and (steps["padded"] >= steps["rows"] + steps["chunk"]).all()
    assert (steps["max_rel_diff"] < 1e-4).all() and (steps["same_tokens"] == 1.0).all()

