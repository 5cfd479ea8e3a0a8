"""The compiled engine's in-loop step price (``sim/compiled_price.py``) is ``SimExecutor.price``
of a roofline to the bit: on every hardware preset, tensor-parallel degree and host overlap, for
random steps of every kind; and runs that use it are the Python engine's runs."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
from servesim.sim import compiled_engine as ce
from servesim.sim import compiled_price as cp
from servesim.sim import compiled_profile as cg
from servesim.sim import row_kernels as rk
from servesim.sim.batch import step_sums
from servesim.sim.cost_model import (
    ConstantCostModel,
    CostModelConfig,
    RooflineCostModel,
    build_cost_model,
    load_profile,
    resolve_profile_path,
)
from servesim.sim.engine import SimExecutor
from servesim.sim.presets import HARDWARE, get_model
from servesim.sim.scenario import load_scenario
from test_compiled_engine import assert_identical, random_case

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(not rk.available(), reason="numba is not installed")


@pytest.fixture(autouse=True)
def _loops_on(monkeypatch):
    """The compiled loops on (the compiled engine needs them; the Python engine's large-run path
    then takes FA2's term compiled, as it does in a run), restored after."""
    was = rk.ON
    monkeypatch.setenv("SERVESIM_JIT", "1")
    rk.use(True)
    assert ce._load()
    yield
    rk.use(was)


def _steps(rng: np.random.Generator, count: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """(q, ctx) of random steps: decode-only, prefill-only and mixed, short and long contexts."""
    steps = []
    for k in range(count):
        n = int(rng.choice([1, 2, 7, 64, 255, 1024]))
        kind = k % 3
        q = np.ones(n, dtype=np.int64) if kind == 0 else rng.integers(1, int(rng.choice([2, 64, 2049])), n)
        if kind == 1:
            q = np.maximum(q, 2)
        ctx = rng.integers(0, int(rng.choice([1, 17, 1000, 130_000])), n)
        steps.append((q, ctx))
    return steps


CASES = [(hw, model, tp) for hw in sorted(HARDWARE) for model, tp in
         (("llama-3.1-8b", 1), ("llama-3.1-8b", 2), ("qwen3-32b", 1), ("qwen3-32b", 4), ("llama-2-7b", 1))]


@pytest.mark.parametrize(("hw", "model", "tp"), CASES)
def test_price_is_the_executors_to_the_bit(hw: str, model: str, tp: int):
    cost = build_cost_model(CostModelConfig(type="roofline"), get_model(model), HARDWARE[hw], tp)
    assert type(cost) is RooflineCostModel
    rng = np.random.default_rng(len(hw) * 7 + tp)
    compiled = cp.price
    plain = cp.PLAIN["price"]
    assert compiled is not plain  # (the module holds the compiled one once the engine loaded)
    for overlap in (False, True):
        ex = SimExecutor(cost, 1.0, overlap_host=overlap)
        f, i = cp.pack(ex)
        for q, ctx in _steps(rng, 90):
            sums = step_sums(q, ctx)
            dec = q == 1
            longest = int(ctx[dec].max()) + 1 if dec.any() else 0
            want = ex.price(sums, longest, q, ctx)
            got = compiled(f, i, *sums, longest)
            assert got == want, (hw, model, tp, overlap, tuple(sums), longest, got, want)
            assert plain(f, i, *sums, longest) == want


def test_pack_leaves_other_cost_models_to_python():
    assert cp.pack(SimExecutor(ConstantCostModel(1e-3, 0.0, 1e9), 1.0)) is None

    class Tuned(RooflineCostModel):  # a subclass may price differently: not this module's to price
        pass

    tuned = Tuned(get_model("llama-3.1-8b"), HARDWARE["h100-sxm"])
    assert cp.pack(SimExecutor(tuned, 1.0)) is None


@pytest.mark.parametrize("seed", range(24))
def test_runs_priced_in_the_loop_are_the_python_engines(seed: int):
    """Engine runs on the GPUs whose roofline has FA2's varlen and decode-wave terms, at TP 1 and
    2, with async scheduling (the host overlap) in half: every output equal to the Python engine's."""
    sc, requests = random_case(seed, async_scheduling=seed % 2 == 1)
    hw = ["rtx-pro-6000", "rtx-4090", "a100-80g", "l40s", "h200", "h100-sxm"][seed % 6]
    sc = sc.model_copy(update={"hardware": hw, "cost_model": CostModelConfig(type="roofline")})
    if seed % 4 >= 2:
        sc = sc.model_copy(update={"tensor_parallel": 2})
    assert_identical(sc, requests, iterations="full")


def test_a_changed_source_drops_the_cached_loop(tmp_path, monkeypatch):
    """numba keeps the loop's machine code until compiled_engine.py changes; a change to the price's
    files must drop it too, or a large run would price with the old arithmetic."""
    flushed = []

    class Cache:
        _cache_path = str(tmp_path)

        def flush(self):
            flushed.append(1)

    class Dispatcher:
        _cache = Cache()

    made = [Dispatcher(), Dispatcher()]
    stamp = tmp_path / ce._SOURCES_FILE
    assert ce._drop_stale_cache(made) and len(flushed) == 2  # no record: dropped, recorded
    assert stamp.read_text() == ce._sources_digest()
    assert ce._drop_stale_cache(made) and len(flushed) == 2  # the same sources: kept
    monkeypatch.setattr(ce, "_sources_digest", lambda: "another")
    assert ce._drop_stale_cache(made) and len(flushed) == 4
    assert stamp.read_text() == "another"

    class Unreadable:  # a numba without the internals: the caller compiles without a cache
        pass

    assert not ce._drop_stale_cache([Unreadable()])


GPU_PROFILES = sorted(p.name for p in (Path(__file__).resolve().parent.parent / "calibration" / "profiles").glob("*.json")
                      if json.loads(p.read_text()).get("format", "").startswith("servesim-gpu-profile"))


@pytest.mark.parametrize("name", GPU_PROFILES)
def test_profile_price_is_the_executors_to_the_bit(name: str):
    """``compiled_profile.price`` against ``SimExecutor.price`` of every shipped GPU profile: decode-
    only, prefill-only and mixed steps, inside and past the measured grid, host overlap or not."""
    cost = load_profile(resolve_profile_path(f"profiles/{name}"))
    rng = np.random.default_rng(len(name))
    for overlap in (False, True):
        ex = SimExecutor(cost, 1.0, overlap_host=overlap)
        packed = cg.pack(ex)
        assert packed is not None, name  # (every shipped profile is one it prices)
        for q, ctx in _steps(rng, 150):
            sums = step_sums(q, ctx)
            dec = q == 1
            longest = int(ctx[dec].max()) + 1 if dec.any() else 0
            want = ex.price(sums, longest, q, ctx)
            got = cg.price(*packed, sums[0], sums[1], sums[2], sums[4], q, ctx)
            assert got == want, (name, overlap, tuple(sums), got, want)
            assert cg.PLAIN["price"](*packed, sums[0], sums[1], sums[2], sums[4], q, ctx) == want


def test_profile_pack_leaves_what_it_does_not_price_to_python():
    cost = load_profile(resolve_profile_path(f"profiles/{GPU_PROFILES[0]}"))
    assert cg.pack(SimExecutor(ConstantCostModel(1e-3, 0.0, 1e9), 1.0)) is None
    log = copy.copy(cost)
    log.attention = copy.copy(cost.attention)
    log.attention._packed = None  # (a log reading, or axes not starting at 0)
    assert cg.pack(SimExecutor(log, 1.0)) is None


@pytest.mark.parametrize("seed", range(16))
def test_runs_priced_by_a_profile_in_the_loop_are_the_python_engines(seed: int):
    """Engine runs of the GPU scenarios (their profiles' readings, skew α, TP 2 all-reduce) with
    random requests and knobs: every output equal to the Python engine's."""
    paths = sorted((ROOT / "scenarios" / "gpu").glob("*.yaml"))
    paths = [p for p in paths if "live" not in p.name]
    base = load_scenario(paths[seed % len(paths)])
    sc, requests = random_case(seed, async_scheduling=seed % 2 == 1, shared_prefixes=seed % 4 == 3)
    sc = sc.model_copy(update={"model": base.model, "hardware": base.hardware, "cost_model": base.cost_model,
                               "tensor_parallel": base.tensor_parallel})
    assert_identical(sc, requests, iterations="full")
