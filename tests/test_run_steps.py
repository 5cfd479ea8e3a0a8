"""calibration/run_steps.py: step times read off a run's engine timestamps (vLLM's async scheduling)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from servesim.calibration import run_steps as rs


class FlatCost:
    """A decode step costs 20 ms whatever its rows; a chunk adds 0.01 ms a token."""

    def iteration_time(self, q, c):  # noqa: ANN001, ANN201
        return 0.020 + 1e-5 * float(q[q > 1].sum())


def async_timeline(mixed_factor: float) -> pd.DataFrame:
    """One long request decoding from t = 0 in 20 ms steps, and three more arriving one by one, as
    vLLM's async engine runs them: a request taken in at a step end runs in the step after the one
    already scheduled; its mixed step takes ``mixed_factor`` x the flat price."""
    d, eps = 0.020, 5e-5  # eps: the loop reaching its input after a step end (read into d: d + eps / j)
    reqs = [{"input_toks": 100, "output_toks": 5000, "queued_ts": -0.1, "scheduled_ts": -0.1,
             "first_token_ts": 0.0, "last_token_ts": 100.0}]
    end = 0.0  # the last step end before each arrival: a first token
    for steps, prompt in [(3, 300), (0, 1000), (5, 40)]:
        taken = end + steps * d + eps  # the loop takes it in right after a step end
        first = end + (steps + 1) * d + mixed_factor * (d + 1e-5 * prompt)
        reqs.append({"input_toks": prompt, "output_toks": 5000, "queued_ts": taken, "scheduled_ts": taken,
                     "first_token_ts": first, "last_token_ts": 100.0})
        end = first
    return pd.DataFrame(reqs)


def test_ramp_steps_read_decode_and_mixed_steps_off_the_async_timestamps():
    ramp = rs.ramp_steps(async_timeline(1.25), FlatCost(), budget=2048)
    assert len(ramp) == 3
    timed = ramp[ramp["j"] >= 1]
    assert list(timed["j"]) == [3, 5]
    assert np.allclose(timed["decode_ms"] / timed["decode_priced_ms"], 1.0, atol=0.01)
    assert np.allclose(timed["mixed_ms"] / timed["mixed_priced_ms"], 1.25, atol=0.01)
    at_once = ramp[ramp["j"] == 0].iloc[0]  # taken in right after a step end: decode + mixed together
    assert at_once["pair_ms"] == pytest.approx(20 + 1.25 * (20 + 10), rel=1e-3)
    summary = rs.StepTiming(ramp, rs.seat_steps(async_timeline(1.25), FlatCost(), 2048, 4)).summary()
    assert summary["ramp_mixed"]["median"] == pytest.approx(1.25, abs=0.01) and summary["seat_mixed"] == {"n": 0}


class LowDecodeCost(FlatCost):
    """Prices a decode step at 17 ms, 15 % under the timelines' 20 ms."""

    def iteration_time(self, q, c):  # noqa: ANN001, ANN201
        return 0.017 + 1e-5 * float(q[q > 1].sum())


def gaps_timeline(gaps: list[int]) -> pd.DataFrame:
    """``async_timeline`` with a 100-token request arriving after each of ``gaps`` decode steps."""
    d, eps = 0.020, 5e-5
    reqs = [{"input_toks": 100, "output_toks": 5000, "queued_ts": -0.1, "scheduled_ts": -0.1,
             "first_token_ts": 0.0, "last_token_ts": 100.0}]
    end = 0.0
    for steps in gaps:
        taken, first = end + steps * d + eps, end + (steps + 1) * d + (d + 1e-3)
        reqs.append({"input_toks": 100, "output_toks": 5000, "queued_ts": taken, "scheduled_ts": taken,
                     "first_token_ts": first, "last_token_ts": 100.0})
        end = first
    return pd.DataFrame(reqs)


def test_a_decode_price_off_by_more_than_half_a_step_in_j_moves_j_so_j_up_to_2_is_reported_alone():
    """j is read with the priced decode step: long gaps absorb a price error into j, short ones cannot."""
    ramp = rs.ramp_steps(gaps_timeline([1, 2, 1, 8, 9, 12, 10]), LowDecodeCost(), budget=2048)
    assert sorted(ramp["j"]) == [1, 1, 2, 9, 11, 12, 14]  # 8, 9, 10 and 12 steps read as more
    summary = rs.StepTiming(ramp, rs.seat_steps(gaps_timeline([1]), LowDecodeCost(), 2048, 4)).summary()
    assert summary["ramp_decode_j_at_most_2"]["median"] == pytest.approx(20 / 17, abs=0.01)  # the true ratio
    assert summary["ramp_decode_j_at_most_2"]["n"] == 3
    assert summary["ramp_decode"]["median"] < 1.07  # the long gaps pull the whole figure towards 1


def sync_timeline(mixed_factor: float) -> pd.DataFrame:
    """As ``async_timeline`` without async scheduling: a request taken in at a step end runs in the
    next step, nothing scheduled ahead of it."""
    d, eps = 0.020, 5e-5
    reqs = [{"input_toks": 100, "output_toks": 5000, "queued_ts": -0.1, "scheduled_ts": -0.1,
             "first_token_ts": 0.0, "last_token_ts": 100.0}]
    end = 0.0
    for steps, prompt in [(3, 300), (0, 1000), (5, 40)]:
        taken = end + steps * d + eps
        first = end + steps * d + mixed_factor * (d + 1e-5 * prompt)
        reqs.append({"input_toks": prompt, "output_toks": 5000, "queued_ts": taken, "scheduled_ts": taken,
                     "first_token_ts": first, "last_token_ts": 100.0})
        end = first
    return pd.DataFrame(reqs)


def test_without_async_scheduling_a_request_runs_in_the_step_after_it_is_taken_in():
    ramp = rs.ramp_steps(sync_timeline(1.25), FlatCost(), budget=2048, ahead=0)
    assert len(ramp) == 3 and ramp["pair_ms"].isna().all()  # every mixed step alone, none paired
    assert np.allclose(ramp["mixed_ms"] / ramp["mixed_priced_ms"], 1.25, atol=0.01)
    timed = ramp[ramp["j"] >= 1]
    assert np.allclose(timed["decode_ms"] / timed["decode_priced_ms"], 1.0, atol=0.01)
    # read as if async, the same timestamps would put the mixed steps a decode step short
    wrong = rs.ramp_steps(sync_timeline(1.25), FlatCost(), budget=2048, ahead=1)
    assert not np.allclose(wrong["mixed_ms"].dropna() / wrong["mixed_priced_ms"][wrong["mixed_ms"].notna()], 1.25,
                           atol=0.05)


def test_a_prompt_over_the_budget_or_a_second_arrival_is_not_read():
    tl = async_timeline(1.0)
    assert len(rs.ramp_steps(tl, FlatCost(), budget=500)) == 2  # the 1000-token prompt takes two chunks
    crowded = pd.concat([tl, tl.iloc[[1]].assign(queued_ts=tl["queued_ts"][1] - 0.001, first_token_ts=99.0)])
    assert 300 not in set(rs.ramp_steps(crowded, FlatCost(), budget=2048)["prompt"])


def test_seat_steps_read_a_seat_admission_as_one_decode_step_and_its_mixed_step():
    # three seats; the last request waited 0.5 s for a seat, was scheduled at a step end and ran in
    # the step after the decode step already scheduled; its mixed step took 1.1 x the flat price
    rows = [(100, 50, 0.0, 0.0, 0.05, 1.0), (100, 5000, 0.0, 0.0, 0.05, 90.0), (100, 5000, 0.0, 0.0, 0.05, 90.0),
            (500, 5000, 0.5, 1.0, 1.0 + 0.020 + 1.1 * (0.020 + 1e-5 * 500), 90.0)]
    req = pd.DataFrame(rows, columns=["input_toks", "output_toks", "queued_ts", "scheduled_ts", "first_token_ts",
                                      "last_token_ts"])
    seat = rs.seat_steps(req, FlatCost(), budget=2048, seats=3)
    assert len(seat) == 1 and seat.iloc[0]["rows"] == 2
    assert seat.iloc[0]["mixed_ms"] / seat.iloc[0]["mixed_priced_ms"] == pytest.approx(1.1, rel=1e-6)


def test_engine_times_come_from_a_measured_runs_requests_frame_or_not_at_all():
    frame = pd.DataFrame({"prompt_len": [10, 20], "output_len": [5, 6], "first_scheduled_time": [0.0, 0.5],
                          "first_token_time": [0.1, 0.7], "finish_time": [1.0, 2.0], "ttft_from_queued": [0.1, 0.3]})
    t = rs.engine_times(frame)
    assert list(t["queued_ts"]) == pytest.approx([0.0, 0.4]) and list(t["last_token_ts"]) == [1.0, 2.0]
    assert rs.engine_times(frame.drop(columns="ttft_from_queued")) is None  # vLLM's bench JSON: no engine clock
    assert rs.engine_times(frame.assign(first_scheduled_time=np.nan)) is None



def test_decode_contexts_are_the_prompt_plus_the_tokens_made_by_then():
    req = pd.DataFrame({"input_toks": [100, 50, 70], "output_toks": [9, 5, 3], "first_token_ts": [0.0, 1.0, 5.0],
                        "last_token_ts": [2.0, 1.5, 6.0]})
    assert list(rs._contexts(req, 1.0)) == [104, 50]  # half way through 8 tokens; at its first token
    assert list(rs._contexts(req, 1.4999)) == [105, 53]  # never past prompt + output - 1
    assert list(rs._contexts(req, 4.0)) == []  # nobody decoding


def test_a_cost_model_that_prices_decode_steps_at_nothing_reads_no_step():
    class Free:
        def iteration_time(self, q, c):  # noqa: ANN001, ANN201
            return 0.0

    timing = rs.step_timing(async_timeline(1.0), Free(), 2048, 4)
    assert timing.ramp.empty and timing.seat.empty and timing.markdown() == []
