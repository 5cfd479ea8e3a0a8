"""Readers of public GPU measurement formats: SI units, provenance, one-line errors."""

import re
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


def _csv(tmp_path: Path, name: str, text: str) -> Path:
    f = tmp_path / name
    f.write_text(text)
    return f


# every reader, given a file whose time column holds 0 in its second data row (line 3)
ZERO_TIME = [
    ("dense.csv", "layer,tokens,time_us\nqkv_proj,1,10\nqkv_proj,2,0\n", llmservingsim.read_dense, "time_us"),
    ("per_sequence.csv", "layer,sequences,time_us\nlm_head,1,700\nlm_head,2,0\n", llmservingsim.read_per_sequence,
     "time_us"),
    ("attention.csv", "prefill_chunk,kv_prefill,n_decode,kv_decode,time_us\n0,0,1,16,8\n16,0,0,0,0\n",
     llmservingsim.read_attention, "time_us"),
    ("skew.csv", "regime,n,nb,skew,pc,kp,kvs,kv_big,kv_mean,t_mean_us,t_max_us,t_skew_us\n"
     "pure,2,1,4.0,0,0,128,512,320,46,50,47\npure,2,1,4.0,0,0,256,1024,640,51,59,0\n",
     llmservingsim.read_skew, "t_skew_us"),
    ("layers.csv", "layer_name,input,kv_cache,tp_size,latency(ns)\nq_proj,1,0,1,2000\nq_proj,2,0,1,0\n",
     llmservingsim.read_v0_layers, "latency(ns)"),
    ("mlp.csv", "time_stats.attn_pre_proj.median,num_tokens,num_tensor_parallel_workers\n0.25,8,1\n0,16,1\n",
     vidur.read_mlp, "time_stats.attn_pre_proj.median"),
    ("all_reduce.csv", "time_stats.all_reduce.median,num_workers,size,devices_per_node\n0.02,2,4096,8\n0,2,8192,8\n",
     vidur.read_all_reduce, "time_stats.all_reduce.median"),
    ("mha_decode_h100_32-8-128-tp1.csv", "batch_size,kv_len,latency_us\n1,1024,30\n1,2048,0\n",
     inference_sim.read_decode, "latency_us"),
    ("mha_prefill_h100_32-8-128.csv", "seq_len,latency_us\n1024,38\n2048,0\n", inference_sim.read_prefill,
     "latency_us"),
]


@pytest.mark.parametrize("name, text, reader, column", ZERO_TIME, ids=[z[0] for z in ZERO_TIME])
def test_a_zero_time_is_named(tmp_path, name, text, reader, column):
    """A kernel that took no time is no measurement: it was a traceback in the NNLS fit (dense,
    per-sequence, Vidur, inference-sim) or a 0 written into the profile (v0 small ops, all-reduce)."""
    with pytest.raises(SourceError, match=rf"{re.escape(name)}: column '{re.escape(column)}' row 3 is 0(\.0)?, expected a finite number > 0"):
        reader(_csv(tmp_path, name, text))


# every reader, given a count (tokens, rows, context, TP degree, bytes) of 0 or with a fraction in
# its second data row (line 3), where the reader would have truncated it or fitted 0 tokens
COUNTS = [
    ("dense.csv", "layer,tokens,time_us\nqkv_proj,1,10\nqkv_proj,{},12\n", llmservingsim.read_dense, "tokens"),
    ("per_sequence.csv", "layer,sequences,time_us\nlm_head,1,700\nlm_head,{},710\n", llmservingsim.read_per_sequence,
     "sequences"),
    ("layers.csv", "layer_name,input,kv_cache,tp_size,latency(ns)\nq_proj,1,0,1,2000\nq_proj,{},0,1,2100\n",
     llmservingsim.read_v0_layers, "input"),
    ("layers.csv", "layer_name,input,kv_cache,tp_size,latency(ns)\nq_proj,1,0,1,2000\nq_proj,2,0,{},2100\n",
     llmservingsim.read_v0_layers, "tp_size"),
    ("mlp.csv", "time_stats.attn_pre_proj.median,num_tokens,num_tensor_parallel_workers\n0.25,8,1\n0.3,{},1\n",
     vidur.read_mlp, "num_tokens"),
    ("mlp.csv", "time_stats.attn_pre_proj.median,num_tokens,num_tensor_parallel_workers\n0.25,8,1\n0.3,16,{}\n",
     vidur.read_mlp, "num_tensor_parallel_workers"),
    ("all_reduce.csv", "time_stats.all_reduce.median,num_workers,size,devices_per_node\n0.02,2,4096,8\n0.03,2,{},8\n",
     vidur.read_all_reduce, "size"),
    ("all_reduce.csv", "time_stats.all_reduce.median,num_workers,size,devices_per_node\n0.02,2,4096,8\n0.03,{},8192,8\n",
     vidur.read_all_reduce, "num_workers"),
    ("mha_decode_h100_32-8-128-tp1.csv", "batch_size,kv_len,latency_us\n1,1024,30\n{},2048,31\n",
     inference_sim.read_decode, "batch_size"),
    ("mha_decode_h100_32-8-128-tp1.csv", "batch_size,kv_len,latency_us\n1,1024,30\n1,{},31\n",
     inference_sim.read_decode, "kv_len"),
    ("mha_prefill_h100_32-8-128.csv", "seq_len,latency_us\n1024,38\n{},200\n", inference_sim.read_prefill, "seq_len"),
]


@pytest.mark.parametrize("name, text, reader, column", COUNTS, ids=[f"{c[0]}-{c[3]}" for c in COUNTS])
@pytest.mark.parametrize("cell", ["0", "1.5"])
def test_a_zero_or_fractional_count_is_named(tmp_path, name, text, reader, column, cell):
    """0 tokens, rows or bytes measure nothing (it was a traceback in the fit, or a 0-token node in
    the profile); 1.5 was truncated to 1 without a word."""
    with pytest.raises(SourceError, match=rf"{re.escape(name)}: column '{column}' row 3 is {cell}(\.0)?, "
                                          r"expected a whole number > 0"):
        reader(_csv(tmp_path, name, text.format(cell)))


@pytest.mark.parametrize("name, text, reader, column", [
    ("attention.csv", "prefill_chunk,kv_prefill,n_decode,kv_decode,time_us\n0,0,1,16,8\n16,0,0,{},7\n",
     llmservingsim.read_attention, "kv_decode"),
    ("layers.csv", "layer_name,input,kv_cache,tp_size,latency(ns)\nq_proj,1,0,1,2000\nq_proj,2,{},1,2100\n",
     llmservingsim.read_v0_layers, "kv_cache"),
])
def test_a_fractional_context_is_named_and_zero_is_fine(tmp_path, name, text, reader, column):
    reader(_csv(tmp_path, name, text.format("0")))  # no context: a measured shape
    with pytest.raises(SourceError, match=rf"{name}: column '{column}' row 3 is 1\.5, expected a whole number >= 0"):
        reader(_csv(tmp_path, name, text.format("1.5")))


@pytest.mark.parametrize("data", [b"\xff\xfeg\x00p\x00u\x00", bytes(range(256))], ids=["utf-16", "binary"])
def test_meta_that_is_not_utf8_is_named(tmp_path, data):
    """Was a UnicodeDecodeError traceback (exit 1)."""
    folder = write_llmservingsim(tmp_path)
    (folder / "meta.yaml").write_bytes(data)
    with pytest.raises(SourceError, match=r"meta\.yaml: not UTF-8 text \(byte 0x(ff|80) at offset \d+\)"):
        llmservingsim.read_profile(folder)


@pytest.mark.parametrize("line, says", [
    ("tp_degrees: '12'", "tp_degrees must be a list of whole numbers >= 1"),  # was read as [1, 2]
    ("tp_degrees: '1'", "tp_degrees must be a list"),  # was read as [1] by accident
    ("tp_degrees: 1", "tp_degrees must be a list"),  # TypeError traceback
    ("tp_degrees: null", "tp_degrees must be a list"),
    ("tp_degrees: [x]", "tp_degrees must be a list"),  # ValueError traceback
    ("tp_degrees: [1.5]", "tp_degrees must be a list"),  # read as tp1
    ("tp_degrees: [0]", "tp_degrees must be a list"),
    ("tp_degrees: []", "tp_degrees must be a list"),
    ("tp_degrees: {a: 1}", "tp_degrees must be a list"),
    ("measurement_iterations: 0", "measurement_iterations must be a whole number >= 1"),  # read as 1
    ("measurement_iterations: -1", "measurement_iterations must be"),  # negative skew times
    ("measurement_iterations: x", "measurement_iterations must be"),  # traceback
    ("measurement_iterations: 1.5", "measurement_iterations must be"),  # read as 1
    ("measurement_iterations: true", "measurement_iterations must be"),  # read as 1
    ("measurement_iterations: .inf", "measurement_iterations must be"),  # OverflowError traceback
    ("engine_effective: [1]", "engine_effective must be a mapping"),  # AttributeError traceback
    ("engine_effective: {hf_overrides: [1]}", "engine_effective.hf_overrides must be a mapping"),  # ignored
    ("engine_effective: {hf_overrides: {num_attention_heads: x}}", "hf_overrides.num_attention_heads must be a whole"),
    ("engine_effective: {hf_overrides: {vocab_size: null}}", "hf_overrides.vocab_size must be a whole"),
    ("engine_effective: {hf_overrides: {num_key_value_heads: 7.5}}", "hf_overrides.num_key_value_heads must be"),
    ("gpu: [1]", "gpu must be a name"),
    ("model: null", "model must be a name"),
])
def test_meta_fields_of_the_wrong_type_are_named(tmp_path, line, says):
    folder = write_llmservingsim(tmp_path)
    key = line.split(":")[0]
    kept = [m for m in META.splitlines() if not m.startswith(key) and not m.startswith("  ")]
    (folder / "meta.yaml").write_text("\n".join([*kept, line]) + "\n")
    with pytest.raises(SourceError, match=rf"meta\.yaml: {re.escape(says)}.*, got "):
        llmservingsim.read_profile(folder)


def test_meta_without_measurement_iterations_reads_skew_as_one_call(tmp_path):
    folder = write_llmservingsim(tmp_path)
    assert "measurement_iterations" not in (folder / "meta.yaml").read_text()
    llmservingsim.read_profile(folder)


@pytest.mark.parametrize("key, value, whole", [("hidden_size", 1000, 1000), ("head_dim", 64, 64),
                                                ("num_attention_heads", 8, 16)])
def test_a_layer_shape_of_another_model_is_named(key, value, whole):
    """hidden_size and head_dim are not split across ranks: a profile whose meta.yaml shrank them
    measured another layer (was imported as llama-3.1-8b without a word)."""
    from servesim.calibration.gpu_import import check_layer_shape
    from servesim.sim.presets import get_model

    meta = {"tp_degrees": [1, 2], "engine_effective": {"hf_overrides": {key: value}}}
    with pytest.raises(SourceError, match=rf"F/meta\.yaml: hf_overrides\.{key} = {value} at tp2 means {whole} for the "
                                          r"whole model, but preset llama-3\.1-8b has"):
        check_layer_shape(meta, get_model("llama-3.1-8b"), "F")
    check_layer_shape({"tp_degrees": [1, 2], "engine_effective": {"hf_overrides": {
        "hidden_size": 4096, "head_dim": 128, "num_attention_heads": 16}}}, get_model("llama-3.1-8b"), "F")


def test_an_llmservingsim_profile_of_another_gpu_is_refused(tmp_path):
    """An RTX 4090 profile imported as --hardware h100-sxm was written as an H100 profile."""
    from servesim.calibration.gpu_import import ImportOptions, run_import

    folder = write_llmservingsim(tmp_path)
    (folder / "meta.yaml").write_text(META.replace("model: org/Tiny-1B", "model: meta-llama/Llama-3.1-8B")
                                      .replace("gpu: NVIDIA Test GPU", "gpu: NVIDIA GeForce RTX 4090\nhardware: RTX4090"))
    with pytest.raises(SourceError, match=r"Tiny-1B measures on 'RTX4090' \(preset rtx-4090\), but --hardware is "
                                          r"'h100-sxm'; import it with --hardware rtx-4090"):
        run_import(ImportOptions("llmservingsim", [str(folder)], "llama-3.1-8b", "h100-sxm", out=str(tmp_path / "p.json")))
    assert not (tmp_path / "p.json").exists()


@pytest.mark.parametrize("gpu, hardware", [("h100", "a100-80g"), ("a100", "h100-sxm"), ("h100", "rtx-4090")])
def test_a_vidur_table_of_another_gpu_is_refused(tmp_path, gpu, hardware):
    """Vidur's compute/<gpu>/ folder names the GPU: its H100 table imported as --hardware a100-80g
    was written as an A100 profile."""
    from servesim.calibration.gpu_import import ImportOptions, run_import

    f = tmp_path / "compute" / gpu / "org" / "M" / "mlp.csv"
    f.parent.mkdir(parents=True)
    f.write_text("time_stats.attn_pre_proj.median,num_tokens,num_tensor_parallel_workers\n0.25,8,1\n")
    with pytest.raises(SourceError, match=rf"mlp\.csv measures on 'NVIDIA {gpu.upper()}.*' \(preset .*\), but --hardware is "
                                          rf"'{hardware}'; import it with --hardware"):
        run_import(ImportOptions("vidur", [str(f)], "llama-2-7b", hardware, out=str(tmp_path / "p.json")))


# files that measure each shape once: a second row of a shape (line 4) with another time
DUPLICATES = [
    ("dense.csv", "layer,tokens,time_us\nqkv_proj,1,10\nqkv_proj,2,12\nqkv_proj,2,{}\n", llmservingsim.read_dense,
     "layer=qkv_proj, tokens=2", "time_us"),
    ("per_sequence.csv", "layer,sequences,time_us\nlm_head,1,700\nlm_head,2,710\nlm_head,2,{}\n",
     llmservingsim.read_per_sequence, "layer=lm_head, sequences=2", "time_us"),
    ("attention.csv", "prefill_chunk,kv_prefill,n_decode,kv_decode,time_us\n0,0,1,16,8\n16,0,0,0,7\n16,0,0,0,{}\n",
     llmservingsim.read_attention, "prefill_chunk=16, kv_prefill=0, n_decode=0, kv_decode=0", "time_us"),
    ("layers.csv", "layer_name,input,kv_cache,tp_size,latency(ns)\nq_proj,1,0,1,2000\nq_proj,2,0,1,2100\n"
     "q_proj,2,0,1,{}\n", llmservingsim.read_v0_layers, "layer_name=q_proj, input=2, kv_cache=0, tp_size=1",
     "latency(ns)"),
    ("mha_decode_h100_32-8-128-tp1.csv", "batch_size,kv_len,latency_us\n1,1024,30\n1,2048,31\n1,2048,{}\n",
     inference_sim.read_decode, "batch_size=1, kv_len=2048", "latency_us"),
    ("mha_prefill_h100_32-8-128.csv", "seq_len,latency_us\n1024,38\n2048,200\n2048,{}\n", inference_sim.read_prefill,
     "seq_len=2048", "latency_us"),
]


@pytest.mark.parametrize("name, text, reader, shape, column", DUPLICATES, ids=[d[0] for d in DUPLICATES])
def test_two_rows_of_one_shape_with_different_times_are_named(tmp_path, name, text, reader, shape, column):
    """These formats time each shape once: two times for one shape were averaged (dense, per-sequence,
    v0, inference-sim) or the last one kept (attention) without a word."""
    with pytest.raises(SourceError, match=rf"{re.escape(name)}: rows 3 and 4 both measure {re.escape(shape)} with "
                                          rf"different {re.escape(column)} \(\S+ vs 9999\S*\); keep one row per shape"):
        reader(_csv(tmp_path, name, text.format("9999")))
    same = text.splitlines()[2].rpartition(",")[2]  # the row repeated as it is: read once
    again = reader(_csv(tmp_path, name, text.format(same)))
    assert len(again[0] if isinstance(again, tuple) else again) == 2


def _tiny_folder(tmp_path: Path, dense: str, per_sequence: str = "layer,sequences,time_us\nlm_head,1,700\n"
                 "lm_head,2,710\nsampler,1,20\nsampler,2,21\n") -> Path:
    folder = write_llmservingsim(tmp_path)
    (folder / "meta.yaml").write_text(META.replace("model: org/Tiny-1B", "model: tiny"))
    (folder / "tp1" / "dense.csv").write_text(dense)
    (folder / "tp1" / "per_sequence.csv").write_text(per_sequence)
    return folder


def _dense(tokens_of: dict[str, tuple[int, ...]]) -> str:
    rows = [f"{op},{t},{5 + t}" for op in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
            for t in tokens_of.get(op, (1, 2, 4, 8))]
    return "layer,tokens,time_us\n" + "\n".join(rows) + "\n"


@pytest.mark.parametrize("tokens_of, says", [
    ({"qkv_proj": (1,)}, r"op 'qkv_proj' is measured at tokens 1 only, the table at 1\.\.8"),  # was flat
    ({"o_proj": (1, 2)}, r"op 'o_proj' is measured at tokens 1\.\.2, the table at 1\.\.8"),  # flat beyond 2
    ({op: (1,) for op in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")}, r"measured at one tokens value \(1\)"),
])
def test_a_dense_op_not_measured_over_the_table_is_named(tmp_path, tokens_of, says):
    """An op with fewer token counts than the table was extrapolated flat from its last one (exit 0);
    a table of one token count failed on the profile's own check, naming no file, with a numpy
    warning on stderr."""
    from servesim.calibration.gpu_import import ImportOptions, run_import

    folder = _tiny_folder(tmp_path, _dense(tokens_of))
    with pytest.raises(SourceError, match=rf"tp1/dense\.csv: {says}"):
        run_import(ImportOptions("llmservingsim", [str(folder)], "tiny", "h100-sxm", out=str(tmp_path / "p.json")))


@pytest.mark.parametrize("per_sequence, says", [
    ("layer,sequences,time_us\nlm_head,1,700\nlm_head,2,710\n", "no rows for op 'sampler'"),  # step had no sampler
    ("layer,sequences,time_us\nsampler,1,20\nsampler,2,21\n", "no rows for op 'lm_head'"),  # nor LM head
    ("layer,sequences,time_us\nlm_head,1,700\nlm_head,2,710\nsampler,1,20\n",
     r"op 'sampler' is measured at sequences 1 only, the table at 1\.\.2"),
    ("layer,sequences,time_us\nlm_head,1,700\nsampler,1,20\n", r"measured at one sequences value \(1\)"),
])
def test_a_per_sequence_table_without_both_ops_over_its_range_is_named(tmp_path, per_sequence, says):
    from servesim.calibration.gpu_import import ImportOptions, run_import

    folder = _tiny_folder(tmp_path, _dense({}), per_sequence)
    with pytest.raises(SourceError, match=rf"tp1/per_sequence\.csv: {says}"):
        run_import(ImportOptions("llmservingsim", [str(folder)], "tiny", "h100-sxm", out=str(tmp_path / "p.json")))


@pytest.mark.parametrize("hole, says", [
    (32, r"op 'q_proj' is measured at tokens 1\.\.16, the table at 1\.\.32"),
    (4, r"no row for op 'q_proj' at tokens 4; give every op every token count of the table"),
])
def test_a_v0_op_with_a_hole_is_named(tmp_path, hole, says):
    """q_proj missing at one token count was a NaN in the summed qkv GEMM: a traceback in the fit."""
    from servesim.calibration.gpu_import import ImportOptions, run_import

    ops = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head", "embedding",
           "input_layernorm", "post_layernorm", "rope", "act_fn", "final_layernorm"]
    rows = [f"{op},{t},0,1,{1000 + t}" for op in ops for t in (1, 2, 4, 8, 16, 32) if (op, t) != ("q_proj", hole)]
    f = _csv(tmp_path, "layers.csv", "layer_name,input,kv_cache,tp_size,latency(ns)\n" + "\n".join(rows) + "\n")
    with pytest.raises(SourceError, match=rf"layers\.csv: {says}"):
        run_import(ImportOptions("llmservingsim", [str(f)], "llama-3.1-8b", "h100-sxm", out=str(tmp_path / "p.json")))


def _vidur_mlp(tmp_path: Path, tokens: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64), tp: int = 1) -> Path:
    """A Vidur mlp.csv of a Llama-2-7B layer on an H100 (ms)."""
    ops = ["emb", "input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj", "post_attention_layernorm",
           "mlp_up_proj", "mlp_act", "mlp_down_proj", "add"]
    f = tmp_path / "compute" / "h100" / "meta-llama" / "Llama-2-7b-hf" / "mlp.csv"
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text(",".join(f"time_stats.{op}.median" for op in ops) + ",n_head,n_kv_head,n_embd,n_expanded_embd,"
                 "num_tokens,num_tensor_parallel_workers\n" + "".join(
                     ",".join(f"{0.01 + 0.0001 * t * (i + 1):.6f}" for i in range(len(ops))) + f",32,32,4096,11008,{t},{tp}\n"
                     for t in tokens))
    return f


def _import_vidur(tmp_path: Path, *extra: str, tp: int = 1, mlp: Path | None = None) -> dict:
    from servesim.calibration.gpu_import import ImportOptions, run_import

    return run_import(ImportOptions("vidur", [str(mlp or _vidur_mlp(tmp_path, tp=tp))], "llama-2-7b", "h100-sxm", tp,
                                    out=str(tmp_path / "p.json"), extra=list(extra)))


@pytest.mark.parametrize("shape", [[(1, 1024)], [(1, 1024), (2, 1024)], [(1, 1024), (1, 2048)],
                                   [(1, 1024), (1, 2048), (2, 1024), (2, 2048)]])
def test_a_decode_grid_too_small_to_read_is_named(tmp_path, shape):
    """One or two rows were a matmul traceback in the held-out check (exit 1)."""
    f = _csv(tmp_path, "mha_decode_h100_32-32-128-tp1.csv",
             "batch_size,kv_len,latency_us\n" + "".join(f"{b},{kv},{20 + b * kv / 1000}\n" for b, kv in shape))
    if len(shape) == 4:  # two batch sizes x two KV lengths: a grid
        _import_vidur(tmp_path, f"inference-sim:{f}")
        return
    with pytest.raises(SourceError, match=r"mha_decode_h100_32-32-128-tp1\.csv: a decode grid needs at least two batch "
                                          r"sizes and two KV lengths, has batch \[.*\] x KV \[.*\]"):
        _import_vidur(tmp_path, f"inference-sim:{f}")


@pytest.mark.parametrize("n", [1, 2, 3])
def test_a_prefill_file_too_short_to_fit_is_named(tmp_path, n):
    """One point was a traceback (exit 1); two or three fitted a 3-term curve to fewer points than
    its leave-one-out check needs, exit 0."""
    f = _csv(tmp_path, "mha_prefill_h100_32-32-128.csv",
             "seq_len,latency_us\n" + "".join(f"{s},{25 + 2e-5 * s * s}\n" for s in (1024, 2048, 4096, 8192)[:n]))
    with pytest.raises(SourceError, match=rf"mha_prefill_h100_32-32-128\.csv: the prefill fit needs at least 4 sequence "
                                          rf"lengths \(3 terms, checked leave-one-out\), has {n}"):
        _import_vidur(tmp_path, f"inference-sim:{f}")


@pytest.mark.parametrize("rows, says", [
    ("0,0,1,16,8\n16,0,0,0,7\n", r"axis prefill_chunk needs 0 and at least two more values, has \[0, 16\]"),
    ("".join(f"{pc},{kp},{n},{kv},{5 + pc + kp + n}\n" for pc in (0, 16, 32) for kp in (0, 16, 32) for n in (0, 1, 2)
             for kv in (0, 16, 32) if (pc or n) and (pc or not kp) and (n or not kv) and not (pc and n)),
     r"\d+ grid points could not be filled"),  # no mixed step measured
])
def test_an_attention_sweep_that_makes_no_grid_names_its_file(tmp_path, rows, says):
    """The message said "attention table: ..." without the file."""
    from servesim.calibration.gpu_import import ImportOptions, run_import

    folder = _tiny_folder(tmp_path, _dense({}))
    (folder / "tp1" / "attention.csv").write_text("prefill_chunk,kv_prefill,n_decode,kv_decode,time_us\n" + rows)
    with pytest.raises(SourceError, match=rf"Tiny-1B/tp1/attention\.csv: {says}"):
        run_import(ImportOptions("llmservingsim", [str(folder)], "tiny", "h100-sxm", out=str(tmp_path / "p.json")))


@pytest.mark.parametrize("change, says", [
    (lambda t: t.replace(",n_head,", ",heads,"), r"missing column 'n_head'"),  # was a traceback (usecols)
    (lambda t: t.replace(",32,32,4096,11008,1,1\n", ",32,32,x,11008,1,1\n"),
     r"column 'n_embd' row 2 is 'x', expected a whole number > 0"),  # traceback (int('x'))
    (lambda t: t.replace(",32,32,4096,11008,1,1\n", ",32,32,4096.5,11008,1,1\n"),
     r"column 'n_embd' row 2 is 4096\.5, expected a whole number > 0"),  # read as 4096
    (lambda t: t.replace(",32,32,4096,11008,2,1\n", ",32,32,4096,14336,2,1\n"),
     r"rows 2 and 3 measure different layers \(n_expanded_embd 11008 vs 14336\)"),  # row 2 on read, rest ignored
])
def test_a_vidur_layer_shape_that_cannot_be_read_is_named(tmp_path, change, says):
    mlp = _vidur_mlp(tmp_path)
    mlp.write_text(change(mlp.read_text()))
    with pytest.raises(SourceError, match=rf"mlp\.csv: {says}"):
        _import_vidur(tmp_path, mlp=mlp)


@pytest.mark.parametrize("rows, says", [
    ("0.02,4,4096,8\n0.03,4,8192,8\n", r"no rows for num_workers 2 \(has \[4\]\)"),  # was the PCIe link model
    ("0.02,2,4096,8\n0.02,4,8192,8\n", r"one message size at num_workers 2 \(4096 bytes\); the all-reduce table "
                                       r"needs at least two"),  # was a flat table
])
def test_an_all_reduce_table_without_the_tp_degree_is_named(tmp_path, rows, says):
    """--with vidur:all_reduce.csv at --tp 2 whose file has no 2-GPU rows priced the all-reduces with
    the default PCIe link model (16 GB/s) without a word."""
    f = tmp_path / "network" / "h100_dgx" / "all_reduce.csv"
    f.parent.mkdir(parents=True)
    f.write_text("time_stats.all_reduce.median,num_workers,size,devices_per_node\n" + rows)
    with pytest.raises(SourceError, match=rf"all_reduce\.csv: {says}"):
        _import_vidur(tmp_path, f"vidur:{f}", tp=2)


def test_an_all_reduce_table_keeps_one_node_and_holds_out_what_it_reads(tmp_path):
    """Vidur's A100 file also times each TP degree spread over two nodes (devices_per_node <
    num_workers), 10-30x slower: mixed into the medians they priced an A100 TP 4 all-reduce of
    32 MiB at 4.4 ms instead of 0.32 ms, and a 70B prefill 2.6x slower than its own GEMMs."""
    f = tmp_path / "network" / "h100_dgx" / "all_reduce.csv"  # the importer's fixture is an H100 Llama-2-7B
    f.parent.mkdir(parents=True)
    sizes = [2048 * 2 ** k for k in range(12)]
    one_node = "".join(f"{0.02 + s / 2e8:.6f},2,{s},2\n" for s in sizes)
    two_nodes = "".join(f"{(0.02 + s / 2e8) * 20:.6f},2,{s},1\n" for s in sizes)
    f.write_text("time_stats.all_reduce.median,num_workers,size,devices_per_node\n" + one_node + two_nodes)
    profile = _import_vidur(tmp_path, f"vidur:{f}", tp=2)
    ar = profile["allreduce"]
    assert ar["type"] == "table" and ar["bytes"] == sizes
    assert ar["seconds"] == pytest.approx([(0.02 + s / 2e8) * 1e-3 for s in sizes], rel=1e-4)  # not 20x
    assert "in one node" in " ".join(profile["provenance"]["assembly"])
    held = profile["held_out_error"]["allreduce"]
    assert held["n"] == 2 and held["median_ape"] < 0.2  # log-log between neighbours of a linear curve
    f.write_text("time_stats.all_reduce.median,num_workers,size,devices_per_node\n" + two_nodes)
    with pytest.raises(SourceError, match=r"all_reduce\.csv: num_workers 2 is only timed across nodes "
                                          r"\(devices_per_node \[1\]\); tensor parallelism needs one node"):
        _import_vidur(tmp_path, f"vidur:{f}", tp=2)


def test_two_sources_for_one_role_are_refused(tmp_path):
    """Two decode files (or mlp.csv files, ...) kept the last without a word, both named in the provenance."""
    files = []
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
        files.append(_csv(tmp_path / d, "mha_decode_h100_32-32-128-tp1.csv", "batch_size,kv_len,latency_us\n"
                          + "".join(f"{b},{kv},{20 + b * kv / 1000}\n" for b in (1, 2) for kv in (1024, 2048))))
    with pytest.raises(SourceError, match=r"b/mha_decode_h100_32-32-128-tp1\.csv: a second inference-sim decode "
                                          r"file \(the first: .*a/mha_decode_h100_32-32-128-tp1\.csv\); give one"):
        _import_vidur(tmp_path, *(f"inference-sim:{f}" for f in files))
    mlp = _vidur_mlp(tmp_path)
    with pytest.raises(SourceError, match=r"mlp\.csv: a second Vidur mlp\.csv \(the first: .*mlp\.csv\); give one"):
        _import_vidur(tmp_path, f"vidur:{mlp}", mlp=mlp)


@pytest.mark.parametrize("out, says", [
    ("", r"--out is empty; name the profile's JSON file"),  # wrote calibration/profiles/h100-sxm-llama-2-7b-tp1.json
    ("  ", r"--out is empty; name the profile's JSON file"),  # wrote a file called "  "
    ("{tmp}", r"--out .*: is a folder; name the profile's JSON file"),  # "cannot write the results (Is a directory)"
    ("/proc/servesim-x/p.json", r"--out /proc/servesim-x/p\.json: cannot write the profile \(No such file or directory"),
])
def test_an_out_path_that_cannot_take_the_profile_is_named(tmp_path, monkeypatch, out, says):
    """/proc/x said "file not found: /proc/x", naming neither --out nor that it was being written."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SourceError, match=says):
        from servesim.calibration.gpu_import import ImportOptions, run_import

        run_import(ImportOptions("vidur", [str(_vidur_mlp(tmp_path))], "llama-2-7b", "h100-sxm",
                                 out=out.format(tmp=tmp_path)))
    assert not (tmp_path / "calibration" / "profiles").exists()


@pytest.mark.parametrize("field, value, says", [
    ("link_bandwidth", 0.0, r"--link-bandwidth must be a finite number > 0, got 0"),  # was the 16 GB/s default
    ("link_bandwidth", -5.0, r"--link-bandwidth must be a finite number > 0, got -5"),
    ("link_latency_us", float("inf"), r"--link-latency-us must be a finite number >= 0, got inf"),
    ("step_overhead_us", -5.0, r"--step-overhead-us must be a finite number >= 0, got -5"),  # named overhead.step_s
    ("per_seq_overhead_us", float("nan"), r"--per-seq-overhead-us must be a finite number >= 0, got nan"),
    ("prompt_step_overhead_us", -1.0, r"--prompt-step-overhead-us must be a finite number >= 0, got -1"),
])
def test_a_bad_number_flag_is_named_as_the_flag(tmp_path, field, value, says):
    from servesim.calibration.gpu_import import ImportOptions, run_import

    opts = ImportOptions("vidur", [str(tmp_path / "nothing.csv")], "llama-2-7b", "h100-sxm", 2,
                         out=str(tmp_path / "p.json"))
    setattr(opts, field, value)
    with pytest.raises(SourceError, match=says):
        run_import(opts)


@pytest.mark.parametrize("name", ["dense.csv", "skew.csv", "meta.yaml"])
def test_a_folder_where_a_file_belongs_is_named(tmp_path, name):
    """A folder was "file not found" (dense.csv, meta.yaml) or, as skew.csv, skipped without a word."""
    folder = write_llmservingsim(tmp_path)
    target = folder / name if name == "meta.yaml" else folder / "tp1" / name
    target.unlink(missing_ok=True)
    target.mkdir()
    with pytest.raises(SourceError, match=rf"{re.escape(name)}: a folder, not a file"):
        llmservingsim.read_profile(folder)


def test_a_device_where_a_file_belongs_is_named():
    with pytest.raises(SourceError, match=r"/dev/null: not a regular file \(a device, pipe or socket\)"):
        vidur.read_mlp("/dev/null")


def test_a_missing_count_inside_an_ops_range_is_filled_by_the_count_not_the_row():
    import pandas as pd
    from servesim.calibration.gpu_import import fill_between

    t = pd.DataFrame({"qkv_proj": [1.0, float("nan"), float("nan"), 8.0]}, index=[1, 2, 4, 8])
    assert fill_between(t)["qkv_proj"].tolist() == [1.0, 2.0, 4.0, 8.0]  # by row it was 1, 3.33, 5.67, 8
