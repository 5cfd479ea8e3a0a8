"""Calibration: the shape grid, the fit (recovers known coefficients, held-out shapes stay out), and
``servesim calibrate`` end to end producing a profile ``servesim run`` accepts."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from servesim.calibration.fit import fit, parse_shape, shape_table, split_held_out
from servesim.calibration.grid import GridSpec, Shape, build_grid
from servesim.sim.cli import main
from servesim.sim.cost_model import FEATURE_NAMES, FittedCostModel, classify_step, step_features

# ---- grid ----


@pytest.mark.parametrize("spec", [GridSpec(), GridSpec(quick=True), GridSpec(max_num_seqs=8, max_tokens=64,
                                                                              max_context=100, seed=3)])
def test_grid_respects_the_budgets_and_labels_each_regime(spec):
    shapes = build_grid(spec)
    assert len(shapes) == len(set(shapes))
    for s in shapes:
        q, ctx = np.array(s.q), np.array(s.ctx)
        assert classify_step(q) == s.regime
        assert len(q) <= spec.max_num_seqs and q.sum() <= spec.max_tokens and ctx.max() <= spec.max_context
        assert parse_shape(s.key)[0].tolist() == list(s.q) and parse_shape(s.key)[1].tolist() == list(s.ctx)
    regimes = {s.regime for s in shapes}
    assert regimes == {"prefill", "decode", "mixed"}
    # prefill of one and of several sequences, lengths from 16 to the budget; decode up to max_num_seqs
    assert {s.q for s in shapes if s.regime == "prefill" and len(s.q) == 1 and s.ctx == (0,)} >= {(16,),
                                                                                                  (spec.max_tokens,)}
    assert any(s.regime == "prefill" and len(s.q) > 1 for s in shapes)
    assert max(len(s.q) for s in shapes if s.regime == "decode") == spec.max_num_seqs
    assert build_grid(spec) == shapes  # deterministic for a seed


# ---- fit ----

TRUE = {  # seconds per feature unit, per regime (a made-up but CPU-like profile)
    "prefill": dict(tokens=6e-5, prefill_attn_pairs=1e-7, seqs=2e-4, const=3e-3, paged_prefill_pairs=3e-8),
    "decode": dict(tokens=9e-5, decode_kv_tokens=1e-7, const=2.5e-3, decode_padded_kv=3e-7),
    "mixed": dict(tokens=6e-5, prefill_attn_pairs=1e-7, decode_kv_tokens=5e-7, seqs=5e-5, prefill_seqs=5e-3,
                  paged_prefill_kv=2e-7),
}


def synthetic_raw(shapes: list[Shape], noise: float, rounds: int = 5, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    rows = []
    for s in shapes:
        coef = np.array([TRUE[s.regime].get(f, 0.0) for f in FEATURE_NAMES])
        t = float(coef @ step_features(np.array(s.q), np.array(s.ctx), tile=1))
        for r in range(rounds):
            rows.append({"round": r, "shape": s.key, "regime": s.regime, "seconds": t * (1 + noise * rng.normal())})
    return pd.DataFrame(rows)


def test_fit_recovers_known_coefficients_and_reports_held_out_error():
    shapes = build_grid(GridSpec())
    result = fit(synthetic_raw(shapes, noise=0.0), tile=1)
    # Some features are collinear within a regime (tokens == seqs in a decode step; with tile 1
    # tokens_tiled == tokens), so only their sums are identifiable; the others come back exactly.
    groups = {"tokens": ("tokens", "tokens_tiled"), "decode_tokens": ("tokens", "tokens_tiled", "seqs")}
    for regime, terms in TRUE.items():
        got = dict(zip(FEATURE_NAMES, result.coefs[regime], strict=True))
        group = groups["decode_tokens" if regime == "decode" else "tokens"]
        assert sum(got[f] for f in group) == pytest.approx(sum(terms.get(f, 0.0) for f in group), rel=1e-3)
        for name in ("prefill_attn_pairs", "decode_kv_tokens", "decode_padded_kv"):
            assert got[name] == pytest.approx(terms.get(name, 0.0), rel=1e-3, abs=1e-12), (regime, name)
        assert result.held_out[regime]["median_ape"] < 1e-6 and result.held_out[regime]["max_ape"] < 1e-5
    # with 3 % noise per run the held-out error is of the order of the noise, not zero
    noisy = fit(synthetic_raw(shapes, noise=0.03, seed=1), tile=1)
    for regime in TRUE:
        assert 0.0 < noisy.held_out[regime]["median_ape"] < 0.03


def test_held_out_shapes_do_not_influence_the_fit():
    shapes = build_grid(GridSpec(quick=True))
    raw = synthetic_raw(shapes, noise=0.02)
    held = split_held_out(shape_table(raw), 0.2, seed=0)
    held_keys = set(shape_table(raw)["shape"][held])
    assert 0.15 * len(shapes) < len(held_keys) < 0.25 * len(shapes)
    spoiled = raw.copy()
    spoiled.loc[spoiled["shape"].isin(held_keys), "seconds"] *= 10  # only the held-out shapes change
    a, b = fit(raw, tile=1), fit(spoiled, tile=1)
    for regime in a.coefs:
        np.testing.assert_allclose(a.coefs[regime], b.coefs[regime])
    assert b.held_out["all"]["median_ape"] > 5 * a.held_out["all"]["median_ape"]
    assert b.held_out["all"]["n"] == len(held_keys)


def test_a_host_bound_engine_gets_a_floor_under_its_device_terms_and_a_device_bound_one_none():
    shapes = build_grid(GridSpec())
    raw = synthetic_raw(shapes, noise=0.03, seed=2)
    plain = fit(raw, tile=1)
    assert plain.floors == {}  # the CPU-like synthetic engine: no floor beats none
    # the same engine behind a host that needs the median prefill's time to launch any step
    t_pre = raw.loc[raw["regime"] == "prefill"].groupby("shape")["seconds"].mean()
    floor = float(t_pre.median())
    hosted = raw.copy()
    pre = hosted["regime"] == "prefill"
    jitter = 1 + 0.03 * np.random.default_rng(3).normal(size=int(pre.sum()))
    hosted.loc[pre, "seconds"] = np.maximum(hosted.loc[pre, "seconds"], floor * jitter)
    bent, straight = fit(hosted, tile=1), fit(hosted, tile=1, floors=False)
    assert set(bent.floors) == {"prefill"} and bent.floors["prefill"] == pytest.approx(floor, rel=0.1)
    assert bent.held_out["prefill"]["median_ape"] < 0.03 < straight.held_out["prefill"]["median_ape"]
    assert bent.held_out["decode"] == plain.held_out["decode"]  # other regimes untouched
    model = FittedCostModel({r: c.tolist() for r, c in bent.coefs.items()}, tile_tokens=1, floors=bent.floors)
    small = model.iteration_time(np.array([16]), np.array([0]))
    assert small == pytest.approx(bent.floors["prefill"])  # a tiny prefill costs the floor


def test_a_regime_with_too_few_shapes_falls_back_to_all():
    shapes = [s for s in build_grid(GridSpec()) if s.regime != "mixed"][:150]
    shapes += [s for s in build_grid(GridSpec()) if s.regime == "mixed"][:5]
    result = fit(synthetic_raw(shapes, noise=0.0), tile=1)
    assert "mixed" not in result.coefs and "all" in result.coefs
    model = FittedCostModel({r: c.tolist() for r, c in result.coefs.items()}, tile_tokens=1)
    assert model.iteration_time(np.array([64, 1]), np.array([0, 10])) > 0


def test_round_deviation_is_each_rounds_distance_from_its_shapes_mean():
    from servesim.calibration.fit import round_deviation

    rows = [{"round": r, "shape": "a", "regime": "decode", "seconds": s} for r, s in ((0, 0.9), (0, 0.9), (1, 1.1))]
    rows += [{"round": r, "shape": "b", "regime": "prefill", "seconds": s} for r, s in ((0, 2.0), (1, 2.0))]
    dev = round_deviation(pd.DataFrame(rows))
    assert dev["decode"] == pytest.approx(0.1) and dev["prefill"] == pytest.approx(0.0)
    assert dev["all"] == pytest.approx(0.05)  # median of 0.1, 0.1, 0, 0
    assert round_deviation(pd.DataFrame(rows).query("round == 0")) == {}  # one round: no noise figure


def test_the_report_prints_the_timing_noise_beside_the_held_out_error():
    from servesim.calibration.commands import format_report

    err = {"median_ape": 0.1, "p90_ape": 0.2, "max_ape": 0.3, "n": 5}
    profile = {"held_out_error": {"decode": err, "all": err}, "train_error": {}, "tile_tokens": 16,
               "overhead": {"step_s": 1e-4, "per_seq_s": 1e-6}, "paths": ["p.json"],
               "provenance": {"grid": {"shapes": 25, "rounds": 2}, "sweep_seconds": 1.0, "device_name": "x",
                              "round_deviation": {"decode": 0.077, "all": 0.055}}}
    report = format_report(profile)
    assert "timing noise, one round of a shape against its mean over rounds (median): decode 7.7 %, all 5.5 %" in report
    del profile["provenance"]["round_deviation"]  # profiles written before it: no line
    assert "timing noise" not in format_report(profile)
    assert "host floor" not in report
    profile["regimes"] = {"prefill": {"coef": [0.0], "floor_s": 0.0325}, "decode": {"coef": [0.0]}}
    assert "host floor, max(floor, fitted terms): prefill 32.5 ms" in format_report(profile)


# ---- servesim calibrate ----

SMALL = ["--model", "tiny", "--rounds", "1", "--max-num-seqs", "4", "--max-tokens", "32", "--max-context", "32",
         "--quick", "--quiet", "--threads", "1"]


def test_calibrate_writes_a_profile_that_servesim_run_accepts(tmp_path, capsys):
    out = tmp_path / "prof" / "cpu-tiny.json"
    out.parent.mkdir()
    out.write_text("an earlier profile: calibrate overwrites it")
    assert main(["calibrate", *SMALL, "--out", str(out)]) == 0
    report = capsys.readouterr().out
    assert "held-out median APE" in report and "decode" in report and str(out) in report
    profile = json.loads(out.read_text())
    assert profile["format"] == "servesim-profile/2"
    for key in ("device", "device_name", "cpu_model", "torch_version", "triton_version", "model", "dtype", "date",
                "servesim_commit", "grid", "backend"):
        assert key in profile["provenance"], key
    assert profile["provenance"]["model"] == "tiny"
    assert set(profile["held_out_error"]) >= {"prefill", "decode", "all"}
    raw = pd.read_csv(out.with_suffix(".csv"))
    assert {"round", "shape", "regime", "seconds"} <= set(raw.columns) and (raw["seconds"] > 0).all()
    assert out.with_suffix(".png").stat().st_size > 0
    gemm = pd.read_csv(out.with_name("cpu-tiny-gemm.csv"))
    assert {"m", "linear_s", "lm_head_s"} <= set(gemm.columns) and sorted(set(gemm["m"])) == profile["gemm_tables"][
        "tokens"]
    overhead = profile["overhead"]
    assert overhead["step_s"] >= 0 and overhead["per_seq_s"] >= 0

    scenario = tmp_path / "s.yaml"
    scenario.write_text(f"""
name: uses-profile
model: tiny
hardware: cpu-2core
cost_model: {{type: profile, path: {out}}}
scheduler: {{type: chunked, max_num_seqs: 4, max_num_batched_tokens: 32}}
kv_cache: {{num_blocks: 64}}
workload: {{num_requests: 20, arrival: {{process: poisson, rate: 5}}, prompt_len: {{dist: fixed, value: 24}},
           output_len: {{dist: fixed, value: 8}}}}
""")
    assert main(["run", str(scenario), "--out", str(tmp_path / "run"), "--quiet", "--no-plots"]) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["completed"] == 20 and summary["mean_tpot_ms"] > 0


def test_calibrate_time_budget_stops_after_a_round_and_says_so(tmp_path, capsys):
    out = tmp_path / "budget.json"
    small = [a if a != "1" or SMALL[i - 1] != "--rounds" else "4" for i, a in enumerate(SMALL)]
    assert main(["calibrate", *small, "--time-budget", "0.001", "--out", str(out)]) == 0
    report = capsys.readouterr().out
    assert "stopping after 1 of 4 rounds" in report and "timing noise" not in report  # one round: no figure
    grid = json.loads(out.read_text())["provenance"]["grid"]
    assert (grid["rounds"], grid["rounds_planned"], grid["time_budget_s"]) == (1, 4, 0.001)
    assert set(pd.read_csv(out.with_suffix(".csv"))["round"]) == {0}
    assert main(["calibrate", *SMALL, "--time-budget", "0", "--out", str(out)]) == 2
    assert "--time-budget" in capsys.readouterr().err
    assert main(["calibrate", *SMALL, "--out", str(tmp_path)]) == 2  # a folder, not the profile's file
    assert "is a folder" in capsys.readouterr().err


def test_calibrate_rejects_a_bad_model_in_one_line(capsys):
    assert main(["calibrate", "--model", "llama-9", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "llama-9" in err[0]


@pytest.mark.slow
def test_calibrate_quick_grid_end_to_end(tmp_path):
    out = tmp_path / "quick.json"
    assert main(["calibrate", "--quick", "--quiet", "--out", str(out)]) == 0
    profile = json.loads(out.read_text())
    assert profile["provenance"]["grid"]["quick"] is True
    assert FittedCostModel.from_profile(out).iteration_time(np.ones(8, dtype=np.int64), np.full(8, 100)) > 0


def test_calibrate_refit_reproduces_a_profile_from_its_raw_csv_and_keeps_the_first_fit(tmp_path, capsys):
    import shutil
    from pathlib import Path

    shipped = Path(__file__).resolve().parents[1] / "calibration" / "profiles"
    for name in ("cpu-tiny.json", "cpu-tiny.csv"):
        shutil.copy(shipped / name, tmp_path / name)
    first = json.loads((tmp_path / "cpu-tiny.json").read_text())
    out = tmp_path / "re" / "again.json"
    assert main(["calibrate", "refit", str(tmp_path / "cpu-tiny.json"), "--out", str(out)]) == 0
    report = capsys.readouterr().out
    assert "held-out median APE" in report and "first fit, all regimes" in report and "host floor" not in report
    again = json.loads(out.read_text())
    assert again["provenance"]["refit"]["first_held_out_error"] == first["held_out_error"]
    for regime, e in first["held_out_error"].items():  # the same split, no floor on this CPU: the same fit
        assert again["held_out_error"][regime]["median_ape"] == pytest.approx(e["median_ape"], abs=1e-4), regime
    assert again["provenance"]["raw_csv"] == "../cpu-tiny.csv" and again["provenance"]["gemm_csv"] == "../cpu-tiny-gemm.csv"
    assert out.with_suffix(".png").stat().st_size > 0
    assert main(["calibrate", "refit", str(out)]) == 0  # a refit profile refits again (its CSV found)
    assert json.loads(out.read_text())["provenance"]["refit"]["first_held_out_error"] == first["held_out_error"]
    capsys.readouterr()
    (tmp_path / "cpu-tiny.csv").unlink()
    assert main(["calibrate", "refit", str(tmp_path / "cpu-tiny.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cpu-tiny.csv (the profile's raw_csv) is missing" in err[0]
    assert main(["calibrate", "refit", str(shipped / "h100-sxm-llama-3.1-8b-tp1.json")]) == 2  # an imported profile
    assert "not a servesim profile" in capsys.readouterr().err
    assert main(["calibrate", "refit", str(out), "--out", str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().err


@pytest.mark.parametrize(("args", "says"), [
    (["--threads", "100000"], "--threads must be between 1 and 1024"),  # torch's thread pool segfaulted
    (["--threads", "0"], "--threads must be between 1 and 1024"),
    (["--seed", "-1"], "--seed must be between 0"),  # was numpy's traceback
    (["--model", "llama-3.1-70b"], "--model llama-3.1-70b: calibrate builds it with random weights"),  # was OOM
])
def test_calibrate_refuses_settings_it_cannot_run_in_one_line(args, says, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("servesim.sim.host_memory.host_memory_bytes", lambda: 24 << 30)  # (any machine)
    assert main(["calibrate", "--quick", "--quiet", *args, "--out", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "p.json").exists()


@pytest.mark.parametrize(("edit", "says"), [
    (lambda lines: [], "not a CSV of timings"),  # pandas' EmptyDataError
    (lambda lines: lines[:1], "0 shape(s); a fit needs at least"),  # numpy's 'need at least one array to stack'
    (lambda lines: lines[:6], "5 shape(s)"),
    (lambda lines: [lines[0], lines[1].replace("q=", "q=x", 1), *lines[2:]], "row 2: shape"),  # int()'s traceback
    (lambda lines: [lines[0], *(ln.rsplit(",", 1)[0] + ",-0.001" for ln in lines[1:])], "row 2: seconds must be"),
    (lambda lines: [lines[0], lines[1].replace(",mixed,", ",banana,").replace(",decode,", ",banana,"), *lines[2:]],
     "row 2: regime 'banana'"),
])
def test_calibrate_refit_names_the_bad_row_of_its_raw_csv(edit, says, tmp_path, capsys):
    # each was a traceback, or (negative seconds) a profile fitted to them with a -100 % error
    import shutil
    from pathlib import Path

    shipped = Path(__file__).resolve().parents[1] / "calibration" / "profiles"
    shutil.copy(shipped / "cpu-tiny.json", tmp_path / "cpu-tiny.json")
    lines = (shipped / "cpu-tiny.csv").read_text().splitlines()
    (tmp_path / "cpu-tiny.csv").write_text("\n".join(edit(lines)) + "\n")
    assert main(["calibrate", "refit", str(tmp_path / "cpu-tiny.json"), "--out", str(tmp_path / "o.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "o.json").exists()


def test_a_tiny_grid_fits_without_a_held_out_set_and_says_its_error_is_unmeasured():
    """--quick --max-num-seqs 2 --max-tokens 16 --max-context 16: a handful of shapes, a fold or
    the held-out set empty (a traceback in np.stack before); the fit is made and the warning says
    that nothing was held out."""
    from servesim.calibration.commands import unusable_fit_warning

    shapes = build_grid(GridSpec(max_num_seqs=2, max_tokens=16, max_context=16, quick=True))
    assert len(shapes) <= 8
    result = fit(synthetic_raw(shapes, noise=0.01))
    assert np.isfinite(result.predictions["predicted"]).all()
    profile = {"held_out_error": result.held_out, "train_error": result.train}
    assert result.held_out == {}  # (4 shapes: none held out at 20 %)
    assert unusable_fit_warning(profile).startswith(f"warning: only {len(shapes)} shapes were timed and none was held out")
