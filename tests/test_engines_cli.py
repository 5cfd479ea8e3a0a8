"""``servesim engines``: the same traffic through several presets, a comparison table and a CDF overlay."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from servesim.sim.cli import main
from servesim.sim.engine_presets import PRESETS
from servesim.sim.scenario import ScenarioError
from servesim.sim.verbs.engines import DEFAULT_PRESETS, parse_presets

SCENARIO = """\
name: engines-test
model: llama-3.1-8b
hardware: h100-sxm
scheduler: {preset: triton-dynamic, max_batch_size: 4, max_queue_delay_microseconds: 30000}
kv_cache: {block_size: 16, num_blocks: 120}
workload:
  num_requests: 30
  arrival: {process: poisson, rate: 4.0}
  prompt_len: {dist: uniform, min: 16, max: 400}
  output_len: {dist: uniform, min: 4, max: 48}
"""


@pytest.fixture
def scenario_file(tmp_path: Path) -> Path:
    p = tmp_path / "engines-test.yaml"
    p.write_text(SCENARIO)
    return p


def test_engines_writes_one_row_per_preset_the_cdf_overlay_and_run_folders(capsys, scenario_file, tmp_path):
    out = tmp_path / "cmp"
    code = main(["engines", str(scenario_file), "--presets", "vllm-v1,tensorrt-llm:MAX_UTILIZATION,triton-dynamic",
                 "--out", str(out), "--quiet"])
    captured = capsys.readouterr()
    stdout = captured.out
    assert code == 0
    table = pd.read_csv(out / "engines.csv")
    assert table["preset"].tolist() == ["vllm-v1", "tensorrt-llm:MAX_UTILIZATION", "triton-dynamic"]
    # 120 blocks of 16 cannot hold one request of Llama-3.1's 131,072-token context: vLLM would not
    # start; said once, for the vLLM row only, and the comparison is still made
    refusals = [line for line in captured.err.splitlines() if "would not start" in line]
    assert len(refusals) == 1 and refusals[0].startswith("warning: vllm-v1: vLLM would not start")
    assert pd.read_parquet(out / "engines.parquet")["preset"].tolist() == table["preset"].tolist()
    assert (out / "latency_cdf.png").stat().st_size > 0
    assert (table["completed"] + table["rejected"] == 30).all()
    for folder, preset in (("vllm-v1", "vllm-v1"), ("tensorrt-llm-MAX_UTILIZATION", "tensorrt-llm")):
        summary = json.loads((out / folder / "summary.json").read_text())
        assert summary["scheduler"] == preset
    for name in table["preset"]:
        assert name in stdout
    # the same arrivals went through every preset
    arrivals = [pd.read_parquet(out / f / "requests.parquet")["arrival_time"].to_numpy()
                for f in ("vllm-v1", "tensorrt-llm-MAX_UTILIZATION", "triton-dynamic")]
    assert all((a == arrivals[0]).all() for a in arrivals[1:])


def test_engines_keeps_kv_capacity_in_tokens_and_the_scenarios_own_preset_knobs(scenario_file, tmp_path):
    out = tmp_path / "cmp"
    assert main(["engines", str(scenario_file), "--presets", "hf-transformers,sglang,triton-dynamic",
                 "--out", str(out), "--quiet", "--no-plots"]) == 0
    table = pd.read_csv(out / "engines.csv").set_index("preset")
    tokens = table["kv_block_size"] * table["kv_num_blocks"]
    assert table.loc["hf-transformers", "kv_block_size"] == 256 and table.loc["sglang", "kv_block_size"] == 1
    assert (tokens <= 120 * 16).all() and (tokens > 120 * 16 - 256).all()
    written = (out / "triton-dynamic" / "scenario.yaml").read_text()
    assert "max_queue_delay_microseconds: 30000" in written  # the scenario's own triton settings


def test_engines_default_list_is_every_preset_and_variant():
    names = {c.knobs["preset"] for c in parse_presets(None)}
    assert names == set(PRESETS)
    assert len(parse_presets(None)) == len(DEFAULT_PRESETS)
    assert parse_presets("sglang:lpm")[0].knobs == {"preset": "sglang", "schedule_policy": "lpm"}


@pytest.mark.parametrize(("presets", "word"), [("vllm-v9", "vllm-v9"), ("triton-dynamic:x", "no variant"),
                                               ("sglang:sjf", "schedule_policy")])
def test_engines_bad_preset_is_a_one_line_error(capsys, scenario_file, tmp_path, presets, word):
    code = main(["engines", str(scenario_file), "--presets", presets, "--out", str(tmp_path / "o"), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and word in err and "Traceback" not in err


def test_parse_presets_rejects_duplicates():
    with pytest.raises(ScenarioError):
        parse_presets("vllm-v1,vllm-v1")
