"""The GPU step-cost model built from measured layer tables, and the importer that builds it."""

import json
import math
import re
import timeit
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from servesim.calibration import gpu_profile as gp
from servesim.calibration.gpu_import import ImportOptions, run_import
from servesim.calibration.importers import SourceError
from servesim.sim.cli import main
from servesim.sim.cost_model import (
    CostModelConfig,
    ProfileError,
    RooflineCostModel,
    build_cost_model,
    load_profile,
    reading_attention_shape,
)
from servesim.sim.layer_cost_model import (
    ATTENTION_AXES,
    GPU_PROFILE_FORMAT,
    AttentionGrid,
    Curve,
    LayerCostModel,
    allreduce_seconds,
)
from servesim.sim.presets import get_hardware, get_model

I64 = np.int64
PROFILES = Path(__file__).resolve().parents[1] / "calibration" / "profiles"
PC, KP, N, KV = [0, 16, 32, 64], [0, 16, 64], [0, 1, 2, 4, 8], [0, 16, 64, 256, 1024]
TOKENS = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128]


def attn_s(pc: float, kp: float, n: float, kv: float) -> float:
    """A made-up attention law for the fabricated source: launch + decode KV read + prefill pairs."""
    return 5e-6 + 2e-9 * n * kv + 1e-9 * pc * (kp + (pc + 1) / 2)


def fabricate_llmservingsim(root: Path, model: str = "meta-llama/Llama-3.1-8B") -> Path:
    """A tiny LLMServingSim profile folder with known tables (microseconds, as published)."""
    folder = root / "profiles" / "FAKEGPU" / "meta-llama" / "Llama-3.1-8B"
    (folder / "tp1").mkdir(parents=True)
    (folder / "meta.yaml").write_text(f"gpu: Fake GPU\nhardware: FAKEGPU\nmodel: {model}\nvariant: bf16\n"
                                      "vllm_version: 0.19.0\ntp_degrees: [1]\nmeasurement_iterations: 3\n"
                                      "engine_effective: {enforce_eager: true}\n")
    ops = {"layernorm": (2.0, 0.01), "qkv_proj": (30.0, 0.2), "rotary_emb": (2.0, 0.005), "o_proj": (20.0, 0.1),
           "gate_up_proj": (100.0, 0.5), "act_fn": (2.0, 0.02), "down_proj": (60.0, 0.3), "embedding": (3.0, 0.001),
           "final_layernorm": (2.0, 0.01)}
    dense = ["layer,tokens,time_us"] + [f"{op},{t},{a + b * t}" for op, (a, b) in ops.items() for t in TOKENS]
    (folder / "tp1" / "dense.csv").write_text("\n".join(dense) + "\n")
    seq = ["layer,sequences,time_us"] + [f"{op},{n},{a + b * n}" for op, (a, b) in
                                         {"lm_head": (700.0, 0.5), "sampler": (25.0, 0.4)}.items() for n in TOKENS]
    (folder / "tp1" / "per_sequence.csv").write_text("\n".join(seq) + "\n")
    rows = ["prefill_chunk,kv_prefill,n_decode,kv_decode,time_us"]
    for pc in PC:
        for kp in KP if pc else [0]:
            for n in N:
                for kv in KV[1:] if n else [0]:
                    if pc or n:
                        rows.append(f"{pc},{kp},{n},{kv},{attn_s(pc, kp, n, kv) * 1e6}")
    (folder / "tp1" / "attention.csv").write_text("\n".join(rows) + "\n")
    skew = ["regime,n,nb,ratio,skew,pc,kp,kvs,kv_big,kv_mean,t_mean_us,t_max_us,t_skew_us,alpha"]
    for n in (2, 4, 8):
        for nb in sorted({1, n // 2}):
            for kvs in (16, 32, 64, 128, 256):
                big = 4 * kvs
                mean = (nb * big + (n - nb) * kvs) // n
                tm, tx = attn_s(0, 0, n, mean) * 3e6, attn_s(0, 0, n, big) * 3e6  # the file sums 3 calls
                skew.append(f"pure,{n},{nb},{nb / n},4.0,0,0,{kvs},{big},{mean},{tm},{tx},{tm + 0.5 * (tx - tm)},0.5")
    (folder / "tp1" / "skew.csv").write_text("\n".join(skew) + "\n")
    return folder


@pytest.fixture(scope="module")
def fake_profile(tmp_path_factory):
    root = tmp_path_factory.mktemp("src")
    out = root / "fake.json"
    profile = run_import(ImportOptions("llmservingsim", [str(fabricate_llmservingsim(root))], "llama-3.1-8b",
                                       "rtx-pro-6000", 1, out=str(out)))
    return profile, out


# ---- one-axis tables ----


def test_curve_is_linear_between_points_and_continues_with_the_tail_slope():
    c = Curve([1, 2, 4, 8], [1.0, 2.0, 4.0, 8.0])
    assert c(3) == pytest.approx(3.0)
    assert c(16) == pytest.approx(16.0)  # slope 1 beyond the grid: linear in tokens, not flat
    assert c(0) == 0.0


# ---- attention grid ----


def grid_of(law=attn_s) -> AttentionGrid:
    axes = {"prefill_chunk": [0, 16, 32, 64], "kv_prefill": [0, 16, 64], "n_decode": [0, 1, 2, 4],
            "kv_decode": [0, 16, 64, 256, 1024]}
    arr = np.array([[[[law(pc, kp, n, kv) if (pc or n) else 1e-6 for kv in axes["kv_decode"]]
                      for n in axes["n_decode"]] for kp in axes["kv_prefill"]] for pc in axes["prefill_chunk"]])
    return AttentionGrid(axes, arr)


def test_grid_returns_its_nodes_and_interpolates_power_laws_exactly():
    g = grid_of(lambda pc, kp, n, kv: 1e-9 * max(n, 1) * max(kv, 1) + 1e-12 * pc * pc)
    assert g(0, 0, 4, 256) == pytest.approx(1e-9 * 4 * 256)
    # kv = 128 lies between nodes 64 and 256: log-log interpolation is exact for t ~ kv
    assert g(0, 0, 2, 128) == pytest.approx(1e-9 * 2 * 128, rel=1e-9)


def test_grid_extrapolates_linearly_in_decode_context_and_rows():
    g = grid_of()
    at_top = g(0, 0, 4, 1024)
    slope = (at_top - g(0, 0, 4, 256)) / (1024 - 256)
    assert g(0, 0, 4, 4096) == pytest.approx(at_top + slope * 3072)
    assert g(0, 0, 8, 1024) > at_top  # more rows than the grid: grows, not clamped


def test_grid_extrapolates_long_chunks_by_query_key_pairs():
    g = grid_of()  # attn_s is linear in pairs q * (ctx + (q + 1) / 2): extrapolation reproduces it
    assert g(256, 0, 0, 0) == pytest.approx(attn_s(256, 0, 0, 0))
    assert g(256, 64, 0, 0) == pytest.approx(attn_s(256, 64, 0, 0))


def test_chunks_and_contexts_below_the_grid_take_the_first_point():
    g = grid_of()
    assert g(5, 0, 0, 0) == g(16, 0, 0, 0)
    assert g(0, 0, 2, 3) == g(0, 0, 2, 16)


def test_fill_gaps_extends_a_kv_budget_corner_along_its_line():
    axes = [np.array(a, dtype=float) for a in (PC, KP, N, KV)]
    arr = np.array([[[[attn_s(pc, kp, n, kv) for kv in KV] for n in N] for kp in KP] for pc in PC])
    arr[1, 0, 4, 4] = np.nan  # chunk 16, 8 decodes at 1024: "did not fit"
    filled = gp.fill_gaps(arr, axes)
    expected = arr[1, 0, 4, 3] + (arr[1, 0, 4, 3] - arr[1, 0, 4, 2]) * (1024 - 256) / (256 - 64)
    assert filled[1, 0, 4, 4] == pytest.approx(expected)


def test_held_out_split_is_seeded():
    a, b, c = gp.split_mask(100, seed=0), gp.split_mask(100, seed=0), gp.split_mask(100, seed=1)
    assert (a == b).all() and not (a == c).all()
    assert a.sum() == round(0.2 * 98) and not a[0] and not a[-1]


# ---- the model from a fabricated source ----


def test_profile_round_trip_prices_a_step_from_the_source_tables(fake_profile):
    profile, path = fake_profile
    assert profile["format"] == GPU_PROFILE_FORMAT
    model = load_profile(path)
    assert isinstance(model, LayerCostModel) and model.needs_rows
    layers = get_model("llama-3.1-8b").num_layers
    # 4 decode rows of context 64 (a node of every table): the sum of the source's numbers
    t = 4
    per_layer = (2 * (2.0 + 0.01 * t) + 30 + 0.2 * t + 2 + 0.005 * t + 20 + 0.1 * t + 100 + 0.5 * t + 2 + 0.02 * t
                 + 60 + 0.3 * t) * 1e-6
    step_ops = (3 + 0.001 * t + 2 + 0.01 * t) * 1e-6
    head = (700 + 0.5 * t + 25 + 0.4 * t) * 1e-6
    expected = layers * (per_layer + attn_s(0, 0, 4, 64)) + step_ops + head
    assert model.iteration_time(np.ones(4, dtype=I64), np.full(4, 64, dtype=I64)) == pytest.approx(expected, rel=1e-4)


def test_the_prompt_step_term_prices_steps_with_prompt_rows_only(fake_profile, tmp_path):
    _profile, path = fake_profile
    data = json.loads(Path(path).read_text())
    data["overhead"] = {**data["overhead"], "prompt_step_s": 0.005}
    dearer_path = tmp_path / "dearer.json"
    dearer_path.write_text(json.dumps(data))
    base, dearer = load_profile(path), load_profile(dearer_path)
    steps = {"decode": ([1, 1, 1], [64, 80, 100]), "mixed": ([1, 1, 300], [64, 80, 0]), "prefill": ([500], [0]),
             "two chunks": ([200, 40], [0, 16])}
    for name, (q, ctx) in steps.items():
        q, ctx = np.array(q, dtype=I64), np.array(ctx, dtype=I64)
        extra = dearer.iteration_time(q, ctx) - base.iteration_time(q, ctx)
        assert extra == pytest.approx(0.0 if name == "decode" else 0.005, abs=1e-12), name
    # device time: async scheduling does not hide it behind the device, as it does the host term
    assert dearer.loop_overhead(3) == base.loop_overhead(3)
    assert dearer.describe()["overhead"]["prompt_step_s"] == 0.005
    assert "prompt_step_s" not in base.describe()["overhead"]  # unset: the description as before
    data["overhead"]["prompt_step_s"] = -1.0
    dearer_path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match=r"overhead.prompt_step_s must be a number"):
        load_profile(dearer_path)


def test_provenance_names_every_source_file(fake_profile):
    profile, _ = fake_profile
    paths = {s["path"] for s in profile["provenance"]["sources"]}
    assert "profiler/perf/FAKEGPU/meta-llama/Llama-3.1-8B/bf16/tp1/attention.csv" in paths
    assert all(s["license"] == "MIT" and s["commit"] for s in profile["provenance"]["sources"])
    assert profile["provenance"]["assembly"]


def test_held_out_error_is_stored_per_regime(fake_profile):
    profile, _ = fake_profile
    held = profile["held_out_error"]
    assert set(held["steps"]) == {"decode", "prefill", "mixed"}
    for regime in ("decode", "prefill", "mixed"):
        assert held["attention"][regime]["table"]["n"] > 0
    # the fabricated law is linear in its terms, so the physics fit can describe it too
    assert held["attention"]["decode"]["fit"]["median_ape"] < 0.05


def test_a_physics_law_is_reproduced_and_measured_kernels_kept_as_tables(fake_profile):
    profile, path = fake_profile
    # the fabricated attention is linear in each axis: the linear table (chosen on held-out points) and
    # the physics fit both predict the held-out points almost exactly, whichever is kept
    held = profile["held_out_error"]
    assert held["attention_interpolation"]["chosen"] == "linear"
    for regime, chosen in held["attention_chosen"].items():
        assert held["attention"][regime][chosen]["median_ape"] < 0.01
    grid = load_profile(path).attention
    for node in [(16, 16, 2, 64), (64, 64, 8, 1024), (0, 0, 4, 256), (32, 0, 0, 0)]:
        assert grid(*node) == pytest.approx(attn_s(*node), rel=1e-3)  # the fit, tabulated
    shipped = json.loads((PROFILES / "rtx-pro-6000-llama-3.1-8b-tp1.json").read_text())["held_out_error"]
    assert set(shipped["attention_chosen"].values()) == {"table"}
    assert shipped["attention_interpolation"]["chosen"] == "roofline"


def wavy(pc: float, kp: float, n: float, kv: float) -> float:
    """A shape with thread-block waves: flat, then a step at every 48 tokens of chunk (no grid node
    sits on a step), plus a decode read."""
    return 4e-6 * (1 + math.ceil(pc / 48)) + 1e-9 * (kp + n * kv) + 1e-6


def test_roofline_reading_keeps_the_nodes_and_follows_the_shape_between_them():
    axes = {"prefill_chunk": [0, 16, 32, 64, 128], "kv_prefill": [0, 16, 64], "n_decode": [0, 1, 2, 4],
            "kv_decode": [0, 16, 64, 256]}
    law = lambda pc, kp, n, kv: 1.3 * wavy(pc, kp, n, kv) if pc else 2e-6 + 1e-9 * n * kv  # noqa: E731
    arr = np.array([[[[law(pc, kp, n, kv) for kv in axes["kv_decode"]] for n in axes["n_decode"]]
                     for kp in axes["kv_prefill"]] for pc in axes["prefill_chunk"]])
    roof = AttentionGrid(axes, arr, "roofline", wavy)
    lin = AttentionGrid(axes, arr, "linear")
    for node in [(16, 0, 0, 0), (64, 16, 2, 64), (0, 0, 4, 256), (128, 64, 4, 256)]:
        assert roof(*node) == pytest.approx(lin(*node), rel=1e-12)  # nodes are the table's
    # between chunk nodes 32 and 64 the shape steps at 48 and 49: the ratio reading lands on it exactly,
    # the chord misses it; beyond the grid the ratio at the edge rides the shape
    for pt in [(40, 16, 1, 64), (50, 16, 1, 64), (96, 0, 2, 16), (300, 200, 8, 1000)]:
        assert roof(*pt) == pytest.approx(law(*pt), rel=1e-9), pt
    assert abs(lin(50, 16, 1, 64) / law(50, 16, 1, 64) - 1) > 0.05
    # decode-only steps are read linearly in time, as before
    assert roof(0, 0, 3, 100) == pytest.approx(lin(0, 0, 3, 100), rel=1e-12)
    with pytest.raises(ProfileError, match="roofline"):
        AttentionGrid(axes, arr, "roofline")


def test_import_picks_the_roofline_reading_when_it_predicts_held_out_chunks_better():
    rows = [(pc, kp, n, kv, 1.2 * wavy(pc, kp, n, kv) if pc else 2e-6 + 1e-9 * n * kv)
            for pc in [0, 16, 32, 48, 64, 96, 128, 192, 256] for kp in ([0, 16, 64, 256] if pc else [0])
            for n in [0, 1, 2, 4, 8] for kv in ([16, 64, 256, 1024] if n else [0]) if pc or n]
    att = pd.DataFrame(rows, columns=[*ATTENTION_AXES, "seconds"])
    grid, err, _scored, choice = gp.choose_interpolation(gp.attention_grid(att, shape=wavy), att)
    assert choice["chosen"] == "roofline" and grid.interpolation == "roofline"
    cand = choice["candidates"]
    assert cand["roofline"]["prefill"]["p90_ape"] < 1e-9 < cand["linear"]["prefill"]["p90_ape"]
    assert cand["roofline"]["decode"] == cand["linear"]["decode"]  # decode slices are read the same way
    assert err["prefill"]["table"]["median_ape"] < 1e-9
    without = gp.choose_interpolation(gp.attention_grid(att), att)[3]  # no shape: not a candidate
    assert "roofline" not in without["candidates"]


def test_shipped_profiles_read_against_the_roofline_hold_out_better_than_linear():
    for path in sorted(PROFILES.glob("rtx-*-tp*.json")):
        held = json.loads(path.read_text())["held_out_error"]["attention_interpolation"]
        assert held["chosen"] == "roofline", path.name
        roof, lin = held["candidates"]["roofline"], held["candidates"]["linear"]
        assert roof["prefill"]["p90_ape"] < lin["prefill"]["p90_ape"], path.name
        assert roof["decode"] == lin["decode"], path.name


def test_a_roofline_read_profile_needs_preset_model_and_hardware(tmp_path):
    data = json.loads((PROFILES / "rtx-pro-6000-llama-3.1-8b-tp1.json").read_text())
    assert load_profile(PROFILES / "rtx-pro-6000-llama-3.1-8b-tp1.json").attention.interpolation == "roofline"
    data["hardware"] = "my-own-gpu"
    (tmp_path / "p.json").write_text(json.dumps(data))
    with pytest.raises(ProfileError, match="must be presets.*my-own-gpu"):
        load_profile(tmp_path / "p.json")
    with pytest.raises(ProfileError, match="roofline"):
        LayerCostModel(json.loads((PROFILES / "rtx-pro-6000-llama-3.1-8b-tp1.json").read_text()))


def test_linear_attention_reads_between_nodes_on_the_chord():
    axes = {"prefill_chunk": [0, 16, 32], "kv_prefill": [0, 16], "n_decode": [0, 1, 2], "kv_decode": [0, 16, 32]}
    sec = np.full((3, 2, 3, 3), 1e-5)
    sec[0, 0, 1, 1], sec[0, 0, 1, 2] = 1e-5, 3e-5
    from servesim.sim.layer_cost_model import AttentionGrid
    mid = 24  # between contexts 16 and 32
    assert AttentionGrid(axes, sec, "linear")(0, 0, 1, mid) == pytest.approx(2e-5)
    assert AttentionGrid(axes, sec, "log")(0, 0, 1, mid) == pytest.approx(1e-5 * 3 ** (np.log(1.5) / np.log(2)))


def test_unequal_decode_contexts_cost_between_mean_and_max(fake_profile):
    _, path = fake_profile
    model = load_profile(path)
    q = np.ones(4, dtype=I64)
    even = model.iteration_time(q, np.full(4, 160, dtype=I64))
    skewed = model.iteration_time(q, np.array([16, 16, 16, 592], dtype=I64))  # same mean context
    longest = model.iteration_time(q, np.full(4, 592, dtype=I64))
    assert even < skewed < longest
    # the fabricated batches sit halfway between their mean and longest context: alpha = 0.5
    mean_t = model.iteration_time(q, np.full(4, 160, dtype=I64))
    assert skewed - mean_t == pytest.approx(0.5 * (longest - mean_t), rel=0.05)


def _skew_rows(alpha_of) -> pd.DataFrame:
    """Two-level decode batches (``nb`` rows at 4x the rest's context) beside prefill chunks, their
    skewed time ``alpha_of(pc, kp)`` of the way from the mean-context time to the longest's."""
    rows = []
    for pc in (0, 16, 32, 256, 1024, 2048):
        for kp in ((0, 2048, 8192) if pc else (0,)):
            for n in (4, 16, 64):
                for nb in (1, n // 2):
                    for kvs in (136, 160, 192, 224, 256, 1024):  # five with the longest in (512, 1024]
                        big, mean = 4 * kvs, (nb * 4 * kvs + (n - nb) * kvs) / n
                        tm, tx = attn_s(pc, kp, n, mean), attn_s(pc, kp, n, big)
                        rows.append({"regime": "mixed" if pc else "pure", "n": n, "nb": nb, "skew": 4.0, "pc": pc,
                                     "kp": kp, "kvs": kvs, "kv_big": big, "kv_mean": int(mean), "t_mean_s": tm,
                                     "t_max_s": tx, "t_skew_s": tm + alpha_of(pc, kp) * (tx - tm)})
    return pd.DataFrame(rows)


def test_skew_alpha_is_fitted_per_prefill_chunk_and_cached_context():
    from servesim.sim.layer_cost_model import SkewAlpha

    def alpha_of(pc, kp):  # decode-only 0.5; behind a short chunk the longest row shows, behind a long one less
        return 0.5 if pc == 0 else (0.9 if pc <= 64 else 0.3 if kp <= 4096 else 0.1)

    # a grid with the rows' chunks, cached contexts and row counts as nodes, read linearly: exact
    # for attn_s, which is linear in the decode context
    axes = {"prefill_chunk": [0, 16, 32, 256, 1024, 2048], "kv_prefill": [0, 2048, 8192], "n_decode": [0, 4, 16, 64],
            "kv_decode": [0, 128, 4096]}
    arr = np.array([[[[attn_s(pc, kp, n, kv) for kv in axes["kv_decode"]] for n in axes["n_decode"]]
                     for kp in axes["kv_prefill"]] for pc in axes["prefill_chunk"]])
    section, errors = gp.fit_skew(_skew_rows(alpha_of), AttentionGrid(axes, arr, "linear"))
    alpha = SkewAlpha(section)
    for n, pc, kp in ((4, 0, 0), (16, 32, 0), (64, 16, 8192), (4, 1024, 0), (16, 2048, 2048), (64, 256, 8192)):
        assert alpha(n, 640.0, 256.0, 1024.0, pc, kp) == pytest.approx(alpha_of(pc, kp), abs=1e-3), (n, pc, kp)
    assert errors["skew_full_model"]["p90_ape"] < 1e-3  # held-out rows follow the same law
    # a shape no training row has (2 rows) takes a coarser bucket's alpha of the same kind of step
    assert alpha(2, 640.0, 256.0, 1024.0, 0, 0) == pytest.approx(0.5, abs=1e-3)


def test_a_profile_skew_section_without_prefill_axes_still_reads():
    from servesim.sim.layer_cost_model import SkewAlpha
    old = {"n_edges": [2, 1 << 20], "ratio_edges": [0.5, 1.01], "kv_edges": [1024, 1 << 30],
           "alpha": [[[[0.25, 0.25], [0.25, 0.25]]] * 2, [[[0.75, 0.75], [0.75, 0.75]]] * 2]}
    alpha = SkewAlpha(old)
    assert alpha(4, 500.0, 100.0, 2000.0) == 0.25  # decode-only step
    assert alpha(4, 500.0, 100.0, 2000.0, 32, 0) == 0.75  # beside a prefill chunk
    with pytest.raises(ProfileError, match="skew.kp_edges"):
        SkewAlpha({**old, "pc_edges": [0, 64]})


def test_a_second_prefill_row_adds_its_own_chunk(fake_profile):
    _, path = fake_profile
    model = load_profile(path)
    one = model.iteration_time(np.array([32, 1], dtype=I64), np.array([0, 64], dtype=I64))
    two = model.iteration_time(np.array([32, 32, 1], dtype=I64), np.array([0, 0, 64], dtype=I64))
    assert two > one
    assert model.iteration_time(np.zeros(0, dtype=I64), np.zeros(0, dtype=I64)) == 0.0


def test_the_model_is_cheap_enough_for_the_simulator_loop():
    model = load_profile(PROFILES / "rtx-pro-6000-llama-3.1-8b-tp1.json")
    rng = np.random.default_rng(0)
    q, ctx = np.ones(128, dtype=I64), rng.integers(0, 4000, 128)
    per_call = min(timeit.repeat(lambda: model.iteration_time(q, ctx), number=500, repeat=3)) / 500
    assert per_call < 1e-3  # ~15 us on an idle core; pandas in the loop would cost milliseconds


# ---- the CLI and bad input ----


def test_calibrate_import_end_to_end(tmp_path, capsys):
    folder = fabricate_llmservingsim(tmp_path)
    out = tmp_path / "p.json"
    rc = main(["calibrate", "import", "--format", "llmservingsim", str(folder), "--model", "llama-3.1-8b",
               "--hardware", "rtx-pro-6000", "--out", str(out), "--step-overhead-us", "150"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "step, mixed" in text and "median APE" in text and str(out) in text
    data = json.loads(out.read_text())
    chosen = data["held_out_error"]["attention_interpolation"]["chosen"]
    assert f"attention read {chosen!r} between nodes" in text
    assert all(f"  {mode} " in text for mode in ("log", "linear", "roofline"))  # every reading tried, scored
    assert data["overhead"]["step_s"] == pytest.approx(150e-6)
    assert "prompt_step_s" not in data["overhead"]
    assert "--format llmservingsim" in data["provenance"]["command"]
    rc = main(["calibrate", "import", "--format", "llmservingsim", str(folder), "--model", "llama-3.1-8b",
               "--hardware", "rtx-pro-6000", "--out", str(out), "--prompt-step-overhead-us", "5000"])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["overhead"]["prompt_step_s"] == pytest.approx(5e-3)
    assert "--prompt-step-overhead-us 5000" in data["provenance"]["command"]
    assert any("--prompt-step-overhead-us" in n for n in data["provenance"]["assembly"])


def test_calibrate_import_of_another_model_is_one_line_exit_2(tmp_path, capsys):
    folder = fabricate_llmservingsim(tmp_path, model="Qwen/Qwen3-32B")
    rc = main(["calibrate", "import", "--format", "llmservingsim", str(folder), "--model", "llama-3.1-8b",
               "--hardware", "rtx-pro-6000", "--out", str(tmp_path / "p.json")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err
    assert "'Qwen/Qwen3-32B'" in err and "'llama-3.1-8b'" in err


def test_a_source_whose_layer_shape_is_not_the_preset_is_refused(tmp_path):
    folder = fabricate_llmservingsim(tmp_path)
    meta = folder / "meta.yaml"
    meta.write_text(meta.read_text().replace("engine_effective: {enforce_eager: true}",
                                             "engine_effective: {hf_overrides: {num_attention_heads: 16}}"))
    with pytest.raises(ProfileError, match="num_attention_heads = 16 at tp1 means 16 .* llama-3.1-8b has 32"):
        run_import(ImportOptions("llmservingsim", [str(folder)], "llama-3.1-8b", "rtx-pro-6000", 1,
                                 out=str(tmp_path / "p.json")))


@pytest.mark.parametrize(("field", "model", "hardware", "tp"), [
    ("model", "llama-3-8b", "rtx-pro-6000", 1),
    ("hardware", "llama-3.1-8b", "h100-sxm", 1),
    ("tensor_parallel", "llama-3.1-8b", "rtx-pro-6000", 2),
])
def test_a_profile_for_another_setup_than_the_scenario_is_an_error(field, model, hardware, tp):
    cfg = CostModelConfig(type="profile", path="rtx-pro-6000-llama-3.1-8b-tp1.json")
    with pytest.raises(ProfileError, match=f"is for {field} .* but the scenario runs") as exc:
        build_cost_model(cfg, get_model(model), get_hardware(hardware), tp)
    assert "\n" not in str(exc.value)


def test_scenario_with_a_mismatched_profile_exits_2(capsys):
    rc = main(["run", "scenarios/gpu/rtxpro6000-llama-3.1-8b.yaml", "--set", "hardware=rtx-4090", "--quiet",
               "--no-plots"])
    assert rc == 2
    assert "is for hardware 'rtx-pro-6000' but the scenario runs 'rtx-4090'" in capsys.readouterr().err


# ---- the shipped profiles ----


SHIPPED = sorted(p.name for p in PROFILES.glob("*.json") if json.loads(p.read_text()).get("format") == GPU_PROFILE_FORMAT)


def test_every_gpu_model_pair_the_data_covers_is_shipped():
    assert {"rtx-pro-6000-llama-3.1-8b-tp1.json", "rtx-pro-6000-llama-3.1-8b-tp2.json",
            "rtx-pro-6000-qwen3-32b-tp1.json", "rtx-pro-6000-qwen3-32b-tp2.json", "rtx-4090-llama-3.1-8b-tp1.json",
            "h100-sxm-llama-3.1-8b-tp1.json", "h100-sxm-llama-2-7b-tp1.json", "a100-80g-llama-3-8b-tp1.json",
            "h100-sxm-llama-2-70b-tp4.json", "h100-sxm-llama-2-70b-tp8.json", "a100-80g-llama-3-70b-tp4.json",
            "a100-80g-llama-3-70b-tp8.json"} <= set(SHIPPED)


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_profiles_token_ops_meet_the_held_out_target(name):
    err = json.loads((PROFILES / name).read_text())["held_out_error"]["dense_all_layers"]
    assert err["n"] >= 20 and err["median_ape"] <= 0.03 and err["p90_ape"] <= 0.08, err


def test_a_measured_all_reduce_table_extrapolates_with_its_top_quarter():
    """NCCL's medians step: Vidur's H100 table at 4 GPUs gave its last two sizes one time (318 us),
    and the chord between them held every message past 64 MiB (4,096 Llama-70B tokens) there."""
    sizes = [float(2 ** k) * 2 ** 20 for k in range(7)]  # 1-64 MiB
    secs = [20e-6 + s / 200e9 for s in sizes]
    secs[-2] = secs[-1]
    spec = {"type": "table", "count": 3, "bytes_per_token": 2 ** 14, "bytes": sizes, "seconds": secs}
    per_call = allreduce_seconds(spec, np.array([4096, 8192, 16384])) / 3
    assert per_call[0] == pytest.approx(secs[-1])
    assert per_call[1] == pytest.approx(2 * per_call[0], rel=0.1)
    assert per_call[2] == pytest.approx(4 * per_call[0], rel=0.15)


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_profile_loads_for_its_presets_with_sources(name):
    data = json.loads((PROFILES / name).read_text())
    model = build_cost_model(CostModelConfig(type="profile", path=name), get_model(data["model"]),
                             get_hardware(data["hardware"]), data["tensor_parallel"])
    assert model.iteration_time(np.ones(8, dtype=I64), np.full(8, 1000, dtype=I64)) > 0
    assert data["provenance"]["sources"] and data["held_out_error"]["dense_ops"]


@pytest.mark.parametrize("name", [n for n in SHIPPED if n.startswith("rtx")])
def test_llmservingsim_profiles_meet_the_step_error_target(name):
    steps = json.loads((PROFILES / name).read_text())["held_out_error"]["steps"]
    for regime, e in steps.items():
        assert e["median_ape"] <= 0.03 and e["p90_ape"] <= 0.08, (regime, e)


# ---- a composite profile (Vidur token ops + inference-sim attention) ----


def fabricate_composite(root: Path, gpu: str = "h100") -> tuple[Path, Path, Path]:
    """Vidur mlp.csv (ms) for a Llama-2-7B-shaped layer and inference-sim decode/prefill files (us)."""
    mlp = root / "compute" / gpu / "meta-llama" / "Llama-2-7b-hf" / "mlp.csv"
    mlp.parent.mkdir(parents=True)
    ops = ["emb", "input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj", "post_attention_layernorm",
           "mlp_up_proj", "mlp_act", "mlp_down_proj", "add"]
    head = ",".join(f"time_stats.{op}.median" for op in ops)
    lines = [head + ",n_head,n_kv_head,n_embd,n_expanded_embd,vocab_size,num_tokens,num_tensor_parallel_workers"]
    for t in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512):
        lines.append(",".join(f"{0.01 + 0.0001 * t * (i + 1):.6f}" for i in range(len(ops)))
                     + f",32,32,4096,11008,32000,{t},1")
    mlp.write_text("\n".join(lines) + "\n")
    dec = root / "mha_decode_h100_32-32-128-tp1.csv"
    dec.write_text("dtype,kv_dtype,batch_size,kv_len,latency_us,mfu\n" + "".join(
        f"bf16,bf16,{b},{kv},{20 + 0.002 * b * kv},0\n" for b in (1, 2, 4, 8, 16) for kv in (1024, 2048, 4096, 8192)))
    pre = root / "mha_prefill_h100_32-32-128.csv"
    pre.write_text("dtype,seq_len,latency_us,mfu\n" + "".join(
        f"bf16,{s},{25 + 2e-5 * s * (s + 1) / 2},0\n" for s in (1024, 2048, 4096, 8192)))
    return mlp, dec, pre


def test_composite_profile_joins_three_sources_and_says_how(tmp_path, capsys):
    mlp, dec, pre = fabricate_composite(tmp_path)
    out = tmp_path / "h100.json"
    rc = main(["calibrate", "import", "--format", "vidur", str(mlp), "--with", f"inference-sim:{dec}",
               "--with", f"inference-sim:{pre}", "--model", "llama-2-7b", "--hardware", "h100-sxm", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    data = json.loads(out.read_text())
    assert {s["repo"] for s in data["provenance"]["sources"]} == {"microsoft/vidur", "inference-sim/inference-sim"}
    notes = " ".join(data["provenance"]["assembly"])
    assert "residual add is left out" in notes and "LM head: roofline" in notes and "Sampler: estimate" in notes
    grid = load_profile(out).attention
    # decode from the inference-sim grid (a node), prefill from the pairs fit, mixed = sum - shared launch
    assert grid(0, 0, 4, 2048) == pytest.approx((20 + 0.002 * 4 * 2048) * 1e-6, rel=1e-6)
    assert grid(2048, 0, 0, 0) == pytest.approx((25 + 2e-5 * 2048 * 2049 / 2) * 1e-6, rel=0.02)
    shared = min(grid(16, 0, 0, 0), grid(0, 0, 1, 1024))
    assert grid(1024, 0, 4, 2048) == pytest.approx(grid(1024, 0, 0, 0) + grid(0, 0, 4, 2048) - shared, rel=1e-6)


def test_composite_without_attention_labels_the_roofline(tmp_path):
    mlp, _, _ = fabricate_composite(tmp_path)
    profile = run_import(ImportOptions("vidur", [str(mlp)], "llama-2-7b", "h100-sxm", 1, out=str(tmp_path / "a.json")))
    assert "ROOFLINE" in " ".join(profile["provenance"]["assembly"])
    assert "attention" not in profile["held_out_error"]  # nothing measured, nothing held out


@pytest.mark.parametrize("hardware", ["a100-80g", "h100-sxm"])
def test_composite_without_attention_is_the_roofline_attention_at_every_node(tmp_path, hardware):
    mlp, _, _ = fabricate_composite(tmp_path, hardware.split("-")[0])  # compute/<gpu>/ names the GPU
    profile = run_import(ImportOptions("vidur", [str(mlp)], "llama-2-7b", hardware, 1, out=str(tmp_path / "a.json")))
    grid = load_profile(tmp_path / "a.json").attention
    roof = RooflineCostModel(get_model("llama-2-7b"), get_hardware(hardware), 1)
    layers = get_model("llama-2-7b").num_layers

    def roofline(pc: int, kp: int, nd: int, kv: int) -> float:
        pairs = pc * kp + pc * (pc + 1) // 2
        sums = (nd + (pc > 0), nd, pc + nd, pairs, nd * (kv + 1), kp + pc if pc else 0)
        return roof.breakdown(sums)["attention"] / layers

    for node in [(0, 0, 64, 1024), (512, 0, 0, 0), (512, 1024, 128, 1024), (2048, 4096, 16, 16384)]:
        assert grid(*node) == pytest.approx(roofline(*node), rel=1e-4), node  # the file keeps 5 digits
    # FA2 (A100): steps with a prefill row as the varlen kernel runs them; FA3 (H100): decode + prefill
    notes = " ".join(profile["provenance"]["assembly"])
    assert "RooflineCostModel attention term" in notes
    assert ("varlen kernel" in notes) == (hardware == "a100-80g")


def test_shipped_a100_attention_is_todays_roofline():
    """Rebuild the profile (benchmarks/gpu_profiles.sh) when the roofline's attention changes."""
    grid = load_profile(PROFILES / "a100-80g-llama-3-8b-tp1.json").attention
    model = get_model("llama-3-8b")
    roof = RooflineCostModel(model, get_hardware("a100-80g"), 1)
    for pc, kp, nd, kv in [(0, 0, 128, 1024), (512, 0, 128, 1024), (2048, 1024, 32, 4096)]:
        sums = (nd + (pc > 0), nd, pc + nd, pc * kp + pc * (pc + 1) // 2, nd * (kv + 1), kp + pc if pc else 0)
        assert grid(pc, kp, nd, kv) == pytest.approx(roof.breakdown(sums)["attention"] / model.num_layers, rel=1e-4)
    # GQA under FA2: 128 decodes beside a chunk cost several times their own decode read
    assert grid(512, 0, 128, 1024) > 3 * (grid(512, 0, 0, 0) + grid(0, 0, 128, 1024))


def test_vidur_gemms_of_another_model_are_refused(tmp_path):
    mlp, _, _ = fabricate_composite(tmp_path)
    with pytest.raises(ProfileError, match="n_expanded_embd = 11008, llama-3-8b has 14336"):
        run_import(ImportOptions("vidur", [str(mlp)], "llama-3-8b", "h100-sxm", 1, out=str(tmp_path / "c.json")))


def test_inference_sim_heads_must_match_the_model(tmp_path):
    mlp, dec, _ = fabricate_composite(tmp_path)
    with pytest.raises(ProfileError, match="measures 32 query / 32 KV heads .* llama-3-8b has 32 / 8"):
        run_import(ImportOptions("vidur", [str(mlp)], "llama-3-8b", "h100-sxm", 1, out=str(tmp_path / "b.json"),
                                 extra=[f"inference-sim:{dec}"]))


def test_a_loaded_profile_is_reused_until_its_bytes_change(tmp_path):
    data = json.loads((PROFILES / "rtx-pro-6000-llama-3.1-8b-tp1.json").read_text())
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    first = load_profile(path)
    assert load_profile(path) is first  # a plan's points and a scenario's check share the built model
    first.describe()["provenance"]["sources"].clear()  # what describe hands out is a copy
    assert load_profile(path).describe()["provenance"]["sources"]
    data["overhead"]["step_s"] = 0.5  # same file, new bytes (perhaps within the same mtime tick)
    path.write_text(json.dumps(data))
    again = load_profile(path)
    assert again is not first and again.loop_overhead(1) == pytest.approx(0.5)


@pytest.mark.parametrize(("key", "value", "says"), [
    ("attention", None, "attention must be an object, got null"),  # was 'malformed profile (AttributeError ...)'
    ("dense", [1], "dense must be an object, got list"),
    ("skew", "x", "skew must be an object or null, got str"),
])
def test_a_gpu_profile_section_of_the_wrong_kind_is_named(tmp_path, key, value, says):
    data = json.loads((PROFILES / "rtx-4090-llama-3.1-8b-tp1.json").read_text())
    data[key] = value
    (tmp_path / "p.json").write_text(json.dumps(data))
    with pytest.raises(ProfileError, match=says):
        load_profile(tmp_path / "p.json")


def test_the_reading_shape_has_no_l2_cliff_and_fills_across_it_near_the_measured_curve():
    # The roofline re-reads decode KV once per query head when one KV head's share stops fitting the
    # L2 (FA2VarlenAttention): for Llama-3.1-8B TP 2 on an RTX PRO 6000, 128 decode rows beside a
    # 64-token chunk cross it between 1,728 and 2,048 tokens of context. A measured table rises
    # smoothly there; a gap filled (and read) as a ratio to a term with the cliff lands far under it.
    model, hw = get_model("llama-3.1-8b"), get_hardware("rtx-pro-6000")
    roofline = RooflineCostModel(model, hw, 2).attention_layer_s
    shape = reading_attention_shape(model, hw, 2)
    assert roofline(64, 512, 128, 2048) / roofline(64, 512, 128, 1728) > 2.2  # the roofline's own cliff
    assert shape(64, 512, 128, 2048) / shape(64, 512, 128, 1728) < 1.25  # 1.19x the context
    assert shape(64, 512, 4, 1024) == pytest.approx(roofline(64, 512, 4, 1024), rel=1e-12)  # fits L2 both ways
    kvs = [16, 64, 256, 1024, 1728, 2048, 4096]
    law = lambda pc, kp, n, kv: 2.5 * roofline(pc, kp, n, 1024) * (kv / 1024) ** 1.3 if n else 2.5 * roofline(pc, kp, 0, 0)  # noqa: E731
    rows = [(pc, kp, n, kv, law(pc, kp, n, kv)) for pc in (16, 64, 256) for kp in (0, 256, 512)
            for n in (0, 32, 64, 128) for kv in (kvs if n else [0])
            if not (n == 128 and kv == 1728 and pc == 64)]  # the node to fill, as LLMServingSim's sweep leaves it
    rows += [(0, 0, n, kv, 1e-9 * n * kv + 5e-6) for n in (32, 64, 128) for kv in kvs]
    att = pd.DataFrame(rows, columns=[*ATTENTION_AXES, "seconds"])
    for term, ok in ((shape, True), (roofline, False)):
        g = gp.attention_grid(att, interpolation="roofline", shape=term)
        read = AttentionGrid(g.axes, g.seconds, "roofline", term)
        errors = [read(64, 512, 128, kv) / law(64, 512, 128, kv) - 1 for kv in (1728, 1800, 1950)]
        assert (max(map(abs, errors)) < 0.08) is ok, (term, errors)  # with the cliff: -40 %


def test_skew_alpha_is_read_between_its_measured_rows_and_longest_contexts_not_stepped():
    from servesim.sim.layer_cost_model import SkewAlpha

    # rows edges 2, 4, 8 (+ sentinel), longest context edges 1024, 2048, 4096 (+ sentinel); alpha
    # grows with both, one ratio / chunk / cached bucket
    n_edges, kv_edges = [2, 4, 8, 1 << 20], [1024, 2048, 4096, 1 << 30]
    cell = lambda i, k: [[0.1 * (i + 1) + 0.01 * k] * 2] * 2  # noqa: E731 - (chunk, cached): two buckets each
    table = [[[cell(i, k) for k in range(4)]] * 2 for i in range(4)]  # two ratio buckets, the same values
    alpha = SkewAlpha({"n_edges": n_edges, "ratio_edges": [0.5, 1.01], "kv_edges": kv_edges, "pc_edges": [0, 1 << 30],
                       "kp_edges": [0, 1 << 30], "alpha": table})
    at = lambda n, longest: alpha(n, 600.0, 100.0, float(longest))  # noqa: E731
    for i, n in enumerate(n_edges[:3]):
        for k, longest in enumerate(kv_edges[:3]):
            assert at(n, longest) == pytest.approx(0.1 * (i + 1) + 0.01 * k)  # at the edges: the bucket's own
    # halfway in log2 between 2048 and 4096, and between 4 and 8 rows: the mean of the neighbours
    assert at(4, 2048 * 2 ** 0.5) == pytest.approx(0.2 + 0.015)
    assert at(4 * 2 ** 0.5, 2048 * 2 ** 0.5) == pytest.approx(0.25 + 0.015)
    assert at(4, 2049) == pytest.approx(at(4, 2048), abs=1e-3)  # one token past an edge: no step
    assert at(1, 500) == pytest.approx(0.1) and at(64, 9000) == pytest.approx(0.43)  # first / past the last: as is


def test_a_mixed_step_costs_about_the_same_whichever_side_of_4096_its_longest_row_is():
    model = load_profile(PROFILES / "rtx-pro-6000-llama-3.1-8b-tp1.json")
    ctx = np.r_[0, np.linspace(380, 1900, 126).astype(np.int64)]
    q = np.r_[390, np.ones(127, dtype=np.int64)].astype(I64)  # a 390-token chunk beside 127 decodes
    times = [model.iteration_time(q, np.r_[ctx, longest].astype(I64)) for longest in (4090, 4096, 4100, 4141)]
    assert max(times) / min(times) < 1.02, times  # (before: 46.5 -> 73.1 ms between them)


@pytest.mark.parametrize("meta_line, mode, kept", [
    ("", "auto", True),
    ("skew_profile: {enabled: false}\n", "auto", False),  # the source switched its skew profile off
    ("skew_fit:\n  enabled: false\n", "auto", False),
    ("skew_profile: {enabled: true}\nskew_fit: {enabled: true}\n", "auto", True),
    ("skew_profile: false\n", "auto", False),  # the section itself switched off
    ("skew_profile: {enabled: false}\n", "use", True),
    ("", "ignore", False),
])
def test_the_skew_table_is_used_as_the_sources_meta_says_unless_told(tmp_path, meta_line, mode, kept):
    """LLMServingSim's meta.yaml can switch its skew profile off (its RTX 4090 Llama profile does): its own
    simulator then prices unequal decode contexts at their mean, and so does the imported profile, saying
    why; ``--skew use`` / ``ignore`` override. Either way the table is read and checked."""
    folder = fabricate_llmservingsim(tmp_path)
    meta = folder / "meta.yaml"
    meta.write_text(meta.read_text() + meta_line)
    profile = run_import(ImportOptions("llmservingsim", [str(folder)], "llama-3.1-8b", "rtx-pro-6000", 1,
                                       out=str(tmp_path / "p.json"), skew=mode))
    assert (profile["skew"] is not None) == kept
    held = profile["held_out_error"]
    assert held["skew_used"] is kept and held["skew"]["skew_mean_context_grid"]["n"] > 0  # scored either way
    assembly = " ".join(profile["provenance"]["assembly"])
    assert ("priced at their mean context" in assembly) == (not kept)
    if "enabled: false" in meta_line:
        assert "enabled: false" in assembly  # the reason is named, kept or not
    if mode != "auto":
        assert f"--skew {mode}" in profile["provenance"]["command"]
    q = np.ones(4, dtype=I64)
    skewed = load_profile(tmp_path / "p.json").iteration_time(q, np.array([16, 16, 16, 592], dtype=I64))
    even = load_profile(tmp_path / "p.json").iteration_time(q, np.array([160, 160, 160, 160], dtype=I64))
    # the same mean context: dearer only where the skew table is used, else priced exactly alike
    assert skewed > even * 1.001 if kept else skewed == pytest.approx(even, rel=1e-12)


@pytest.mark.parametrize("meta_line, field", [
    ('skew_profile: {enabled: "false"}\n', "skew_profile.enabled"),  # a quoted word is not a switch
    ("skew_fit: {enabled: 0}\n", "skew_fit.enabled"),
    ("skew_profile: [enabled]\n", "skew_profile"),
])
def test_a_skew_switch_of_another_kind_is_an_error_naming_it(tmp_path, meta_line, field):
    """Read as 'on', a malformed switch would silently price against the source's own choice."""
    folder = fabricate_llmservingsim(tmp_path)
    meta = folder / "meta.yaml"
    meta.write_text(meta.read_text() + meta_line)
    with pytest.raises(SourceError, match=rf"meta\.yaml: field '{re.escape(field)}' must be"):
        run_import(ImportOptions("llmservingsim", [str(folder)], "llama-3.1-8b", "rtx-pro-6000", 1,
                                 out=str(tmp_path / "p.json")))


def test_skew_flags_are_refused_where_there_is_no_skew_table(tmp_path):
    folder = fabricate_llmservingsim(tmp_path)
    with pytest.raises(SourceError, match="--skew must be one of auto, use, ignore, got 'maybe'"):
        run_import(ImportOptions("llmservingsim", [str(folder)], "llama-3.1-8b", "rtx-pro-6000", 1,
                                 out=str(tmp_path / "p.json"), skew="maybe"))
    v0 = tmp_path / "layers.csv"
    v0.write_text("layer_name,input,kv_cache,tp_size,latency(ns)\n")
    with pytest.raises(SourceError, match="only an LLMServingSim profile folder has a skew.csv"):
        run_import(ImportOptions("llmservingsim", [str(v0)], "llama-3.1-8b", "h100-sxm", 1,
                                 out=str(tmp_path / "q.json"), skew="use"))
