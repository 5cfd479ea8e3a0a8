"""``servesim plan --target-rate`` on a disaggregated scenario: the fewest-GPU prefill:decode split."""

from __future__ import annotations

from pathlib import Path

import pytest
from servesim.sim.cli import main
from servesim.sim.scenario import load_scenario
from servesim.sim.verbs.plan import PlanSettings
from servesim.sim.verbs.plan_disagg import plan_disagg
from servesim.sim.verbs.slo import terms_from_scenario_slo

ROOT = Path(__file__).resolve().parent.parent


def test_plan_finds_the_fewest_gpus_and_every_smaller_split_fails():
    sc = load_scenario(ROOT / "scenarios/cluster/disagg.yaml")
    st = PlanSettings(terms_from_scenario_slo(sc.slo), seeds=1, window_s=20.0, min_requests=50)
    result = plan_disagg(sc, st, target_rate=30.0, max_gpus=5, progress=False)
    assert result.best is not None and result.gpus == 4
    passed = {(p, d) for p, d, _, point in result.points if point.passed}
    assert result.best in passed
    assert all(not point.passed for _, _, g, point in result.points if g < result.gpus)
    assert all(g <= result.gpus for _, _, g, _ in result.points)  # the search stops at the first passing level


def test_plan_cli_writes_the_split(tmp_path, capsys):
    code = main(["plan", str(ROOT / "scenarios/cluster/disagg.yaml"), "--target-rate", "5", "--seeds", "1",
                 "--duration", "20", "--min-requests", "50", "--quiet", "--out", str(tmp_path / "p")])
    out = capsys.readouterr().out
    assert code == 0
    assert "1 prefill + 1 decode instances (2 GPUs" in out
    assert (tmp_path / "p" / "plan_disagg.csv").is_file()


def test_plan_without_a_target_names_the_capacity_as_the_whole_deployments(tmp_path, capsys):
    # the disaggregated scenario runs its pools as given: its capacity is not one replica's
    code = main(["plan", str(ROOT / "scenarios/cluster/disagg.yaml"), "--seeds", "1", "--duration", "20",
                 "--min-requests", "50", "--tolerance", "0.3", "--quiet", "--no-plots", "--out", str(tmp_path / "p")])
    out = capsys.readouterr().out
    assert code == 0
    assert "req/s for the whole disaggregated deployment (1 prefill + 1 decode instances)" in out
    assert "per replica" not in out


def test_plan_disagg_json_is_an_object_not_a_quoted_string(tmp_path, capsys):
    import json

    assert main(["plan", str(ROOT / "scenarios/cluster/disagg.yaml"), "--target-rate", "5", "--max-gpus", "2",
                 "--seeds", "1", "--duration", "20", "--min-requests", "50", "--quiet",
                 "--out", str(tmp_path / "p")]) == 0
    answer = json.loads((tmp_path / "p" / "plan_disagg.json").read_text())
    assert isinstance(answer, dict) and (answer["prefill"], answer["decode"], answer["gpus"]) == (1, 1, 2)


@pytest.mark.parametrize("max_gpus", ["0", "1", "-3", "99999999999"])
def test_a_gpu_limit_below_one_split_or_absurdly_high_is_one_line_exit_2(tmp_path, capsys, max_gpus):
    code = main(["plan", str(ROOT / "scenarios/cluster/disagg.yaml"), "--target-rate", "5", "--max-gpus", max_gpus,
                 "--quiet", "--out", str(tmp_path / "p")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--max-gpus must be between 2" in err[0]
