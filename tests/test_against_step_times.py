"""benchmarks/against_step_times.py: the simulated and the measured side go through one estimator."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pandas as pd
import pytest


@pytest.fixture(scope="module")
def ast():
    spec = importlib.util.spec_from_file_location(
        "against_step_times", Path(__file__).resolve().parents[1] / "benchmarks" / "against_step_times.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _saturated_steps(seats: int = 4, seconds: float = 90.0) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Decode steps of 10 ms; every 7th step is mixed: a prompt of 50..250 tokens that costs a fixed
    20 ms (decode rows in the prefill kernel) plus 0.1 ms a token on top of the decode step."""
    rng = np.random.default_rng(3)
    rows, reqs, t, k = [], [], 0.0, 0
    while t < seconds:
        pre = int(rng.integers(50, 251)) if k % 7 == 6 else 0
        dur = 0.010 + (0.020 + 1e-4 * pre if pre else 0.0)
        rows.append({"start": t, "duration": dur, "num_prefill_tokens": pre, "num_decode_tokens": seats - (pre > 0),
                     "num_running": seats})
        if pre:
            reqs.append({"arrival_time": t, "sim_ttft": dur, "prompt_len": pre})
        t += dur
        k += 1
    return pd.DataFrame(rows), pd.DataFrame(reqs)


def test_the_same_steps_give_the_same_figures_on_both_sides(ast):
    it, pr = _saturated_steps()
    ticks = ast.sim_ticks(it, pr, 4)
    s = ast.saturated(ticks, it, pr, 4)
    for w, measured in s["measured"].items():
        assert s["sim"][w] == pytest.approx(measured)
    assert s["sim_decode"] == pytest.approx(0.010)


def test_a_tick_is_saturated_as_its_last_step_left_it(ast):
    it = pd.DataFrame({"start": [0.2, 0.6, 1.2], "duration": [0.1, 0.1, 0.1], "num_prefill_tokens": [0, 0, 0],
                       "num_decode_tokens": [4, 3, 4], "num_running": [4, 3, 4]})
    pr = pd.DataFrame({"arrival_time": [0.0], "sim_ttft": [0.1], "prompt_len": [10]})
    ticks = ast.sim_ticks(it, pr, 4).set_index("t")
    assert ticks.loc[1.0, "running"] == 3 and ticks.loc[2.0, "running"] == 4
    assert ticks.loc[1.0, "gen_throughput"] == 8 and ticks.loc[1.0, "prompt_throughput"] == 10

