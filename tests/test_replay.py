"""The dynamics check (``validate --replay-steps``): a run's own steps, replayed, reproduce it exactly;
a record that the engine loop would not have produced is reported at its first divergent step."""

from __future__ import annotations

import contextlib
import io
import json
import sys
import time
import types
from dataclasses import replace

import numpy as np
import pytest
import simpy
import simpy.rt
import yaml
from servesim.calibration.replay import StepTrace, check_dynamics, divergence_line, format_dynamics
from servesim.sim.cli import main
from servesim.sim.cost_model import build_cost_model
from servesim.sim.engine import SimExecutor
from servesim.sim.presets import get_hardware, get_model
from servesim.sim.scenario import scenario_from_dict
from servesim.sim.simulate import build_scheduler, finish_run, plan_kv, run_replicas
from servesim.sim.workload import generate_requests


def scenario(**over):
    """Chunked prefill on a cache small enough to preempt, Poisson arrivals: dynamics worth replaying."""
    d = {
        "name": "replay-test",
        "seed": 7,
        "model": "tiny",
        "hardware": "cpu-2core",
        "scheduler": {"type": "chunked", "max_num_seqs": 8, "max_num_batched_tokens": 64},
        "kv_cache": {"block_size": 8, "num_blocks": 20},
        "live": {"threads": 2, "warmup_steps": 0},
        "workload": {
            "num_requests": 40,
            "arrival": {"process": "poisson", "rate": 400.0},
            "prompt_len": {"dist": "uniform", "min": 9, "max": 60},
            "output_len": {"dist": "uniform", "min": 4, "max": 30},
        },
    }
    d.update(over)
    return scenario_from_dict(d)


class RowRecorder:
    """Wraps an executor and records each step's rows, as the live executor does."""

    def __init__(self, inner) -> None:  # noqa: ANN001
        self.inner = inner
        self.shapes, self.ids = [], []

    def run(self, batch) -> float:  # noqa: ANN001
        self.shapes.append((batch.num_new_tokens.copy(), batch.num_context_tokens.copy()))
        self.ids.append(np.array([r.request_id for r in batch.requests], dtype=np.int64))
        return self.inner.run(batch)


class SleepingExecutor:
    """A forward that really takes time: 1 ms plus 20 us a token, slept."""

    def run(self, batch) -> float:  # noqa: ANN001
        seconds = 1e-3 + 2e-5 * int(batch.num_new_tokens.sum())
        time.sleep(seconds)
        return seconds


def recorded_run(sc, env, executor, requests=None):  # noqa: ANN001, ANN201
    """One replica of ``sc`` on ``env``; the RunResult carries its steps as a live run's does."""
    kv = plan_kv(sc)
    if requests is None:
        requests = generate_requests(sc.workload, sc.seed)
    for r in requests:
        r.reset_progress()
    rec = RowRecorder(executor)
    recorder, _ = run_replicas(env, sc, requests, lambda _r: (build_scheduler(sc, kv), rec), False)
    run = finish_run(sc, "live", requests, recorder, kv, 0.0)
    run.step_shapes, run.step_request_ids = rec.shapes, rec.ids
    return run, requests


def simulated_run(sc, requests=None):  # noqa: ANN001, ANN201
    cost = build_cost_model(sc.cost_model, get_model(sc.model), get_hardware(sc.hardware), sc.tensor_parallel)
    run, requests = recorded_run(sc, simpy.Environment(), SimExecutor(cost, plan_kv(sc).block_bytes), requests)
    return sc, run, requests


@pytest.fixture(scope="module")
def simulated():
    sc, run, requests = simulated_run(scenario())
    assert run.iterations_df["num_preempted"].sum() > 0  # the replay has preemptions to get right
    return sc, run, requests


def test_replaying_a_simulated_runs_own_steps_reproduces_every_request_exactly(simulated):
    sc, run, requests = simulated
    check = check_dynamics(sc, requests, StepTrace.of_run(run), run.requests_df)
    assert check.passed, format_dynamics(check)
    assert check.num_replayed == check.num_steps == len(run.iterations_df)
    assert check.num_requests == len(requests)
    assert check.max_ttft_diff_s == 0.0 and check.max_e2e_diff_s == 0.0
    assert check.run.iterations_df.equals(run.iterations_df)


def test_replaying_a_real_time_run_reproduces_it_although_arrivals_land_inside_steps():
    # the live clock: steps that really take time, requests that arrive during them and while idle
    sc = scenario(workload={"num_requests": 24, "arrival": {"process": "poisson", "rate": 150.0},
                            "prompt_len": {"dist": "uniform", "min": 9, "max": 60},
                            "output_len": {"dist": "uniform", "min": 2, "max": 8}})
    env = simpy.rt.RealtimeEnvironment(strict=False)
    env.sync()
    run, requests = recorded_run(sc, env, SleepingExecutor())
    it = run.iterations_df
    ends = (it["start"] + it["duration"]).to_numpy()
    arrivals = run.requests_df["arrival_time"].to_numpy()
    inside = ((arrivals[:, None] > it["start"].to_numpy()) & (arrivals[:, None] < ends)).any(axis=1)
    assert inside.any() and not inside.all()  # some arrived during a step, some to an idle replica
    # each recorded duration holds the host time up to the end of the forward, not just the sleep
    slept = 1e-3 + 2e-5 * it["num_tokens"].to_numpy()
    assert (it["duration"].to_numpy() > slept).all()
    check = check_dynamics(sc, requests, StepTrace.of_run(run), run.requests_df)
    assert check.passed, format_dynamics(check)
    assert check.max_ttft_diff_s == 0.0 and check.max_e2e_diff_s == 0.0


def _copy(trace: StepTrace) -> StepTrace:
    return replace(trace, start=trace.start.copy(), duration=trace.duration.copy(),
                   request_ids=[a.copy() for a in trace.request_ids],
                   num_new_tokens=[a.copy() for a in trace.num_new_tokens],
                   num_context_tokens=[a.copy() for a in trace.num_context_tokens])


def test_a_different_row_is_the_first_divergence_with_both_batches_printed(simulated):
    sc, run, requests = simulated
    trace = _copy(StepTrace.of_run(run))
    k = len(trace) // 2
    row = len(trace.request_ids[k]) - 1
    trace.num_context_tokens[k][row] += 1
    rid = int(trace.request_ids[k][row])
    check = check_dynamics(sc, requests, trace, run.requests_df)
    d = check.divergence
    assert not check.passed and check.run is None
    assert (d.step, d.request_id, check.num_replayed) == (k, rid, k)
    assert d.live_start == d.sim_start == run.iterations_df["start"].iloc[k]
    text = format_dynamics(check)
    assert f"DIVERGED at step {k} of {len(trace)}: the batches differ; first request {rid}" in text
    live_line, sim_line = (line for line in text.splitlines() if line.startswith(("  live:", "  sim:")))
    assert f"{rid}:" in live_line and f"{rid}:" in sim_line and "*" in live_line and "*" in sim_line
    assert divergence_line(check).startswith(f"dynamics: the replay diverged from the live run at step {k}, "
                                             f"request {rid}")


def test_a_longer_step_lets_the_next_one_admit_the_requests_that_arrived_meanwhile():
    # a consistent record of another run: step k took `extra` seconds more and everything after
    # started that much later; the replay sees more arrivals at step k + 1 than the record does
    light = {"num_requests": 40, "arrival": {"process": "poisson", "rate": 100.0},
             "prompt_len": {"dist": "uniform", "min": 9, "max": 60}, "output_len": {"dist": "uniform", "min": 4, "max": 30}}
    sc, run, requests = simulated_run(scenario(kv_cache={"block_size": 8, "num_blocks": 400}, workload=light))
    trace = _copy(StepTrace.of_run(run))
    arrivals = run.requests_df.set_index("request_id")["arrival_time"]
    ends = trace.start + trace.duration
    extra = 0.01
    # the first step an arrival follows closely, with nobody waiting: the next step would admit it
    k = next(i for i in range(len(trace) - 1) if ((arrivals > ends[i]) & (arrivals < ends[i] + extra)).any()
             and run.iterations_df["num_waiting"].iloc[i] == 0)
    trace.duration[k] += extra
    trace.start[k + 1:] += extra
    check = check_dynamics(sc, requests, trace, run.requests_df)
    d = check.divergence
    assert d is not None and d.step == k + 1, format_dynamics(check)
    new = {r for r, _, _ in d.sim_rows} - {r for r, _, _ in d.live_rows}
    assert new and all(ends[k] < arrivals[r] <= ends[k] + extra for r in new)


def test_a_shifted_start_is_reported_as_a_time_divergence(simulated):
    sc, run, requests = simulated
    trace = _copy(StepTrace.of_run(run))
    k = 3
    trace.start[k] += 1e-6
    d = check_dynamics(sc, requests, trace, run.requests_df).divergence
    assert d.step == k and d.reason.startswith("the step starts -0.000001000 s from live")
    assert d.live_rows == d.sim_rows


def test_a_step_more_or_less_than_live_ran_is_a_divergence(simulated):
    sc, run, requests = simulated
    trace = StepTrace.of_run(run)
    n = len(trace)
    short = replace(trace, start=trace.start[:-1], duration=trace.duration[:-1], request_ids=trace.request_ids[:-1],
                    num_new_tokens=trace.num_new_tokens[:-1], num_context_tokens=trace.num_context_tokens[:-1])
    d = check_dynamics(sc, requests, short, run.requests_df).divergence
    assert d.step == n - 1 and d.live_rows is None and "live never ran" in d.reason
    longer = replace(trace, start=np.append(trace.start, trace.start[-1] + 1.0),
                     duration=np.append(trace.duration, 1.0), request_ids=[*trace.request_ids, trace.request_ids[-1]],
                     num_new_tokens=[*trace.num_new_tokens, trace.num_new_tokens[-1]],
                     num_context_tokens=[*trace.num_context_tokens, trace.num_context_tokens[-1]])
    check = check_dynamics(sc, requests, longer, run.requests_df)
    assert check.divergence.step == n and check.divergence.sim_rows is None
    assert f"finished after {n} steps; live ran {n + 1}" in check.divergence.reason


def test_matching_steps_with_other_request_times_name_the_first_such_request(simulated):
    sc, run, requests = simulated
    reference = run.requests_df.copy()
    late = reference.index[5]
    reference.loc[late:, "e2e"] += 1e-3  # requests 5 onwards finished 1 ms later in the "live" record
    check = check_dynamics(sc, requests, StepTrace.of_run(run), reference)
    d = check.divergence
    assert d.request_id == int(reference.loc[late, "request_id"]) and d.step == check.num_steps
    assert check.max_e2e_diff_s == pytest.approx(1e-3) and check.max_ttft_diff_s == 0.0


def test_a_run_without_recorded_rows_cannot_be_replayed(simulated):
    sc, run, requests = simulated
    with pytest.raises(Exception, match="needs a live run of one replica"):
        StepTrace.of_run(replace(run, step_request_ids=None))


# ---- the command line ------------------------------------------------------------------------------
@pytest.mark.parametrize("extra, message", [
    (["--repeats", "2"], "--replay-steps replays one live run, its own steps; drop --repeats 2"),
    (["--set", "cluster.num_replicas=2"], "--replay-steps replays one replica's steps; cluster.num_replicas is 2"),
])
def test_replay_steps_with_what_it_cannot_replay_exits_2_before_running(tmp_path, capsys, extra, message):
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(scenario().model_dump(mode="json", exclude_none=True)))
    out = tmp_path / "out"
    assert main(["validate", str(path), "--out", str(out), "--replay-steps", *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"servesim validate: error: {message}")
    assert not out.exists()


def stand_in_for_live_mode(monkeypatch, **scheduler):  # noqa: ANN001
    """``run_live`` replaced by a recorded simulation (no torch); ``scheduler`` overrides give the stand-in
    an engine loop that decides differently from the simulator's."""
    def run_live(sc, requests, progress=None):  # noqa: ANN001, ANN202
        sc = sc.model_copy(update={"scheduler": sc.scheduler.model_copy(update=scheduler)})
        return simulated_run(sc, requests)[1]

    monkeypatch.setitem(sys.modules, "servesim.kernels.live", types.SimpleNamespace(run_live=run_live))


def validate_cli(tmp_path, capsys):  # noqa: ANN001, ANN201
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(scenario().model_dump(mode="json", exclude_none=True)))
    out = tmp_path / "out"
    rc = main(["validate", str(path), "--out", str(out), "--replay-steps", "--quiet", "--no-plots"])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err, out


def test_validate_replay_steps_passes_and_writes_the_replay_when_the_loops_agree(tmp_path, capsys, monkeypatch):
    stand_in_for_live_mode(monkeypatch)
    rc, stdout, err, out = validate_cli(tmp_path, capsys)
    assert rc == 0, err
    assert "[3/3] replay" in stdout and "dynamics check" in stdout and "identical" in stdout
    doc = json.loads((out / "validation.json").read_text())
    assert doc["passed"] and doc["dynamics"]["passed"] and doc["dynamics"]["max_abs_e2e_diff_s"] == 0.0
    assert (out / "replay" / "requests.parquet").is_file()
    assert "identical" in (out / "validation.md").read_text()


def test_validate_replay_steps_fails_at_the_first_step_another_loop_decided_differently(tmp_path, capsys,
                                                                                       monkeypatch):
    stand_in_for_live_mode(monkeypatch, max_num_seqs=2)  # the "live" loop admits fewer requests at once
    rc, stdout, err, out = validate_cli(tmp_path, capsys)
    assert rc == 1
    doc = json.loads((out / "validation.json").read_text())
    d = doc["dynamics"]["divergence"]
    assert not doc["passed"] and d is not None
    assert len(d["sim_rows"]) > len(d["live_rows"]) == 2  # the first step where the simulator ran more rows
    assert f"DIVERGED at step {d['step']}" in stdout
    fail = [line for line in err.splitlines() if "FAIL dynamics" in line]
    assert len(fail) == 1 and f"at step {d['step']}, request {d['request_id']}" in fail[0]
    assert not (out / "replay").exists()
    assert "**failed**" in (out / "validation.md").read_text()


# ---- live, the four live-cpu scenarios (slow: 30-80 s each measured at load 9 on 2 cores) ----------
@pytest.mark.slow
@pytest.mark.parametrize("name", ["static", "continuous", "chunked", "kv-pressure"])
def test_live_cpu_scenarios_replay_to_identical_ttft_and_e2e(tmp_path, name):
    pytest.importorskip("torch")
    import pandas as pd

    out = tmp_path / name
    n = 24  # a dozen seconds of arrivals; the live run is most of the test's time
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(io.StringIO()):
        rc = main(["validate", f"scenarios/live-cpu-{name}.yaml", "--set", f"workload.num_requests={n}",
                   "--replay-steps", "--quiet", "--no-plots", "--out", str(out)])
    assert rc == 0, stdout.getvalue()
    dyn = json.loads((out / "validation.json").read_text())["dynamics"]
    assert dyn["passed"] and dyn["requests_compared"] == n and dyn["steps_replayed"] == dyn["steps"]
    assert dyn["max_abs_ttft_diff_s"] <= dyn["tolerance_s"] and dyn["max_abs_e2e_diff_s"] <= dyn["tolerance_s"]
    live, replayed = (pd.read_parquet(out / side / "requests.parquet") for side in ("live", "replay"))
    assert np.allclose(live[["ttft", "e2e"]], replayed[["ttft", "e2e"]], rtol=0, atol=dyn["tolerance_s"])
    assert len(pd.read_parquet(out / "replay" / "iterations.parquet")) == dyn["steps"]
    assert "identical" in stdout.getvalue()
