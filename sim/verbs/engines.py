"""``servesim engines``: the same traffic through several engine presets, side by side.

The scenario's workload is generated once and replayed through each preset (``scheduler:`` is
replaced by the preset, except that knobs the scenario sets for that same preset are kept;
everything else is kept). KV capacity is held equal in tokens: an explicit
``kv_cache.num_blocks`` is converted to tokens with the scenario's block size and back to blocks
of each preset's own block size; without it every preset gets the same memory (what a vLLM V1
server with its defaults leaves, ``Scenario.derived_kv_blocks``). KV-cache settings
the scenario writes (prefix caching, swap space, ...) apply to every preset; the ones it leaves
out take each engine's default. Outputs, in ``--out``:

- ``engines.csv`` / ``engines.parquet``: one row per preset (summary metrics, KV size, wall time);
- ``latency_cdf.png``: TTFT, TPOT and E2E CDFs of every preset overlaid;
- one run folder per preset (``requests.parquet``, ``iterations.parquet``, ``summary.json``, ...).
"""

from __future__ import annotations

import copy
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from ..engine_presets import PRESETS
from ..hints import did_you_mean
from ..outputs import Interrupted, begin_folder, write_csv, write_parquet
from ..scenario import Scenario, ScenarioError, read_scenario_file, scenario_from_dict
from ..simulate import RunResult, simulate, write_results
from ..workload import generate_requests

# Every preset, with the variants the issue asks to compare (the preset's main policy knob).
DEFAULT_PRESETS = (
    "vllm-v1", "vllm-v0", "hf-transformers", "hf-transformers:prefill_first", "tensorrt-llm",
    "tensorrt-llm:MAX_UTILIZATION", "triton-dynamic", "sglang", "sglang:lpm",
)  # fmt: skip

TABLE_COLUMNS = (
    "preset", "engine", "kv_block_size", "kv_num_blocks", "completed", "rejected", "request_throughput",
    "output_throughput", "request_goodput", "slo_attainment", "median_ttft_ms", "p99_ttft_ms",
    "median_tpot_ms", "p99_tpot_ms", "p99_itl_ms", "median_e2el_ms", "p99_e2el_ms", "num_preemptions",
    "preempted_requests", "mean_batch_size", "num_iterations", "wall_s",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class PresetChoice:
    """One entry of ``--presets``: ``NAME`` or ``NAME:VALUE`` (VALUE sets the preset's variant knob)."""

    label: str
    knobs: dict[str, Any]

    @property
    def folder(self) -> str:
        return self.label.replace(":", "-")


def parse_presets(text: str | None) -> list[PresetChoice]:
    """``"vllm-v1,tensorrt-llm:MAX_UTILIZATION"`` -> choices; one-line ``ScenarioError`` on a bad entry."""
    # None: the default set; an empty --presets "" is a mistake, not "all of them"
    items = [s.strip() for s in text.split(",")] if text is not None else list(DEFAULT_PRESETS)
    choices = []
    for item in items:
        if not item:
            continue
        name, _, value = item.partition(":")
        cls = PRESETS.get(name)
        if cls is None:
            raise ScenarioError(f"--presets: unknown engine preset {name!r}{did_you_mean(name, PRESETS)}; "
                                f"choose from: {', '.join(PRESETS)}")
        knobs: dict[str, Any] = {"preset": name}
        if value:
            if cls.VARIANT_KNOB is None:
                raise ScenarioError(f"--presets {item!r}: {name} has no variant; write just {name}")
            knobs[cls.VARIANT_KNOB] = value
        choices.append(PresetChoice(item, knobs))
    if not choices:
        raise ScenarioError("--presets: name at least one engine preset")
    if len({c.label for c in choices}) != len(choices):
        raise ScenarioError("--presets: a preset is listed twice")
    return choices


def preset_scenario(raw: dict[str, Any], choice: PresetChoice, base_dir: Path, source: str) -> Scenario:
    """The scenario with its scheduler replaced by ``choice`` and the KV capacity kept in tokens."""
    d = copy.deepcopy(raw)
    written = d.get("scheduler") or {}
    same = isinstance(written, dict) and written.get("preset") == choice.knobs["preset"]
    # the scenario's own knobs for its own preset are kept (a variant still overrides them)
    d["scheduler"] = {**written, **choice.knobs} if same else dict(choice.knobs)
    d["name"] = f"{raw.get('name', 'scenario')}-{choice.folder}"
    d.pop("output_dir", None)
    kv = dict(d.get("kv_cache") or {})
    block_size = kv.pop("block_size", 16)  # each preset keeps its own block size
    if kv.get("num_blocks") is not None:
        preset_block = PRESETS[choice.knobs["preset"]].KV_DEFAULTS.get("block_size", 16)
        kv["num_blocks"] = max(int(kv["num_blocks"]) * int(block_size) // preset_block, 1)
    d["kv_cache"] = kv
    sc = scenario_from_dict(d, source=f"{source} [{choice.label}]")
    sc.workload = sc.workload.resolve_paths(base_dir)
    return sc


def summary_row(choice: PresetChoice, result: RunResult) -> dict[str, Any]:
    s = result.summary
    row: dict[str, Any] = {
        "preset": choice.label,
        "engine": PRESETS[choice.knobs["preset"]].MODELLED,
        "kv_block_size": result.kv.block_size,
        "kv_num_blocks": result.kv.num_blocks,
        "wall_s": result.wall_s,
    }
    for col in TABLE_COLUMNS:
        if col not in row:
            row[col] = s.get(col)
    return {c: row[c] for c in TABLE_COLUMNS}


def compare_engines(
    scenario_path: str | Path,
    overrides: list[str] | None,
    presets: str | None,
    out_dir: str | Path | None,
    progress: bool | None = None,
    plots: bool = True,
) -> tuple[pd.DataFrame, Path]:
    """Run the scenario's traffic through each preset; write the table, the CDF overlay, the run folders."""
    path = Path(scenario_path)
    choices = parse_presets(presets)
    raw = read_scenario_file(path, overrides)
    base = scenario_from_dict(copy.deepcopy(raw), source=str(path))  # the scenario as written must be valid
    base.workload = base.workload.resolve_paths(path.parent)
    out = Path(out_dir) if out_dir else Path("results") / f"{base.name}-engines"
    scenarios = [preset_scenario(raw, c, path.parent, str(path)) for c in choices]  # all errors before any run
    requests = generate_requests(base.workload, base.seed)  # one draw of the traffic for every preset
    begin_folder(out, "engines.csv")  # engines.csv last: it marks a finished comparison
    rows, frames = [], {}
    for choice, sc in zip(choices, scenarios, strict=True):
        t0 = time.perf_counter()
        try:
            result = simulate(sc, requests=requests, progress=False)  # one line per preset instead of bars
            result.wall_s = time.perf_counter() - t0
            write_results(result, out / choice.folder, plots=False)
        except KeyboardInterrupt:
            raise Interrupted(f"interrupted: {len(rows)} of {len(choices)} presets finished, each a run folder in "
                              f"{out}/; engines.csv not written") from None
        rows.append(summary_row(choice, result))
        frames[choice.label] = result.requests_df
        if refusal := sc.start_refusal(result.kv.num_blocks, result.kv.block_size):
            # compared all the same, as a what-if; said once per preset
            print(f"warning: {choice.label}: {refusal}", file=sys.stderr)
        if progress is not False:
            print(f"  {choice.label}: {result.summary['completed']} requests in {result.wall_s:.1f} s", flush=True)
    table = pd.DataFrame(rows, columns=list(TABLE_COLUMNS))
    write_parquet(table, out / "engines.parquet")
    if plots:
        from ..plots import plot_cdf_overlay  # matplotlib import is slow; only when plotting

        plot_cdf_overlay(out / "latency_cdf.png", frames)
    write_csv(table, out / "engines.csv")
    return table, out


def format_table(table: pd.DataFrame) -> str:
    """The comparison as fixed-width text: latencies in ms, rates per second."""
    cols = {
        "preset": "preset", "kv_block_size": "block", "completed": "done", "rejected": "rejected",
        "request_throughput": "req/s",
        "request_goodput": "goodput", "median_ttft_ms": "TTFT p50", "p99_ttft_ms": "TTFT p99",
        "median_tpot_ms": "TPOT p50", "p99_tpot_ms": "TPOT p99", "p99_itl_ms": "ITL p99",
        "p99_e2el_ms": "E2E p99", "num_preemptions": "preempt", "mean_batch_size": "batch",
    }  # fmt: skip
    view = table[list(cols)].rename(columns=cols)
    return view.to_string(index=False, float_format=lambda x: f"{x:.2f}" if abs(x) < 100 else f"{x:.0f}")
