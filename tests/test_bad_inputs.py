"""Every bad input fails cleanly: exit 2, one line naming the field or file, no traceback, no results.

The corpus (``bad_input_corpus.py``) mutates every shipped scenario field by field and adds broken
files, malformed options and the cases of issue #15; each case drives the CLI in this process
(``main(argv)``), so the whole table runs in seconds. A few cases also run as real processes, to
check the exit status the shell sees. The validation layer's own rules (every section inherits
``ConfigModel``; the host-memory bounds) are checked directly below.
"""

from __future__ import annotations

import contextlib
import copy
import io
import signal
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import yaml
from bad_input_corpus import QUICKSTART, SCENARIOS, Case, corpus, counts
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel
from servesim.sim.cli import main
from servesim.sim.config_model import INT_MAX, ConfigModel
from servesim.sim.host_memory import BLOCK_BYTES, REQUEST_BYTES, ROW_BYTES, Demand, over_host_memory
from servesim.sim.kv_cache import BlockManager
from servesim.sim.scenario import Scenario, ScenarioError, _models_in, load_scenario
from servesim.sim.schedulers.running import RunningTable
from servesim.sim.workload import generate_requests

# a case the CLI accepts would run a simulation: stop it rather than wait
CASE_SECONDS = 20


class _TookTooLong(Exception):
    pass


def run_case(argv: list[str] | tuple[str, ...]) -> tuple[int, str]:
    """(exit status, stderr) of ``servesim ARGV`` run in this process."""
    err, out = io.StringIO(), io.StringIO()

    def stop(*_: object) -> None:
        raise _TookTooLong

    old = signal.signal(signal.SIGALRM, stop)
    signal.alarm(CASE_SECONDS)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            try:
                code = main(list(argv))
            except SystemExit as e:  # argparse's own usage errors
                code = e.code if isinstance(e.code, int) else 2
    except _TookTooLong:
        code = -1
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    return code, err.getvalue()


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> list[Case]:
    found = corpus(tmp_path_factory.mktemp("bad-inputs"))
    print("\nbad-input corpus, cases per category:",
          ", ".join(f"{k} {v}" for k, v in sorted(counts(found).items())), f"(total {len(found)})")
    return found


def problems(case: Case) -> list[str]:
    """What is wrong with how the CLI handled ``case`` (empty when it failed cleanly)."""
    code, stderr = run_case(case.argv)
    lines = stderr.strip().splitlines()
    found = []
    if code == -1:
        return [f"accepted: still running after {CASE_SECONDS} s"]
    if code != 2:
        found.append(f"exit {code}, not 2")
    if "Traceback" in stderr:
        found.append("traceback")
    if len(lines) != 1:
        found.append(f"{len(lines)} lines on stderr")
    missing = [n for n in case.names if n not in stderr]
    if missing:
        found.append(f"does not name {missing}")
    try:
        left = bool(case.out) and (Path(case.out) / "summary.json").exists()
    except OSError:  # an --out no file system takes (what the case is about)
        left = False
    if left:
        found.append("left a summary.json")
    return found


def test_corpus_covers_every_verb_and_category(cases: list[Case]) -> None:
    c = counts(cases)
    assert len(cases) >= 300
    for verb in ("run", "plan", "sweep", "compare", "engines", "validate", "calibrate"):
        assert c[f"verb:{verb}"] >= 3, verb
    for category in ("bool_for_number", "non_finite", "huge", "negative", "wrong_type", "misspelt_key",
                     "bad_enum", "bad_file", "bad_data_file", "set_syntax", "grid_syntax", "verb_options", "out_of_range", "issue_15"):
        assert c[category] >= 3, category
    assert {p.name for p in SCENARIOS} <= {Path(a).name for case in cases for a in case.argv}


# The per-field mutations are many (every numeric field of every shipped scenario); the default
# suite runs every SAMPLE-th of each such category and every other case, the slow suite all of them.
MUTATIONS = {"bool_for_number", "non_finite", "huge", "negative", "wrong_type", "misspelt_key", "bad_enum",
             "missing_required"}
SAMPLE = 4


def default_share(cases: list[Case]) -> list[Case]:
    seen: dict[str, int] = {}
    keep = []
    for case in cases:
        i = seen[case.category] = seen.get(case.category, -1) + 1
        if case.category not in MUTATIONS or i % SAMPLE == 0:
            keep.append(case)
    return keep


def test_default_share_still_covers_every_verb_and_category(cases: list[Case]) -> None:
    share = default_share(cases)
    c, full = counts(share), counts(cases)
    assert len(share) >= 300 and set(c) == set(full)
    print(f"\ndefault share: {len(share)} of {len(cases)} cases:", ", ".join(f"{k} {v}" for k, v in sorted(c.items())))


def test_every_bad_input_fails_with_one_line_naming_it(cases: list[Case]) -> None:
    check_all(default_share(cases))


@pytest.mark.slow
def test_every_bad_input_of_the_full_corpus_fails_cleanly(cases: list[Case]) -> None:
    check_all(cases)


def check_all(cases: list[Case]) -> None:
    failures = []
    for case in cases:
        wrong = problems(case)
        if wrong:
            failures.append(f"{' '.join(case.argv)}: {'; '.join(wrong)}")
    assert not failures, f"{len(failures)} of {len(cases)} cases:\n" + "\n".join(failures[:40])


@pytest.mark.parametrize("argv", [
    ["run", str(QUICKSTART), "--set", "seed=-1", "--no-plots", "--quiet"],
    ["run", str(QUICKSTART.parent / "engines" / "tensorrt-llm.yaml"), "--set", "scheduler.enable_chunked_prefill=true",
     "--set", "scheduler.max_num_tokens=31", "--no-plots", "--quiet"],
    ["engines", str(QUICKSTART), "--presets", "", "--quiet"],
])
def test_a_real_process_exits_2_with_one_line(argv: list[str], tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "servesim.sim.cli", *argv, "--out", str(tmp_path / "o")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert not (tmp_path / "o").exists()


# ---- the validation layer itself ------------------------------------------------------------------
def _section_models() -> set[type[BaseModel]]:
    seen: set[type[BaseModel]] = set()
    todo: list[type[BaseModel]] = [Scenario]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        for field in m.model_fields.values():
            todo.extend(model for model, _ in _models_in(field.annotation))
    return seen


def test_every_scenario_section_inherits_the_validation_rules() -> None:
    models = _section_models()
    assert len(models) > 15  # the walk reaches the policies, the presets and the workload parts
    # the unknown-name placeholders of the scheduler union validate nothing: they only raise
    escaped = [m.__name__ for m in models if not issubclass(m, ConfigModel) and m.__name__ != "Unknown"]
    assert not escaped, f"scenario sections that skip sim/config_model.py's rules: {escaped}"


@pytest.mark.parametrize("override, says", [
    ("workload.prompt_len.min=true", "expected a number, got true"),
    ("scheduler.max_num_batched_tokens=false", "expected a number, got false"),
    ("kv_cache.gpu_memory_utilization=.nan", "finite"),
    ("kv_cache.block_size=5000000000", "less than or equal to 4096"),  # its own bound wins
    ("workload.output_len.max=5000000000", f"at most {INT_MAX}"),
])
def test_rules_apply_to_fields_that_declare_nothing_about_them(override: str, says: str) -> None:
    with pytest.raises(ScenarioError, match=says):
        load_scenario(QUICKSTART, [override])


def test_booleans_stay_legal_where_a_field_is_a_flag() -> None:
    sc = load_scenario(QUICKSTART, ["kv_cache.enable_prefix_caching=true", "workload.token_ids=true"])
    assert sc.kv_cache.enable_prefix_caching and sc.workload.token_ids


def test_every_whole_number_field_reads_a_float_without_a_fraction_alike() -> None:
    # seed refused 1.0 (a strict field, once the guard against true) where num_requests took 10.0
    sc = load_scenario(QUICKSTART, ["seed=1.0", "workload.num_requests=10.0"])
    assert (sc.seed, sc.workload.num_requests) == (1, 10) and type(sc.seed) is int
    assert sc == load_scenario(QUICKSTART, ["seed=1", "workload.num_requests=10"])
    for item in ("seed=1.5", "workload.num_requests=10.5"):
        with pytest.raises(ScenarioError, match="fractional part"):
            load_scenario(QUICKSTART, [item])


def test_host_memory_names_the_largest_demand_and_its_limit() -> None:
    demands = [Demand("scheduler.max_num_seqs", "running-table rows", 1000, 64),
               Demand("workload.num_requests", "requests", 10**6, 1000)]
    field, reason = over_host_memory(demands, host=10**8)
    assert field == "workload.num_requests" and "at most 99936" in reason
    assert over_host_memory(demands, host=10**10) is None


def test_host_memory_blames_the_replica_count_when_one_replica_fits() -> None:
    demands = [Demand("kv_cache.num_blocks", "KV blocks", 1000, 50, per=10**6)]
    field, reason = over_host_memory(demands, host=10**9)
    assert field == "cluster.num_replicas" and "at most 20000" in reason


def test_bytes_per_item_do_not_overstate_what_servesim_allocates() -> None:
    # the bound refuses only what would certainly not fit: each constant is at most what is measured
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        table = RunningTable(100_000)
        row = (tracemalloc.get_traced_memory()[0] - base) / 100_000
        base = tracemalloc.get_traced_memory()[0]
        kv = BlockManager(100_000, 16, num_host_blocks=100_000)
        block = (tracemalloc.get_traced_memory()[0] - base) / 200_000
        sc = load_scenario(QUICKSTART, ["workload.num_requests=2000"])
        base = tracemalloc.get_traced_memory()[0]
        reqs = generate_requests(sc.workload, 0)
        request = (tracemalloc.get_traced_memory()[0] - base) / len(reqs)
    finally:
        tracemalloc.stop()
    assert table.ints.size and kv.num_blocks
    assert 0.5 * ROW_BYTES <= row <= 1.5 * ROW_BYTES
    assert 0.5 * BLOCK_BYTES <= block <= 1.5 * BLOCK_BYTES
    # a generated Request is a part of REQUEST_BYTES (its latencies and result row are the rest)
    assert request < REQUEST_BYTES and np.isfinite(request)


def test_the_checker_flags_an_input_the_cli_accepts(tmp_path: Path) -> None:
    # a valid scenario (3 requests) must be reported as not failing cleanly: the checks can fail
    out = tmp_path / "ok"
    case = Case("valid", ("run", str(QUICKSTART), "--set", "workload.num_requests=3", "--no-plots", "--quiet",
                          "--out", str(out)), ("workload.num_requests",))
    wrong = problems(case)
    assert "exit 0, not 2" in wrong and "left a summary.json" in wrong


ENGINES = QUICKSTART.parent / "engines"


@pytest.mark.parametrize("size", [0, -1])
def test_sglang_chunked_prefill_size_at_most_zero_turns_chunking_off(size: int) -> None:
    # SGLang's scheduler: "if self.chunked_prefill_size <= 0: # -1 means disable"
    sc = load_scenario(ENGINES / "sglang.yaml", [f"scheduler.chunked_prefill_size={size}"])
    assert sc.policy.chunked is False and sc.scheduler.chunked_prefill_size == size
    assert load_scenario(ENGINES / "sglang.yaml").policy.chunked is True


def test_tensorrt_llm_chunking_with_a_budget_of_one_block_finishes_every_request() -> None:
    from servesim.sim.simulate import simulate

    sc = load_scenario(ENGINES / "tensorrt-llm.yaml", ["scheduler.enable_chunked_prefill=true",
                                                      "scheduler.max_num_tokens=32", "workload.num_requests=20"])
    result = simulate(sc, progress=False)
    assert result.summary["completed"] == 20
    with pytest.raises(ScenarioError, match=r"scheduler\.max_num_tokens: 31 tokens is less than one chunk unit"):
        load_scenario(ENGINES / "tensorrt-llm.yaml", ["scheduler.enable_chunked_prefill=true",
                                                     "scheduler.max_num_tokens=31"])


# ---- property: any value at any field either validates into sane numbers or is one clean line ------
def _numbers_in(model: BaseModel) -> list[tuple[str, object]]:
    out: list[tuple[str, object]] = []
    for name in type(model).model_fields:
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            out += [(f"{name}.{k}", v) for k, v in _numbers_in(value)]
        elif isinstance(value, dict):
            out += [(f"{name}.{k}", v) for k, v in value.items()]
        elif isinstance(value, list | tuple):
            out += [(f"{name}.{i}", v) for i, v in enumerate(value)]
        else:
            out.append((name, value))
    return out


HOSTILE = st.one_of(
    st.booleans(), st.none(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8),
    st.lists(st.one_of(st.booleans(), st.integers(), st.floats()), max_size=3),
    st.dictionaries(st.sampled_from(["a", "min", "rate", "dist", "process"]), st.integers(), max_size=2),
)
RAW = {p.name: (p, yaml.safe_load(p.read_text())) for p in SCENARIOS if "live" not in p.name}


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_any_value_at_any_field_validates_sanely_or_fails_in_one_line(data: st.DataObject) -> None:
    from bad_input_corpus import _leaves, _sections
    from servesim.sim.scenario import scenario_from_dict

    name = data.draw(st.sampled_from(sorted(RAW)))
    raw = copy.deepcopy(RAW[name][1])
    path = data.draw(st.sampled_from([p for p, _ in _leaves(raw)] + [p for p in _sections(raw) if p]))
    node = raw
    *parents, last = path.split(".")
    for part in parents:
        node = node[part]
    node[last] = data.draw(HOSTILE)
    try:
        sc = scenario_from_dict(raw, source=name)
    except ScenarioError as e:
        text = str(e)
        assert "\n" not in text and text.startswith(f"{name}: ") and path.split(".")[0] in text
        return
    for where, value in _numbers_in(sc):
        if isinstance(value, float):
            assert np.isfinite(value), where
        if isinstance(value, int) and not isinstance(value, bool):
            assert abs(value) <= 2**63 - 1, where
