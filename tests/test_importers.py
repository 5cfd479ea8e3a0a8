"""Readers of public GPU measurement formats: SI units, provenance, one-line errors."""

from pathlib import Path

import pytest
from servesim.calibration.importers import SourceError, inference_sim, llmservingsim, vidur
from servesim.sim.cost_model import ProfileError

META = """gpu: NVIDIA Test GPU
model: org/Tiny-1B
variant: bf16
tp_degrees: [1]
engine_effective:
  hf_overrides: {num_hidden_layers: 1}
"""


def write_llmservingsim(root: Path, *, dense_header: str = "layer,tokens,time_us") -> Path:
    """A minimal LLMServingSim profile folder: profiles/GPU/org/model/{meta.yaml, tp1/*.csv}."""
    folder = root / "profiles" / "TESTGPU" / "org" / "Tiny-1B"
    (folder / "tp1").mkdir(parents=True)
    (folder / "meta.yaml").write_text(META)
    (folder / "tp1" / "dense.csv").write_text(f"{dense_header}\nqkv_proj,1,10\nqkv_proj,2,12.5\n")
    (folder / "tp1" / "attention.csv").write_text(
        "prefill_chunk,kv_prefill,n_decode,kv_decode,time_us\n0,0,1,16,8\n16,0,0,0,7\n")
    (folder / "tp1" / "per_sequence.csv").write_text("layer,sequences,time_us\nlm_head,1,700\nsampler,1,20\n")
    return folder


def test_llmservingsim_profile_reads_in_seconds_with_provenance(tmp_path):
    prof = llmservingsim.read_profile(write_llmservingsim(tmp_path))
    t = prof.tp[1]
    assert t.dense["seconds"].tolist() == pytest.approx([10e-6, 12.5e-6])
    assert t.attention.loc[0, ["prefill_chunk", "kv_prefill", "n_decode", "kv_decode"]].tolist() == [0, 0, 1, 16]
    assert t.per_sequence.set_index("op")["seconds"]["lm_head"] == pytest.approx(700e-6)
    assert t.skew is None  # optional file
    paths = [p.path for p in prof.provenance]
    assert "profiler/perf/TESTGPU/org/Tiny-1B/bf16/tp1/dense.csv" in paths
    assert {p.repo for p in prof.provenance} == {"casys-kaist/LLMServingSim"}
    assert {p.gpu for p in prof.provenance} == {"NVIDIA Test GPU"}


def test_missing_column_names_the_file_and_the_column(tmp_path):
    folder = write_llmservingsim(tmp_path, dense_header="layer,tokens,latency")
    with pytest.raises(SourceError, match=r"dense\.csv: missing column 'time_us'") as exc:
        llmservingsim.read_profile(folder)
    assert isinstance(exc.value, ProfileError)  # the CLI's one-line exit-2 path
    assert "\n" not in str(exc.value)


def test_non_numeric_cell_is_named(tmp_path):
    folder = write_llmservingsim(tmp_path)
    (folder / "tp1" / "per_sequence.csv").write_text("layer,sequences,time_us\nlm_head,1,fast\n")
    with pytest.raises(SourceError, match=r"per_sequence\.csv: column 'time_us' row 2 is 'fast'"):
        llmservingsim.read_profile(folder)


@pytest.mark.parametrize("cell, shown", [("nan", "nan"), ("-5", "-5"), ("-2.5", "-2.5"), ("inf", "inf")])
def test_a_negative_or_missing_time_is_named_as_read(tmp_path, cell, shown):
    folder = write_llmservingsim(tmp_path)
    (folder / "tp1" / "per_sequence.csv").write_text(f"layer,sequences,time_us\nlm_head,1,{cell}\n")
    with pytest.raises(SourceError, match=rf"per_sequence\.csv: column 'time_us' row 2 is {shown}, expected"):
        llmservingsim.read_profile(folder)


def test_meta_without_tp_degrees_is_an_error(tmp_path):
    folder = write_llmservingsim(tmp_path)
    (folder / "meta.yaml").write_text("gpu: X\nmodel: Y\n")
    with pytest.raises(SourceError, match="missing field 'tp_degrees'"):
        llmservingsim.read_profile(folder)


def test_asking_for_a_tp_degree_the_profile_lacks(tmp_path):
    with pytest.raises(SourceError, match="no tp2 tables"):
        llmservingsim.read_profile(write_llmservingsim(tmp_path), tp=[2])


def test_v0_layers_in_seconds_with_vllm_names(tmp_path):
    f = tmp_path / "layers.csv"
    f.write_text("layer_name,input,kv_cache,tp_size,latency(ns)\ninput_layernorm,4,0,1,2000\nrope,4,0,1,1000\n")
    df, prov = llmservingsim.read_v0_layers(f)
    assert df["op"].tolist() == ["layernorm", "rotary_emb"]
    assert df["seconds"].tolist() == pytest.approx([2e-6, 1e-6])
    assert prov.license == "MIT" and prov.path.endswith("layers.csv")


def test_vidur_mlp_takes_the_median_in_seconds(tmp_path):
    f = tmp_path / "compute" / "h100" / "org" / "M" / "mlp.csv"
    f.parent.mkdir(parents=True)
    f.write_text("time_stats.attn_pre_proj.mean,time_stats.attn_pre_proj.median,num_tokens,"
                 "num_tensor_parallel_workers\n0.5,0.25,8,1\n")
    df, prov = vidur.read_mlp(f)
    assert df.to_dict("records") == [{"op": "qkv_proj", "tokens": 8, "tp": 1, "seconds": pytest.approx(0.25e-3)}]
    assert prov.repo == "microsoft/vidur" and prov.path == "data/profiling/compute/h100/org/M/mlp.csv"
    assert prov.gpu.startswith("NVIDIA H100")


def test_vidur_mlp_without_timing_columns(tmp_path):
    f = tmp_path / "mlp.csv"
    f.write_text("num_tokens,num_tensor_parallel_workers\n1,1\n")
    with pytest.raises(SourceError, match=r"mlp\.csv: missing column 'time_stats\.<op>\.median'"):
        vidur.read_mlp(f)


def test_vidur_all_reduce_bytes_and_seconds(tmp_path):
    f = tmp_path / "all_reduce.csv"
    f.write_text(",time_stats.all_reduce.median,num_workers,size,devices_per_node\n0,0.02,2,4096,8\n")
    df, _ = vidur.read_all_reduce(f)
    assert df.to_dict("records") == [{"bytes": 4096, "num_workers": 2, "devices_per_node": 8,
                                      "seconds": pytest.approx(20e-6)}]


def test_inference_sim_reads_heads_from_the_name(tmp_path):
    f = tmp_path / "mha_decode_h100_32-8-128-tp1.csv"
    f.write_text("dtype,kv_dtype,batch_size,kv_len,latency_us,mfu\nbf16,bf16,4,1024,30,0\n")
    df, prov = inference_sim.read_decode(f)
    assert df.to_dict("records") == [{"batch": 4, "kv_len": 1024, "seconds": pytest.approx(30e-6)}]
    assert inference_sim.heads(f) == ("decode", "h100", 32, 8, 128, 1)
    assert prov.license == "Apache-2.0" and prov.path == "bench_data/mha/decode/h100/" + f.name
    with pytest.raises(SourceError, match="decode file where a prefill file"):
        inference_sim.read_prefill(f)


def test_inference_sim_bad_name(tmp_path):
    f = tmp_path / "attention.csv"
    f.write_text("seq_len,latency_us\n1024,38\n")
    with pytest.raises(SourceError, match="name does not read as mha_"):
        inference_sim.read_prefill(f)
