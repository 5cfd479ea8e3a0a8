"""The Mooncake trace reader: 512-token block hashes become prefix-cache keys at any block size."""

from __future__ import annotations

import json

import pytest
from servesim.sim.errors import WorkloadError
from servesim.sim.scenario import scenario_from_dict
from servesim.sim.simulate import simulate

# (input_length, hash_ids): shared system prompt [1, 2], two documents, a partial last block,
# a request whose hashes cover less than its prompt, and one that shares only the first hash
ROWS = [
    (1300, [1, 2, 3]),
    (1500, [1, 2, 4]),
    (1100, [1, 2, 3]),          # the first 1100 tokens of request 0 (block 3 partial, a prefix of it)
    (2000, [1, 2, 4, 5]),       # 464 tokens past its hashes: its own
    (700, [1, 9]),
    (1536, [1, 2, 4]),
]


def write_trace(path, rows=ROWS):
    with path.open("w") as f:
        for i, (n, hashes) in enumerate(rows):
            f.write(json.dumps({"timestamp": i * 20_000, "input_length": n, "output_length": 8,
                                "hash_ids": hashes}) + "\n")
    return path


def tokens(n, hashes, own):
    """The prompt as token ids, built independently: hash h's 512 tokens are h*1000 + 0..511."""
    toks = [h * 1000 + j for h in hashes for j in range(512)][:n]
    return toks + [(-1 - own, j) for j in range(n - len(toks))]


def expected_hits(rows, bs):
    prompts = [tokens(n, h, i) for i, (n, h) in enumerate(rows)]
    out = []
    for i, p in enumerate(prompts):
        best = 0
        for q in prompts[:i]:
            lcp = 0
            while lcp < min(len(p), len(q)) and p[lcp] == q[lcp]:
                lcp += 1
            best = max(best, lcp // bs)  # full blocks of the earlier prompt that match
        out.append(min(best, (len(p) - 1) // bs) * bs)
    return out


@pytest.mark.parametrize("block_size", [512, 256, 16, 48, 1024])
def test_mooncake_trace_replays_with_the_expected_prefix_hits(tmp_path, block_size):
    path = write_trace(tmp_path / "trace.jsonl")
    sc = scenario_from_dict({
        "name": "mc", "cost_model": {"type": "roofline"},
        "kv_cache": {"block_size": block_size, "num_blocks": 100_000 // block_size, "enable_prefix_caching": True},
        "workload": {"trace": {"format": "mooncake", "path": str(path)}},
    })
    res = simulate(sc, progress=False)
    got = [r.num_cached_tokens for r in sorted(res.requests, key=lambda r: r.request_id)]
    assert got == expected_hits(ROWS, block_size)
    assert sum(got) > 0
    assert res.summary["prefix_cache_hit_tokens"] == sum(got)


def test_mooncake_timestamps_are_milliseconds(tmp_path):
    path = write_trace(tmp_path / "trace.jsonl")
    sc = scenario_from_dict({"name": "mc", "cost_model": {"type": "roofline"},
                             "workload": {"trace": {"format": "mooncake", "path": str(path), "time_scale": 0.5}}})
    res = simulate(sc, progress=False)
    assert [r.arrival_time for r in res.requests] == pytest.approx([i * 10.0 for i in range(len(ROWS))])


def test_a_bad_mooncake_line_is_one_error_naming_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1]}\n{"timestamp": 5}\n')
    sc = scenario_from_dict({"name": "mc", "workload": {"trace": {"format": "mooncake", "path": str(path)}}})
    with pytest.raises(WorkloadError, match="line 2 is not a Mooncake record"):
        simulate(sc, progress=False)


def test_a_mooncake_scenario_runs_from_the_cli(tmp_path, capsys):
    # the scenario loader reads every trace when it loads: a Mooncake file must not go to the CSV reader
    from servesim.sim.cli import main

    write_trace(tmp_path / "trace.jsonl")
    (tmp_path / "mc.yaml").write_text("name: mc\ncost_model: {type: roofline}\n"
                                      "kv_cache: {block_size: 16, num_blocks: 6000, enable_prefix_caching: true}\n"
                                      "workload: {trace: {format: mooncake, path: trace.jsonl}}\n")
    assert main(["run", str(tmp_path / "mc.yaml"), "--quiet", "--no-plots", "--out", str(tmp_path / "out")]) == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["completed"] == len(ROWS) and summary["prefix_cache_hit_tokens"] == sum(expected_hits(ROWS, 16))


@pytest.mark.parametrize("line, says", [
    ('{"timestamp": 0, "input_length": true, "output_length": 2, "hash_ids": []}', "input_length must be a finite"),
    ('{"timestamp": 0, "input_length": 1e30, "output_length": 2, "hash_ids": []}', "whole number of tokens"),
    ('{"timestamp": NaN, "input_length": 10, "output_length": 2, "hash_ids": []}', "timestamp must be a finite"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1.5]}', "hash_ids must be integers"),
    ("[1, 2]", "a JSON object per line"),
])
def test_hostile_mooncake_values_are_refused_naming_the_line(tmp_path, line, says):
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    sc = scenario_from_dict({"name": "mc", "workload": {"trace": {"format": "mooncake", "path": str(path)}}})
    with pytest.raises(WorkloadError, match=f"line 1 is not a Mooncake record .*{says}"):
        simulate(sc, progress=False)
