"""``servesim calibrate import``: public GPU measurements -> a ``servesim-gpu-profile/1`` file.

Sources combine by role: an LLMServingSim profile folder supplies everything (dense ops, attention
grid, LM head and sampler, skew); otherwise GEMMs come from the LLMServingSim v0 ``layers.csv``,
small ops from Vidur's ``mlp.csv``, attention from inference-sim, all-reduce from Vidur's
``all_reduce.csv`` (see ``assemble_composite``). Every file used is named in the profile's
provenance with its repository, commit, path, license and GPU; ``provenance.assembly`` says in
words how the tables were joined.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
from servesim.sim.cost_model import reading_attention_shape
from servesim.sim.presets import ModelConfig, get_hardware, get_model

from . import gpu_profile as gp
from .importers import SourceError, llmservingsim
from .source_checks import check_hardware_matches, check_ops_cover

FORMATS = ("llmservingsim", "vidur", "inference-sim")
# LLMServingSim 2.0's own cluster config for the RTX PRO 6000 tp2 run (runs/*/llmservingsim_config.json:
# link_bw 16 GB/s, link_latency 20000 ns): the GPU-GPU link it prices TP all-reduces with. No
# measured all-reduce exists for these PCIe cards, so it is the only published figure to use.
PCIE_LINK = {"latency_s": 20e-6, "bandwidth": 16e9,
             "source": "casys-kaist/LLMServingSim @ 5daddb21a545 bench/examples/RTXPRO6000/Qwen3-32B/"
                       "llmservingsim_config.json (link_bw 16 GB/s, link_latency 20 us), MIT"}


@dataclass
class ImportOptions:
    fmt: str
    paths: list[str]
    model: str
    hardware: str
    tp: int = 1
    out: str | None = None
    step_overhead_us: float = 0.0
    per_seq_overhead_us: float = 0.0
    link_bandwidth: float | None = None  # bytes/s, for TP all-reduce when no measured table is given
    link_latency_us: float | None = None
    extra: list[str] = field(default_factory=list)  # --with FORMAT:PATH sources combined in
    prompt_step_overhead_us: float = 0.0  # device time of a step with prompt rows beyond its kernels
    skew: str = "auto"  # LLMServingSim skew.csv: auto (as the source's meta.yaml says), use, ignore


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9.]+", "-", name.lower()).strip("-")


def check_model_matches(source_model: str, model: ModelConfig, where: str) -> None:
    """The source measured the model the user named (compared by normalised name, e.g.
    'meta-llama/Llama-3.1-8B' ~ 'llama-3.1-8b'); otherwise a ``SourceError`` naming both."""
    src = _slug(source_model.split("/")[-1]).removeprefix("meta-").removesuffix("-hf")
    if src != _slug(model.name):
        raise SourceError(f"{where} measures model {source_model!r}, but --model is {model.name!r}")


def check_layer_shape(meta: dict[str, Any], model: ModelConfig, where: str) -> None:
    """meta.yaml's hf_overrides are those of the last TP degree profiled (the layer shrunk to one
    rank's shard): times that degree they must give the preset's shape (hidden size and head dim,
    which no rank splits, as they are), else the preset is not the model that was measured."""
    over = (meta.get("engine_effective") or {}).get("hf_overrides") or {}
    tp = max(int(t) for t in meta.get("tp_degrees") or [1])
    want = {"num_attention_heads": model.num_heads, "num_key_value_heads": model.num_kv_heads,
            "intermediate_size": model.intermediate_size, "vocab_size": model.vocab_size,
            "hidden_size": model.hidden_size, "head_dim": model.head_dim}
    for key, value in want.items():
        split = 1 if key in ("hidden_size", "head_dim") else tp  # every rank holds the whole hidden state
        if key in over and int(over[key]) * split != value:
            raise SourceError(f"{where}/meta.yaml: hf_overrides.{key} = {over[key]} at tp{tp} means {int(over[key]) * split} "
                              f"for the whole model, but preset {model.name} has {value}")


def fill_between(table: pd.DataFrame) -> pd.DataFrame:
    """``table`` (one column per op, indexed by token or sequence count) with an op's count missing
    inside its measured range filled linearly in the count between its neighbours (``check_ops_cover``
    has refused one missing at either end); by position it would put a hole between 16 and 32 tokens
    of a table that steps by 1 up to 16 halfway in rows, not in tokens."""
    return table.interpolate(method="index", limit_direction="both")


SKEW_CHOICES = ("auto", "use", "ignore")


def skew_switched_off(meta: dict[str, Any], where: str = "meta.yaml") -> str | None:
    """Where an LLMServingSim meta.yaml switches its skew profile off (``skew_profile.enabled: false``
    or ``skew_fit.enabled: false``, or the section itself ``false``: its own simulator then prices
    unequal contexts at their mean), or None. A switch of another kind (``enabled: "no"``, a list) is a
    ``SourceError`` naming it: read as on, it would silently undo the source's choice."""
    for key in ("skew_profile", "skew_fit"):
        section = meta.get(key)
        if section is False:
            return f"{key}: false"
        if section is None or section is True:
            continue
        if not isinstance(section, dict):
            raise SourceError(f"{where}: field '{key}' must be a mapping (or true/false), got {section!r:.60}")
        enabled = section.get("enabled")
        if enabled is False:
            return f"{key}.enabled: false"
        if enabled is not None and enabled is not True:
            raise SourceError(f"{where}: field '{key}.enabled' must be true or false, got {enabled!r:.60}")
    return None


def assemble_llmservingsim(folder: str | Path, model: ModelConfig, hardware: str, tp: int,
                           allreduce: dict[str, Any], skew_mode: str = "auto",
                           ) -> tuple[gp.Assembly, pd.DataFrame, pd.DataFrame | None]:
    """(assembly, attention rows, skew rows) from an LLMServingSim profile folder at one TP degree.

    ``skew_mode``: ``auto`` uses ``skew.csv`` unless meta.yaml switches the skew profile off
    (``skew_switched_off``), ``use`` always, ``ignore`` never; an unused table is still read, checked and
    scored (``Assembly.skew_used`` False), so the profile states what mean-context pricing costs there."""
    prof = llmservingsim.read_profile(folder, tp=[tp])
    check_model_matches(prof.model, model, str(folder))
    check_hardware_matches(str(prof.meta.get("hardware") or prof.gpu), hardware, str(folder))
    check_layer_shape(prof.meta, model, str(folder))
    t = prof.tp[tp]
    dense = t.dense.pivot_table(index="tokens", columns="op", values="seconds", aggfunc="median").sort_index()
    ops = gp.dense_ops_for(model, dense.columns)
    missing = [o for o in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj") if o not in dense.columns]
    if missing:
        raise SourceError(f"{folder}/tp{tp}/dense.csv: no rows for op {missing[0]!r}")
    check_ops_cover(dense, f"{folder}/tp{tp}/dense.csv", ops, "tokens")
    dense = fill_between(dense[list(ops)])
    src = f"LLMServingSim {prof.meta.get('hardware', '')} tp{tp}/dense.csv"
    dense_ops = {k: {"per": per, "count": c, "seconds": dense[k].tolist(), "source": src}
                 for k, (per, c) in ops.items()}
    seq = t.per_sequence.pivot_table(index="sequences", columns="op", values="seconds", aggfunc="median")
    missing = [o for o in ("lm_head", "sampler") if o not in seq.columns]
    if missing:
        raise SourceError(f"{folder}/tp{tp}/per_sequence.csv: no rows for op {missing[0]!r}")
    check_ops_cover(seq, f"{folder}/tp{tp}/per_sequence.csv", seq.columns, "sequences")
    seq = fill_between(seq.sort_index())
    # the roofline's attention term for this model and GPU: the shape the "roofline" reading offers
    shape = reading_attention_shape(model, get_hardware(hardware), tp)
    grid = gp.attention_grid(t.attention, shape=shape, where=f"{folder}/tp{tp}/attention.csv")
    eager = (prof.meta.get("engine_effective") or {}).get("enforce_eager")
    notes = [
        f"All tables from one LLMServingSim profile: {prof.model} on {prof.gpu}, vLLM "
        f"{prof.meta.get('vllm_version')}, CUDA {prof.meta.get('cuda_version')}, "
        f"enforce_eager={eager} (kernels timed without CUDA graphs).",
        f"tp{tp}: each table was measured on one GPU with the layer shrunk to one rank's shard, so its "
        "times are per rank and include no communication; the all-reduces are added separately "
        f"({allreduce.get('type')}).",
        f"Step = {model.num_layers} x (2 x layernorm + "
        + " + ".join(k for k, (per, _c) in ops.items() if per == "layer" and k != "layernorm")
        + " + attention) + embedding + final_layernorm + lm_head(rows) + sampler(rows)"
        + (" + all-reduces." if tp > 1 else "."),
        f"Attention: every measured value of each axis of the 4-D sweep is a node ({grid.measured} measured "
        f"points, {grid.filled} filled: moot axes copied, the doubling and 1.5x sub-grids joined along the "
        "context axes in the reading held_out_error.attention_interpolation chose (log: power laws; linear; "
        "roofline: linear in the ratio to the roofline's attention term, without its L2 re-read cliff, where a "
        "chunk is present), KV-budget "
        "corners extended linearly).",
    ]
    skew = t.skew
    off = skew_switched_off(prof.meta, f"{folder}/meta.yaml")
    unused = skew is not None and (skew_mode == "ignore" or (skew_mode == "auto" and off is not None))
    if unused:
        why = (f"the source's meta.yaml has {off}, so its own simulator applies no skew correction on this GPU; "
               "--skew use overrides" if skew_mode == "auto" else "--skew ignore")
        notes.append(f"Decode rows of unequal context are priced at their mean context: tp{tp}/skew.csv was read "
                     f"and scored (held_out_error.skew) but not used ({why}).")
    elif skew is not None:
        notes.append(f"Decode rows of unequal context: alpha from tp{tp}/skew.csv places the step between its "
                     "mean-context and longest-context attention"
                     + (f" (--skew use, although the source's meta.yaml has {off})." if off else "."))
    asm = gp.Assembly(model=model, hardware=hardware, tp=tp, dense_tokens=[int(x) for x in dense.index],
                      dense_ops=dense_ops, seq_sequences=[int(x) for x in seq.index],
                      seq_ops={k: seq[k].tolist() for k in seq.columns},
                      seq_sources={k: f"LLMServingSim tp{tp}/per_sequence.csv" for k in seq.columns},
                      grid=grid, attention_source=f"LLMServingSim tp{tp}/attention.csv (4-D grid)",
                      allreduce=allreduce, sources=[p.to_dict() for p in prof.provenance], assembly_notes=notes,
                      skew_used=not unused)
    return asm, t.attention, skew


def run_import(opts: ImportOptions, log: Callable[[str], None] = lambda _m: None) -> dict[str, Any]:
    """Build, check and write the profile; returns it (plus ``path``)."""
    model = get_model(opts.model)
    get_hardware(opts.hardware)  # PresetError lists the names
    if opts.tp < 1:
        raise SourceError(f"--tp must be >= 1, got {opts.tp}")
    if opts.skew not in SKEW_CHOICES:
        raise SourceError(f"--skew must be one of {', '.join(SKEW_CHOICES)}, got {opts.skew!r}")
    if opts.fmt not in FORMATS:
        raise SourceError(f"--format must be one of {', '.join(FORMATS)}, got {opts.fmt!r}")
    for flag, value, positive in (("--step-overhead-us", opts.step_overhead_us, False),
                                  ("--per-seq-overhead-us", opts.per_seq_overhead_us, False),
                                  ("--prompt-step-overhead-us", opts.prompt_step_overhead_us, False),
                                  ("--link-bandwidth", opts.link_bandwidth, True),
                                  ("--link-latency-us", opts.link_latency_us, False)):
        if value is not None and not (math.isfinite(value) and (value > 0 if positive else value >= 0)):
            raise SourceError(f"{flag} must be a finite number {'>' if positive else '>='} 0, got {value:g}")
    if opts.out is not None and not opts.out.strip():
        raise SourceError("--out is empty; name the profile's JSON file (default calibration/profiles/HW-MODEL-tpN.json)")
    path = Path(opts.out) if opts.out else Path("calibration/profiles") / f"{opts.hardware}-{model.name}-tp{opts.tp}.json"
    if path.is_dir():
        raise SourceError(f"--out {path}: is a folder; name the profile's JSON file")
    link = dict(PCIE_LINK)
    if opts.link_bandwidth is not None:
        link.update(bandwidth=opts.link_bandwidth, source="--link-bandwidth")
    if opts.link_latency_us is not None:
        link.update(latency_s=opts.link_latency_us * 1e-6, source=link["source"] + "; --link-latency-us")
    if opts.fmt == "llmservingsim" and Path(opts.paths[0]).is_dir():
        if len(opts.paths) != 1 or opts.extra:
            raise SourceError("an LLMServingSim profile folder (the one holding meta.yaml) is imported alone")
        allreduce = gp.allreduce_link(model, opts.tp, link["bandwidth"], link["latency_s"], link["source"])
        asm, att_rows, skew = assemble_llmservingsim(opts.paths[0], model, opts.hardware, opts.tp, allreduce,
                                                     opts.skew)
    else:
        if opts.skew != "auto":
            raise SourceError(f"--skew {opts.skew}: only an LLMServingSim profile folder has a skew.csv to use or ignore")
        from .gpu_composite import assemble_composite

        asm, att_rows, skew = assemble_composite(opts, model, link)
    asm.overhead = {"step_s": opts.step_overhead_us * 1e-6, "per_seq_s": opts.per_seq_overhead_us * 1e-6}
    asm.assembly_notes.append(
        f"Host overhead: {opts.step_overhead_us:g} us per step + {opts.per_seq_overhead_us:g} us per row "
        "(the kernel timings contain no scheduler or input-preparation time).")
    if opts.prompt_step_overhead_us:
        asm.overhead["prompt_step_s"] = opts.prompt_step_overhead_us * 1e-6
        asm.assembly_notes.append(
            f"Each step with a prompt row costs {opts.prompt_step_overhead_us:g} us of device time beyond its "
            "kernel tables (--prompt-step-overhead-us: a figure the user measured, not one of the sources).")
    gp.check_tables(asm, att_rows, skew, log)
    profile = gp.to_profile(asm)
    profile["provenance"]["imported"] = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    profile["provenance"]["command"] = command_line(opts)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(profile, separators=(",", ":")) + "\n")
    except OSError as e:  # /proc, a read-only or full file system, a file where a folder must be
        raise SourceError(f"--out {path}: cannot write the profile ({e.strerror or e}"
                          + (f": {e.filename}" if e.filename else "") + ")") from None
    return {**profile, "path": str(path)}


def command_line(opts: ImportOptions) -> str:
    parts = ["servesim calibrate import", f"--format {opts.fmt}", *opts.paths,
             *(f"--with {w}" for w in opts.extra), f"--model {opts.model}", f"--hardware {opts.hardware}",
             f"--tp {opts.tp}"]
    if opts.step_overhead_us or opts.per_seq_overhead_us:
        parts.append(f"--step-overhead-us {opts.step_overhead_us:g} --per-seq-overhead-us {opts.per_seq_overhead_us:g}")
    if opts.prompt_step_overhead_us:
        parts.append(f"--prompt-step-overhead-us {opts.prompt_step_overhead_us:g}")
    if opts.skew != "auto":
        parts.append(f"--skew {opts.skew}")
    return " ".join(parts)


def format_report(profile: dict[str, Any]) -> str:
    """The held-out error table the importer prints (fractions shown as %)."""
    h = profile["held_out_error"]

    def pct(e: dict[str, Any], k: str) -> str:
        return f"{100 * e[k]:.2f}%" if k in e else "-"

    lines = [f"{'held-out (not used to build the table)':<44} {'n':>6} {'median APE':>11} {'p90 APE':>9} "
             f"{'fit median':>11} {'fit p90':>9}"]

    def row(label: str, table: dict[str, Any], fit: dict[str, Any] | None = None) -> None:
        fit = fit or {}
        lines.append(f"{label:<44} {table.get('n', 0):>6} {pct(table, 'median_ape'):>11} {pct(table, 'p90_ape'):>9} "
                     f"{pct(fit, 'median_ape'):>11} {pct(fit, 'p90_ape'):>9}")

    for r, e in h.get("steps", {}).items():
        row(f"step, {r}", e)
    for r, e in h.get("attention", {}).items():
        row(f"attention, {r}", e.get("table", {}), e.get("fit"))
    if "dense_all_layers" in h:
        row("token ops, all layers summed", h["dense_all_layers"])
    for name, e in h.get("dense_ops", {}).items():
        row(f"  {name} ({e['chosen']})", e["table"], e["fit"])
    for name, e in h.get("per_sequence_ops", {}).items():
        row(f"  {name} ({e['chosen']})", e["table"], e["fit"])
    if "allreduce" in h:
        row("TP all-reduce, one call (table)", h["allreduce"])
    if h.get("skew_used") is False:
        lines.append("skew.csv scored but not used: unequal decode contexts are priced at their mean "
                     "(skew mean context grid is this profile's error on those batches)")
    for name, e in h.get("skew", {}).items():
        row(name.replace("_", " "), e)
    reading = h.get("attention_interpolation")
    if reading:
        lines.append(f"attention read {reading['chosen']!r} between nodes; held-out median / p90 of each reading tried:")
        for mode, regimes in reading.get("candidates", {}).items():
            lines.append(f"  {mode:<10} " + "  ".join(f"{r} {pct(e, 'median_ape')} / {pct(e, 'p90_ape')}"
                                                       for r, e in regimes.items() if e.get("n")))
    return "\n".join(lines)
