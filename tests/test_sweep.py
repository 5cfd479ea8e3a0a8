"""``servesim sweep``: the grid, one row per point in grid order, failures kept in their row, and the
same table from local processes and from a local Ray cluster."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pandas as pd
import pytest
import yaml
from servesim.sim.cli import main
from servesim.sim.scenario import ScenarioError
from servesim.sim.verbs.sweep import comparable, grid_points, parse_grid, run_sweep

# Small and fast: a constant-time cost model and 40 requests per point.
RAW = {
    "name": "sweep-test",
    "seed": 0,
    "model": "tiny",
    "hardware": "cpu-2core",
    "cost_model": {"type": "constant", "step_ms": 5.0, "per_token_ms": 0.02},
    "scheduler": {"type": "chunked", "max_num_seqs": 16, "max_num_batched_tokens": 512},
    "kv_cache": {"num_blocks": 4000, "block_size": 16},
    "workload": {
        "num_requests": 40,
        "arrival": {"process": "poisson", "rate": 20.0},
        "prompt_len": {"dist": "uniform", "min": 16, "max": 400},
        "output_len": {"dist": "uniform", "min": 2, "max": 40},
    },
    "slo": {"ttft_ms": 200, "tpot_ms": 20},
}
# 3 schedulers x 2 budgets x 2 seeds = 12 points
GRID = ["scheduler.type=static,continuous,chunked", "scheduler.max_num_batched_tokens=512,2048", "seed=0,1"]
HAS_RAY = importlib.util.find_spec("ray") is not None


def sweep(backend: str = "local", workers: int = 1, grid=GRID) -> pd.DataFrame:
    return run_sweep(RAW, parse_grid(grid), backend=backend, workers=workers, progress=False)


def test_grid_values_parse_as_yaml_and_lists_stay_whole():
    axes = parse_grid(["scheduler.type=static, chunked", "slo={ttft_ms: 100, tpot_ms: 5},{ttft_ms: 200}",
                       "kv_cache.block_size=16,32"])
    assert axes[0].values == ("static", "chunked")
    assert axes[1].values == ({"ttft_ms": 100, "tpot_ms": 5}, {"ttft_ms": 200})
    assert axes[2].values == (16, 32)
    # the first axis varies slowest
    assert grid_points(axes)[:3] == [[0, 0, 0], [0, 0, 1], [0, 1, 0]]


@pytest.mark.parametrize("item", ["scheduler.type", "=a,b", "scheduler.type="])
def test_bad_grid_items_are_one_line_errors(item: str):
    with pytest.raises(ScenarioError, match="expected key.path=v1,v2"):
        parse_grid([item])


def test_sweep_rows_follow_grid_order_with_each_points_values_and_summary():
    df = sweep()
    assert len(df) == 12 and list(df["point"]) == list(range(12))
    assert list(df.columns[:4]) == ["point", "scheduler.type", "scheduler.max_num_batched_tokens", "seed"]
    assert list(df["scheduler.type"]) == ["static"] * 4 + ["continuous"] * 4 + ["chunked"] * 4
    assert (df["status"] == "ok").all() and (df["completed"] == 40).all()
    # the same point run alone gives the same numbers: each row is that point's own run
    alone = run_sweep(RAW, parse_grid(["scheduler.type=continuous", "scheduler.max_num_batched_tokens=2048",
                                       "seed=1"]), progress=False)
    pd.testing.assert_frame_equal(comparable(alone).drop(columns="point"),
                                  comparable(df.iloc[[7]]).drop(columns="point").reset_index(drop=True))


def test_local_process_pool_gives_the_same_rows_as_one_process():
    pd.testing.assert_frame_equal(comparable(sweep(workers=2)), comparable(sweep(workers=1)))


def test_a_failing_point_keeps_its_row_and_error_and_the_rest_run():
    # max_num_seqs=0 does not validate, so those points fail with the field named
    df = sweep(grid=["scheduler.type=continuous,chunked", "scheduler.max_num_seqs=0,8"])
    assert list(df["status"]) == ["failed", "ok", "failed", "ok"]
    bad = df[df["status"] == "failed"]
    assert all("scheduler.max_num_seqs" in e and "\n" not in e for e in bad["error"])
    assert bad["completed"].isna().all()
    assert (df.loc[df["status"] == "ok", "completed"] == 40).all()


def test_a_grid_where_no_point_validates_fails_up_front_naming_the_bad_key(capsys, tmp_path: Path):
    with pytest.raises(ScenarioError, match=r"none of the 4 grid points.*scheduler\.max_num_seq\b"):
        sweep(grid=["scheduler.type=continuous,chunked", "scheduler.max_num_seq=4,8"])
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(RAW))
    code = main(["sweep", str(path), "--grid", "scheduler.max_num_seq=4,8", "--workers", "1", "--quiet",
                 "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code != 0 and "max_num_seq" in err and "Traceback" not in err
    assert not (tmp_path / "out" / "sweep.parquet").exists()


def test_sweep_cli_writes_parquet_csv_and_plot_and_exit_status_says_a_point_failed(capsys, tmp_path: Path):
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(RAW))
    out = tmp_path / "sweep"
    code = main(["sweep", str(path), "--grid", "scheduler.type=static,chunked", "--grid",
                 "scheduler.max_num_seqs=0,4", "--workers", "1", "--quiet", "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 1
    assert captured.err.count("failed") == 2 and "Traceback" not in captured.err
    table = pd.read_parquet(out / "sweep.parquet")
    assert len(table) == 4 and list(table["status"]) == ["failed", "ok", "failed", "ok"]
    assert len(pd.read_csv(out / "sweep.csv")) == 4
    assert (out / "sweep.png").stat().st_size > 10_000
    code = main(["sweep", str(path), "--grid", "scheduler.type=static,chunked", "--workers", "1", "--quiet",
                 "--no-plots", "--out", str(tmp_path / "ok")])
    assert code == 0


@pytest.mark.skipif(not HAS_RAY, reason="ray is an optional extra (pip install -e '.[ray]')")
def test_a_local_ray_cluster_gives_identical_rows_to_local_processes(capsys, tmp_path: Path):
    import ray

    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(RAW))
    grid = [a for g in GRID for a in ("--grid", g)]
    assert main(["sweep", str(path), *grid, "--workers", "2", "--quiet", "--no-plots",
                 "--out", str(tmp_path / "local")]) == 0
    # a 2-CPU local cluster started here; `--ray` joins it instead of starting its own
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        assert main(["sweep", str(path), *grid, "--ray", "--quiet", "--no-plots", "--out", str(tmp_path / "ray")]) == 0
        assert ray.is_initialized()  # the sweep left the cluster it did not start running
    finally:
        ray.shutdown()
    assert "on ray" in capsys.readouterr().out
    local, on_ray = (pd.read_parquet(tmp_path / d / "sweep.parquet") for d in ("local", "ray"))
    assert len(on_ray) == 12 and (on_ray["status"] == "ok").all()
    pd.testing.assert_frame_equal(comparable(on_ray), comparable(local))
    pd.testing.assert_frame_equal(comparable(local), comparable(sweep(workers=1)), check_dtype=False)


def test_ci_runs_the_readme_install_command_which_installs_the_ray_extra():
    repo = Path(__file__).resolve().parent.parent
    readme = (repo / "README.md").read_text()
    install = next(line for line in readme.splitlines() if line.startswith("python3 -m venv .venv"))
    assert "ray" in install.split("pip install", 1)[1]
    assert install in (repo / ".ci" / "run").read_text().splitlines()
