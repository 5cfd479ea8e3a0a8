"""Multi-turn sessions: closed loop per session, prompts that resend the conversation, cache hits on it."""

from __future__ import annotations

import pytest
from servesim.sim.scenario import scenario_from_dict
from servesim.sim.simulate import simulate
from servesim.sim.workload import WorkloadConfig, generate_requests


def session_scenario(num_sessions=8, turns=None, **sessions):
    return scenario_from_dict({
        "name": "s", "seed": 1, "cost_model": {"type": "roofline"},
        "kv_cache": {"block_size": 16, "num_blocks": 4000, "enable_prefix_caching": True},
        "workload": {
            "num_requests": num_sessions, "arrival": {"process": "poisson", "rate": 2.0},
            "prompt_len": {"dist": "uniform", "min": 20, "max": 200},
            "output_len": {"dist": "uniform", "min": 5, "max": 100},
            "sessions": {"turns": turns or {"dist": "uniform", "min": 1, "max": 5}, **sessions},
        },
    })


def test_next_turn_is_sent_think_time_after_the_previous_reply_ends():
    res = simulate(session_scenario(think_time_s=1.5, think_time_dist="fixed"), progress=False)
    followed = [r for r in res.requests if r.next_turn is not None]
    assert followed
    for r in followed:
        assert r.next_turn.arrival_time == pytest.approx(r.finish_time + 1.5)
        assert r.next_turn.first_scheduled_time >= r.finish_time + 1.5


def test_each_turn_resends_the_conversation_so_far():
    cfg = WorkloadConfig.model_validate({
        "num_requests": 5, "arrival": {"process": "constant", "rate": 1.0}, "prompt_len": 30,
        "output_len": {"dist": "uniform", "min": 5, "max": 50},
        "sessions": {"turns": 4, "system_prompt_len": 100}})
    reqs = generate_requests(cfg, 0)
    assert len(reqs) == 20
    for r in reqs:
        if r.next_turn is not None:
            assert r.next_turn.prompt_len == r.prompt_len + r.output_len + 30
            assert r.next_turn.segments[: len(r.segments)] == r.segments  # prompt + reply, then the new message


def test_a_second_turn_finds_the_first_turns_prompt_and_reply_in_the_cache():
    cfg = session_scenario(1, 2, think_time_s=0.5, think_time_dist="fixed", system_prompt_len=0)
    res = simulate(cfg, progress=False)
    first, second = res.requests
    # KV of all of turn 1's tokens but its last sampled one, in full 16-token blocks
    expected = min((first.prompt_len + first.output_len - 1) // 16, (second.prompt_len - 1) // 16) * 16
    assert second.num_cached_tokens == expected > 0
    assert first.num_cached_tokens == 0


def test_sessions_refuse_a_trace_or_token_ids():
    with pytest.raises(Exception, match="sessions build their own prompts; remove token_ids"):
        WorkloadConfig.model_validate({"num_requests": 1, "arrival": {"process": "poisson", "rate": 1},
                                       "prompt_len": 5, "output_len": 5, "token_ids": True,
                                       "sessions": {"turns": 2}})


def test_a_long_conversation_holds_its_history_once_not_once_per_turn():
    # each turn's segments are a view of the session's one history list: T turns hold O(T) runs,
    # where copies held T**2 (2000 turns x 500 sessions took 14 GB)
    cfg = WorkloadConfig.model_validate({
        "num_requests": 1, "arrival": {"process": "constant", "rate": 1.0}, "prompt_len": 30, "output_len": 5,
        "sessions": {"turns": 2000, "system_prompt_len": 100}})
    reqs = generate_requests(cfg, 0)
    assert len({id(r.segments._runs) for r in reqs}) == 1
    assert len(reqs[0].segments._runs) == 1 + 2 * 2000
    last = reqs[-1]
    assert len(last.segments) == 1 + 2 * 2000 and list(last.segments)[:3] == [(1, 100), (2, 30), (3, 5)]
    assert reqs[1].segments == list(reqs[2].segments)[:5]


def test_more_turns_than_the_host_can_hold_are_refused_naming_turns():
    from servesim.sim.scenario import ScenarioError

    with pytest.raises(ScenarioError, match=r"workload\.sessions\.turns: .* requests need .* at most \d+ turns"):
        session_scenario(num_sessions=500, turns=2**32)


def test_plan_windows_cover_many_conversations_unless_duration_is_given():
    # a window shorter than a conversation never reaches steady load: plan found 8.0 starts/s at
    # --tolerance 0.3 and 1.83 at 0.05 on multi-turn-chat.yaml before this floor
    from pathlib import Path

    from servesim.sim.scenario import load_scenario
    from servesim.sim.verbs.plan import SESSION_WINDOWS, PlanSettings
    from servesim.sim.verbs.slo import parse_slo

    root = Path(__file__).resolve().parent.parent
    chat = load_scenario(root / "scenarios/cluster/multi-turn-chat.yaml")  # turns 2..12, think 8 s
    st = PlanSettings(parse_slo(["p99_ttft_ms=500"]), tolerance=0.3)
    assert st.base_window_s < 100 and st.for_scenario(chat).base_window_s == SESSION_WINDOWS * 7 * 8.0
    given = PlanSettings(parse_slo(["p99_ttft_ms=500"]), window_s=30.0)
    assert given.for_scenario(chat).base_window_s == 30.0
    plain = load_scenario(root / "scenarios/quickstart.yaml")
    assert st.for_scenario(plain).base_window_s == st.base_window_s
