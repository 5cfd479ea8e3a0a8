"""Random valid scenarios keep the run invariants (``random_scenarios.py`` says which and how)."""

from __future__ import annotations

import pytest
from random_scenarios import knobs_scenario, problems, round_trip, scenario, session_scenario, trace_scenario

# Default seeds per generator: those whose scenarios broke a run before their fix, then a spread.
# scenario: a swapped-out request waiting for blocks that queued transferred requests held (32); a
# preempted one queued ahead of them (2271); SGLang pools (2362); static batches that could not
# reserve beside them (3179). traces: an HF prefill instance short of blocks while its prompts
# waited for their transfer (52); an Azure trace with stamps with and without fractions (71).
# sessions: a disaggregated cluster's one-token turn, answered in the prefill pool, crashed the
# release of the next turn (187). knobs: under async scheduling a transferred request reached the
# decode queue behind a request preempted meanwhile (386).
DEFAULT = {
    "scenario": [32, 2271, 2362, 3179, *range(0, 200, 10)],
    "traces": [52, 71, *range(0, 100, 10)],
    "sessions": [187, *range(0, 100, 10)],
    "knobs": [386, *range(0, 100, 10)],
}
MORE = {"scenario": range(200), "traces": range(100), "sessions": range(100), "knobs": range(100)}


def _raw(kind: str, seed: int, tmp_path):
    if kind == "traces":
        return trace_scenario(seed, tmp_path)
    return {"scenario": scenario, "sessions": session_scenario, "knobs": knobs_scenario}[kind](seed)


def _cases(table: dict, skip: dict | None = None) -> list[tuple[str, int]]:
    return [(kind, s) for kind, seeds in table.items() for s in seeds if not skip or s not in skip[kind]]


@pytest.mark.parametrize("kind, seed", _cases(DEFAULT))
def test_random_scenario_keeps_the_invariants(kind, seed, tmp_path):
    raw = _raw(kind, seed, tmp_path)
    found = problems(raw)
    assert not found, f"{kind} seed {seed}: {found}\n{raw}"


@pytest.mark.slow
@pytest.mark.parametrize("kind, seed", _cases(MORE, DEFAULT))
def test_more_random_scenarios_keep_the_invariants(kind, seed, tmp_path):
    test_random_scenario_keeps_the_invariants(kind, seed, tmp_path)


# 258 and 285 put two arrivals within a nanosecond, which workload.csv rounded into one instant
@pytest.mark.parametrize("seed", [0, 3, 7, 258, 285])
def test_validate_against_reproduces_its_own_random_run(seed, tmp_path):
    assert round_trip(seed, tmp_path) in ([], None)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(8, 48))
def test_validate_against_reproduces_more_of_its_own_random_runs(seed, tmp_path):
    test_validate_against_reproduces_its_own_random_run(seed, tmp_path)
