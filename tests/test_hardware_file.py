"""A GPU without a preset, from a hardware file (sim/hardware_file.py): read with units, based on a
preset or standing alone, accepted wherever a preset name is, refused in one line when malformed."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from servesim.sim.errors import PresetError
from servesim.sim.presets import HARDWARE, GiB, MiB, get_hardware
from servesim.sim.scenario import load_scenario
from servesim.sim.simulate import simulate
from servesim.sim.verbs.prices import prices_for

ROOT = Path(__file__).resolve().parents[1]
L4 = "base: l40s\npeak_flops: 121 TFLOPS\nhbm_bandwidth: 300 GB/s\nmemory_bytes: 23034 MiB\nsm_count: 58\n"


def write(path: Path, text: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path)


def test_a_based_file_overrides_only_what_it_gives_and_takes_units(tmp_path):
    hw = get_hardware(write(tmp_path / "L4.yaml", L4))
    assert hw.name == "l4" and hw.peak_flops == 121e12 and hw.hbm_bandwidth == 300e9
    assert hw.memory_bytes == 23034 * MiB and hw.sm_count == 58
    # CUDA's total is not the base's: nvidia-smi's less 512 MiB, as for the presets nobody measured
    assert hw.cuda_memory_bytes == (23034 - 512) * MiB
    base = HARDWARE["l40s"]
    given = {"name", "peak_flops", "hbm_bandwidth", "memory_bytes", "cuda_memory_bytes", "sm_count"}
    assert all(getattr(hw, k) == getattr(base, k) for k in {f.name for f in dataclasses.fields(hw)} - given)
    # a file that leaves the memory alone keeps the base's measured CUDA total
    assert get_hardware(write(tmp_path / "fast.yaml", "base: l40s\npeak_flops: 400 TFLOPS\n")).cuda_memory_bytes == \
        base.cuda_memory_bytes


def test_a_file_without_a_base_takes_the_unprofiled_defaults_and_plain_si_numbers(tmp_path):
    text = "peak_flops: 2.0e+14\nhbm_bandwidth: 1e12\nmemory_bytes: 48e9\nkernel_floor_s: 5 us\n"
    hw = get_hardware(write(tmp_path / "gpu.yaml", text))  # YAML reads 1e12 as text: it is a number here
    default = dataclasses.replace(HARDWARE["h100-sxm"].__class__("x"), name="gpu", peak_flops=2e14,
                                  hbm_bandwidth=1e12, memory_bytes=48e9, cuda_memory_bytes=48e9 - 512 * MiB,
                                  kernel_floor_s=5e-6)
    assert hw == default
    assert get_hardware(write(tmp_path / "g.json", json.dumps({"base": "a100-80g", "memory_bytes": 40 * GiB,
                                                               "cuda_memory_bytes": 39.4 * GiB}))).name == "g"


@pytest.mark.parametrize("text, names", [
    ("peak_flops: 1e14\nhbm_bandwidth: 1e12\n", ("memory_bytes", "missing", "base")),
    ("base: l40x\n", ("base", "l40s")),
    ("base: l40s\npeak_flop: 1e14\n", ("unknown field", "peak_flops")),
    ("base: l40s\nhbm_bandwidth: 300 TFLOPS\n", ("hbm_bandwidth", "flop/s", "bytes/s")),
    ("base: l40s\nhbm_bandwidth: 300 parsecs\n", ("unknown unit",)),
    ("base: l40s\nmemory_bytes: -1\n", ("memory_bytes", "> 0")),
    ("base: l40s\npeak_flops: true\n", ("peak_flops", "number")),
    ("base: l40s\npeak_flops: .nan\n", ("peak_flops", "finite")),
    ("base: l40s\ngemm_flops_fraction: 3\n", ("gemm_flops_fraction", "(0, 2]")),
    ("base: l40s\nsm_count: 1.5\n", ("sm_count", "whole number")),
    ("base: l40s\nflash_attention: 4\n", ("flash_attention", "2 or 3")),
    ("base: l40s\ninterconnect: 5\n", ("interconnect", "text")),
    ("base: l40s\npeak_flops: null\n", ("peak_flops", "null")),
    ("base: l40s\ncuda_memory_bytes: 50 GiB\n", ("cuda_memory_bytes", "more than memory_bytes")),
    ("base: l40s\nmemory_bytes: 256 MiB\n", ("memory_bytes", "512 MiB", "cuda_memory_bytes")),
    ("[1, 2]\n", ("mapping",)),
    ("base: [l40s\n", ("not valid YAML",)),
])
def test_a_bad_file_is_a_one_line_error_naming_the_field(tmp_path, text, names):
    path = write(tmp_path / "gpu.yaml", text)
    with pytest.raises(PresetError) as err:
        get_hardware(path)
    message = str(err.value)
    assert "\n" not in message and "gpu.yaml" in message
    for name in names:
        assert name in message


def test_missing_files_and_unknown_names_say_what_hardware_may_be(tmp_path):
    with pytest.raises(PresetError, match="no such file"):
        get_hardware(str(tmp_path / "nope.yaml"))
    with pytest.raises(PresetError, match="a folder"):
        get_hardware(str(tmp_path) + "/")
    with pytest.raises(PresetError, match="hardware file"):
        get_hardware("tpu-v9")


def test_a_scenario_path_is_relative_to_its_file_and_a_based_copy_simulates_as_its_base(tmp_path):
    write(tmp_path / "gpus" / "twin.yaml", "base: h100-sxm\n")
    body = yaml.safe_load((ROOT / "scenarios" / "quickstart.yaml").read_text())
    body["workload"]["num_requests"] = 60
    (tmp_path / "file.yaml").write_text(yaml.safe_dump({**body, "hardware": "gpus/twin.yaml"}))
    (tmp_path / "preset.yaml").write_text(yaml.safe_dump(body))
    sc = load_scenario(tmp_path / "file.yaml")
    assert sc.hardware == str((tmp_path / "gpus" / "twin.yaml").absolute())
    ours, preset = simulate(sc), simulate(load_scenario(tmp_path / "preset.yaml"))
    assert ours.requests_df.equals(preset.requests_df)


def test_search_prices_a_file_by_its_own_price_or_asks_for_one(tmp_path):
    priced = write(tmp_path / "a.yaml", L4 + "price_per_gpu_hour: 0.8\n")
    assert prices_for([priced, "h100-sxm"], {})[priced] == 0.8
    unpriced = write(tmp_path / "b.yaml", "base: cpu-2core\nprice_per_gpu_hour: null\n")
    with pytest.raises(Exception, match="price_per_gpu_hour in that hardware file"):
        prices_for([unpriced], {})


def test_cli_run_takes_a_hardware_file_and_refuses_a_bad_one_in_one_line(tmp_path):
    path = write(tmp_path / "L4.yaml", L4)
    args = [sys.executable, "-m", "servesim.sim.cli", "run", str(ROOT / "scenarios" / "quickstart.yaml"),
            "--set", "workload.num_requests=20", "--no-plots", "--quiet"]
    ok = subprocess.run([*args, "--set", f"hardware={path}", "--out", str(tmp_path / "ok")], capture_output=True,
                        text=True)
    assert ok.returncode == 0, ok.stderr
    assert json.loads((tmp_path / "ok" / "summary.json").read_text())["hardware"] == path
    write(tmp_path / "L4.yaml", L4 + "hbm_bandwidth_fraction: 0.9\n")
    bad = subprocess.run([*args, "--set", f"hardware={path}", "--out", str(tmp_path / "bad")], capture_output=True,
                         text=True)
    assert bad.returncode == 2 and "unknown field 'hbm_bandwidth_fraction'" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1 and "Traceback" not in bad.stderr
