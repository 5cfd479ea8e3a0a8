"""vllm-v1's async_scheduling: the next step is chosen while this one runs; host time hides behind it."""

from __future__ import annotations

import numpy as np
import pytest
from servesim.sim.batch import Batch
from servesim.sim.cost_model import ConstantCostModel
from servesim.sim.engine import SimExecutor
from servesim.sim.request import Request
from servesim.sim.scenario import scenario_from_dict
from servesim.sim.simulate import simulate

STEP = 0.010


def scenario(async_scheduling: bool, **cost):
    return scenario_from_dict({
        "model": "llama-3.1-8b", "hardware": "h100-sxm",
        "cost_model": cost or {"type": "constant", "step_ms": STEP * 1e3},
        "scheduler": {"preset": "vllm-v1", "max_num_seqs": 8, "max_num_batched_tokens": 512,
                      "async_scheduling": async_scheduling},
        "kv_cache": {"num_blocks": 1000},
        "workload": {"num_requests": 1, "arrival": {"process": "poisson", "rate": 1}, "prompt_len": 1,
                     "output_len": 1},
    })  # fmt: skip


def requests() -> list[Request]:
    # the first starts an idle engine; the second arrives in the middle of the first's prefill step
    return [Request(0, 0.0, 100, 5), Request(1, 0.5 * STEP, 100, 5)]


def test_a_request_arriving_mid_step_waits_one_more_step_under_async_scheduling():
    sync = simulate(scenario(False), requests=requests(), progress=False).requests_df
    asyn = simulate(scenario(True), requests=requests(), progress=False).requests_df
    # an idle engine schedules at once either way
    assert sync.loc[0, "ttft"] == pytest.approx(STEP) and asyn.loc[0, "ttft"] == pytest.approx(STEP)
    # sync: scheduled at the end of the step it arrived in; async: that step's successor was chosen already
    assert sync.loc[1, "first_scheduled_time"] == pytest.approx(STEP)
    assert asyn.loc[1, "first_scheduled_time"] == pytest.approx(2 * STEP)
    assert asyn.loc[1, "ttft"] - sync.loc[1, "ttft"] == pytest.approx(STEP)
    assert np.allclose(asyn["tpot"], sync["tpot"])


def full_seats(async_scheduling: bool, num_blocks: int = 1000):
    """Two seats taken by a short (3 tokens) and a long request; a third waits from the start."""
    raw = scenario(async_scheduling).model_dump(mode="json", exclude_none=True)
    raw["scheduler"]["max_num_seqs"] = 2
    raw["kv_cache"]["num_blocks"] = num_blocks
    reqs = [Request(0, 0.0, 16, 3), Request(1, 0.0, 16, 20), Request(2, 0.0, 16, 5)]
    return simulate(scenario_from_dict(raw), requests=reqs, progress=False)


def test_a_finished_request_keeps_its_seat_through_the_next_schedule_under_async_scheduling():
    # vLLM's step_with_batch_queue schedules step n+1 before update_from_output(n) frees what step n
    # finished: request 0's last token is sampled in step 3, its seat is free from step 5 on
    sync, asyn = full_seats(False).requests_df, full_seats(True).requests_df
    assert sync.loc[0, "e2e"] == pytest.approx(3 * STEP) and asyn.loc[0, "e2e"] == pytest.approx(3 * STEP)
    assert sync.loc[2, "first_scheduled_time"] == pytest.approx(3 * STEP)
    assert asyn.loc[2, "first_scheduled_time"] == pytest.approx(4 * STEP)
    assert asyn.loc[1, "e2e"] == pytest.approx(sync.loc[1, "e2e"])  # the other row runs on meanwhile


def test_a_finished_request_keeps_its_blocks_through_the_next_schedule_under_async_scheduling():
    # seats to spare, blocks (16 tokens each) for two growing requests only: the third is preempted
    # in step 2 and comes back when the first's blocks do, one schedule later under async scheduling
    raw = scenario(True).model_dump(mode="json", exclude_none=True)
    out = {}
    for mode in (False, True):
        raw["scheduler"]["async_scheduling"] = mode
        raw["kv_cache"]["num_blocks"] = 4
        reqs = [Request(0, 0.0, 16, 3), Request(1, 0.0, 16, 20), Request(2, 0.0, 16, 5)]
        out[mode] = simulate(scenario_from_dict(raw), requests=reqs, progress=False).requests_df
    assert list(out[False]["num_preemptions"]) == list(out[True]["num_preemptions"]) == [0, 0, 1]
    assert out[True].loc[2, "finish_time"] - out[False].loc[2, "finish_time"] == pytest.approx(STEP)


def test_a_seat_held_with_nothing_else_to_run_is_given_back_at_once():
    # one seat: the schedule after the last step finds it held and nothing to run, so the finished
    # request's outputs are processed and the next one starts at once, as vLLM's engine does
    raw = scenario(True).model_dump(mode="json", exclude_none=True)
    raw["scheduler"]["max_num_seqs"] = 1
    reqs = [Request(0, 0.0, 16, 3), Request(1, 0.0, 16, 5)]
    df = simulate(scenario_from_dict(raw), requests=reqs, progress=False).requests_df
    assert df.loc[1, "first_scheduled_time"] == pytest.approx(3 * STEP)


def test_the_preset_schedules_synchronously_unless_told_so():
    raw = scenario(False).model_dump(mode="json", exclude_none=True)
    del raw["scheduler"]["async_scheduling"]
    default = simulate(scenario_from_dict(raw), requests=requests(), progress=False).requests_df
    sync = simulate(scenario(False), requests=requests(), progress=False).requests_df
    asyn = simulate(scenario(True), requests=requests(), progress=False).requests_df
    assert default["first_token_time"].equals(sync["first_token_time"])
    assert not default["first_token_time"].equals(asyn["first_token_time"])


class HostAndDevice:
    """A step costs ``device`` seconds on the device plus ``host`` on the CPU (the loop_overhead)."""

    def __init__(self, device: float, host: float) -> None:
        self.device, self.host = device, host

    def iteration_time(self, q_lens, ctx_lens, swap_bytes=0.0):  # noqa: ANN001
        return self.device + self.host if len(q_lens) else 0.0

    def loop_overhead(self, rows: int) -> float:
        return self.host


@pytest.mark.parametrize("device, host, sync, overlapped", [
    (0.020, 0.002, 0.022, 0.020),  # the GPU is the bottleneck: host time disappears
    (0.001, 0.003, 0.004, 0.003),  # a tiny step: the CPU is, and sets the pace
])
def test_overlapped_host_time_makes_a_step_the_longer_of_host_and_device(device, host, sync, overlapped):
    batch = Batch.of([Request(0, 0.0, 10, 2)], [10], [0])
    cost = HostAndDevice(device, host)
    assert SimExecutor(cost, 1.0).run(batch) == pytest.approx(sync)
    assert SimExecutor(cost, 1.0, overlap_host=True).run(batch) == pytest.approx(overlapped)
    assert SimExecutor(ConstantCostModel(STEP), 1.0, overlap_host=True).run(batch) == pytest.approx(STEP)
