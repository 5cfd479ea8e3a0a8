"""The bad-input corpus: hostile or mistaken inputs to every verb, each of which must fail cleanly.

``corpus(tmp)`` builds the table: mutations of every shipped scenario (each numeric field set to a
boolean, a negative number, inf / nan, a huge integer, a string; a misspelt key at every level of
nesting, tagged unions included; unknown names for every enum), broken files (not UTF-8, UTF-16,
binary, truncated YAML, unsafe tags, not a mapping), malformed ``--set`` / ``--grid`` / verb
options, and every case issue #15 lists. A case is the CLI's argv and the words its one error line
must contain (the field path or the file). ``tests/test_bad_inputs.py`` runs them all;
``python tests/bad_input_corpus.py`` prints how many there are per category.
"""

from __future__ import annotations

import copy
import itertools
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = sorted((ROOT / "scenarios").rglob("*.yaml"))
QUICKSTART = ROOT / "scenarios" / "quickstart.yaml"

# every verb that takes a scenario: argv before the scenario, argv after it
VERBS: dict[str, tuple[list[str], list[str]]] = {
    "run": (["run"], ["--no-plots", "--quiet"]),
    "plan": (["plan"], ["--no-plots", "--quiet", "--workers", "1", "--slo", "p99_ttft_ms=500"]),
    "sweep": (["sweep"], ["--no-plots", "--quiet", "--workers", "1", "--grid", "seed=0,1"]),
    "engines": (["engines"], ["--no-plots", "--quiet", "--presets", "vllm-v1"]),
    "compare": (["compare"], ["--quiet", "--workers", "1", "--seeds", "2"]),
    "validate": (["validate"], ["--no-plots", "--quiet"]),
    "search": (["search"], ["--no-plots", "--quiet", "--workers", "1", "--target-rate", "10",
                            "--slo", "p99_ttft_ms=500", "--space", "seed=0,1"]),
}
# values a numeric field must refuse, by category; -1 is checked only where negatives mean nothing
NUMBER_MUTATIONS = {
    "bool_for_number": ["true", "false"],
    "non_finite": [".inf", ".nan", "-.inf"],
    "huge": ["9223372036854775808", "1.0e30"],
    "wrong_type": ["abc", "[1, 2]", "{a: 1}"],
    "negative": ["-1"],
}
NEGATIVE_MEANS_SOMETHING = {"scheduler.chunked_prefill_size"}  # SGLang: <= 0 turns chunking off
# fields where any finite positive number means something (a rate of 1e18 requests/s all arrive at
# once; an SLO of 1e18 ms is always met): no "huge" case for them
SCALE_FREE = {"rate", "cv", "burstiness", "time_scale", "ttft_ms", "tpot_ms", "e2el_ms", "step_ms",
              "per_token_ms", "step_overhead_ms", "per_seq_overhead_ms",
              "prefix_weight", "load_weight"}  # the prefix_aware router's weights: only their ratio counts
# unknown names for every enum-like field, where the scenario has the section
BAD_ENUMS = {
    "model": "gpt-9", "hardware": "tpu-v9", "scheduler.type": "fifo2", "scheduler.preset": "vllm-v9",
    "scheduler.policy": "lifo", "scheduler.preemption_mode": "swapp", "cost_model.type": "magic",
    "cluster.router": "random", "live.device": "tpu", "live.dtype": "float8", "live.backend": "jax",
    "workload.arrival.process": "poison", "workload.prompt_len.dist": "lognorml",
    "workload.output_len.dist": "unifrom", "workload.trace.format": "parquet",
    "workload.sessions.think_time_dist": "gaussian", "cluster.disagg.link.preset": "carrier-pigeon",
    "cluster.disagg.prefill_router": "random", "cluster.disagg.decode_router": "random",
}

ALWAYS = {"model", "hardware", "cluster", "live", "cost_model"}  # sections --set creates where absent


@dataclass(frozen=True, slots=True)
class Case:
    category: str
    argv: tuple[str, ...]
    names: tuple[str, ...]  # the error line must contain each (a field path, a file)

    @property
    def out(self) -> str | None:
        """The --out folder the case passes, if any (it must hold no summary.json afterwards)."""
        argv = list(self.argv)
        for flag in ("--out",):
            if flag in argv:
                return argv[argv.index(flag) + 1]
        return None


def _leaves(node: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted path, value) of every scalar in a raw scenario mapping."""
    if isinstance(node, dict):
        return [pair for k, v in node.items() for pair in _leaves(v, f"{prefix}{k}.")]
    return [(prefix[:-1], node)]


def _sections(node: Any, prefix: str = "") -> list[str]:
    """Dotted paths of every mapping in a raw scenario, the top level as ''."""
    out = [prefix[:-1]]
    if isinstance(node, dict):
        for k, v in node.items():
            if isinstance(v, dict):
                out += _sections(v, f"{prefix}{k}.")
    return out


def _misspell(key: str) -> str:
    return key[:-1] + "x" + key[-1] if len(key) > 2 else key + "xx"


class _Builder:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.cases: list[Case] = []
        self._verbs = itertools.cycle(VERBS)

    def scenario(self, category: str, path: Path, sets: list[str], names: tuple[str, ...],
                 verb: str | None = None) -> None:
        verb = verb or next(self._verbs)
        before, after = VERBS[verb]
        if verb == "compare":  # the scenario against itself: the baseline is the one that fails
            before = ["compare", str(path)]
        argv = [*before, str(path), *[a for s in sets for a in ("--set", s)], *after,
                "--out", str(self.tmp / f"out{len(self.cases)}")]
        self.cases.append(Case(category, tuple(argv), names))

    def raw(self, category: str, argv: list[str], names: tuple[str, ...], out: bool = True) -> None:
        extra = ["--out", str(self.tmp / f"out{len(self.cases)}")] if out else []
        self.cases.append(Case(category, (*argv, *extra), names))

    def file(self, name: str, data: bytes) -> Path:
        p = self.tmp / name
        p.write_bytes(data)
        return p


def corpus(tmp: Path) -> list[Case]:
    """Every case, with its files written under ``tmp``."""
    b = _Builder(tmp)
    for path in SCENARIOS:
        raw = yaml.safe_load(path.read_text())
        for field, value in _leaves(raw):
            if isinstance(value, bool) or not isinstance(value, int | float):
                continue
            # a boolean for every number; one other category per field, rotating, and one value of
            # it, rotating through the category's values
            others = [c for c in NUMBER_MUTATIONS if c != "bool_for_number"
                      and not (c == "negative" and field in NEGATIVE_MEANS_SOMETHING)
                      and not (c == "huge" and field.rpartition(".")[2] in SCALE_FREE)]
            for category in ("bool_for_number", others[len(b.cases) % len(others)]):
                texts = NUMBER_MUTATIONS[category]
                b.scenario(category, path, [f"{field}={texts[len(b.cases) % len(texts)]}"], (field,))
        for section in _sections(raw):
            node = raw
            for part in filter(None, section.split(".")):
                node = node[part]
            key = next((k for k in node if k not in ("type", "preset", "process", "dist", "format")), None)
            if key is None:
                continue
            wrong = f"{section}.{_misspell(key)}" if section else _misspell(key)
            b.scenario("misspelt_key", path, [f"{wrong}=1"], (wrong,))
        for field, bad in BAD_ENUMS.items():
            parent = field.rpartition(".")[0]
            if (_get(raw, field) is not None or (field.count(".") <= 1 and field.partition(".")[0] in ALWAYS)
                    or (field.count(".") > 1 and _get(raw, parent) is not None)):
                b.scenario("bad_enum", path, [f"{field}={bad}"], (field,))
        b.scenario("missing_required", path, ["workload="], ("workload",))
    _files(b)
    _data_files(b)
    _set_syntax(b)
    _verb_options(b)
    _out_of_range(b)
    _issue_cases(b)
    _measured_runs(b)
    _gpu_profiles(b)
    return b.cases


def _get(raw: Any, dotted: str) -> Any:
    node = raw
    for part in filter(None, dotted.split(".")):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _files(b: _Builder) -> None:
    text = QUICKSTART.read_text()
    bad = {
        "utf16.yaml": text.encode("utf-16"),
        "latin1.yaml": "name: caf\xe9\n".encode("latin-1") + text.encode(),
        "binary.yaml": bytes(range(256)) * 4,
        "truncated.yaml": text.encode()[: text.index("workload:") + 30] + b"{rate: [1,",
        "unsafe-tag.yaml": b"name: !!python/object/apply:os.system ['true']\n" + text.encode(),
        "list.yaml": b"- run\n- this\n",
        "scalar.yaml": b"just a string\n",
        "empty.yaml": b"",
        "tabs.yaml": b"name: x\n\tmodel: tiny\n",
        "duplicate-mapping.yaml": b"workload: [1, 2]\n",
        # YAML would keep the last of a key given twice without a word
        "duplicate-key.yaml": text.encode() + b"\nseed: 1\nseed: 2\n",
    }
    for name, data in bad.items():
        p = b.file(name, data)
        for verb in VERBS:
            b.scenario("bad_file", p, [], (name,), verb=verb)
    for verb in VERBS:
        b.scenario("missing_file", b.tmp / "no-such.yaml", [], ("no-such.yaml",), verb=verb)
    b.raw("missing_file", ["compare", str(QUICKSTART), str(b.tmp / "no-such.yaml"), "--quiet"], ("no-such.yaml",))


def _data_files(b: _Builder) -> None:
    """Broken files a scenario points at: traces (CSV) and cost-model profiles (JSON)."""
    header = b"arrival_time,prompt_len,output_len\n"
    traces = {
        "trace-binary-rows.csv": header + b"0.0,100,20\n\xff\xfe,\x00\x01,5\n",
        "trace-utf16.csv": (header + b"0,1,2\n").decode().encode("utf-16"),
        "trace-empty.csv": b"",
        "trace-header-only.csv": header,
        "trace-bad-time.csv": header + b"0,5,3\nabc,1,2\n",
        "trace-text-length.csv": header + b"0,five,3\n",
        "trace-no-columns.csv": b"a,b\n1,2\n",
        # read as 1 / 0 tokens, and rounded to 101, before
        "trace-bool-length.csv": header + b"0,true,3\n1,false,3\n",
        "trace-fraction-length.csv": header + b"0,100.7,3\n",
    }
    for name, data in traces.items():
        b.file(name, data)
        scenario = b.file(f"uses-{name}.yaml", f"workload:\n  trace: {{format: csv, path: {name}}}\n".encode())
        b.scenario("bad_data_file", scenario, [], (name,))
    # a negative count was dropped as a failed request and reported as "0 response tokens"
    burst = b.file("burstgpt-negative-output.csv", b"Timestamp,Model,Request tokens,Response tokens\n"
                   b"0.0,GPT-4,100,20\n1.0,GPT-4,100,-5\n")
    scenario = b.file("uses-burstgpt-negative-output.yaml",
                      f"workload:\n  trace: {{format: burstgpt, path: {burst.name}}}\n".encode())
    b.scenario("bad_data_file", scenario, [], (burst.name, "line 3", "Response tokens", "negative"))
    b.scenario("bad_data_file", b.file("trace-negative-prompt.yaml", b"workload:\n  trace: {format: csv, path: "
               + b.file("trace-negative-prompt.csv", header + b"0,-3,5\n").name.encode() + b"}\n"), [],
               ("trace-negative-prompt.csv", "line 2", "prompt_len", "negative"))
    record = b'{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}\n'
    mooncake = {  # JSONL (sim/mooncake.py): each line must be a record of finite numbers and integer hashes
        "mooncake-not-json.jsonl": record + b"not json\n",
        "mooncake-missing-field.jsonl": b'{"timestamp": 0, "input_length": 100}\n',
        "mooncake-text-hash.jsonl": b'{"timestamp": 0, "input_length": 100, "output_length": 5, "hash_ids": ["a"]}\n',
        "mooncake-huge-length.jsonl": b'{"timestamp": 0, "input_length": 1e30, "output_length": 5, "hash_ids": []}\n',
        "mooncake-bool-length.jsonl": b'{"timestamp": 0, "input_length": true, "output_length": 5, "hash_ids": []}\n',
        "mooncake-nan-time.jsonl": b'{"timestamp": NaN, "input_length": 100, "output_length": 5, "hash_ids": []}\n',
        "mooncake-array-line.jsonl": b"[1, 2]\n",
        "mooncake-scalar-hashes.jsonl": b'{"timestamp": 0, "input_length": 100, "output_length": 5, "hash_ids": 7}\n',
        "mooncake-empty.jsonl": b"",
        "mooncake-utf16.jsonl": record.decode().encode("utf-16"),
    }
    for name, data in mooncake.items():
        b.file(name, data)
        scenario = b.file(f"uses-{name}.yaml", f"workload:\n  trace: {{format: mooncake, path: {name}}}\n".encode())
        b.scenario("bad_data_file", scenario, [], (name,))
    # a folder and /dev/null were "file not found"
    folder = b.tmp / "trace-folder"
    folder.mkdir()
    for fmt in ("csv", "mooncake"):
        for path, names in ((folder, ("trace-folder", "a folder")), (Path("/dev/null"), ("/dev/null", "not a regular"))):
            scenario = b.file(f"uses-{path.name}-{fmt}.yaml", f"workload:\n  trace: {{format: {fmt}, path: {path}}}\n".encode())
            b.scenario("bad_data_file", scenario, [], names)
    b.scenario("bad_data_file", QUICKSTART, [f"workload.prompt_len={{dist: empirical, path: {folder}, column: x}}"],
               ("workload.prompt_len.path", "a folder"))
    b.raw("missing_file", ["run", str(folder), "--quiet", "--no-plots"], ("trace-folder", "a folder"))
    profiles = {
        "profile-binary.json": b"\xff\xfe\x00\x01garbage",
        "profile-utf16.json": '{"a": 1}'.encode("utf-16"),
        "profile-list.json": b"[1, 2]",
        "profile-truncated.json": b'{"format": "servesim-profile/2", "coeff',
    }
    for name, data in profiles.items():
        path = b.file(name, data)
        b.scenario("bad_data_file", QUICKSTART, ["cost_model.type=profile", f"cost_model.path={path}"], (name,))
    b.scenario("bad_data_file", QUICKSTART, ["cost_model.type=profile", f"cost_model.path={b.tmp / 'nope.json'}"],
               ("nope.json",))
    # a model's Hugging Face config.json (sim/hf_config.py): broken, or a model servesim cannot price
    llama = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256}
    configs = {
        "config-not-json.json": (b'{"model_type": "llama",', ("config-not-json.json", "not valid JSON")),
        "config-utf16.json": (json.dumps(llama).encode("utf-16"), ("config-utf16.json", "UTF-8")),
        "config-list.json": (b"[1]", ("config-list.json", "JSON object")),
        "config-moe.json": (json.dumps({**llama, "model_type": "mixtral", "num_local_experts": 8}).encode(),
                            ("config-moe.json", "mixture-of-experts")),
        "config-gemma.json": (json.dumps({**llama, "model_type": "gemma2"}).encode(), ("config-gemma.json", "gemma2")),
        "config-no-layers.json": (json.dumps({k: v for k, v in llama.items() if k != "num_hidden_layers"}).encode(),
                                  ("config-no-layers.json", "num_hidden_layers")),
        "config-text-width.json": (json.dumps({**llama, "hidden_size": "4096"}).encode(), ("hidden_size",)),
        "config-awq.json": (json.dumps({**llama, "quantization_config": {"quant_method": "awq"}}).encode(),
                            ("quantised",)),
    }
    for name, (data, names) in configs.items():
        b.scenario("bad_data_file", QUICKSTART, [f"model={b.file(name, data)}"], names)
    b.scenario("bad_data_file", QUICKSTART, [f"model={folder}"], ("trace-folder", "config.json"))
    # a hardware file (sim/hardware_file.py): broken, or a figure of the wrong kind
    gpus = {
        "gpu-not-yaml.yaml": (b"base: [l40s\n", ("gpu-not-yaml.yaml", "not valid YAML")),
        "gpu-list.yaml": (b"- l40s\n", ("gpu-list.yaml", "mapping")),
        "gpu-binary.yaml": (b"\xff\xfe\x00base", ("gpu-binary.yaml", "UTF-8")),
        "gpu-no-peaks.yaml": (b"hbm_bandwidth: 300 GB/s\n", ("gpu-no-peaks.yaml", "peak_flops", "missing")),
        "gpu-bad-base.yaml": (b"base: h101\n", ("gpu-bad-base.yaml", "base", "h100-sxm")),
        "gpu-typo.yaml": (b"base: l40s\npeak_flop: 1e14\n", ("gpu-typo.yaml", "peak_flop", "peak_flops")),
        "gpu-wrong-unit.yaml": (b"base: l40s\nmemory_bytes: 48 TFLOPS\n", ("memory_bytes", "flop/s")),
        "gpu-negative.yaml": (b"base: l40s\nhbm_bandwidth: -3\n", ("hbm_bandwidth", "> 0")),
        "gpu-fraction.yaml": (b"base: l40s\ngemm_flops_fraction: 75\n", ("gemm_flops_fraction", "(0, 2]")),
        "gpu-text.yaml": (b"base: l40s\npeak_flops: fast\n", ("peak_flops", "number")),
        "gpu-tiny-memory.yaml": (b"base: l40s\nmemory_bytes: 300 MiB\n", ("memory_bytes", "cuda_memory_bytes")),
    }
    for name, (data, names) in gpus.items():
        b.scenario("bad_data_file", QUICKSTART, [f"hardware={b.file(name, data)}"], names)
    b.scenario("bad_data_file", QUICKSTART, [f"hardware={b.tmp / 'no-gpu.yaml'}"], ("no-gpu.yaml", "no such file"))


def _set_syntax(b: _Builder) -> None:
    cases = {
        "no-equals-sign": "scheduler.max_num_seqs",
        "=3": "=3",
        "name=[1, 2": "name",
        "name=!!python/object/apply:os.system ['true']": "name",
        "kv_cache=3": "kv_cache",
        "kv_cache.block_size.x=3": "block_size",
        "workload.arrival=poisson": "workload.arrival",
        "scheduler=chunked": "scheduler",
        "slo.p99_itl_ms=5": "slo",
        "slo.ttft_ms=-5": "slo.ttft_ms",
        "slo.ttft_ms=true": "slo",
        "output_dir=[1]": "output_dir",
        "name={a: 1}": "name",
    }
    for item, name in cases.items():
        for verb in ("run", "sweep", "engines"):
            b.scenario("set_syntax", QUICKSTART, [item], (name,), verb=verb)
    for grid, name in {"seed": "seed", "seed=": "seed", "=1,2": "--grid", "seed=[1,": "seed",
                       "seed=!!python/name:os.system": "seed", "scheduler.max_num_seq=1,2": "max_num_seq",
                       "workload.num_requests=true": "num_requests", "kv_cache.num_blocks=1.0e30": "num_blocks",
                       "seed=0,0": "seed"}.items():  # (each point ran twice)
        b.raw("grid_syntax", ["sweep", str(QUICKSTART), "--grid", grid, "--quiet", "--no-plots", "--workers", "1"],
              (name,))


def _verb_options(b: _Builder) -> None:
    q = str(QUICKSTART)
    for presets, name in {"": "--presets", ",": "--presets", "vllm-v9": "vllm-v9", "vllm-v1:FOO": "vllm-v1",
                          "vllm-v1,vllm-v1": "twice", "tensorrt-llm:BEST": "BEST"}.items():
        b.raw("verb_options", ["engines", q, "--presets", presets, "--quiet", "--no-plots"], (name,))
    for slo, name in {"p99_ttft_ms": "p99_ttft_ms", "p99_ttft_ms=abc": "p99_ttft_ms", "p99_bogus_ms=5": "bogus",
                      "p101_ttft_ms=5": "p101", "p99_ttft_ms=-5": "p99_ttft_ms", "p99_ttft_ms=.inf": "p99_ttft_ms",
                      "p99_ttft_ms=nan": "p99_ttft_ms"}.items():
        b.raw("verb_options", ["plan", q, "--slo", slo, "--quiet", "--no-plots", "--workers", "1"], (name,))
    b.raw("verb_options", ["plan", str(QUICKSTART), "--set", "slo={}", "--quiet", "--no-plots"], ("SLO",))
    for flag, value, name in [("--attainment", "2", "attainment"), ("--attainment", "0", "attainment"),
                              ("--seeds", "0", "seeds"), ("--tolerance", "0", "tolerance"),
                              ("--target-rate", "-1", "target"),
                              ("--duration", "-5", "duration"), ("--start-rate", "0", "start"),
                              # each once a traceback, a failure inside every run or minutes of work
                              ("--target-rate", "inf", "--target-rate"), ("--target-rate", "1e30", "--target-rate"),
                              ("--duration", "inf", "--duration"), ("--duration", "1e30", "--duration"),
                              ("--start-rate", "inf", "--start-rate"), ("--start-rate", "1e30", "--start-rate"),
                              ("--start-rate", "1e-20", "--start-rate"), ("--seeds", "100000000", "--seeds")]:
        b.raw("verb_options", ["plan", q, flag, value, "--slo", "p99_ttft_ms=500", "--quiet", "--no-plots",
                               "--workers", "1"], (name,))
    for extra, name in [(["--candidate-set", "scheduler.max_num_seq=1"], "max_num_seq"),
                        (["--candidate-set", "workload.arrival.rate=true"], "rate"),
                        (["--fail-on", "nonsense"], "fail-on"), (["--seeds", "0"], "seeds"),
                        (["--seeds", "100000000"], "--seeds"),
                        # one seed gives no interval: the gate could never flag anything
                        (["--seeds", "1", "--fail-on", "p99_ttft_ms=+5%"], "--fail-on"),
                        # the second rule replaced the first
                        (["--fail-on", "p99_ttft_ms=+5%", "--fail-on", "p99_ttft_ms=-5%"], "p99_ttft_ms"),
                        (["--metrics", "no_such_metric"], "no_such_metric"),
                        # an empty list reported the default metrics
                        (["--metrics", ""], "--metrics"), (["--metrics", " , "], "--metrics")]:
        b.raw("verb_options", ["compare", q, q, *extra, "--quiet", "--workers", "1"], (name,))
    b.raw("verb_options", ["validate", q, "--max-error", "ttft=abc", "--quiet", "--no-plots"], ("abc",))
    # the last threshold of a metric given twice won without a word
    for twice, name in [("ttft=5,ttft=1", "ttft"), ("p50_ttft_ms=5,median_ttft_ms=1", "median_ttft_ms")]:
        b.raw("verb_options", ["validate", q, "--max-error", twice, "--quiet", "--no-plots"], (name, "already"))
    # an empty name in a --set path was dropped ('.seed' read as 'seed')
    for item, name in [(".seed=1", ".seed"), ("workload..num_requests=3", "workload..num_requests")]:
        b.raw("set_syntax", ["run", q, "--set", item, "--quiet", "--no-plots"], (name, "empty name"))
    # a request count one seed's runs cannot hold blamed --seeds; --max-gpus without a disaggregated
    # search was ignored; an --out no file system takes was found only after the whole run
    b.raw("verb_options", ["plan", q, "--min-requests", "10000000000", "--slo", "p99_ttft_ms=500", "--quiet",
                           "--no-plots", "--workers", "1"], ("--min-requests 10000000000",))
    disagg = str(ROOT / "scenarios" / "cluster" / "disagg.yaml")
    for argv in ([q, "--target-rate", "5"], [disagg]):
        b.raw("verb_options", ["plan", *argv, "--max-gpus", "4", "--slo", "p99_ttft_ms=500", "--quiet", "--no-plots",
                               "--workers", "1"], ("--max-gpus",))
    if Path("/proc/self").is_dir():
        b.raw("verb_options", ["run", q, "--out", "/proc/servesim-out", "--quiet", "--no-plots"],
              ("--out", "/proc"), out=False)
    # each accepted before: a slice that dropped the last row, a window of no requests, a run of 1e9 live
    # runs, an ignored flag, and a threshold on what the run does not measure (exit 1 after simulating)
    b.raw("verb_options", ["search", q, "--target-rate", "10", "--slo", "p99_ttft_ms=500", "--space", "seed=0,1",
                           "--top", "-1", "--quiet", "--no-plots", "--workers", "1"], ("--top",))
    b.raw("verb_options", ["plan", q, "--min-requests", "0", "--slo", "p99_ttft_ms=500", "--quiet", "--no-plots",
                           "--workers", "1"], ("--min-requests",))
    b.raw("verb_options", ["validate", str(ROOT / "scenarios" / "live-cpu-chunked.yaml"), "--repeats", "1000000000",
                           "--quiet", "--no-plots"], ("--repeats",))
    run = ROOT.parent / "shared" / "data" / "gpu" / "llmservingsim" / "runs" / "RTXPRO6000-Llama-3.1-8B"
    if run.is_dir():
        for extra, name in [(["--replay-steps"], "--replay-steps"), (["--max-error", "itl=5"], "median_itl_ms")]:
            b.raw("verb_options", ["validate", "--against", str(run), *extra, "--quiet", "--no-plots"], (name,))
    for out, name in [("", "--out"), ("o" * 300, "--out")]:  # (ignored; a traceback after the run)
        b.raw("verb_options", ["run", q, "--out", out, "--quiet", "--no-plots"], (name,), out=False)
    # argparse's own errors: its usage block made them several lines
    for argv, name in [(["plan", q, "--seeds", "abc"], "--seeds"), (["plan", q, "--target-rate", "fast"], "--target-rate"),
                       (["search", q, "--space", "seed=0,1"], "--target-rate"), (["run", q, "--frobnicate"], "--frobnicate"),
                       (["compare", q], "CANDIDATE")]:
        b.raw("verb_options", argv, (name,))
    b.raw("verb_options", ["validate", "--against", str(b.tmp / "no-run"), "--quiet", "--no-plots"], ("no-run",))
    b.raw("verb_options", ["validate", "--quiet", "--no-plots"], ("--against",))
    imp = ["calibrate", "import", "--format", "vidur", "--model", "llama-3.1-8b", "--hardware", "h100-sxm"]
    b.raw("calibrate_import", [*imp, str(b.tmp / "no-profile")], ("no-profile",), out=False)
    b.raw("calibrate_import", [*imp[:-4], "--model", "gpt-9", "--hardware", "h100-sxm", str(b.tmp)], ("gpt-9",),
          out=False)
    b.raw("calibrate_import", [*imp[:-2], "--hardware", "tpu-v9", str(b.tmp)], ("tpu-v9",), out=False)
    b.raw("calibrate_import", [*imp, str(b.tmp), "--with", "nonsense"], ("--with",), out=False)


def _out_of_range(b: _Builder) -> None:
    """Values of the right type outside what the field allows (zero where it must be positive, ...)."""
    q, eng = QUICKSTART, ROOT / "scenarios" / "engines"
    composed = ["scheduler.type=composed"]
    cases = [
        (q, ["tensor_parallel=0"], "tensor_parallel"), (q, ["tensor_parallel=65"], "tensor_parallel"),
        (q, ["tensor_parallel=3"], "tensor_parallel"),
        (q, ["cluster.num_replicas=0"], "cluster.num_replicas"), (q, ["workload.num_requests=0"], "num_requests"),
        (q, ["workload.arrival.rate=0"], "workload.arrival.rate"), (q, ["kv_cache.block_size=0"], "block_size"),
        (q, ["kv_cache.gpu_memory_utilization=0"], "gpu_memory_utilization"),
        (q, ["kv_cache.gpu_memory_utilization=1.5"], "gpu_memory_utilization"),
        (q, ["kv_cache.watermark=1"], "kv_cache.watermark"), (q, ["kv_cache.num_blocks=0"], "num_blocks"),
        (q, ["workload.prompt_len.min=9000"], "workload.prompt_len"),
        (q, ["workload.prefix={num_prefixes: 2, prefix_len: 8, fraction: 1.5}"], "workload.prefix.fraction"),
        (q, ["workload.arrival={process: gamma, rate: 2, cv: 1, burstiness: 1}"], "workload.arrival"),
        (q, ["workload.arrival={process: gamma, rate: 2}"], "workload.arrival"),
        (q, ["workload.prompt_len={dist: zipf, a: 1, max: 10}"], "workload.prompt_len.a"),
        (q, ["slo.ttft_ms=0"], "slo.ttft_ms"), (q, ["live.kv_cache_memory_mb=0"], "live.kv_cache_memory_mb"),
        (q, ["live.threads=100000"], "live.threads"),  # (torch's thread pool segfaulted)
        # a name is the run folder's (results/NAME): never a path out of it, nor too long to create
        (q, ["name=../escaped"], "name"), (q, ["name=/tmp/elsewhere"], "name"), (q, ["name=."], "name"),
        (q, ["name=''"], "name"), (q, ["name=" + "n" * 300], "name"),
        (q, ["workload.arrival={process: poisson, rate: 1, rate: 50}"], "rate"),
        (q, ["scheduler.max_num_seqs=0"], "scheduler.max_num_seqs"),
        (q, ["scheduler.max_num_batched_tokens=0"], "scheduler.max_num_batched_tokens"),
        (q, [*composed, "scheduler.chunk_unit=0"], "scheduler.chunk_unit"),
        (q, [*composed, "scheduler.max_rows_per_step=-1"], "scheduler.max_rows_per_step"),
        (q, [*composed, "scheduler.safety_margin=2"], "scheduler.safety_margin"),
        (q, [*composed, "scheduler.max_num_batched_tokens=3", "scheduler.chunk_unit=4"],
         "scheduler.max_num_batched_tokens"),
        (q, ["scheduler.type=dynamic_batcher", "scheduler.preferred_batch_sizes=[512]"],
         "scheduler.preferred_batch_sizes"),
        (q, ["cost_model.step_overhead_ms=-1"], "cost_model.step_overhead_ms"),
        (q, ["cost_model.flops_efficiency=1.5"], "cost_model.flops_efficiency"),
        (eng / "tensorrt-llm.yaml", ["scheduler.max_batch_size=0"], "scheduler.max_batch_size"),
        (eng / "sglang.yaml", ["scheduler.max_running_requests=0"], "scheduler.max_running_requests"),
        (eng / "vllm-v1.yaml", ["scheduler.long_prefill_token_threshold=-1"], "long_prefill_token_threshold"),
        (eng / "triton-dynamic.yaml", ["scheduler.max_queue_delay_microseconds=-1"], "max_queue_delay_microseconds"),
        (eng / "hf-transformers.yaml", ["scheduler.safety_margin=2"], "scheduler.safety_margin"),
        (eng / "triton-dynamic.yaml", ["scheduler.preferred_batch_size=[512]"], "scheduler.preferred_batch_size"),
    ]
    for path, sets, name in cases:
        b.scenario("out_of_range", path, sets, (name,))


def _issue_cases(b: _Builder) -> None:
    """Every input issue #15 lists, as written there."""
    q, engines = QUICKSTART, ROOT / "scenarios" / "engines"
    listed = [
        (q, ["workload.num_request=5"], "workload.num_request"),
        (q, ["workload.arrival.rat=5"], "workload.arrival.rat"),
        (q, ["workload.prompt_len.maen=1"], "workload.prompt_len.maen"),
        (q, ["seed=-1"], "seed"),
        (q, ["kv_cache.swap_space_gb=.inf"], "kv_cache.swap_space_gb"),
        (q, ["kv_cache.swap_space_gb=1e30"], "kv_cache.swap_space_gb"),
        (q, ["kv_cache.swap_space_gb=1.0e30"], "kv_cache.swap_space_gb"),
        (q, ["live.kv_cache_memory_mb=.inf"], "live.kv_cache_memory_mb"),
        (q, ["live.kv_cache_memory_mb=1.0e30"], "live.kv_cache_memory_mb"),
        (q, ["workload.num_requests=", "workload.duration_s=1.0e30"], "workload.duration_s"),
        (q, ["kv_cache.num_blocks=100000000000"], "kv_cache.num_blocks"),
        (q, ["kv_cache.num_blocks=2000000000"], "kv_cache.num_blocks"),
        (q, ["cluster.num_replicas=100000000000"], "cluster.num_replicas"),
        (q, ["cluster.num_replicas=10000000"], "cluster.num_replicas"),
        (q, ["workload.num_requests=100000000000"], "workload.num_requests"),
        (q, ["workload.num_requests=1000000000"], "workload.num_requests"),
        (q, ["scheduler.max_num_seqs=100000000000000"], "scheduler.max_num_seqs"),
        (q, ["scheduler.max_num_seqs=3000000000"], "scheduler.max_num_seqs"),
        (q, [f"workload.prompt_len={2**63}"], "workload.prompt_len"),
        (q, ["name=[unclosed"], "name"),
        (q, ["name=!!python/object/apply:os.system ['true']"], "name"),
        (q, ["name=!!python/object:os.system {}"], "name"),
        (q, ["seed=true"], "seed"),
        (q, ["tensor_parallel=true"], "tensor_parallel"),
        (q, ["scheduler.max_num_seqs=true"], "scheduler.max_num_seqs"),
        (q, ["kv_cache.num_blocks=true"], "kv_cache.num_blocks"),
        (q, ["workload.arrival.rate=true"], "workload.arrival.rate"),
        (q, ["cluster.num_replicas=true"], "cluster.num_replicas"),
        (q, ["workload.num_requests=true"], "workload.num_requests"),
        (engines / "tensorrt-llm.yaml", ["scheduler.enable_chunked_prefill=true", "scheduler.max_num_tokens=31"],
         "scheduler.max_num_tokens"),
        (engines / "tensorrt-llm.yaml", ["scheduler.max_batch_size=true"], "scheduler.max_batch_size"),
        (engines / "sglang.yaml", ["scheduler.max_running_requests=4000000000"], "scheduler.max_running_requests"),
    ]
    for path, sets, name in listed:
        b.scenario("issue_15", path, sets, (name,), verb="run")
    b.scenario("issue_15", b.file("utf16-issue.yaml", QUICKSTART.read_text().encode("utf-16")), [],
               ("utf16-issue.yaml",), verb="run")
    b.scenario("issue_15", b.file("binary-issue.yaml", b"\x00\xff\xfe" * 100), [], ("binary-issue.yaml",),
               verb="run")
    b.raw("issue_15", ["run", str(q), "--no-plots", "--quiet", "--out", str(b.file("out-is-a-file", b"x"))],
          ("out-is-a-file",), out=False)
    b.raw("issue_15", ["sweep", str(q), "--grid", "seed=[1,", "--quiet", "--no-plots"], ("seed",))
    b.raw("issue_15", ["sweep", str(q), "--grid", "seed=!!python/object/apply:os.system ['true']", "--quiet",
                       "--no-plots"], ("seed",))
    b.raw("issue_15", ["engines", str(q), "--presets", "", "--quiet", "--no-plots"], ("--presets",))
    trace = b.file("trace-1e30.csv", b"arrival_time,prompt_len,output_len\n0.0,100,20\n0.5,1e30,20\n1.0,50,10\n")
    scenario = b.file("trace-1e30.yaml", f"workload:\n  trace: {{format: csv, path: {trace.name}}}\n".encode())
    b.scenario("issue_15", scenario, [], ("trace-1e30.csv", "line 3", "prompt_len"), verb="run")
    empirical = b.file("empirical-1e30.yaml", (
        "workload:\n  num_requests: 5\n  arrival: {process: poisson, rate: 1}\n"
        f"  prompt_len: {{dist: empirical, path: {trace.name}, column: prompt_len}}\n  output_len: 5\n").encode())
    b.scenario("issue_15", empirical, [], ("trace-1e30.csv", "line 3"), verb="run")


RUN_REQUEST = {"input_toks": 100, "output_toks": 5, "arrival_time": 1.7e9, "queued_ts": 5000.0,
               "scheduled_ts": 5000.0, "first_token_ts": 5000.01, "last_token_ts": 5000.05}
RUN_TIMES = ("arrival_time", "queued_ts", "scheduled_ts", "first_token_ts", "last_token_ts")
RUN_META = {"model": "meta-llama/Llama-3.1-8B", "vllm_version": "0.19.0",
            "engine_kwargs": {"tensor_parallel_size": 1, "data_parallel_size": 1, "max_num_seqs": 8,
                              "max_num_batched_tokens": 512}}


def _run_folder(b: _Builder, name: str, rows: list[dict[str, Any]] | None = None, meta: dict[str, Any] | None = None,
                files: dict[str, bytes] | None = None) -> Path:
    """An LLMServingSim run folder (calibration/measured_run.py) of three requests 2 s apart."""
    folder = b.tmp / name
    folder.mkdir()
    if rows is None:
        rows = [{**RUN_REQUEST, "request_id": f"r{i}", **{k: RUN_REQUEST[k] + 2.0 * i for k in RUN_TIMES}}
                for i in range(3)]
    (folder / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "meta.json").write_text(json.dumps(RUN_META if meta is None else meta))
    (folder / "llmservingsim_config.json").write_text(json.dumps(
        {"nodes": [{"instances": [{"hardware": "RTXPRO6000", "tp_size": 1}]}]}))
    for file, data in (files or {}).items():
        (folder / file).write_bytes(data)
    return folder


def _measured_runs(b: _Builder) -> None:
    """Hostile measured runs for ``validate --against``: each was a traceback, a value silently
    replaced or a wrong result."""
    def edit_meta(change: Any) -> dict[str, Any]:
        meta = copy.deepcopy(RUN_META)
        change(meta)
        return meta

    def edit_row(line: int, **values: Any) -> list[dict[str, Any]]:
        rows = [{**RUN_REQUEST, "request_id": f"r{i}", **{k: RUN_REQUEST[k] + 2.0 * i for k in RUN_TIMES}}
                for i in range(3)]
        rows[line - 1].update(values)
        return rows

    kwargs = lambda **kw: edit_meta(lambda m: m["engine_kwargs"].update(kw))  # noqa: E731
    runs: list[tuple[str, dict[str, Any], tuple[str, ...]]] = [
        ("utf16-meta", {"files": {"meta.json": json.dumps(RUN_META).encode("utf-16")}}, ("meta.json", "UTF-8")),
        ("binary-requests", {"files": {"requests.jsonl": b"\xff\xfe\x00garbage\n"}}, ("requests.jsonl", "UTF-8")),
        ("binary-summary", {"files": {"llmservingsim_summary.txt": b"\xff\xfe\x00"}}, ("llmservingsim_summary.txt",)),
        ("deep-meta", {"files": {"meta.json": b"[" * 100000 + b"]" * 100000}}, ("meta.json",)),
        ("tp-zero", {"meta": kwargs(tensor_parallel_size=0)}, ("meta.json", "tensor_parallel_size")),
        ("tp-text", {"meta": kwargs(tensor_parallel_size="two")}, ("meta.json", "tensor_parallel_size")),
        ("tp-fraction", {"meta": kwargs(tensor_parallel_size=2.5)}, ("meta.json", "tensor_parallel_size")),
        ("tp-three", {"meta": kwargs(tensor_parallel_size=3), "files": {"llmservingsim_config.json": json.dumps(
            {"nodes": [{"instances": [{"hardware": "RTXPRO6000", "tp_size": 3}]}]}).encode()}}, ("tensor_parallel",)),
        ("dp-zero", {"meta": kwargs(data_parallel_size=0)}, ("meta.json", "data_parallel_size")),
        ("dp-true", {"meta": kwargs(data_parallel_size=True)}, ("meta.json", "data_parallel_size")),
        ("dp-huge", {"meta": kwargs(data_parallel_size=10**9)}, ("cluster.num_replicas",)),
        ("max-model-len-zero", {"meta": kwargs(max_model_len=0)}, ("meta.json", "max_model_len")),
        ("max-model-len-text", {"meta": kwargs(max_model_len="4096")}, ("meta.json", "max_model_len")),
        ("dtype-list", {"meta": kwargs(dtype=["bfloat16"])}, ("meta.json", "engine_kwargs.dtype")),
        ("kv-dtype-list", {"meta": kwargs(kv_cache_dtype=["fp8"])}, ("meta.json", "kv_cache_dtype")),
        ("utilization-text", {"meta": kwargs(gpu_memory_utilization="nan")}, ("meta.json", "engine_kwargs.gpu_memory_utilization")),
        ("utilization-tiny", {"meta": kwargs(gpu_memory_utilization=0.01)}, ("kv_cache", "does not fit")),
        ("block-size-text", {"meta": edit_meta(lambda m: m.update(kv_cache={"block_size": "abc"}))},
         ("kv_cache.block_size",)),
        ("kv-cache-list", {"meta": edit_meta(lambda m: m.update(kv_cache=[1]))}, ("meta.json", "kv_cache")),
        ("async-text", {"meta": edit_meta(lambda m: m.update(
            resolved_config={"scheduler_config": {"async_scheduling": "yes"}}))}, ("meta.json", "async_scheduling")),
        ("no-engine-kwargs", {"meta": edit_meta(lambda m: m.pop("engine_kwargs"))}, ("meta.json", "engine_kwargs")),
        ("meta-list", {"files": {"meta.json": b"[1, 2]"}}, ("meta.json",)),
        ("no-requests", {"files": {"requests.jsonl": b""}}, ("requests.jsonl",)),
        ("scheduled-text", {"rows": edit_row(2, scheduled_ts="abc")}, ("requests.jsonl:2", "scheduled_ts")),
        ("scheduled-after-first-token", {"rows": edit_row(2, scheduled_ts=6000.0)}, ("requests.jsonl:2", "scheduled_ts")),
        ("queued-1e300-early", {"rows": edit_row(1, queued_ts=-1e300)}, ("requests.jsonl:1",)),
        ("arrival-1e12-late", {"rows": edit_row(3, arrival_time=1e12)}, ("requests.jsonl", "line 3")),
        ("duplicate-id", {"rows": edit_row(3, request_id="r0")}, ("requests.jsonl:3", "request_id")),
        # arrival_time in ms, one line's 100 s off: every arrival moved by a wrong offset, exit 0
        ("arrival-ms", {"rows": [{**r, "arrival_time": r["arrival_time"] * 1000} for r in edit_row(1)]},
         ("requests.jsonl", "queued_ts - arrival_time", "one clock")),
        ("arrival-100s-late", {"rows": edit_row(2, arrival_time=RUN_REQUEST["arrival_time"] + 102.0)},
         ("requests.jsonl", "line 2", "one clock")),
        ("no-model-preset", {"meta": edit_meta(lambda m: m.update(model="google/gemma-2-9b"))}, ("--set model=",)),
        # the GPU came from the folder's name; the engine's TP degree won; a text count was "missing"
        ("config-list", {"files": {"llmservingsim_config.json": b"[1, 2]"}}, ("llmservingsim_config.json", "object")),
        ("config-nodes-text", {"files": {"llmservingsim_config.json": b'{"nodes": "RTXPRO6000"}'}},
         ("llmservingsim_config.json", "nodes")),
        ("config-hardware-number", {"files": {"llmservingsim_config.json": b'{"nodes": [{"instances": [{"hardware": 6000}]}]}'}},
         ("llmservingsim_config.json", "hardware")),
        ("device-name-number", {"meta": edit_meta(lambda m: m.update(hardware={"device_name": 6000}))},
         ("meta.json", "hardware.device_name")),
        ("tp-disagrees", {"meta": kwargs(tensor_parallel_size=2)}, ("tensor_parallel_size 2", "tp_size 1")),
        ("max-num-seqs-text", {"meta": kwargs(max_num_seqs="8")}, ("meta.json", "engine_kwargs.max_num_seqs", "whole number")),
        ("max-batched-tokens-true", {"meta": kwargs(max_num_batched_tokens=True)},
         ("meta.json", "engine_kwargs.max_num_batched_tokens")),
        # a server vLLM refuses to start (SchedulerConfig), simulated as if it had run; a text flag read as absent
        ("budget-below-seats", {"meta": kwargs(max_num_batched_tokens=1)},
         ("max_num_batched_tokens 1", "max_num_seqs 8")),
        ("eager-text", {"meta": kwargs(enforce_eager="false")}, ("meta.json", "engine_kwargs.enforce_eager")),
    ]
    for name, parts, names in runs:
        folder = _run_folder(b, f"run-{name}", **parts)
        b.raw("bad_run", ["validate", "--against", str(folder), "--no-plots", "--quiet"], names)
    b.raw("bad_run", ["validate", "--against", str(_run_folder(b, "run-ok-set-tp")), "--set", "tensor_parallel=abc",
                      "--no-plots", "--quiet"], ("tensor_parallel",))
    b.raw("bad_run", ["validate", "--against", str(_run_folder(b, "run-ok-set-hw")), "--set", "hardware=tpu-v9",
                      "--no-plots", "--quiet"], ("hardware",))
    for item in ("tensor_parallel=2", "cluster.num_replicas=2"):  # another engine than the run's, simulated: exit 0
        b.raw("bad_run", ["validate", "--against", str(_run_folder(b, f"run-ok-set-{item[:3]}")), "--set", item,
                          "--no-plots", "--quiet"], (item, "the run states"))
    for item in ("workload.num_requests=2", "workload.trace.time_scale=2"):  # a RuntimeError; a replay at 2x
        b.raw("bad_run", ["validate", "--against", str(_run_folder(b, f"run-ok-set-{item[-1]}{len(b.cases)}")), "--set",
                          item, "--no-plots", "--quiet"], (item.partition("=")[0],))
    bench = {"model_id": "meta-llama/Llama-3.1-8B", "request_rate": 4.0, "input_lens": [100, 200],
             "output_lens": [3, 4], "ttfts": [0.05, 0.06], "latencies": [0.1, 0.2], "start_times": [0.0, 0.5]}
    benches: list[tuple[str, dict[str, Any] | bytes, tuple[str, ...]]] = [
        ("bench-utf16", json.dumps(bench).encode("utf-16"), ("bench-utf16.json", "UTF-8")),
        ("bench-errors-number", {**bench, "errors": 5}, ("errors",)),
        ("bench-latencies-number", {**bench, "latencies": 5}, ("latencies",)),
        ("bench-negative-ttft", {**bench, "ttfts": [-5.0, 0.06]}, ("request 0", "ttfts")),
        ("bench-latency-below-ttft", {**bench, "latencies": [0.01, 0.2]}, ("request 0", "latencies")),
        ("bench-negative-itl", {**bench, "itls": [[-0.5, 0.02], [0.01, 0.01, 0.03]]}, ("request 0", "itls")),
        ("bench-ttft-1e300", {**bench, "ttfts": [1e300, 0.06]}, ("request 0", "ttfts")),
        ("bench-start-1e12", {**bench, "start_times": [1e12, 0.5]}, ("start_times",)),
        ("bench-tiny-rate", {**bench, "start_times": None, "request_rate": 1e-300}, ("request_rate",)),
        ("bench-list", [1, 2], ("bench-list.json",)),  # type: ignore[list-item]
        # each was "missing field": a field of the wrong type, a run of no requests
        ("bench-input-lens-object", {**bench, "input_lens": {"0": 100, "1": 200}}, ("input_lens", "must be a list")),
        ("bench-no-requests", {**bench, **{k: [] for k in ("input_lens", "output_lens", "ttfts", "latencies",
                                                         "start_times")}}, ("bench-no-requests.json", "no requests")),
    ]
    for name, data, names in benches:
        path = b.file(f"{name}.json", data if isinstance(data, bytes) else json.dumps(data).encode())
        b.raw("bad_run", ["validate", "--against", str(path), "--format", "vllm-bench", "--set", "hardware=h100-sxm",
                          "--no-plots", "--quiet"], names)


def _gpu_profiles(b: _Builder) -> None:
    """A shipped GPU profile (servesim-gpu-profile/1) with one field broken; each was a traceback, a
    value truncated or a wrong result."""
    base = json.loads((ROOT / "calibration" / "profiles" / "h100-sxm-llama-3.1-8b-tp1.json").read_text())

    def seconds(d: dict[str, Any], value: Any) -> None:
        d["dense"]["ops"]["qkv_proj"]["seconds"][3] = value

    def cell(d: dict[str, Any], value: Any) -> None:
        d["attention"]["seconds"][1][1][1][1] = value

    broken: list[tuple[str, Any, tuple[str, ...]]] = [
        ("tp-text", lambda d: d.update(tensor_parallel="abc"), ("tensor_parallel",)),
        ("tp-fraction", lambda d: d.update(tensor_parallel=1.7), ("tensor_parallel",)),
        ("tp-true", lambda d: d.update(tensor_parallel=True), ("tensor_parallel",)),
        ("layers-text", lambda d: d.update(num_layers="x"), ("num_layers",)),
        ("layers-other-model", lambda d: d.update(num_layers=80), ("num_layers", "llama-3.1-8b")),
        ("count-text", lambda d: d["dense"]["ops"]["qkv_proj"].update(count="x"), ("dense.ops.qkv_proj.count",)),
        ("count-negative", lambda d: d["dense"]["ops"]["qkv_proj"].update(count=-3), ("dense.ops.qkv_proj.count",)),
        ("seconds-true", lambda d: seconds(d, True), ("dense.ops.qkv_proj.seconds",)),
        ("seconds-1e300", lambda d: seconds(d, 1e300), ("dense.ops.qkv_proj.seconds",)),
        ("tokens-1e300", lambda d: d["dense"]["tokens"].__setitem__(-1, 1e300), ("dense.tokens",)),
        ("attention-ragged", lambda d: d["attention"]["seconds"][1][1].__setitem__(1, [1.0]), ("attention.seconds",)),
        ("attention-text", lambda d: cell(d, "x"), ("attention.seconds",)),
        ("step-text", lambda d: d.update(overhead={"step_s": "x"}), ("overhead.step_s",)),
        ("step-inf", lambda d: d.update(overhead={"step_s": float("inf")}), ("overhead.step_s",)),
        ("swap-negative", lambda d: d.update(overhead={"swap_bandwidth": -1}), ("overhead.swap_bandwidth",)),
        ("allreduce-text", lambda d: d.update(allreduce={"type": "link", "count": 2, "bytes_per_token": "x",
                                                          "latency_s": 0, "bandwidth": 1e9, "tp": 1}),
         ("allreduce.bytes_per_token",)),
    ]
    for name, change, names in broken:
        data = copy.deepcopy(base)
        change(data)
        path = b.file(f"gpu-profile-{name}.json", json.dumps(data).encode())
        b.scenario("bad_data_file", QUICKSTART, ["cost_model.type=profile", f"cost_model.path={path}"],
                   (path.name, *names))
    header = b"layer_name,input,kv_cache,tp_size,latency(ns)\n"
    for name, data, names in [("layers-inf.csv", header + b"q_proj,1,0,1,inf\n", ("layers-inf.csv", "latency(ns)")),
                              ("layers-no-k-proj.csv", header + b"q_proj,1,0,1,5\n", ("layers-no-k-proj.csv", "k_proj"))]:
        b.raw("calibrate_import", ["calibrate", "import", "--format", "llmservingsim", str(b.file(name, data)),
                                   "--model", "llama-3.1-8b", "--hardware", "h100-sxm"], names)
    # sources that were a traceback, a guess or a silent default (tests/test_importers.py has the rest)
    imp = ["calibrate", "import", "--model", "llama-2-7b", "--hardware", "h100-sxm"]
    for name, meta, names in [("utf16", "gpu: X\n".encode("utf-16"), ("meta.yaml", "UTF-8")),
                              ("tp-x", b"gpu: X\nmodel: Y\ntp_degrees: [x]\n", ("meta.yaml", "tp_degrees")),
                              ("iters-0", b"gpu: X\nmodel: Y\ntp_degrees: [1]\nmeasurement_iterations: 0\n",
                               ("meta.yaml", "measurement_iterations"))]:
        (b.tmp / f"llmservingsim-{name}").mkdir()
        b.file(f"llmservingsim-{name}/meta.yaml", meta)
        b.raw("calibrate_import", [*imp, "--format", "llmservingsim", str(b.tmp / f"llmservingsim-{name}")], names)
    mlp = b.file("mlp.csv", b"time_stats.attn_pre_proj.median,num_tokens,num_tensor_parallel_workers\n0.25,8,1\n")
    b.raw("calibrate_import", [*imp, "--format", "vidur", str(mlp)], ("mlp.csv", "n_embd"))
    dec = b.file("mha_decode_h100_32-32-128-tp1.csv", b"batch_size,kv_len,latency_us\n1,1024,30\n")
    b.raw("calibrate_import", [*imp, "--format", "inference-sim", str(dec), "--with", f"vidur:{mlp}"],
          (dec.name, "decode grid"))
    b.raw("calibrate_import", [*imp, "--format", "vidur", str(mlp), "--tp", "2", "--link-bandwidth", "0"],
          ("--link-bandwidth",))
    b.raw("calibrate_import", [*imp, "--format", "vidur", str(mlp), "--out", ""], ("--out",), out=False)
    deep = b.file("gpu-profile-deep.json", b"[" * 100000 + b"]" * 100000)
    b.scenario("bad_data_file", QUICKSTART, ["cost_model.type=profile", f"cost_model.path={deep}"], (deep.name,))
    moon = b.file("mooncake-deep.jsonl", b"[" * 100000 + b"]" * 100000 + b"\n")
    b.scenario("bad_data_file", b.file("uses-mooncake-deep.yaml", f"workload:\n  trace: {{format: mooncake, path: "
                                       f"{moon.name}}}\n".encode()), [], (moon.name,))
    b.scenario("bad_file", b.file("deep.yaml", b"name: " + b"[" * 100000 + b"]" * 100000 + b"\n"), [], ("deep.yaml",))
    b.raw("set_syntax", ["run", str(QUICKSTART), "--set", "name=" + "[" * 50000 + "]" * 50000, "--no-plots", "--quiet"],
          ("--set",))
    b.raw("grid_syntax", ["sweep", str(QUICKSTART), "--grid", f"seed={','.join(map(str, range(1000)))}", "--grid",
                          f"kv_cache.block_size={','.join(map(str, range(1, 1000)))}", "--grid",
                          f"workload.num_requests={','.join(map(str, range(1, 1000)))}", "--quiet", "--no-plots",
                          "--workers", "1"], ("--grid",))


def counts(cases: list[Case]) -> Counter[str]:
    """Cases per category, and per verb under ``verb:NAME``."""
    c: Counter[str] = Counter(case.category for case in cases)
    c.update(f"verb:{case.argv[0]}" for case in cases)
    return c


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        found = corpus(Path(d))
    for name, n in sorted(counts(found).items()):
        print(f"{name:20s} {n:5d}")
    print(f"{'total':20s} {len(found):5d}")
