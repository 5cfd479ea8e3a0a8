"""The compiled step loops (sim/row_kernels.py) against the numpy code they stand in for.

Each loop is checked on random rows against the numpy path, and whole runs are simulated with the
loops on and off: shipped scenarios (every policy and preset), randomized ones (preemption modes,
prefix caching, swap, several replicas) and a run large enough for ``simulate`` to turn them on by
itself. Identical means identical here: every latency, step and summary figure, bit for bit.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from servesim.sim import row_kernels as rk
from servesim.sim.batch import Batch, step_sums
from servesim.sim.cost_model import RooflineCostModel
from servesim.sim.presets import HARDWARE, get_hardware, get_model
from servesim.sim.request import Request
from servesim.sim.scenario import load_scenario, scenario_from_dict
from servesim.sim.schedulers.chunked import _split_budget
from servesim.sim.schedulers.running import RunningTable, StepRows
from servesim.sim.simulate import simulate
from test_fast_forward import SCENARIOS_DIR, SHIPPED, assert_same_run, random_scenario

pytestmark = pytest.mark.skipif(not rk.available(), reason="numba is not installed")


@pytest.fixture(autouse=True, scope="module")
def compiled():
    """The loops below are the compiled ones (loaded once; each test leaves them on or off)."""
    was = rk.ON
    rk.use(True)
    rk.use(was)


@pytest.fixture
def jit_state():
    """Restores whether the loops were on, whatever a test did."""
    was = rk.ON
    yield
    rk.use(was)


def both_ways(sc, monkeypatch, **kw):
    monkeypatch.setenv("SERVESIM_JIT", "0")
    plain = simulate(sc, progress=False, **kw)
    assert not rk.ON
    monkeypatch.setenv("SERVESIM_JIT", "1")
    # (the Python engine with the loops: the compiled engine has its own tests, test_compiled_engine.py)
    compiled = simulate(sc, progress=False, compiled=False, **kw)
    assert rk.ON
    return plain, compiled


# ---- the loops, one by one -------------------------------------------------------------------
def test_batch_rows_gives_the_batch_its_numpy_rows_and_aggregates():
    rng = np.random.default_rng(0)
    for _ in range(300):
        n = int(rng.integers(1, 40))
        computed = rng.integers(0, 3000, n).astype(np.int64)
        tokens = computed + rng.integers(1, 600, n) * (rng.random(n) < 0.3) + 1
        rows = np.sort(rng.choice(n, int(rng.integers(1, n + 1)), replace=False)).astype(np.int64)
        q = np.minimum(tokens[rows] - computed[rows], rng.integers(1, 700, len(rows))).astype(np.int64)
        ctx = np.full(len(rows), -7, dtype=np.int64)
        samples = np.zeros(len(rows), dtype=bool)
        shape = rk.batch_rows(computed, tokens, rows, q, ctx, samples)
        want_ctx = computed[rows]
        want_samples = want_ctx + q >= tokens[rows]
        assert np.array_equal(ctx, want_ctx) and np.array_equal(samples, want_samples)
        ref = Batch(num_new_tokens=q, num_context_tokens=want_ctx, samples=want_samples)
        assert tuple(shape[:6]) == tuple(step_sums(q, want_ctx))
        assert (shape[6] or None) == ref.longest_decode_kv
        assert shape[7] == ref.num_decode_tokens
        assert shape[8] == ref.num_samples == int(want_samples.sum())
        got = Batch(num_new_tokens=q, num_context_tokens=ctx, samples=samples)
        got.set_shape(*shape)
        assert (got.sums, got.longest_decode_kv, got.num_decode_tokens, got.num_samples) == (
            ref.sums, ref.longest_decode_kv, ref.num_decode_tokens, ref.num_samples)


def test_varlen_layer_s_is_the_python_arithmetic(jit_state):
    """The compiled FA2 varlen term against ``FA2VarlenAttention.layer_s`` on random integer step
    shapes, on every GPU that runs FA2, models with 1-8 query heads per KV head, L2 holding the
    decode KV and thrashing: the same float, not a close one."""
    rng = np.random.default_rng(7)
    fa2 = [name for name, hw in HARDWARE.items() if hw.flash_attention == 2]
    assert len(fa2) >= 3
    checked = 0
    for hw_name in fa2:
        for model, tp in (("llama-3.1-8b", 1), ("qwen3-32b", 2), ("llama-2-7b", 1)):
            v = RooflineCostModel(get_model(model), get_hardware(hw_name), tp)._varlen
            for _ in range(150):
                n_dec = int(rng.integers(0, 300))
                rows = int(rng.integers(1, 4))
                q = [int(x) for x in rng.integers(2, 2048, rows)]
                ctx = [int(x) for x in rng.integers(0, 8000, rows)]
                dec_ctx = rng.integers(0, int(rng.choice([64, 4000, 60_000])), n_dec)
                shape = (n_dec + rows, n_dec, n_dec + sum(q), int((dec_ctx + 1).sum()),
                         sum(c + x for c, x in zip(ctx, q, strict=True)))
                longest = int(dec_ctx.max()) + 1 if n_dec and rng.random() < 0.8 else None
                rk.use(False)
                want = v.layer_s(*shape, longest)
                rk.use(True)
                got = v.layer_s(*shape, longest)
                assert got == want, (hw_name, model, shape, longest)
                checked += 1
    assert checked == len(fa2) * 3 * 150
    # a step without prefill rows is no varlen step: both ways divide by zero
    for on in (False, True):
        rk.use(on)
        with pytest.raises(ZeroDivisionError):
            v.layer_s(5, 5, 5, 500, 0, 101)
    # non-integer sums (a GPU profile's attention_layer_s readings) take the Python arithmetic
    # instead of compiling a float version in the middle of a run
    signatures = len(rk.varlen_layer_s.signatures)
    rk.use(False)
    want = v.layer_s(3.0, 2.0, 300.0, 2 * 900.5, 700.0, None)
    rk.use(True)
    assert v.layer_s(3.0, 2.0, 300.0, 2 * 900.5, 700.0, None) == want
    assert len(rk.varlen_layer_s.signatures) == signatures


def _shipped_compiled_parts(part: str):
    """(path, LayerCostModel, its ``part``) of every shipped GPU layer-table profile whose ``part``
    (``attention`` or ``alpha``) has a compiled reading (``_packed``)."""
    from servesim.sim.cost_model import load_profile
    from servesim.sim.layer_cost_model import LayerCostModel

    for path in sorted((Path(__file__).resolve().parents[1] / "calibration" / "profiles").glob("*.json")):
        model = load_profile(path)
        reading = getattr(model, part, None) if isinstance(model, LayerCostModel) else None
        if reading is not None and reading._packed is not None:
            yield path, model, reading


def test_grid_inside_is_the_python_reading_of_every_shipped_profile(jit_state):
    """The compiled attention-grid reading (``layer_cost_model.grid_inside``) against
    ``AttentionGrid._inside``'s Python arithmetic on every shipped GPU profile with a linear
    reading: random points inside the grid, on its nodes and between "absent" and the first node,
    and whole steps priced both ways: the same float, not a close one."""
    rng = np.random.default_rng(3)
    checked = 0
    for path, model, grid in _shipped_compiled_parts("attention"):
        axes = grid.axes
        for _ in range(400):
            point = []
            for a in axes:
                kind = rng.random()
                if kind < 0.3:  # a node
                    point.append(float(a[int(rng.integers(len(a)))]))
                elif kind < 0.4:  # below the first non-zero node
                    point.append(float(rng.uniform(0, a[1])))
                else:
                    point.append(float(rng.uniform(0, a[-1])))
            rk.use(False)
            want = grid._inside(*point)
            rk.use(True)
            assert grid._inside(*point) == want, (path.name, point)
            checked += 1
        for _ in range(100):  # whole steps: decode-only and mixed, past the grid too
            n_dec = int(rng.integers(0, 400))
            q = np.concatenate([np.ones(n_dec, dtype=np.int64), rng.integers(2, 4096, int(rng.integers(0, 3)))])
            if len(q) == 0:
                continue
            ctx = rng.integers(0, int(rng.choice([100, 5000, 40_000])), len(q)).astype(np.int64)
            rk.use(False)
            want = model.iteration_time(q, ctx)
            rk.use(True)
            assert model.iteration_time(q, ctx) == want, (path.name, q.tolist(), ctx.tolist())
    assert checked >= 5 * 400


def test_skew_alpha_is_the_python_reading_of_every_shipped_profile(jit_state):
    """The compiled skew α (``layer_cost_model.skew_alpha``) against ``SkewAlpha.__call__``'s Python
    arithmetic on every shipped profile with the prefill-axes layout: rows and longest contexts on
    and between the edges (where α is read in log2), past the last, every ratio, chunk and cached
    context bucket: the same float."""
    rng = np.random.default_rng(5)
    checked = 0
    for path, _model, alpha in _shipped_compiled_parts("alpha"):
        finite = [e for e in alpha.kv_edges if e < 1e8]
        for _ in range(2000):
            n = int(rng.choice(alpha.n_edges[:-1])) if rng.random() < 0.3 else int(rng.integers(2, 600))
            longest = float(rng.choice(finite)) if rng.random() < 0.3 else float(rng.integers(2, 40_000))
            shortest = float(rng.integers(0, int(longest)))
            mean = float(rng.uniform(shortest, longest))
            pc, kp = (0, 0) if rng.random() < 0.4 else (int(rng.integers(1, 4096)), int(rng.integers(0, 20_000)))
            rk.use(False)
            want = alpha(n, mean, shortest, longest, pc, kp)
            rk.use(True)
            assert alpha(n, mean, shortest, longest, pc, kp) == want, (path.name, n, mean, shortest, longest, pc, kp)
            checked += 1
    assert checked >= 4 * 2000


def _table(rng, n: int) -> RunningTable:
    table = RunningTable(4)
    for i in range(n):
        req = Request(request_id=i, arrival_time=0.0, prompt_len=int(rng.integers(1, 900)),
                      output_len=int(rng.integers(3, 40)))
        if rng.random() < 0.5:  # decoding: every token but the last sampled one computed
            req.num_output_tokens = int(rng.integers(0, 3))
            req.num_computed_tokens = req.prompt_len + req.num_output_tokens - 1
        else:  # prefilling
            req.num_computed_tokens = int(rng.integers(0, req.prompt_len))
        req.last_token_time = float(rng.random())
        table.append(req, int(rng.integers(0, 80)))
    return table


def _twin(table: RunningTable) -> RunningTable:
    """A second table holding the same rows, to be changed the other way."""
    twin = RunningTable(4)
    twin._bind(table.ints.copy())
    twin.reqs, twin.n = list(table.reqs), table.n
    return twin


def test_advance_rows_is_the_tables_numpy_advance():
    rng = np.random.default_rng(1)
    for _ in range(300):
        n = int(rng.integers(1, 30))
        a = _table(rng, n)
        b = _twin(a)  # one copy advanced each way
        whole = bool(rng.random() < 0.5)
        rows = np.arange(n, dtype=np.int64) if whole else np.sort(
            rng.choice(n, int(rng.integers(1, n + 1)), replace=False)).astype(np.int64)
        need = a.tokens[rows] - a.computed[rows]
        new = np.minimum(need, rng.integers(1, 50, len(rows))).astype(np.int64)
        samples = a.computed[rows] + new >= a.tokens[rows]
        plain = (new == 1) & samples
        lead = int(np.argmin(plain)) if not plain.all() else len(rows)
        step = StepRows(rows, whole, lead if whole else 0)
        now = 1.0 + float(rng.random())
        rk.use(False)
        want = a.advance(step, new, samples, now)
        itl, first, done = np.full(n, np.nan), np.full(n, -1), np.full(n, -1)
        ni, nf, nd = rk.advance_rows(b.ints, b.last_tok, rows, new, samples, now, itl, first, done)
        assert np.array_equal(itl[:ni], want[0]) and first[:nf].tolist() == want[1]
        assert np.array_equal(done[:nd], want[2])
        assert np.array_equal(a.ints[:, :n], b.ints[:, :n])


def test_blocks_short_and_full_rows_find_the_numpy_rows():
    rng = np.random.default_rng(2)
    for _ in range(300):
        n = int(rng.integers(1, 50))
        bs = int(rng.choice([1, 8, 16]))
        nblocks = rng.integers(0, 20, n).astype(np.int64)
        computed = np.maximum(nblocks * bs - rng.integers(0, 2 * bs, n), 0).astype(np.int64)
        new = rng.integers(0, 3 * bs, n)
        want = computed + new
        rows, blocks, counts = (np.full(n, -1) for _ in range(3))
        # (the table's columns run past its n rows: only the rows of ``new`` are read)
        spare = np.concatenate([computed, rng.integers(0, 99, 5)])
        k = rk.blocks_short(nblocks, spare, new, bs, rows, blocks, counts)
        todo = (want > nblocks * bs).nonzero()[0]
        assert np.array_equal(rows[:k], todo)
        assert np.array_equal(blocks[:k], (want[todo] + bs - 1) // bs)
        assert np.array_equal(counts[:k], blocks[:k] - nblocks[todo])
        full = np.full(n, -1)
        todo = (computed >= nblocks * bs).nonzero()[0]
        free = int(rng.integers(0, 2 * len(todo) + 2))
        before = nblocks.copy()
        k = rk.full_rows(computed, nblocks, n, bs, free, full)
        assert np.array_equal(full[:k], todo)
        if len(todo) <= free:  # they fit: each counted one block more, the other rows untouched
            before[todo] += 1
        assert np.array_equal(nblocks, before)


def test_close_rows_is_the_tables_numpy_removal(jit_state):
    rng = np.random.default_rng(4)
    for _ in range(300):
        n = int(rng.integers(1, 40))
        a = _table(rng, n)
        b = _twin(a)
        gone = np.sort(rng.choice(n, int(rng.integers(0, n + 1)), replace=False)).astype(np.int64)
        rk.use(False)
        a.remove_rows(gone.tolist())
        rk.use(True)
        b.remove_rows(gone.tolist(), gone_rows=gone if rng.random() < 0.5 else None)
        assert a.n == b.n and a.reqs == b.reqs
        assert np.array_equal(a.ints[:, : a.n], b.ints[:, : b.n])
    table = _table(rng, 5)
    before = table.ints.copy()
    for rows in ([3, 1], [2, 2]):
        with pytest.raises(AssertionError, match="ascending"):
            table.remove_rows(rows)
        assert np.array_equal(table.ints, before) and table.n == 5  # nothing moved


def test_split_budget_is_the_chunked_policys_split():
    rng = np.random.default_rng(3)
    for _ in range(2000):
        n = int(rng.integers(1, 40))
        computed = rng.integers(0, 500, n).astype(np.int64)
        tokens = computed + np.where(rng.random(n) < float(rng.random()), 1, rng.integers(2, 900, n))
        budget = int(rng.choice([1, 4, 16, 64, 512, 8192]))
        threshold = int(rng.choice([budget, 8, 100]))
        new = np.full(n, -9, dtype=np.int64)  # every entry must be written
        left, lead, given = rk.split_budget(computed, tokens, n, budget, threshold, new)
        ref_new, ref_left, ref_lead, ref_given = _split_budget(computed, tokens, n, budget, threshold)
        assert (left, lead, given) == (ref_left, ref_lead, ref_given)
        if ref_lead != n:  # every row decodes: the caller uses its own ones
            assert np.array_equal(new, ref_new)


# ---- whole runs ------------------------------------------------------------------------------
@pytest.mark.parametrize("path", SHIPPED, ids=[str(p.relative_to(SCENARIOS_DIR)) for p in SHIPPED])
def test_shipped_scenario_is_the_same_with_the_compiled_loops(path: Path, monkeypatch, jit_state):
    sc = load_scenario(path, ["workload.num_requests=150"])
    assert_same_run(*both_ways(sc, monkeypatch), replicas=sc.cluster.num_replicas)


@pytest.mark.parametrize("seed", range(12))
def test_random_scenario_is_the_same_with_the_compiled_loops(seed: int, monkeypatch, jit_state):
    sc = random_scenario(seed)
    assert_same_run(*both_ways(sc, monkeypatch, fast_forward=bool(seed % 3)), replicas=sc.cluster.num_replicas)


@pytest.mark.parametrize("hardware", ["a100-80g", "rtx-pro-6000"])
def test_a_roofline_run_on_an_fa2_gpu_is_the_same_with_the_compiled_loops(hardware: str, monkeypatch, jit_state):
    """Mixed chunked steps on a GPU where vLLM runs FA2: the roofline prices them through the
    varlen term, compiled (``varlen_layer_s``) or not; the random scenarios above run on the H100."""
    sc = scenario_from_dict({
        "name": f"fa2-{hardware}", "seed": 5, "model": "llama-3.1-8b", "hardware": hardware,
        "scheduler": {"type": "chunked", "max_num_seqs": 64, "max_num_batched_tokens": 512},
        "workload": {"num_requests": 400, "arrival": {"process": "poisson", "rate": 8.0},
                     "prompt_len": {"dist": "lognormal", "mean": 1100, "std": 1000, "min": 4, "max": 8000},
                     "output_len": {"dist": "lognormal", "mean": 200, "std": 200, "min": 1, "max": 2000}},
    })
    assert_same_run(*both_ways(sc, monkeypatch))


def test_a_large_run_turns_them_on_and_a_small_one_off(monkeypatch, jit_state):
    monkeypatch.delenv("SERVESIM_JIT", raising=False)
    assert rk.want(rk.MIN_REQUESTS) and not rk.want(rk.MIN_REQUESTS - 1)
    monkeypatch.setenv("SERVESIM_JIT", "0")
    assert not rk.want(10**9)
    monkeypatch.setenv("SERVESIM_JIT", "1")
    assert rk.want(1)
    monkeypatch.delenv("SERVESIM_JIT")
    sc = scenario_from_dict({
        "name": "large", "seed": 4, "model": "llama-3.1-8b", "hardware": "h100-sxm",
        "scheduler": {"type": "chunked", "max_num_seqs": 64, "max_num_batched_tokens": 512},
        "workload": {"num_requests": rk.MIN_REQUESTS, "arrival": {"process": "poisson", "rate": 400.0},
                     "prompt_len": {"dist": "uniform", "min": 4, "max": 64},
                     "output_len": {"dist": "uniform", "min": 1, "max": 8}},
    })
    rk.use(False)
    compiled = simulate(sc, progress=False, iterations="binned")
    assert rk.ON
    monkeypatch.setenv("SERVESIM_JIT", "0")
    plain = simulate(sc, progress=False, iterations="binned")
    assert not rk.ON
    assert_same_run(plain, compiled)


def test_without_numba_they_stay_off(monkeypatch, jit_state):
    rk.use(False)
    monkeypatch.setattr(rk, "_loaded", False)
    monkeypatch.setattr(rk, "available", lambda: False)
    assert rk.use(True) is False and not rk.ON


def test_a_numba_that_fails_to_load_falls_back_with_one_warning(monkeypatch, jit_state):
    rk.use(False)
    plain = rk.batch_rows
    monkeypatch.setattr(rk, "_loaded", False)
    monkeypatch.setattr(rk, "available", lambda: True)  # installed...
    monkeypatch.setitem(sys.modules, "numba", None)  # ...but import numba raises ImportError
    with pytest.warns(RuntimeWarning, match="numpy path"):
        assert rk.use(True) is False
    assert not rk.ON and rk.batch_rows is plain and not rk._loaded


def test_a_small_run_does_not_import_numba():
    code = ("import sys; from servesim.sim.scenario import load_scenario; from servesim.sim.simulate import simulate; "
            "simulate(load_scenario('scenarios/quickstart.yaml', ['workload.num_requests=50']), progress=False); "
            "print('numba' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k != "SERVESIM_JIT"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env,
                         cwd=SCENARIOS_DIR.parent)
    assert out.stdout.strip() == "False"
