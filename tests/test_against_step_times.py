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


class _FlatCost:
    """A decode step costs 20 ms whatever its rows; a chunk adds 0.01 ms a token."""

    def iteration_time(self, q, c):  # noqa: ANN001, ANN201
        return 0.020 + 1e-5 * float(q[q > 1].sum())


def _async_timeline(mixed_factor: float) -> pd.DataFrame:
    """One long request decoding from t = 0 in 20 ms steps, and three more arriving one by one, as
    vLLM's async engine runs them: a request taken in at a step end runs in the step after the one
    already scheduled; its mixed step takes ``mixed_factor`` x the flat price."""
    d, eps = 0.020, 5e-5  # eps: the loop reaching its input after a step end (read into d: d + eps / j)
    reqs = [{"request_id": "r0", "input_toks": 100, "output_toks": 5000, "queued_ts": -0.1, "scheduled_ts": -0.1,
             "first_token_ts": 0.0, "last_token_ts": 100.0}]
    end = 0.0  # the last step end before each arrival: a first token
    for k, (steps, prompt) in enumerate([(3, 300), (0, 1000), (5, 40)]):
        taken = end + steps * d + eps  # the loop takes it in right after a step end
        first = end + (steps + 1) * d + mixed_factor * (d + 1e-5 * prompt)
        reqs.append({"request_id": f"r{k + 1}", "input_toks": prompt, "output_toks": 5000, "queued_ts": taken,
                     "scheduled_ts": taken, "first_token_ts": first, "last_token_ts": 100.0})
        end = first
    return pd.DataFrame(reqs)


def test_ramp_steps_read_decode_and_mixed_steps_off_the_async_timestamps(ast):
    ramp = ast.ramp_steps(_async_timeline(1.25), _FlatCost(), budget=2048)
    assert len(ramp) == 3
    timed = ramp[ramp["j"] >= 1]
    assert list(timed["j"]) == [3, 5]
    assert np.allclose(timed["decode_ms"] / timed["decode_sim_ms"], 1.0, atol=0.01)
    assert np.allclose(timed["mixed_ms"] / timed["mixed_sim_ms"], 1.25, atol=0.01)
    at_once = ramp[ramp["j"] == 0].iloc[0]  # taken in right after a step end: decode + mixed together
    assert at_once["pair_ms"] == pytest.approx(20 + 1.25 * (20 + 10), rel=1e-3)


def test_seat_steps_read_a_seat_admission_as_one_decode_step_and_its_mixed_step(ast):
    # three seats; r2 waited 0.5 s for r0's seat, was scheduled at a step end and ran in the step
    # after the decode step already scheduled; its mixed step took 1.1 x the flat price
    reqs = pd.DataFrame([
        {"input_toks": 100, "output_toks": 50, "queued_ts": 0.0, "scheduled_ts": 0.0, "first_token_ts": 0.05,
         "last_token_ts": 1.0},
        {"input_toks": 100, "output_toks": 5000, "queued_ts": 0.0, "scheduled_ts": 0.0, "first_token_ts": 0.05,
         "last_token_ts": 90.0},
        {"input_toks": 100, "output_toks": 5000, "queued_ts": 0.0, "scheduled_ts": 0.0, "first_token_ts": 0.05,
         "last_token_ts": 90.0},
        {"input_toks": 500, "output_toks": 5000, "queued_ts": 0.5, "scheduled_ts": 1.0,
         "first_token_ts": 1.0 + 0.020 + 1.1 * (0.020 + 1e-5 * 500), "last_token_ts": 90.0},
    ])
    seat = ast.seat_steps(reqs, _FlatCost(), budget=2048, seats=3)
    assert len(seat) == 1 and seat.iloc[0]["rows"] == 2
    assert seat.iloc[0]["mixed_ms"] / seat.iloc[0]["mixed_sim_ms"] == pytest.approx(1.1, rel=1e-6)
