"""servesim validate --against: measured runs read, clocks aligned, the workload rebuilt and simulated."""

from __future__ import annotations

import contextlib
import io
import json
import math
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from servesim.calibration.measured_run import (
    RunFileError,
    hardware_preset,
    model_preset,
    read_llmservingsim_summary,
    read_run,
)
from servesim.calibration.validate_against import measured_summary, vllm_kv_blocks
from servesim.sim.cli import main
from servesim.sim.scenario import load_scenario, scenario_from_dict
from servesim.sim.simulate import simulate

STEP = 0.010  # the constant cost model below: every step takes 10 ms
CONSTANT = ["--set", "cost_model.type=constant", "--set", f"cost_model.step_ms={STEP * 1e3:g}"]
SHARED_RUNS = Path(__file__).resolve().parents[2] / "shared" / "data" / "gpu" / "llmservingsim" / "runs"


def write_run(folder: Path, requests: list[dict], model: str = "meta-llama/Llama-3.1-8B", gpu: str = "RTXPRO6000",
              meta_extra: dict | None = None, tp: int = 1) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    meta = {"model": model, "vllm_version": "0.19.0",
            "engine_kwargs": {"model": model, "tensor_parallel_size": 1, "data_parallel_size": 1,
                              "max_num_seqs": 8, "max_num_batched_tokens": 512, "max_model_len": None}}
    meta.update(meta_extra or {})
    (folder / "meta.json").write_text(json.dumps(meta))
    (folder / "llmservingsim_config.json").write_text(json.dumps(
        {"nodes": [{"instances": [{"hardware": gpu, "tp_size": tp}]}]}))
    (folder / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in requests))
    return folder


def isolated_requests(n: int = 4, client_offset: float = 1.7e9, engine_offset: float = 5000.0,
                      transport: float = 0.002) -> list[dict]:
    """Requests far apart, each prefilled in one step and decoded one token per step: exactly what a
    10 ms constant cost model simulates. Client clock and engine clock differ by a large offset."""
    rows = []
    for i in range(n):
        arrival = 2.0 * i
        out = 5 + i
        queued = arrival + transport + (0.001 if i == 2 else 0.0)  # one request waited for a step boundary
        rows.append({"request_id": f"r{i}", "input_toks": 100 + 10 * i, "output_toks": out,
                     "arrival_time": client_offset + arrival, "queued_ts": engine_offset + queued,
                     "scheduled_ts": engine_offset + queued, "first_token_ts": engine_offset + arrival + transport + STEP,
                     "last_token_ts": engine_offset + arrival + transport + out * STEP})
    return rows


def run_cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


# ---- names ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, preset", [
    ("meta-llama/Llama-3.1-8B", "llama-3.1-8b"), ("Qwen/Qwen3-32B", "qwen3-32b"),
    ("meta-llama/Meta-Llama-3-8B-Instruct", "llama-3-8b"), ("meta-llama/Llama-2-7b-hf", "llama-2-7b"),
    ("/models/Llama-3.1-8B/", "llama-3.1-8b"), ("mistralai/Mistral-7B-v0.3", "mistral-7b"),
    ("google/gemma-2-9b", None), ("meta-llama/Llama-2-7b-chat-hf", "llama-2-7b"),
    ("mistralai/Mistral-7B-Instruct-v0.3", "mistral-7b"), ("Qwen/Qwen2.5-7B-Instruct", "qwen2.5-7b"),
])
def test_hugging_face_ids_map_to_model_presets(name, preset):
    assert model_preset(name) == preset


@pytest.mark.parametrize("name, preset", [
    ("RTXPRO6000", "rtx-pro-6000"), ("NVIDIA RTX PRO 6000 Blackwell Server Edition", "rtx-pro-6000"),
    ("RTX4090", "rtx-4090"), ("NVIDIA H100 80GB HBM3", "h100-sxm"), ("h200", "h200"), ("TPUv5e", None),
    ("NVIDIA A100-SXM4-80GB", "a100-80g"), ("A100", "a100-80g"), ("NVIDIA GeForce RTX 4090", "rtx-4090"),
    # variants whose memory or bandwidth differ from the preset's have none: the user must name one
    ("NVIDIA A100-SXM4-40GB", None), ("NVIDIA A100-PCIE-40GB", None), ("NVIDIA A100 80GB PCIe", None),
    ("NVIDIA H100 PCIe", None),
    ("NVIDIA H100 NVL", None), ("NVIDIA GH200 480GB", None),
    ("NVIDIA RTX PRO 6000 Blackwell Workstation Edition", "rtx-pro-6000"),
    ("NVIDIA RTX PRO 6000 Blackwell Max-Q Workstation Edition", None), ("NVIDIA GeForce RTX 4090 D", None),
    ("NVIDIA GeForce RTX 4090 Laptop GPU", None),
])
def test_gpu_names_map_to_hardware_presets(name, preset):
    assert hardware_preset(name) == preset


# ---- the LLMServingSim format -------------------------------------------------------------------------
def test_client_arrivals_are_moved_onto_the_engine_clock_by_the_smallest_offset(tmp_path):
    run = read_run(write_run(tmp_path / "run", isolated_requests()))
    df = run.requests
    assert run.model == "llama-3.1-8b" and run.hardware == "rtx-pro-6000" and run.tensor_parallel == 1
    np.testing.assert_allclose(df["arrival_time"], [0.0, 2.0, 4.0, 6.0], atol=1e-6)
    # TTFT from the engine-side arrival: one step; the request that waited 1 ms for a step keeps it
    np.testing.assert_allclose(df["ttft"], STEP, atol=1e-6)
    np.testing.assert_allclose(df["ttft_from_queued"], [STEP, STEP, STEP - 0.001, STEP], atol=1e-6)
    np.testing.assert_allclose(df["tpot"], STEP, atol=1e-6)
    np.testing.assert_allclose(df["e2e"], (5 + np.arange(4)) * STEP, atol=1e-6)
    assert run.clock["queued_after_arrival_ms"]["max"] == pytest.approx(1.0, abs=1e-3)
    assert run.scheduler == {"max_num_seqs": 8, "max_num_batched_tokens": 512}
    assert any("num_blocks" in n for n in run.notes)


def test_a_request_line_without_a_field_is_a_one_line_error_naming_file_line_and_field(tmp_path):
    rows = isolated_requests()
    del rows[2]["first_token_ts"]
    folder = write_run(tmp_path / "run", rows)
    with pytest.raises(RunFileError, match=r"requests\.jsonl:3: missing field 'first_token_ts'"):
        read_run(folder)
    code, _, err = run_cli("validate", "--against", str(folder), "--out", str(tmp_path / "o"), "--no-plots")
    assert code == 2
    assert err.count("\n") == 1 and "requests.jsonl:3: missing field 'first_token_ts'" in err


@pytest.mark.parametrize("change, message", [
    (lambda m: m["engine_kwargs"].pop("max_num_seqs"), "missing field 'engine_kwargs.max_num_seqs'"),
    (lambda m: m.pop("engine_kwargs"), "missing field 'engine_kwargs'"),
])
def test_meta_without_engine_settings_is_a_one_line_error(tmp_path, change, message):
    folder = write_run(tmp_path / "run", isolated_requests())
    meta = json.loads((folder / "meta.json").read_text())
    change(meta)
    (folder / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(RunFileError, match=message):
        read_run(folder)


def test_timestamps_out_of_order_and_bad_json_name_their_line(tmp_path):
    rows = isolated_requests()
    rows[1]["last_token_ts"] = rows[1]["first_token_ts"] - 1
    with pytest.raises(RunFileError, match=r"requests\.jsonl:2: timestamps out of order"):
        read_run(write_run(tmp_path / "a", rows))
    folder = write_run(tmp_path / "b", isolated_requests())
    with (folder / "requests.jsonl").open("a") as f:
        f.write("{not json\n")
    with pytest.raises(RunFileError, match=r"requests\.jsonl:5: not valid JSON"):
        read_run(folder)


@pytest.mark.parametrize("value", [1e30, 10.5])
def test_a_token_count_that_is_no_length_names_its_line(tmp_path, value):
    # 1e30 raised 'the simulated workload differs from the run's (a servesim bug)'; 10.5 was truncated
    rows = isolated_requests()
    rows[0]["input_toks"] = value
    with pytest.raises(RunFileError, match=r"requests\.jsonl:1: field 'input_toks' must be a whole number of tokens"):
        read_run(write_run(tmp_path / "a", rows))


def test_llmservingsim_summary_rows_become_servesim_keys(tmp_path):
    path = tmp_path / "llmservingsim_summary.txt"
    path.write_text("Metric   vLLM   Sim   Diff%\n-----\nTTFT Mean   7097.2   6815.7   -4.0%\n"
                    "TPOT P90   36.5   36.7   +0.5%\nLatency Median   29615.6   29248.8   -1.2%\n")
    ref = read_llmservingsim_summary(path)
    assert ref == {"mean_ttft_ms": {"real": 7097.2, "sim": 6815.7, "error_pct": -4.0},
                   "p90_tpot_ms": {"real": 36.5, "sim": 36.7, "error_pct": 0.5},
                   "median_e2el_ms": {"real": 29615.6, "sim": 29248.8, "error_pct": -1.2}}



@pytest.mark.parametrize("folder_name, summary", [
    ("llama-3.1-8b-rtx4090-tp1", "validation/summary.txt"),
    ("RTX4090-Llama-3.1-8B", "validation/rtx4090_summary.txt"),
])
def test_a_run_folder_in_the_bench_harness_layout_names_its_gpu_and_summary(tmp_path, folder_name, summary):
    folder = write_run(tmp_path / folder_name, isolated_requests())
    (folder / "llmservingsim_config.json").unlink()  # the GPU only in the folder's name
    (folder / summary).parent.mkdir(parents=True, exist_ok=True)
    (folder / summary).write_text("Metric   vLLM   Sim   Diff%\nTTFT Mean   70.0   63.0   -10.0%\n")
    run = read_run(folder)
    assert run.hardware == "rtx-4090"
    assert run.reference == {"mean_ttft_ms": {"real": 70.0, "sim": 63.0, "error_pct": -10.0}}
    assert run.reference_source == str(folder / summary)

def test_a_run_in_the_layout_llmservingsim_commits_its_examples_in_is_read(tmp_path):
    """bench/examples/<GPU>/<model>/: the vLLM files in vllm/, the cluster config config.json, LLMServingSim's
    summary in validation/; the run is named after both folders and simulates like the flat copy."""
    flat = write_run(tmp_path / "flat" / "RTXPRO6000-Llama-3.1-8B", isolated_requests())
    example = tmp_path / "examples" / "RTXPRO6000" / "Llama-3.1-8B"
    (example / "vllm").mkdir(parents=True)
    (example / "validation").mkdir()
    for f in ("meta.json", "requests.jsonl"):
        (example / "vllm" / f).write_bytes((flat / f).read_bytes())
    (example / "config.json").write_text(json.dumps({"nodes": [{"instances": [{"hardware": "RTX4090", "tp_size": 1}]}]}))
    (example / "validation" / "summary.txt").write_text("Metric   vLLM   Sim   Diff%\nTTFT Mean   70.0   63.0   -10.0%\n")
    run = read_run(example)
    assert (run.name, run.hardware) == ("RTXPRO6000-Llama-3.1-8B", "rtx-4090")  # the GPU from config.json
    assert run.reference_source == str(example / "validation" / "summary.txt")
    assert run.requests.equals(read_run(flat).requests)
    (example / "config.json").write_text("[1]")  # and a broken one is named, not skipped
    with pytest.raises(RunFileError, match=re.escape(f"{example / 'config.json'}: expected a JSON object")):
        read_run(example)
    (example / "config.json").unlink()
    (example / "vllm" / "meta.json").unlink()
    with pytest.raises(RunFileError, match=re.escape(str(example / "vllm" / "meta.json"))):
        read_run(example)


# ---- the vllm bench serve format ------------------------------------------------------------------------
def bench_json(path: Path, **extra) -> Path:
    data = {"model_id": "meta-llama/Llama-3.1-8B", "request_rate": 4.0, "burstiness": 1.0, "max_concurrency": None,
            "input_lens": [100, 200, 300], "output_lens": [3, 4, 0], "ttfts": [0.05, 0.06, 0.0],
            "itls": [[0.01, 0.02], [0.01, 0.01, 0.03], []], "start_times": [10.5, 10.0, 11.0],
            "errors": ["", "", "Timeout"]}
    data.update(extra)
    path.write_text(json.dumps(data))
    return path


def test_vllm_bench_json_gives_client_times_and_itls_and_drops_failed_requests(tmp_path):
    run = read_run(bench_json(tmp_path / "bench.json"))
    df = run.requests
    assert run.format == "vllm-bench" and run.arrivals_exact and len(df) == 2
    # sorted by send time: the 200-token request was sent first
    assert df["prompt_len"].tolist() == [200, 100] and df["arrival_time"].tolist() == [0.0, 0.5]
    np.testing.assert_allclose(df["e2e"], [0.06 + 0.05, 0.05 + 0.03])  # ttft + sum of the gaps
    np.testing.assert_allclose(df["tpot"], [0.05 / 3, 0.03 / 2])
    assert run.itl_hist.count == 5
    s = measured_summary(run)
    assert s["completed"] == 2 and s["mean_itl_ms"] == pytest.approx(16.0)
    assert any("failed" in n for n in run.notes)


def test_vllm_bench_without_start_times_draws_arrivals_and_says_so(tmp_path):
    run = read_run(bench_json(tmp_path / "b.json", start_times=None))
    assert not run.arrivals_exact and any("no start_times" in n for n in run.notes)
    inf = read_run(bench_json(tmp_path / "c.json", start_times=None, request_rate="inf"))
    assert inf.arrivals_exact and inf.requests["arrival_time"].tolist() == [0.0, 0.0]


def test_vllm_bench_fields_of_unequal_length_are_an_error(tmp_path):
    with pytest.raises(RunFileError, match="field 'ttfts' has 2 entries, input_lens has 3"):
        read_run(bench_json(tmp_path / "b.json", ttfts=[0.1, 0.2]))
    with pytest.raises(RunFileError, match="missing field 'input_lens'"):
        read_run(bench_json(tmp_path / "c.json", input_lens=None))


@pytest.mark.parametrize("edit, says", [
    ({"input_lens": [1e30, 200, 300]}, "request 0: field 'input_lens' must be a whole number of tokens"),
    ({"input_lens": [True, 200, 300]}, "request 0: field 'input_lens' must be a finite number"),
    ({"output_lens": [3.5, 4, 0]}, "request 0: field 'output_lens' must be a whole number of tokens"),
    ({"itls": [["a"], [0.01], []]}, "request 0: field 'itls' must be a finite number"),
    ({"itls": ["a", [0.01], []]}, "request 0: field 'itls' must be a list of seconds"),
    ({"request_rate": "fast"}, "field 'request_rate' must be a number > 0 or \"inf\""),
    ({"request_rate": -2}, "field 'request_rate' must be a number > 0"),
    ({"start_times": None, "burstiness": 0}, "field 'burstiness' must be > 0"),
    # used as they were before: more gaps than tokens, and a client limit of no one or of text
    ({"itls": [[0.01] * 10, [0.01], []]}, "request 0: 10 itls for output_lens 3 (at most 2"),
    ({"max_concurrency": 0}, "field 'max_concurrency' must be a whole number >= 1 or null"),
    ({"max_concurrency": "many"}, "field 'max_concurrency' must be a whole number >= 1 or null"),
])
def test_hostile_vllm_bench_values_are_one_error_naming_the_field(tmp_path, edit, says):
    # these were a RuntimeError ('a servesim bug'), a ValueError and a TypeError traceback
    with pytest.raises(RunFileError, match=re.escape(says)):
        read_run(bench_json(tmp_path / "b.json", **edit))


# ---- end to end -------------------------------------------------------------------------------------------
def test_a_run_the_cost_model_describes_exactly_validates_with_zero_error(tmp_path):
    folder = write_run(tmp_path / "run", isolated_requests())
    out = tmp_path / "out"
    code, stdout, err = run_cli("validate", "--against", str(folder), "--out", str(out), "--max-error",
                                "tpot=0.01,e2e=0.01", "--no-plots", "--quiet", *CONSTANT)
    assert code == 0, err
    assert "measured" in stdout and "llmservingsim error %" in stdout
    report = json.loads((out / "validation.json").read_text())
    rows = {r["metric"]: r for r in report["metrics"]}
    for key in ("median_tpot_ms", "p90_tpot_ms", "median_e2el_ms", "p90_e2el_ms"):
        assert abs(rows[key]["error_pct"]) < 1e-3, key  # float64 of a 1.7e9 s wall clock
    # TTFT: the sim adds nothing the measured run does not have (1 ms for the request that waited)
    assert abs(rows["median_ttft_ms"]["error_pct"]) < 1e-3
    assert rows["mean_itl_ms"]["live"] is None  # ITL is not in this format
    prov = report["provenance"]
    assert prov["kv_num_blocks"] == vllm_kv_blocks("llama-3.1-8b", "rtx-pro-6000", 1, 16, 512, 8)
    # sim/scenario.yaml repeats the simulated side on its own
    sc = load_scenario(out / "sim" / "scenario.yaml")
    assert sc.scheduler.preset == "vllm-v1" and sc.scheduler.max_num_seqs == 8
    again = simulate(sc, progress=False)
    sim_summary = json.loads((out / "sim" / "summary.json").read_text())
    assert again.summary["mean_e2el_ms"] == pytest.approx(sim_summary["mean_e2el_ms"])
    assert (out / "per_request.csv").read_text().count("\n") == 5


def test_a_slower_run_fails_its_threshold_and_exits_1(tmp_path):
    rows = isolated_requests()
    for r in rows:  # the real decode was 20 % slower than the model's 10 ms
        r["last_token_ts"] = r["first_token_ts"] + (r["output_toks"] - 1) * STEP * 1.2
    folder = write_run(tmp_path / "run", rows)
    code, _, err = run_cli("validate", "--against", str(folder), "--out", str(tmp_path / "o"), "--max-error",
                           "tpot=2", "--no-plots", "--quiet", *CONSTANT)
    assert code == 1 and "median_tpot_ms" in err


def test_a_request_longer_than_the_runs_kv_cache_is_a_one_line_error(tmp_path):
    folder = write_run(tmp_path / "run", isolated_requests())
    code, _, err = run_cli("validate", "--against", str(folder), "--out", str(tmp_path / "o"), "--no-plots",
                           "--set", "kv_cache.num_blocks=7", *CONSTANT)
    assert code == 2 and err.count("\n") == 1
    assert "request r1 (line 2) needs 8 KV blocks (116 tokens) but the run's KV cache has 7" in err


def test_an_unknown_model_asks_for_a_preset_and_set_model_supplies_it(tmp_path):
    folder = write_run(tmp_path / "run", isolated_requests(), model="acme/Llama-9-8B")
    code, _, err = run_cli("validate", "--against", str(folder), "--out", str(tmp_path / "o"), "--no-plots")
    assert code == 2 and "model 'acme/Llama-9-8B' has no servesim preset" in err and "--set model=" in err
    code, out, err = run_cli("validate", "--against", str(folder), "--out", str(tmp_path / "o"), "--no-plots",
                             "--quiet", "--set", "model=llama-3.1-8b", *CONSTANT)
    assert code == 0, err
    assert "has no preset; llama-3.1-8b used" in out


def test_a_model_without_a_preset_is_read_from_its_config_json(tmp_path):
    config = {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
              "num_attention_heads": 32, "num_key_value_heads": 4, "vocab_size": 32000,
              "max_position_embeddings": 2048}
    (tmp_path / "TinyLlama-1.1B").mkdir()
    (tmp_path / "TinyLlama-1.1B" / "config.json").write_text(json.dumps(config))
    folder = write_run(tmp_path / "run", isolated_requests(), model="TinyLlama/TinyLlama-1.1B")
    code, _, err = run_cli("validate", "--against", str(folder), "--out", str(tmp_path / "o"), "--no-plots")
    assert code == 2 and "--set model=PATH" in err and "config.json" in err
    code, out, err = run_cli("validate", "--against", str(folder), "--out", str(tmp_path / "o"), "--no-plots",
                             "--quiet", "--set", f"model={tmp_path / 'TinyLlama-1.1B'}", *CONSTANT)
    assert code == 0, err
    assert "has no preset;" in out and "(its config.json names it tinyllama-1.1b) used" in out
    # vLLM served a local checkout that is on this machine too: its config.json is read without a --set
    local = write_run(tmp_path / "local", isolated_requests(), model=str(tmp_path / "TinyLlama-1.1B"))
    code, out, err = run_cli("validate", "--against", str(local), "--out", str(tmp_path / "o2"), "--no-plots",
                             "--quiet", *CONSTANT)
    assert code == 0, err
    assert json.loads((tmp_path / "o2" / "validation.json").read_text())["provenance"]["model"] == \
        str(tmp_path / "TinyLlama-1.1B")


def test_an_unknown_gpu_needs_hardware_and_a_scenario_can_supply_it(tmp_path):
    folder = write_run(tmp_path / "run", isolated_requests(), gpu="TPUv5e")
    code, _, err = run_cli("validate", "--against", str(folder), "--out", str(tmp_path / "o"), "--no-plots")
    assert code == 2 and "GPU 'TPUv5e' has no servesim hardware preset" in err and "--set hardware=PATH" in err
    scenario = tmp_path / "hw.yaml"
    scenario.write_text(yaml.safe_dump({"hardware": "h100-sxm", "workload": {"num_requests": 1, "arrival": {
        "process": "poisson", "rate": 1}, "prompt_len": 1, "output_len": 1},
        "cost_model": {"type": "constant", "step_ms": 10}}))
    code, _, err = run_cli("validate", str(scenario), "--against", str(folder), "--out", str(tmp_path / "o"),
                           "--no-plots", "--quiet")
    assert code == 0, err
    assert json.loads((tmp_path / "o" / "validation.json").read_text())["provenance"]["hardware"] == "h100-sxm"
    # or a hardware file, relative to the scenario that names it
    (tmp_path / "gpus").mkdir()
    (tmp_path / "gpus" / "tpu.yaml").write_text("peak_flops: 197 TFLOPS\nhbm_bandwidth: 819 GB/s\nmemory_bytes: 32 GiB\n")
    scenario.write_text(yaml.safe_dump({**yaml.safe_load(scenario.read_text()), "hardware": "gpus/tpu.yaml"}))
    code, _, err = run_cli("validate", str(scenario), "--against", str(folder), "--out", str(tmp_path / "o"),
                           "--no-plots", "--quiet")
    assert code == 0, err
    assert json.loads((tmp_path / "o" / "validation.json").read_text())["provenance"]["hardware"] == \
        str(tmp_path / "gpus" / "tpu.yaml")


def test_validate_needs_a_scenario_or_a_run(tmp_path):
    code, _, err = run_cli("validate")
    assert code == 2 and "--against RUN" in err
    code, _, err = run_cli("validate", "--against", str(tmp_path / "nowhere"))
    assert code == 2 and "not found" in err


def test_plots_and_the_scatter_are_written(tmp_path):
    folder = write_run(tmp_path / "run", isolated_requests())
    code, _, err = run_cli("validate", "--against", str(folder), "--out", str(tmp_path / "o"), "--quiet", *CONSTANT)
    assert code == 0, err
    for name in ("cdf_ttft.png", "cdf_tpot.png", "cdf_e2e.png", "scatter_requests.png"):
        assert (tmp_path / "o" / name).stat().st_size > 1000
    assert not (tmp_path / "o" / "cdf_itl.png").exists()  # nothing measured to overlay


def test_the_default_output_folder_keeps_a_run_folders_whole_name(tmp_path, monkeypatch):
    folder = write_run(tmp_path / "RTXPRO6000-Llama-3.1-8B", isolated_requests())
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli("validate", "--against", str(folder), "--quiet", "--no-plots", *CONSTANT)
    assert code == 0, err
    assert (tmp_path / "results" / "RTXPRO6000-Llama-3.1-8B-against" / "validation.json").is_file()
    assert "results/RTXPRO6000-Llama-3.1-8B-against/" in out


# ---- the shipped runs (only where ../shared is beside the repository) ----------------------------------
@pytest.mark.skipif(not SHARED_RUNS.is_dir(), reason="../shared/data/gpu not present")
def test_shipped_runs_measure_what_llmservingsims_own_summary_says():
    for folder in sorted(SHARED_RUNS.iterdir()):
        run = read_run(folder)
        ref = run.reference
        assert run.model and run.hardware == "rtx-pro-6000" and len(run.requests) == 300
        s = measured_summary(run)
        for key in ("mean_tpot_ms", "median_tpot_ms", "p90_tpot_ms", "p99_tpot_ms"):
            assert s[key] == pytest.approx(ref[key]["real"], abs=0.06), (folder.name, key)
        # LLMServingSim measures TTFT from queued_ts (rounded to 0.1 ms in its file)
        q = run.requests["ttft_from_queued"].to_numpy() * 1e3
        assert float(np.mean(q)) == pytest.approx(ref["mean_ttft_ms"]["real"], abs=0.06)
        assert float(np.percentile(q, 90)) == pytest.approx(ref["p90_ttft_ms"]["real"], abs=0.06)
        # ours, from the aligned arrival, is never shorter
        assert (run.requests["ttft"].to_numpy() * 1e3 >= q - 1e-6).all()
        assert not math.isnan(s["request_throughput"])


SHIPPED_RUNS = Path(__file__).resolve().parents[1] / "results" / "validation" / "gpu" / "runs"


@pytest.mark.parametrize("folder, hardware", [("RTXPRO6000-Llama-3.1-8B", "rtx-pro-6000"),
                                              ("RTXPRO6000-Qwen3-32B", "rtx-pro-6000"),
                                              ("llama-3.1-8b-rtx4090-tp1", "rtx-4090")])
def test_the_runs_the_repository_ships_read_and_agree_with_their_reference_summary(folder, hardware):
    """The copies under results/validation/gpu/runs (validate_against_runs.py replays them): each reads,
    names its GPU, and its measured TPOT and queued-TTFT are the 'real' column of the summary beside it."""
    run = read_run(SHIPPED_RUNS / folder)
    assert run.hardware == hardware and run.model and len(run.requests) == 300
    assert run.reference_source and Path(run.reference_source).is_relative_to(SHIPPED_RUNS / folder)
    s = measured_summary(run)
    for key in ("median_tpot_ms", "p90_tpot_ms"):
        assert s[key] == pytest.approx(run.reference[key]["real"], abs=0.06), key
    assert s["num_preemptions"] is None and s["preempted_requests"] is None  # not recorded: not 0
    q = run.requests["ttft_from_queued"].to_numpy() * 1e3
    assert float(np.percentile(q, 90)) == pytest.approx(run.reference["p90_ttft_ms"]["real"], abs=0.06)


@pytest.mark.parametrize("version, on", [("0.19.0", True), ("0.14.1", True), ("v0.13.0", False), ("0.8.5", False),
                                         (None, False), ("unknown", False)])
def test_runs_of_recent_vllm_schedule_asynchronously(version, on):
    from servesim.calibration.validate_against import async_by_default

    assert async_by_default(version) is on


def test_a_run_that_records_what_vllm_resolved_is_simulated_with_it(tmp_path):
    meta = {"kv_cache": {"num_gpu_blocks": 900, "block_size": 32, "enable_prefix_caching": False,
                         "gpu_memory_utilization": 0.8},
            "hardware": {"device_name": "NVIDIA H100 80GB HBM3", "device_count": 1},
            "resolved_config": {"scheduler_config": {"async_scheduling": False},
                                "model_config": {"max_model_len": 4096}}}
    folder = write_run(tmp_path / "run", isolated_requests(), gpu="RTX4090", meta_extra=meta)
    run = read_run(folder)
    assert run.hardware == "h100-sxm"  # torch's device name wins over the cluster config
    assert run.kv_cache == {"num_blocks": 900, "block_size": 32, "enable_prefix_caching": False,
                            "gpu_memory_utilization": 0.8}
    assert run.scheduler["async_scheduling"] is False and run.scheduler["max_model_len"] == 4096
    assert not any("num_blocks" in n for n in run.notes)
    code, _, err = run_cli("validate", "--against", str(folder), "--out", str(tmp_path / "o"), "--no-plots",
                           "--quiet", *CONSTANT)
    assert code == 0, err
    prov = json.loads((tmp_path / "o" / "validation.json").read_text())["provenance"]
    assert (prov["kv_num_blocks"], prov["kv_block_size"], prov["enable_prefix_caching"]) == (900, 32, False)
    sc = load_scenario(tmp_path / "o" / "sim" / "scenario.yaml")
    assert sc.scheduler.async_scheduling is False


def test_the_scheduler_settings_vllm_resolved_reach_the_simulation(tmp_path):
    """Chunk cap, queue policy, async scheduling and chunked prefill turned off, from
    resolved_config.scheduler_config (else the engine argument), go to the vllm-v1 preset."""
    meta = {"resolved_config": {"scheduler_config": {"long_prefill_token_threshold": 256, "policy": "priority",
                                                     "enable_chunked_prefill": False}}}
    folder = write_run(tmp_path / "run", isolated_requests(), meta_extra=meta)
    kwargs = json.loads((folder / "meta.json").read_text())
    kwargs["engine_kwargs"] |= {"async_scheduling": False, "scheduling_policy": "fcfs"}  # (the resolved policy wins)
    (folder / "meta.json").write_text(json.dumps(kwargs))
    run = read_run(folder)
    assert {k: run.scheduler[k] for k in ("long_prefill_token_threshold", "policy", "async_scheduling")} == {
        "long_prefill_token_threshold": 256, "policy": "priority", "async_scheduling": False}
    assert run.scheduler["enable_chunked_prefill"] is False
    code, _, err = run_cli("validate", "--against", str(folder), "--out", str(tmp_path / "o"), "--no-plots",
                           "--quiet", *CONSTANT)
    assert code == 0, err
    sc = load_scenario(tmp_path / "o" / "sim" / "scenario.yaml")
    assert (sc.scheduler.long_prefill_token_threshold, sc.scheduler.policy, sc.scheduler.async_scheduling,
            sc.scheduler.enable_chunked_prefill) == (256, "priority", False, False)


@pytest.mark.parametrize("section, field, value, words", [
    ("parallel_config", "pipeline_parallel_size", 2, "pipeline parallelism is not modelled"),
    (None, "pipeline_parallel_size", 4, "pipeline parallelism is not modelled"),
    (None, "speculative_config", {"method": "ngram", "num_speculative_tokens": 4}, "speculative decoding"),
    (None, "scheduling_policy", "lifo", "must be 'fcfs' or 'priority'"),
    ("scheduler_config", "policy", "lifo", "must be 'fcfs' or 'priority'"),
    ("scheduler_config", "long_prefill_token_threshold", -1, "long_prefill_token_threshold"),
    ("scheduler_config", "enable_chunked_prefill", "no", "enable_chunked_prefill"),
])
def test_a_run_servesim_cannot_simulate_as_it_ran_is_a_one_line_error(tmp_path, section, field, value, words):
    folder = write_run(tmp_path / "run", isolated_requests())
    meta = json.loads((folder / "meta.json").read_text())
    if section is None:
        meta["engine_kwargs"][field] = value
    else:
        meta["resolved_config"] = {section: {field: value}}
    (folder / "meta.json").write_text(json.dumps(meta))
    code, _, err = run_cli("validate", "--against", str(folder), "--out", str(tmp_path / "o"), *CONSTANT)
    assert code == 2 and err.count("\n") == 1 and words in err and field in err, err


def test_a_run_whose_context_outgrows_its_cache_notes_that_vllm_started_anyway(tmp_path):
    """vLLM starts only when one request of max_model_len fits; a run that did, simulated with fewer
    blocks than that, is said to have a suspect block count (or an engine that lowered the limit)."""
    meta = {"kv_cache": {"num_gpu_blocks": 900, "block_size": 16, "enable_prefix_caching": True}}
    folder = write_run(tmp_path / "run", isolated_requests(), meta_extra=meta)
    code, out, err = run_cli("validate", "--against", str(folder), "--out", str(tmp_path / "o"), "--no-plots",
                             "--quiet", *CONSTANT)
    assert code == 0, err
    notes = [line for line in (out + err).splitlines() if "yet vLLM started" in line]
    assert len(notes) == 1 and "131072" in notes[0] and "14400 tokens" in notes[0], out + err
    code, out, err = run_cli("validate", "--against", str(folder), "--out", str(tmp_path / "p"), "--no-plots",
                             "--quiet", *CONSTANT, "--set", "scheduler.max_model_len=8192")
    assert code == 0, err
    assert "yet vLLM started" not in out + err


def test_a_boot_snapshot_or_an_interrupted_run_is_a_one_line_error_saying_so(tmp_path):
    """LLMServingSim's runner: --resolve-only writes meta.json (resolve_only, the KV cache) and no
    requests; an interrupted replay leaves engine_start.json and no meta.json."""
    boot = write_run(tmp_path / "boot", [], meta_extra={"resolve_only": True, "num_requests": 0,
                                                        "kv_cache": {"num_gpu_blocks": 2983, "block_size": 16}})
    (boot / "requests.jsonl").unlink()
    code, _, err = run_cli("validate", "--against", str(boot), "--out", str(tmp_path / "o"))
    assert code == 2 and err.count("\n") == 1 and "resolve-only" in err and "2983" in err
    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / "engine_start.json").write_text(json.dumps({"status": "engine_initialized", "kv_cache": {}}))
    code, _, err = run_cli("validate", "--against", str(cut), "--out", str(tmp_path / "p"))
    assert code == 2 and err.count("\n") == 1 and "stopped before it wrote its requests" in err


def test_an_empty_kv_cache_snapshot_falls_back_to_the_resolved_cache_config(tmp_path):
    """The harness writes kv_cache as {} when its snapshot failed; resolved_config.cache_config holds the same."""
    meta = {"kv_cache": {}, "resolved_config": {"cache_config": {
        "num_gpu_blocks": 700, "block_size": 16, "enable_prefix_caching": True, "gpu_memory_utilization": 0.85}}}
    run = read_run(write_run(tmp_path / "run", isolated_requests(), meta_extra=meta))
    assert run.kv_cache == {"num_blocks": 700, "block_size": 16, "enable_prefix_caching": True,
                            "gpu_memory_utilization": 0.85}


def test_a_request_vllm_kept_no_metrics_for_is_left_out_with_a_note(tmp_path):
    rows = isolated_requests()
    rows.insert(1, {"request_id": "lost", "input_toks": 50, "output_toks": 4, "arrival_time": None,
                    "queued_ts": None, "scheduled_ts": None, "first_token_ts": None, "last_token_ts": None})
    run = read_run(write_run(tmp_path / "run", rows))
    assert len(run.requests) == 4 and "lost" not in set(run.requests["source_id"])
    assert any("1 requests have no timestamps" in n for n in run.notes)
    rows[2]["first_token_ts"] = None  # one timestamp missing is a broken line, not an unrecorded request
    with pytest.raises(RunFileError, match=r"requests\.jsonl:3: field 'first_token_ts' must be a finite number"):
        read_run(write_run(tmp_path / "run2", rows))


def test_a_request_that_ended_without_a_token_is_left_out_and_counted(tmp_path):
    """A failed or aborted request (a client's timeout, an HTTP error) has no first token: a run with a few of
    them was a one-line error; now they are left out of both sides with a note naming their lines."""
    rows = isolated_requests()
    arrival, queued = rows[1]["arrival_time"], rows[1]["queued_ts"]
    rows.insert(1, {"request_id": "timed-out", "input_toks": 50, "output_toks": 0, "arrival_time": arrival,
                    "queued_ts": queued, "scheduled_ts": queued, "first_token_ts": None, "last_token_ts": queued + 30})
    rows.insert(3, {"request_id": "aborted", "input_toks": 70, "output_toks": 9, "arrival_time": arrival,
                    "queued_ts": queued, "scheduled_ts": None, "first_token_ts": None, "last_token_ts": None})
    rows.append({"request_id": "unstamped", "input_toks": 70, "output_toks": 9, "arrival_time": arrival,
                 "queued_ts": queued, "scheduled_ts": 0.0, "first_token_ts": 0.0, "last_token_ts": 0.0})  # vLLM's 0.0
    run = read_run(write_run(tmp_path / "run", rows))
    assert len(run.requests) == 4 and not {"timed-out", "aborted", "unstamped"} & set(run.requests["source_id"])
    assert any("3 requests ended without a first token" in n and "line 2, 4, 7" in n for n in run.notes), run.notes
    only_failed = [dict(r, first_token_ts=None, output_toks=0) for r in isolated_requests()]
    with pytest.raises(RunFileError, match=r"no requests with timestamps \(4 ended without a first token\)"):
        read_run(write_run(tmp_path / "run2", only_failed))


def test_data_parallel_engines_become_replicas_behind_vllms_own_dp_balancer(tmp_path):
    folder = write_run(tmp_path / "run", isolated_requests())
    meta = json.loads((folder / "meta.json").read_text())
    meta["engine_kwargs"]["data_parallel_size"] = 2
    (folder / "meta.json").write_text(json.dumps(meta))
    code, _, err = run_cli("validate", "--against", str(folder), "--out", str(tmp_path / "o"), "--no-plots",
                           "--quiet", *CONSTANT)
    assert code == 0, err
    sc = load_scenario(tmp_path / "o" / "sim" / "scenario.yaml")
    assert (sc.cluster.num_replicas, sc.cluster.router, sc.cluster.router_refresh_s) == (2, "vllm_dp", 0.1)
    # two engine loops' timestamps interleave: no step is timed from them
    assert json.loads((tmp_path / "o" / "validation.json").read_text())["provenance"]["step_timing"] is None


def test_a_vllm_bench_json_needs_its_gpu_and_then_compares_itl_too(tmp_path):
    path = bench_json(tmp_path / "bench.json")
    code, _, err = run_cli("validate", "--against", str(path), "--out", str(tmp_path / "o"), "--no-plots")
    assert code == 2 and "the run does not name its GPU" in err and "--set hardware=" in err and "--profile" in err
    code, out, err = run_cli("validate", "--against", str(path), "--out", str(tmp_path / "o"), "--quiet",
                             "--set", "hardware=h100-sxm", *CONSTANT)
    assert code == 0, err
    report = json.loads((tmp_path / "o" / "validation.json").read_text())
    rows = {r["metric"]: r for r in report["metrics"]}
    assert report["provenance"]["itl"] == "measured" and rows["mean_itl_ms"]["live"] == pytest.approx(16.0)
    assert rows["mean_itl_ms"]["sim"] == pytest.approx(STEP * 1e3)
    assert (tmp_path / "o" / "cdf_itl.png").is_file()


def test_a_run_that_names_no_gpu_takes_the_profiles_own(tmp_path):
    path = bench_json(tmp_path / "bench.json")
    profile = "h100-sxm-llama-3.1-8b-tp1.json"
    code, out, err = run_cli("validate", "--against", str(path), "--out", str(tmp_path / "o"), "--no-plots",
                             "--quiet", "--profile", profile)
    assert code == 0, err
    notes = json.loads((tmp_path / "o" / "validation.json").read_text())["provenance"]["notes"]
    assert any("the run does not name its GPU; h100-sxm, the profile's, used" in n for n in notes), notes
    assert load_scenario(tmp_path / "o" / "sim" / "scenario.yaml").hardware == "h100-sxm"
    # a GPU the run does name is never replaced by the profile's: the mismatch is an error
    named = bench_json(tmp_path / "named.json", gpu="NVIDIA A100-SXM4-80GB")
    code, _, err = run_cli("validate", "--against", str(named), "--out", str(tmp_path / "o2"), "--no-plots",
                           "--quiet", "--profile", profile)
    assert code == 2 and "h100-sxm" in err and "a100" in err.lower(), err


@pytest.mark.parametrize("gpu, model, profile", [
    ("RTXPRO6000", "meta-llama/Llama-3.1-8B", "rtx-pro-6000-llama-3.1-8b-tp1.json"),
    ("RTX4090", "meta-llama/Llama-3.1-8B", "rtx-4090-llama-3.1-8b-tp1.json"),
    ("L40S", "meta-llama/Llama-3.1-8B", None),  # nobody published L40S kernels: the roofline
])
def test_without_profile_the_shipped_profile_for_the_runs_gpu_model_and_tp_is_used(tmp_path, gpu, model, profile):
    folder = write_run(tmp_path / "run", isolated_requests(), model=model, gpu=gpu)
    from servesim.calibration.validate_against import scenario_dict
    raw, notes = scenario_dict(read_run(folder))
    if profile is None:
        assert "cost_model" not in raw
        assert any("cost model: the roofline" in n for n in notes)
    else:
        assert raw["cost_model"] == {"type": "profile", "path": profile}
        assert any(f"shipped profile {profile}" in n for n in notes)
    # the user's choice wins: --set, --profile
    raw, _ = scenario_dict(read_run(folder), overrides=["cost_model.type=roofline"])
    assert raw["cost_model"] == {"type": "roofline"}
    raw, _ = scenario_dict(read_run(folder), profile="cpu-tiny.json")
    assert raw["cost_model"]["path"] == "cpu-tiny.json"


def test_a_kv_bound_run_simulated_by_servesim_validates_against_itself_exactly(tmp_path):
    """Round trip: a vLLM-v1 run that preempts (KV short, async scheduling, prefix caching on) is
    simulated, written as an LLMServingSim run folder (engine clock offset from the client's) and
    validated against: the rebuilt workload and engine must reproduce every request's times."""
    blocks = 160
    sc = scenario_from_dict({
        "name": "rt", "seed": 5, "model": "llama-3.1-8b", "hardware": "rtx-4090",
        "cost_model": {"type": "profile", "path": "rtx-4090-llama-3.1-8b-tp1.json"},
        "scheduler": {"preset": "vllm-v1", "max_num_seqs": 16, "max_num_batched_tokens": 512, "async_scheduling": True},
        "kv_cache": {"block_size": 16, "num_blocks": blocks, "enable_prefix_caching": True},
        "workload": {"num_requests": 40, "arrival": {"process": "poisson", "rate": 20.0},
                     "prompt_len": {"dist": "uniform", "min": 64, "max": 600},
                     "output_len": {"dist": "uniform", "min": 100, "max": 400}},
    })
    res = simulate(sc, progress=False)
    assert res.summary["num_preemptions"] > 0  # the case this test is about
    rows = [{"request_id": f"q{r.request_id}", "input_toks": r.prompt_len, "output_toks": r.output_len,
             "arrival_time": 1.7e9 + r.arrival_time, "queued_ts": 5000.0 + r.arrival_time,
             "scheduled_ts": 5000.0 + r.first_scheduled_time, "first_token_ts": 5000.0 + r.first_token_time,
             "last_token_ts": 5000.0 + r.finish_time} for r in res.requests_df.itertuples()]
    folder = write_run(tmp_path / "run", rows, gpu="RTX4090", meta_extra={
        "engine_kwargs": {"model": "meta-llama/Llama-3.1-8B", "tensor_parallel_size": 1, "data_parallel_size": 1,
                          "max_num_seqs": 16, "max_num_batched_tokens": 512, "max_model_len": None},
        "kv_cache": {"num_gpu_blocks": blocks, "block_size": 16, "enable_prefix_caching": True}})
    out = tmp_path / "out"
    code, _, err = run_cli("validate", "--against", str(folder), "--out", str(out), "--no-plots", "--quiet")
    assert code == 0, err
    per = pd.read_csv(out / "per_request.csv")
    for key in ("ttft", "e2e"):
        np.testing.assert_allclose(per[f"sim_{key}"], per[f"measured_{key}"], rtol=1e-6, atol=1e-6, err_msg=key)


ENGINE = {"model": "meta-llama/Llama-3.1-8B", "tensor_parallel_size": 1, "data_parallel_size": 1,
          "max_num_seqs": 8, "max_num_batched_tokens": 512, "max_model_len": None}


@pytest.mark.parametrize("kwarg, says", [
    ({"dtype": "float32"}, "engine_kwargs.dtype 'float32' is not modelled"),
    ({"quantization": "awq"}, "engine_kwargs.quantization 'awq' is not modelled"),
    ({"kv_cache_dtype": "fp8"}, "the run's KV cache is fp8 and it does not record its block count"),
])
def test_a_run_in_another_precision_is_a_one_line_error(tmp_path, kwarg, says):
    folder = write_run(tmp_path / "run", isolated_requests(), meta_extra={"engine_kwargs": {**ENGINE, **kwarg}})
    code, _, err = run_cli("validate", "--against", str(folder), "--out", str(tmp_path / "o"), "--no-plots", *CONSTANT)
    assert code == 2 and err.count("\n") == 1 and says in err, err


def test_an_fp8_kv_cache_runs_with_its_own_block_count_and_says_what_is_not_modelled(tmp_path):
    engine = {**ENGINE, "dtype": "bfloat16", "kv_cache_dtype": "fp8_e4m3"}
    folder = write_run(tmp_path / "run", isolated_requests(), meta_extra={"engine_kwargs": engine})
    code, out, err = run_cli("validate", "--against", str(folder), "--out", str(tmp_path / "o"), "--no-plots",
                             "--set", "kv_cache.num_blocks=900", *CONSTANT)
    assert code == 0, err
    assert "note: engine_kwargs.kv_cache_dtype 'fp8_e4m3': servesim prices a 16-bit KV cache" in out
def test_a_gpu_named_as_text_in_meta_json_is_used(tmp_path):
    # meta.json's 'hardware' as a string was ignored; a mapping holds torch's device_name
    folder = write_run(tmp_path / "run", isolated_requests(), gpu="TPUv9", meta_extra={"hardware": "NVIDIA H100 80GB HBM3"})
    assert read_run(folder).hardware == "h100-sxm"


def test_a_run_setting_of_the_wrong_type_names_its_field_instead_of_being_replaced(tmp_path):
    # tensor_parallel_size 0 ran as TP 1 and max_model_len '4096' was dropped
    for change, field in (({"tensor_parallel_size": 0}, "engine_kwargs.tensor_parallel_size"),
                          ({"max_model_len": "4096"}, "engine_kwargs.max_model_len")):
        folder = write_run(tmp_path / field / str(change), isolated_requests())
        meta = json.loads((folder / "meta.json").read_text())
        meta["engine_kwargs"].update(change)
        (folder / "meta.json").write_text(json.dumps(meta))
        with pytest.raises(RunFileError, match=re.escape(f"field '{field}' must be a whole number >= 1")):
            read_run(folder)


@pytest.mark.parametrize(("change", "says"), [
    ({"enable_prefix_caching": "false"}, "field 'engine_kwargs.enable_prefix_caching' must be true or false"),
    ({"block_size": "16"}, "field 'engine_kwargs.block_size' must be an integer"),
    ({"gpu_memory_utilization": True}, "field 'engine_kwargs.gpu_memory_utilization' must be a number"),
])
def test_a_cache_setting_written_as_text_is_an_error_not_its_value(tmp_path, change, says):
    # "false" turned prefix caching off and "16" was read as 16 blocks
    folder = write_run(tmp_path / "run", isolated_requests())
    meta = json.loads((folder / "meta.json").read_text())
    meta["engine_kwargs"].update(change)
    meta.pop("kv_cache", None)
    meta.get("resolved_config", {}).pop("cache_config", None)
    (folder / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(RunFileError, match=re.escape(says)):
        read_run(folder)


def test_a_scenario_scheduler_of_another_engine_is_left_out_with_a_note(tmp_path):
    from servesim.calibration.validate_against import scenario_dict

    raw, notes = scenario_dict(read_run(write_run(tmp_path / "run", isolated_requests())),
                               base={"scheduler": {"preset": "sglang"}})
    assert raw["scheduler"]["preset"] == "vllm-v1" and any("sglang" in n for n in notes)


def test_a_run_given_a_kv_memory_budget_is_simulated_with_the_blocks_it_buys(tmp_path):
    """vLLM sizes the cache from engine_kwargs.kv_cache_memory_bytes without profiling: 2 GiB of
    Llama-3.1-8B blocks (16 tokens x 32 layers x 8 KV heads x 128 x K,V x 2 bytes = 2 MiB) is 1,024;
    an fp8 cache twice that."""
    for kv_dtype, blocks in (("auto", 1024), ("fp8", 2048)):
        engine = {**ENGINE, "kv_cache_memory_bytes": 2 * 2**30, "kv_cache_dtype": kv_dtype}
        folder = write_run(tmp_path / f"run-{kv_dtype}", isolated_requests(), meta_extra={"engine_kwargs": engine})
        out = tmp_path / f"o-{kv_dtype}"
        code, stdout, err = run_cli("validate", "--against", str(folder), "--out", str(out), "--no-plots", *CONSTANT)
        assert code == 0, err
        assert json.loads((out / "validation.json").read_text())["provenance"]["kv_num_blocks"] == blocks
        assert "from engine_kwargs.kv_cache_memory_bytes" in stdout
    engine = {**ENGINE, "kv_cache_memory_bytes": "2GiB"}
    folder = write_run(tmp_path / "bad", isolated_requests(), meta_extra={"engine_kwargs": engine})
    code, _, err = run_cli("validate", "--against", str(folder), "--out", str(tmp_path / "ob"), "--no-plots", *CONSTANT)
    assert code == 2 and err.count("\n") == 1 and "engine_kwargs.kv_cache_memory_bytes" in err


def test_a_compiled_run_against_an_eager_profile_says_so(tmp_path):
    for eager, said in ((False, True), (True, False), (None, False)):
        engine = {**ENGINE, "enforce_eager": eager}
        folder = write_run(tmp_path / f"run-{eager}", isolated_requests(), meta_extra={"engine_kwargs": engine})
        code, stdout, err = run_cli("validate", "--against", str(folder), "--out", str(tmp_path / f"o-{eager}"),
                                    "--no-plots", "--set", "kv_cache.num_blocks=900")
        assert code in (0, 1), err
        assert ("served with CUDA graphs" in stdout) == said, stdout


def test_vllms_own_counters_in_timeseries_csv_are_set_beside_the_simulation(tmp_path):
    """Newer bench runs log preemptions and prefix-cache hits per tick; the comparison reports both."""
    folder = write_run(tmp_path / "run", isolated_requests(), meta_extra={"tick_seconds": 2.0})
    (folder / "timeseries.csv").write_text(
        "t,prompt_throughput,prompt_compute_throughput,prompt_cached_throughput,gen_throughput,running,waiting,"
        "preempted,kv_cache_pct\n2.0,100.0,75.0,25.0,10.0,1,0,2,5.0\n4.0,50.0,50.0,0.0,10.0,1,0,1,5.0\n")
    out = tmp_path / "o"
    code, stdout, err = run_cli("validate", "--against", str(folder), "--out", str(out), "--no-plots", *CONSTANT)
    assert code == 0, err
    assert "preemptions: 3 in the run (timeseries.csv 'preempted'), 0 simulated" in stdout
    assert "prefix cache: the run served 50 prompt tokens from its cache (16.7 % of its prompt tokens)" in stdout
    result = json.loads((out / "validation.json").read_text())
    assert result["measured_summary"]["num_preemptions"] == 3  # vLLM's counter, not the request file's empty column
    counters = result["provenance"]["engine_counters"]
    assert counters == {"preemptions": 3.0, "prompt_tokens": 300.0, "cached_prompt_tokens": 50.0,
                        "peak_kv_usage": 0.05}
    assert "KV cache use: at most 5.0 % in the run" in stdout
    # the shipped runs' older timeseries.csv has neither column: nothing is said
    (folder / "timeseries.csv").write_text("t,prompt_throughput,gen_throughput,running,waiting,kv_cache_pct\n1,1,1,1,0,0\n")
    code, stdout, _ = run_cli("validate", "--against", str(folder), "--out", str(out), "--no-plots", *CONSTANT)
    assert code == 0 and "preemptions:" not in stdout and "prefix cache: the run" not in stdout


def test_the_runs_own_cuda_memory_total_sizes_a_derived_cache(tmp_path):
    """A newer run names its GPU's CUDA total; without a recorded block count, that total is used."""
    total = 80 * 2**30  # an RTX PRO 6000 reporting 80 GiB instead of the preset's 94.97
    meta = {"hardware": {"device_name": "NVIDIA RTX PRO 6000 Blackwell Server Edition",
                         "device_total_memory_bytes": total}}
    folder = write_run(tmp_path / "run", isolated_requests(), meta_extra=meta)
    assert read_run(folder).cuda_total_bytes == total
    code, stdout, err = run_cli("validate", "--against", str(folder), "--out", str(tmp_path / "o"), "--no-plots",
                                *CONSTANT)
    assert code == 0, err
    blocks = json.loads((tmp_path / "o" / "validation.json").read_text())["provenance"]["kv_num_blocks"]
    assert blocks == vllm_kv_blocks("llama-3.1-8b", "rtx-pro-6000", 1, 16, 512, 8, cuda_total_bytes=total)
    assert blocks < vllm_kv_blocks("llama-3.1-8b", "rtx-pro-6000", 1, 16, 512, 8)
    assert "the run's 80.00 GiB (hardware.device_total_memory_bytes)" in stdout
    meta["hardware"]["device_total_memory_bytes"] = "80GiB"
    folder = write_run(tmp_path / "bad", isolated_requests(), meta_extra=meta)
    code, _, err = run_cli("validate", "--against", str(folder), "--out", str(tmp_path / "ob"), "--no-plots",
                           *CONSTANT)
    assert code == 2 and err.count("\n") == 1 and "hardware.device_total_memory_bytes" in err


def async_run_requests(mixed: float = 1.3) -> list[dict]:
    """One request decoding in 10 ms steps and three arriving one by one, timed as vLLM's async engine
    runs them (calibration/run_steps.py): each taken in at a step end, its prefill in the step after
    the one already scheduled, that mixed step ``mixed`` x 10 ms."""
    rows = [{"request_id": "r0", "input_toks": 100, "output_toks": 400, "arrival_time": 1.7e9, "queued_ts": 5000.0,
             "scheduled_ts": 5000.0, "first_token_ts": 5000.0 + STEP, "last_token_ts": 5000.0 + 400 * STEP}]
    end = 5000.0 + STEP
    for k, steps in enumerate((3, 5, 4)):
        taken = end + steps * STEP + 5e-5
        first = end + (steps + 1) * STEP + mixed * STEP
        rows.append({"request_id": f"r{k + 1}", "input_toks": 100, "output_toks": 100,
                     "arrival_time": 1.7e9 + taken - 5000.0, "queued_ts": taken, "scheduled_ts": taken,
                     "first_token_ts": first, "last_token_ts": first + 99 * STEP})
        end = first
    return rows


def test_steps_timed_from_the_engine_timestamps_are_reported_against_the_cost_model(tmp_path):
    folder = write_run(tmp_path / "run", async_run_requests(1.3))
    out = tmp_path / "out"
    code, stdout, err = run_cli("validate", "--against", str(folder), "--out", str(out), "--no-plots", "--quiet",
                                *CONSTANT)
    assert code == 0, err
    timing = json.loads((out / "validation.json").read_text())["provenance"]["step_timing"]
    assert timing["ramp_decode"]["median"] == pytest.approx(1.0, abs=0.01)
    assert timing["ramp_mixed"]["median"] == pytest.approx(1.3, abs=0.02) and timing["ramp_mixed"]["n"] == 3
    assert "ramp, mixed steps: 1.29" in stdout and "step_timing.csv" in stdout  # (e, 0.05 ms, read into d)
    assert "Steps timed from the run's engine timestamps" in (out / "validation.md").read_text()
    assert (out / "step_timing.csv").read_text().count("\n") == 4  # three ramp steps and the header
    # vLLM's bench JSON has no engine clock: not read
    path = bench_json(tmp_path / "bench.json")
    run_cli("validate", "--against", str(path), "--out", str(tmp_path / "b"), "--quiet", "--no-plots",
            "--set", "hardware=h100-sxm", *CONSTANT)
    assert json.loads((tmp_path / "b" / "validation.json").read_text())["provenance"]["step_timing"] is None
    # read as a run without async scheduling, the same timestamps leave a decode step in the mixed one
    run_cli("validate", "--against", str(folder), "--out", str(tmp_path / "s"), "--quiet", "--no-plots",
            "--set", "scheduler.async_scheduling=false", *CONSTANT)
    sync = json.loads((tmp_path / "s" / "validation.json").read_text())["provenance"]["step_timing"]
    assert sync["ramp_mixed"]["median"] == pytest.approx(2.3, abs=0.02)


# ---- newer bench runs: type tags where values could not be recorded --------------------------------
@pytest.mark.parametrize("resolved, engine", [
    ({"scheduler_config": "<SchedulerConfig>", "model_config": "<ModelConfig>", "cache_config": "<CacheConfig>"}, {}),
    ({"scheduler_config": {"async_scheduling": "<unreadable: AttributeError>", "policy": "<unreadable: KeyError>",
                           "long_prefill_token_threshold": "<unreadable: AttributeError>",
                           "enable_chunked_prefill": "<unreadable: AttributeError>"},
      "model_config": {"max_model_len": "<unreadable: AttributeError>", "hf_config": "<LlamaConfig>"},
      "cache_config": {"num_gpu_blocks": "<unreadable: AttributeError>", "block_size": "<unreadable: X>"}},
     {"async_scheduling": False}),
])
def test_a_type_tag_the_harness_wrote_for_an_unreadable_config_is_read_as_not_recorded(tmp_path, resolved, engine):
    """LLMServingSim's runner writes "<TypeName>" (or "<unreadable: Error>") for a config section or a
    field it could not list or read: not a value, so the next source (engine_kwargs, vLLM's default)
    is used, as for a field not recorded (each of these was 'must be a JSON object' / 'must be ...')."""
    folder = write_run(tmp_path / "run", isolated_requests(), meta_extra={"kv_cache": {}, "resolved_config": resolved})
    meta = json.loads((folder / "meta.json").read_text())
    meta["engine_kwargs"].update(engine)
    (folder / "meta.json").write_text(json.dumps(meta))
    run = read_run(folder)
    assert run.scheduler == {"max_num_seqs": 8, "max_num_batched_tokens": 512, **engine}
    assert run.kv_cache == {} and any("does not record num_blocks" in n for n in run.notes)
    code, _, err = run_cli("validate", "--against", str(folder), "--out", str(tmp_path / "o"), "--no-plots",
                           "--quiet", *CONSTANT)
    assert code == 0, err


def test_run_files_saved_with_a_utf8_byte_order_mark_are_read(tmp_path):
    """Windows editors save UTF-8 with a BOM; each such file was 'line 1: not valid JSON (Unexpected UTF-8 BOM)'."""
    folder = write_run(tmp_path / "run", isolated_requests())
    for name in ("meta.json", "requests.jsonl"):
        (folder / name).write_bytes(b"\xef\xbb\xbf" + (folder / name).read_bytes())
    assert len(read_run(folder).requests) == 4
    path = bench_json(tmp_path / "bench.json")
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    assert len(read_run(path).requests) > 0


@pytest.mark.parametrize("tick, csv_values, left_out", [
    (1.0, "1e308,1e308,1e308", ("prompt_tokens", "cached_prompt_tokens", "preemptions")),  # sums past a float
    (float("nan"), "100.0,25.0,2", ("prompt_tokens", "cached_prompt_tokens")),  # (OverflowError, ValueError before)
    (1e308, "100.0,25.0,2", ("prompt_tokens", "cached_prompt_tokens")),
    (-1.0, "100.0,25.0,2", ("prompt_tokens", "cached_prompt_tokens")),
    ("1.0", "100.0,25.0,2", ("prompt_tokens", "cached_prompt_tokens")),
])
def test_vllms_counters_that_add_up_to_no_number_are_left_out_with_a_note(tmp_path, tick, csv_values, left_out):
    """timeseries.csv is optional: counters whose totals are not finite, or a tick_seconds that is no
    duration, leave those counters out with a note; the comparison runs (a traceback before)."""
    folder = write_run(tmp_path / "run", isolated_requests(), meta_extra={"tick_seconds": tick})
    (folder / "timeseries.csv").write_text("t,prompt_throughput,prompt_cached_throughput,preempted\n"
                                           f"1.0,{csv_values}\n2.0,{csv_values}\n")
    run = read_run(folder)
    assert not set(left_out) & set(run.engine_counters)
    assert any("timeseries.csv" in n and "not compared" in n for n in run.notes), run.notes
    code, _, err = run_cli("validate", "--against", str(folder), "--out", str(tmp_path / "o"), "--no-plots",
                           "--quiet", *CONSTANT)
    assert code == 0, err


@pytest.mark.parametrize("edit, lines", [
    (lambda rows: [r.update(arrival_time=r["arrival_time"] * 1000) for r in rows], ("line 1", "line 20")),  # ms
    (lambda rows: rows[2].update(arrival_time=rows[2]["arrival_time"] + 100), ("line 3",)),  # one line off
    (lambda rows: [r.update(arrival_time=1.7e9) for r in rows], ("line 1", "line 20")),  # the run's start, each
])
def test_arrivals_on_another_clock_than_the_engines_are_a_one_line_error(tmp_path, edit, lines):
    """queued_ts - arrival_time is the clocks' offset plus a way into the engine of at most a step; a
    spread of minutes means arrival_time is not on one clock a constant from the engine's. Before, every
    arrival was moved by the smallest offset and the run simulated with arrivals minutes off (exit 0)."""
    rows = isolated_requests(20)  # 2 s apart: 38 s
    edit(rows)
    folder = write_run(tmp_path / "run", rows)
    with pytest.raises(RunFileError, match=r"requests\.jsonl: queued_ts - arrival_time") as e:
        read_run(folder)
    assert all(line in str(e.value) for line in lines) and "one clock" in str(e.value), e.value


@pytest.mark.parametrize("section, field, value, says", [
    # vLLM resolves these from the checkpoint too: a run whose engine_kwargs leave them out or 'auto'
    ("model_config", "dtype", "torch.float32", "resolved_config.model_config.dtype 'torch.float32' is not modelled"),
    ("model_config", "quantization", "fp8", "resolved_config.model_config.quantization 'fp8' is not modelled"),
    ("cache_config", "cache_dtype", "fp8_e4m3", "the run's KV cache is fp8_e4m3 and it does not record its block count"),
])
def test_a_precision_vllm_resolved_is_checked_like_the_engine_argument(tmp_path, section, field, value, says):
    """Each was simulated as a 16-bit run, exit 0."""
    meta = {"resolved_config": {section: {field: value}}}
    folder = write_run(tmp_path / "run", isolated_requests(), meta_extra=meta)
    code, _, err = run_cli("validate", "--against", str(folder), "--out", str(tmp_path / "o"), "--no-plots", *CONSTANT)
    assert code == 2 and err.count("\n") == 1 and says in err, err


def test_a_dtype_written_as_torchs_name_is_read_as_that_dtype(tmp_path):
    """vLLM's resolved ModelConfig.dtype is a torch.dtype, recorded as 'torch.bfloat16'; that was refused
    as a dtype 'not modelled'."""
    engine = {**ENGINE, "dtype": "torch.bfloat16"}
    meta = {"engine_kwargs": engine, "resolved_config": {"model_config": {"dtype": "torch.bfloat16"},
                                                         "cache_config": {"cache_dtype": "auto"}}}
    run = read_run(write_run(tmp_path / "run", isolated_requests(), meta_extra=meta))
    assert run.kv_cache_dtype is None


@pytest.mark.parametrize("field, value", [("tensor_parallel_size", 2), ("data_parallel_size", 2)])
def test_a_parallel_degree_vllm_resolved_that_disagrees_with_engine_kwargs_is_a_one_line_error(tmp_path, field, value):
    """vLLM never changes TP or DP: the files disagree, and engine_kwargs' degree was used silently (exit 0)."""
    meta = {"resolved_config": {"parallel_config": {field: value, "pipeline_parallel_size": 1}}}
    folder = write_run(tmp_path / "run", isolated_requests(), meta_extra=meta)
    with pytest.raises(RunFileError, match=rf"engine_kwargs.{field} 1 and resolved_config.parallel_config.{field} "
                                           rf"{value} disagree"):
        read_run(folder)
    meta["resolved_config"]["parallel_config"][field] = 1  # agreeing, or a tag: read
    read_run(write_run(tmp_path / "ok", isolated_requests(), meta_extra=meta))
    meta["resolved_config"]["parallel_config"][field] = "<unreadable: AttributeError>"
    read_run(write_run(tmp_path / "tag", isolated_requests(), meta_extra=meta))


@pytest.mark.parametrize("item, stated", [("tensor_parallel=2", "1"), ("cluster.num_replicas=4", "1")])
def test_a_set_that_contradicts_the_runs_parallelism_is_a_one_line_error(tmp_path, item, stated):
    """--set tensor_parallel=2 on a TP-1 run simulated another engine against the measured one, exit 0;
    where the run does not state it (a vllm bench JSON), --set supplies it."""
    folder = write_run(tmp_path / "run", isolated_requests())
    code, _, err = run_cli("validate", "--against", str(folder), "--out", str(tmp_path / "o"), "--no-plots", "--quiet",
                           "--set", item, *CONSTANT)
    key = item.partition("=")[0]
    assert code == 2 and err.count("\n") == 1 and f"--set '{item}'" in err and f"the run states {key} {stated}" in err, err
    code, _, err = run_cli("validate", "--against", str(folder), "--out", str(tmp_path / "p"), "--no-plots", "--quiet",
                           "--set", f"{key}={stated}", *CONSTANT)  # the run's own value: fine
    assert code == 0, err
    code, _, err = run_cli("validate", "--against", str(bench_json(tmp_path / "bench.json")), "--out",
                           str(tmp_path / "b"), "--no-plots", "--quiet", "--set", "hardware=h100-sxm", "--set", item,
                           *CONSTANT)
    assert code == 0, err


def test_a_cuda_memory_total_past_the_gpus_own_memory_is_a_one_line_error(tmp_path):
    """16 TiB on an RTX PRO 6000 (96 GB) derived a cache of 7.5 million blocks, exit 0; a GPU cannot report
    more than it has. Unused where the run records its block count."""
    meta = {"hardware": {"device_name": "NVIDIA RTX PRO 6000 Blackwell Server Edition",
                         "device_total_memory_bytes": 2**44}}
    folder = write_run(tmp_path / "run", isolated_requests(), meta_extra=meta)
    code, _, err = run_cli("validate", "--against", str(folder), "--out", str(tmp_path / "o"), "--no-plots", *CONSTANT)
    assert code == 2 and err.count("\n") == 1 and "hardware.device_total_memory_bytes" in err and "rtx-pro-6000" in err, err
    meta["kv_cache"] = {"num_gpu_blocks": 900, "block_size": 16, "enable_prefix_caching": True}
    folder = write_run(tmp_path / "blocks", isolated_requests(), meta_extra=meta)
    code, _, err = run_cli("validate", "--against", str(folder), "--out", str(tmp_path / "p"), "--no-plots", *CONSTANT)
    assert code == 0, err


def test_a_null_request_id_is_no_id_and_a_folder_given_as_a_file_says_so(tmp_path):
    """request_id null on every line was 'request_id 'None' repeats line 1'; --format vllm-bench on a
    run folder was 'file not found'."""
    rows = isolated_requests()
    for row in rows:
        row["request_id"] = None
    folder = write_run(tmp_path / "run", rows)
    assert len(read_run(folder).requests) == 4
    with pytest.raises(RunFileError, match=r"run: a folder, not a file"):
        read_run(folder, "vllm-bench")


def test_a_pipeline_degree_written_as_a_type_tag_is_not_recorded(tmp_path):
    folder = write_run(tmp_path / "run", isolated_requests())
    meta = json.loads((folder / "meta.json").read_text())
    meta["resolved_config"] = {"parallel_config": {"pipeline_parallel_size": "<unreadable: AttributeError>"}}
    (folder / "meta.json").write_text(json.dumps(meta))
    code, _, err = run_cli("validate", "--against", str(folder), "--out", str(tmp_path / "o"), "--no-plots",
                           "--quiet", *CONSTANT)
    assert code == 0, err


def test_the_batch_limits_vllm_ran_with_win_over_the_engine_arguments(tmp_path):
    """What vLLM resolved is what it ran: a budget it changed is simulated with a note; a run whose
    engine_kwargs leave a limit out takes the resolved one; neither is an error naming the field."""
    folder = write_run(tmp_path / "run", isolated_requests(),
                       meta_extra={"resolved_config": {"scheduler_config": {"max_num_seqs": 8,
                                                                            "max_num_batched_tokens": 1024}}})
    run = read_run(folder)
    assert (run.scheduler["max_num_seqs"], run.scheduler["max_num_batched_tokens"]) == (8, 1024)
    assert any("engine_kwargs.max_num_batched_tokens is 512 but vLLM ran with 1024" in n for n in run.notes)
    meta = json.loads((folder / "meta.json").read_text())
    del meta["engine_kwargs"]["max_num_seqs"]
    (folder / "meta.json").write_text(json.dumps(meta))
    assert read_run(folder).scheduler["max_num_seqs"] == 8
    del meta["resolved_config"]
    (folder / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(RunFileError, match=r"missing field 'engine_kwargs\.max_num_seqs'"):
        read_run(folder)


def test_an_enforce_eager_written_as_text_is_an_error_and_the_resolved_one_is_read(tmp_path):
    """A text "false" was read as not recorded, so the note that the run served with CUDA graphs was lost;
    a run whose engine_kwargs leave it out gives what vLLM resolved (model_config.enforce_eager)."""
    folder = write_run(tmp_path / "text", isolated_requests(), meta_extra={"engine_kwargs": {**ENGINE, "enforce_eager": "false"}})
    with pytest.raises(RunFileError, match=re.escape("field 'engine_kwargs.enforce_eager' must be true, false or null")):
        read_run(folder)
    folder = write_run(tmp_path / "resolved", isolated_requests(),
                       meta_extra={"resolved_config": {"model_config": {"enforce_eager": False}}})
    assert read_run(folder).enforce_eager is False
    folder = write_run(tmp_path / "none", isolated_requests())
    assert read_run(folder).enforce_eager is None


@pytest.mark.parametrize(("where", "edit"), [
    ("run", ["--set", "kv_cache.num_blocks=900"]),
    ("set", ["--set", "kv_cache.num_blocks=900", "--set", "scheduler.max_num_batched_tokens=4"]),
])
def test_a_token_budget_below_the_seats_is_a_one_line_error_as_vllm_refuses_it(tmp_path, where, edit):
    """vLLM's SchedulerConfig refuses max_num_batched_tokens < max_num_seqs, so no run has it: a run file
    (or a --set) that says so was simulated as a server that never existed."""
    engine = {**ENGINE, "max_num_seqs": 8, "max_num_batched_tokens": 4 if where == "run" else 512}
    folder = write_run(tmp_path / "run", isolated_requests(), meta_extra={"engine_kwargs": engine})
    code, _, err = run_cli("validate", "--against", str(folder), "--out", str(tmp_path / "o"), "--no-plots", *edit)
    assert code == 2 and err.count("\n") == 1, err
    assert "max_num_batched_tokens 4 must be at least max_num_seqs 8" in err


def test_a_preset_whose_token_budget_is_below_its_seats_is_one_vllm_would_not_start():
    from servesim.sim.engine_presets import PRESETS

    for preset in ("vllm-v1", "vllm-v0"):
        low = PRESETS[preset](max_num_seqs=64, max_num_batched_tokens=32)
        assert "max_num_batched_tokens 32 must be at least max_num_seqs 64" in low.start_refusal(10**6, 16)
        assert PRESETS[preset](max_num_seqs=64, max_num_batched_tokens=64).start_refusal(10**6, 16) is None
