"""A model from a Hugging Face config.json on disk (sim/hf_config.py): read into the same shapes a
preset holds, accepted wherever a preset name is, and refused in one line where it is not a dense
Llama-style decoder servesim can price."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from servesim.sim.cost_model import build_cost_model, same_shapes
from servesim.sim.errors import PresetError, ProfileError
from servesim.sim.presets import MODELS, get_hardware, get_model
from servesim.sim.scenario import ScenarioError, load_scenario, scenario_from_dict
from servesim.sim.simulate import simulate

ROOT = Path(__file__).resolve().parents[1]


def get_model_at(path: Path):
    return get_model(str(path))

# Llama-3.1-8B's config.json as the Hub serves it (the fields that matter, and a few that do not)
LLAMA = {"_name_or_path": "meta-llama/Meta-Llama-3.1-8B-Instruct", "architectures": ["LlamaForCausalLM"],
         "attention_bias": False, "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336,
         "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32,
         "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
         "rope_scaling": {"factor": 8.0, "rope_type": "llama3"}, "rope_theta": 500000.0,
         "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 128256}
QWEN3_8B = {"model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
            "max_position_embeddings": 40960, "rope_theta": 1000000, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False, "sliding_window": None, "use_sliding_window": False}
QWEN25_7B = {"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
             "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
             "max_position_embeddings": 131072, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
             "tie_word_embeddings": False, "sliding_window": 131072, "use_sliding_window": False}


def write(folder: Path, cfg: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder / "config.json"


def test_configs_read_into_the_presets_shapes(tmp_path):
    # Llama-3.1-8B and Qwen2.5-7B (qkv bias implied by qwen2), against the presets from the same files
    for name, cfg in (("llama-3.1-8b", LLAMA), ("qwen2.5-7b", QWEN25_7B)):
        model = get_model_at(write(tmp_path / name, cfg))
        assert dataclasses.replace(model, name=name) == MODELS[name]
    qwen = get_model_at(write(tmp_path / "Qwen3-8B", QWEN3_8B))
    assert dataclasses.replace(qwen, name="qwen3-8b") == MODELS["qwen3-8b"]
    assert qwen.qk_norm and not qwen.qkv_bias and qwen.num_params == 8_190_735_360


def test_a_folder_a_file_and_the_hub_cache_all_name_the_model(tmp_path):
    no_name = {k: v for k, v in LLAMA.items() if k != "_name_or_path"}
    path = write(tmp_path / "Llama-3.1-8B", no_name)
    assert get_model(str(path)).name == get_model(str(path.parent)).name == "llama-3.1-8b"
    assert get_model(str(write(tmp_path / "x", LLAMA))).name == "meta-llama-3.1-8b-instruct"
    snap = write(tmp_path / "models--Qwen--Qwen3-8B" / "snapshots" / ("a" * 40), QWEN3_8B)
    assert get_model(str(snap)).name == "qwen3-8b"


def test_a_changed_file_is_read_again(tmp_path):
    path = write(tmp_path / "m", LLAMA)
    assert get_model(str(path)).num_layers == 32
    path.write_text(json.dumps({**LLAMA, "num_hidden_layers": 16, "vocab_size": 128000}))
    assert get_model(str(path)).num_layers == 16


@pytest.mark.parametrize("change, names", [
    ({"model_type": "qwen3_moe", "num_experts": 128}, ("mixture-of-experts",)),
    ({"num_local_experts": 8}, ("mixture-of-experts", "num_local_experts")),
    ({"model_type": "gemma2"}, ("gemma2", "llama, mistral, qwen2, qwen3")),
    ({"model_type": None}, ("model_type", "missing")),
    ({"num_hidden_layers": None}, ("num_hidden_layers", "missing")),
    ({"hidden_size": "4096"}, ("hidden_size", "whole number")),
    ({"num_attention_heads": True}, ("num_attention_heads", "whole number")),
    ({"intermediate_size": 0}, ("intermediate_size",)),
    ({"vocab_size": 1.5}, ("vocab_size",)),
    ({"num_key_value_heads": 5}, ("num_key_value_heads", "multiple")),
    ({"tie_word_embeddings": "yes"}, ("tie_word_embeddings", "true or false")),
    ({"rope_theta": -1}, ("rope_theta",)),
    ({"quantization_config": {"quant_method": "awq"}}, ("quantised", "awq")),
    ({"model_type": "mistral", "sliding_window": 4096}, ("sliding-window", "4096")),
    ({"hidden_act": "gelu"}, ("hidden_act", "gelu")),
])
def test_what_is_not_a_dense_llama_style_model_is_a_one_line_error(tmp_path, change, names):
    cfg = {k: v for k, v in {**LLAMA, **change}.items() if v is not None}
    with pytest.raises(PresetError) as err:
        get_model_at(write(tmp_path / "m", cfg))
    message = str(err.value)
    assert "\n" not in message and str(tmp_path / "m" / "config.json") in message
    for name in names:
        assert name in message


@pytest.mark.parametrize("data, names", [
    (b"", ("not valid JSON",)), (b"[1, 2]", ("JSON object",)), ('{"a": 1}'.encode("utf-16"), ("UTF-8",)),
])
def test_a_broken_file_is_a_one_line_error(tmp_path, data, names):
    (tmp_path / "config.json").write_bytes(data)
    with pytest.raises(PresetError) as err:
        get_model(str(tmp_path / "config.json"))
    assert all(n in str(err.value) for n in names) and "\n" not in str(err.value)


def test_a_missing_path_and_an_unknown_name_say_what_a_model_may_be(tmp_path):
    with pytest.raises(PresetError, match="no such file.*config.json"):
        get_model(str(tmp_path / "nope" / "config.json"))
    with pytest.raises(PresetError, match="Hugging Face config.json"):
        get_model("qwen9-1t")
    with pytest.raises(ScenarioError, match="model.*no such file"):
        scenario_from_dict({"model": str(tmp_path / "nope.json"), "workload": {"num_requests": 5}})


def test_a_scenario_path_is_relative_to_its_file_and_simulates_as_the_preset(tmp_path):
    write(tmp_path / "models" / "llama", LLAMA)
    body = {"name": "x", "workload": {"num_requests": 40, "arrival": {"process": "poisson", "rate": 8.0},
                                      "prompt_len": {"dist": "uniform", "min": 100, "max": 3000},
                                      "output_len": {"dist": "uniform", "min": 10, "max": 300}}}
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump({**body, "model": "models/llama"}))
    (tmp_path / "preset.yaml").write_text(yaml.safe_dump({**body, "model": "llama-3.1-8b"}))
    sc = load_scenario(tmp_path / "cfg.yaml")
    assert Path(sc.model).is_absolute() and Path(sc.model) == (tmp_path / "models" / "llama").absolute()
    ours, preset = simulate(sc), simulate(load_scenario(tmp_path / "preset.yaml"))
    assert ours.requests_df.equals(preset.requests_df) and ours.summary["mean_e2el_ms"] == preset.summary["mean_e2el_ms"]  # rope, norm eps and the name are not priced


def test_a_profile_for_the_preset_prices_a_config_with_its_shapes_only(tmp_path):
    profile = {"type": "profile", "path": "rtx-4090-llama-3.1-8b-tp1.json"}
    from servesim.sim.cost_model import CostModelConfig

    cfg, hw = CostModelConfig(**profile), get_hardware("rtx-4090")
    same = get_model(str(write(tmp_path / "a", LLAMA)))
    assert same_shapes("llama-3.1-8b", same) and not same_shapes("llama-3.1-8b", MODELS["llama-3-8b"])
    build_cost_model(cfg, same, hw, 1, 16)
    other = get_model(str(write(tmp_path / "b", {**LLAMA, "intermediate_size": 11008})))
    with pytest.raises(ProfileError, match="llama-3.1-8b"):
        build_cost_model(cfg, other, hw, 1, 16)


def test_cli_run_takes_a_config_path_and_refuses_a_bad_one_in_one_line(tmp_path):
    path = write(tmp_path / "Qwen3-8B", QWEN3_8B)
    args = [sys.executable, "-m", "servesim.sim.cli", "run", str(ROOT / "scenarios" / "quickstart.yaml"),
            "--set", "workload.num_requests=20", "--no-plots", "--quiet"]
    ok = subprocess.run([*args, "--set", f"model={path.parent}", "--out", str(tmp_path / "ok")],
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert yaml.safe_load((tmp_path / "ok" / "scenario.yaml").read_text())["model"] == str(path.parent)
    path.write_text(json.dumps({**QWEN3_8B, "model_type": "qwen3_moe", "num_experts": 128}))
    bad = subprocess.run([*args, "--set", f"model={path}", "--out", str(tmp_path / "bad")],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "mixture-of-experts" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1 and "Traceback" not in bad.stderr
