"""The roofline's attention against LLMServingSim's measured attention kernel, every shape.

LLMServingSim (casys-kaist/LLMServingSim @ 5daddb21a545, MIT, (c) 2024 CASYS Lab at KAIST; see
``../shared/data/gpu/SOURCES.md``) timed one layer's vLLM 0.19 attention call on real GPUs for a
grid of steps: a prefill chunk of ``prefill_chunk`` tokens over ``kv_prefill`` cached ones next to
``n_decode`` decode rows of ``kv_decode`` cached tokens each (``attention.csv``, five tables: RTX
PRO 6000 x Llama-3.1-8B tp1/tp2, x Qwen3-32B tp1/tp2, RTX 4090 x Llama-3.1-8B tp1). Every row is
priced by the default roofline's own attention term (``RooflineCostModel.breakdown``: launch
floors, KV write and the attention kernel, divided by the layers), once as the roofline priced it
before FA2's varlen kernel was modelled (a decode KV read plus a prefill: ``flash_attention=None``)
and once as it prices it now (``sim/varlen_attention.py``). Regimes: decode (no chunk), prefill
(no decode rows), mixed (both). Printed per table and regime: predicted / measured, median (p10,
p90), and the median and p90 absolute percentage error.

``--fit`` varies the one fitted constant of the varlen term (``EMPTY_CTA_S``, an SM's cost of a
thread block that exits at once) and fits it on one set of tables, minimising median + p90 APE of
the mixed rows, then scores another set: RTX PRO 6000 -> RTX 4090 and back (held out across GPUs),
Llama -> Qwen and back on the RTX PRO 6000, and a seeded 80/20 split of the RTX PRO 6000 rows.
``--skew`` prices ``skew.csv``'s mixed steps with unequal decode contexts (``nb`` rows at ``kv_big``,
the rest at ``kvs``; the file sums three timed calls, the importer divides). ``--exact N``
list-schedules every thread block of N sampled mixed shapes per table one by one, the structure
without the closed form (its tile time set the same way, from the reference prefill scheduled
block by block), next to the closed form. ``--decode-waves`` scores the decode-only term: FA2's
split-KV thread blocks in waves (``FA2VarlenAttention.decode_waves_s``), whose two constants per GPU
(``fa2_decode_tile_s``, ``fa2_decode_merge_s``) are fitted on that GPU's decode rows; printed: the
KV-read pricing before it, the shipped constants, and each GPU priced with the other GPU's fit.

    python benchmarks/mixed_attention.py [--data ../shared/data/gpu] [--fit] [--skew] [--exact 300]
        [--decode-waves]
"""

from __future__ import annotations

import argparse
import heapq
import math
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
from servesim.calibration.importers import llmservingsim
from servesim.sim import varlen_attention
from servesim.sim.batch import step_sums
from servesim.sim.cost_model import RooflineCostModel
from servesim.sim.presets import get_hardware, get_model

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "gpu"
# (folder under llmservingsim/profiles, preset model, preset hardware, TP degree)
TABLES = (
    ("RTXPRO6000/meta-llama/Llama-3.1-8B", "llama-3.1-8b", "rtx-pro-6000", 1),
    ("RTXPRO6000/meta-llama/Llama-3.1-8B", "llama-3.1-8b", "rtx-pro-6000", 2),
    ("RTXPRO6000/Qwen/Qwen3-32B", "qwen3-32b", "rtx-pro-6000", 1),
    ("RTXPRO6000/Qwen/Qwen3-32B", "qwen3-32b", "rtx-pro-6000", 2),
    ("RTX4090/meta-llama/Llama-3.1-8B", "llama-3.1-8b", "rtx-4090", 1),
)
REGIMES = ("decode", "prefill", "mixed")
I64 = np.int64


def step_of(chunk: int, kv_prefill: int, n_decode: int, kv_decode: int):
    """The step sums of one grid shape: the prefill row (if any) and n_decode decode rows."""
    q = np.array([chunk] * (chunk > 0) + [1] * n_decode, dtype=I64)
    ctx = np.array([kv_prefill] * (chunk > 0) + [kv_decode] * n_decode, dtype=I64)
    return step_sums(q, ctx)


def load(data: Path) -> pd.DataFrame:
    """Every measured shape of the five tables: axes, measured seconds, regime, table and presets."""
    frames = []
    for folder, model, hardware, tp in TABLES:
        att = llmservingsim.read_profile(data / "llmservingsim" / "profiles" / folder, tp=[tp]).tp[tp].attention
        att = att[(att["prefill_chunk"] > 0) | (att["n_decode"] > 0)].copy()
        att["regime"] = np.where(att["n_decode"] == 0, "prefill", np.where(att["prefill_chunk"] == 0, "decode", "mixed"))
        att["gpu"], att["model"], att["hardware"], att["tp"] = folder.split("/")[0], model, hardware, tp
        att["table"] = f"{hardware} {model} tp{tp}"
        att["sums"] = [step_of(*(int(v) for v in r)) for r in att[list(llmservingsim.ATTENTION_AXES)].to_numpy()]
        frames.append(att)
    return pd.concat(frames, ignore_index=True)


def roofline(model: str, hardware: str, tp: int, varlen: bool = True) -> RooflineCostModel:
    hw = get_hardware(hardware)
    return RooflineCostModel(get_model(model), hw if varlen else replace(hw, flash_attention=None), tp)


def attention_s(frame: pd.DataFrame, varlen: bool = True) -> np.ndarray:
    """The roofline's attention term per layer (seconds) for every row of ``frame``."""
    out = np.empty(len(frame))
    for (model, hardware, tp), idx in frame.groupby(["model", "hardware", "tp"]).indices.items():
        cm = roofline(model, hardware, tp, varlen)
        layers = cm.model.num_layers
        sums = frame["sums"].to_numpy()
        out[idx] = [cm.breakdown(sums[i])["attention"] / layers for i in idx]
    return out


@contextmanager
def empty_cta_s(seconds: float):
    """Price with another EMPTY_CTA_S (the models read it when built)."""
    saved = varlen_attention.EMPTY_CTA_S
    varlen_attention.EMPTY_CTA_S = seconds
    try:
        yield
    finally:
        varlen_attention.EMPTY_CTA_S = saved


def errors(pred: np.ndarray, measured: np.ndarray) -> dict[str, float]:
    ratio = pred / measured
    ape = np.abs(ratio - 1)
    return {"n": len(ratio), "ratio_med": float(np.median(ratio)), "ratio_p10": float(np.quantile(ratio, 0.1)),
            "ratio_p90": float(np.quantile(ratio, 0.9)), "ape_med": float(np.median(ape)),
            "ape_p90": float(np.quantile(ape, 0.9))}


def gap_table(frame: pd.DataFrame) -> str:
    """Before / after, per table and regime."""
    frame = frame.assign(before=attention_s(frame, varlen=False), after=attention_s(frame))
    lines = ["| GPU x model, TP | regime | shapes | before: predicted / measured, median (p10–p90) | before: APE "
             "median / p90 | after: predicted / measured | after: APE median / p90 |", "|---|---|---|---|---|---|---|"]
    for table, g in frame.groupby("table", sort=False):
        for regime in REGIMES:
            r = g[g["regime"] == regime]
            b, a = errors(r["before"].to_numpy(), r["seconds"].to_numpy()), errors(r["after"].to_numpy(),
                                                                                 r["seconds"].to_numpy())
            lines.append(f"| {table} | {regime} | {b['n']} | {b['ratio_med']:.2f} ({b['ratio_p10']:.2f}–"
                         f"{b['ratio_p90']:.2f}) | {100 * b['ape_med']:.1f} / {100 * b['ape_p90']:.1f} % | "
                         f"{a['ratio_med']:.2f} ({a['ratio_p10']:.2f}–{a['ratio_p90']:.2f}) | "
                         f"{100 * a['ape_med']:.1f} / {100 * a['ape_p90']:.1f} % |")
    return "\n".join(lines)


FIT_GRID = np.round(np.arange(0.0, 1.21, 0.05), 2) * 1e-6


def fit(frame: pd.DataFrame) -> tuple[float, dict[float, np.ndarray]]:
    """The EMPTY_CTA_S of FIT_GRID minimising median + p90 APE of ``frame``'s rows, and every
    grid value's predictions (seconds) for them."""
    preds = {}
    for e in FIT_GRID:
        with empty_cta_s(float(e)):
            preds[float(e)] = attention_s(frame)
    score = {e: errors(p, frame["seconds"].to_numpy()) for e, p in preds.items()}
    best = min(score, key=lambda e: score[e]["ape_med"] + score[e]["ape_p90"])
    return best, preds


def held_out(frame: pd.DataFrame) -> str:
    mixed = frame[frame["regime"] == "mixed"].reset_index(drop=True)
    _, preds = fit(mixed)
    measured = mixed["seconds"].to_numpy()
    before = attention_s(mixed, varlen=False)
    rng = np.random.default_rng(0)
    split = rng.random(len(mixed)) < 0.8
    pro, ada = mixed["gpu"] == "RTXPRO6000", mixed["gpu"] == "RTX4090"
    llama, qwen = pro & (mixed["model"] == "llama-3.1-8b"), pro & (mixed["model"] == "qwen3-32b")
    cases = (("RTX PRO 6000 (4 tables)", pro, "RTX 4090", ada), ("RTX 4090", ada, "RTX PRO 6000 (4 tables)", pro),
             ("RTX PRO 6000 Llama tp1+tp2", llama, "RTX PRO 6000 Qwen tp1+tp2", qwen),
             ("RTX PRO 6000 Qwen tp1+tp2", qwen, "RTX PRO 6000 Llama tp1+tp2", llama),
             ("RTX PRO 6000, seeded 80 %", pro & split, "RTX PRO 6000, the other 20 %", pro & ~split))
    lines = ["| fit on | EMPTY_CTA_S | scored on | shapes | before: APE median / p90 | after: APE median / p90 | "
             "after, own fit: APE median / p90 |", "|---|---|---|---|---|---|---|"]
    for fit_name, fit_rows, test_name, test_rows in cases:
        fit_rows, test_rows = fit_rows.to_numpy(), test_rows.to_numpy()
        best = min(preds, key=lambda e: sum(_med_p90(preds[e][fit_rows], measured[fit_rows])))
        own = min(preds, key=lambda e: sum(_med_p90(preds[e][test_rows], measured[test_rows])))
        b = _med_p90(before[test_rows], measured[test_rows])
        a = _med_p90(preds[best][test_rows], measured[test_rows])
        o = _med_p90(preds[own][test_rows], measured[test_rows])
        lines.append(f"| {fit_name} | {best * 1e6:.2f} µs | {test_name} | {test_rows.sum()} | "
                     f"{100 * b[0]:.1f} / {100 * b[1]:.1f} % | {100 * a[0]:.1f} / {100 * a[1]:.1f} % | "
                     f"{100 * o[0]:.1f} / {100 * o[1]:.1f} % ({own * 1e6:.2f} µs) |")
    return "\n".join(lines)


def _med_p90(pred: np.ndarray, measured: np.ndarray) -> tuple[float, float]:
    ape = np.abs(pred / measured - 1)
    return float(np.median(ape)), float(np.quantile(ape, 0.9))


def serving_like(frame: pd.DataFrame) -> str:
    """Mixed shapes like a busy vLLM step: a chunk of 512+ tokens beside 32+ decodes at 256-4096."""
    r = frame[(frame["regime"] == "mixed") & (frame["prefill_chunk"] >= 512) & (frame["n_decode"] >= 32)
              & frame["kv_decode"].between(256, 4096)]
    r = r.assign(before=attention_s(r, varlen=False), after=attention_s(r))
    lines = ["| GPU x model, TP | shapes | before: predicted / measured, median (p10–p90) | after |", "|---|---|---|---|"]
    for table, g in r.groupby("table", sort=False):
        b, a = errors(g["before"].to_numpy(), g["seconds"].to_numpy()), errors(g["after"].to_numpy(),
                                                                             g["seconds"].to_numpy())
        lines.append(f"| {table} | {b['n']} | {b['ratio_med']:.2f} ({b['ratio_p10']:.2f}–{b['ratio_p90']:.2f}) | "
                     f"{a['ratio_med']:.2f} ({a['ratio_p10']:.2f}–{a['ratio_p90']:.2f}) |")
    return "\n".join(lines)


def skew(data: Path) -> str:
    """skew.csv's mixed steps (unequal decode contexts): ``nb`` rows at kv_big, the rest at kvs."""
    lines = ["| GPU x model, TP | shapes | before: predicted / measured, median (p10–p90) | after | after: APE "
             "median / p90 |", "|---|---|---|---|---|"]
    for folder, model, hardware, tp in TABLES:
        sk = llmservingsim.read_profile(data / "llmservingsim" / "profiles" / folder, tp=[tp]).tp[tp].skew
        if sk is None or sk.empty:
            continue
        sk = sk[(sk["regime"] == "mixed") & (sk["pc"] > 0)]
        res = {True: [], False: []}
        for varlen in res:
            cm = roofline(model, hardware, tp, varlen)
            for r in sk.itertuples():
                n, nb = int(r.n), int(r.nb)
                q = np.array([int(r.pc)] + [1] * n, dtype=I64)
                ctx = np.array([int(r.kp)] + [int(r.kv_big)] * nb + [int(r.kvs)] * (n - nb), dtype=I64)
                longest = int(ctx[1:].max()) + 1
                res[varlen].append(cm.breakdown(step_sums(q, ctx), 0.0, longest)["attention"] / cm.model.num_layers)
        measured = sk["t_skew_s"].to_numpy()
        b, a = errors(np.array(res[False]), measured), errors(np.array(res[True]), measured)
        lines.append(f"| {hardware} {model} tp{tp} | {b['n']} | {b['ratio_med']:.2f} ({b['ratio_p10']:.2f}–"
                     f"{b['ratio_p90']:.2f}) | {a['ratio_med']:.2f} ({a['ratio_p10']:.2f}–{a['ratio_p90']:.2f}) | "
                     f"{100 * a['ape_med']:.1f} / {100 * a['ape_p90']:.1f} % |")
    return "\n".join(lines)


def exact_makespan(durations: list[float], sms: int) -> float:
    """Greedy list schedule in launch order: each block to the SM that frees first."""
    if len(durations) <= sms:
        return max(durations)
    free = [0.0] * sms
    for d in durations:
        heapq.heapreplace(free, free[0] + d)
    return max(free)


def exact_reference_its(sms: int) -> float:
    """The reference prefill (varlen_attention.REFERENCE_*) list-scheduled block by block, in tile
    iterations."""
    tokens, bm, bn = varlen_attention.REFERENCE_TOKENS, varlen_attention.BLOCK_M, 128
    tiles = [math.ceil(min(bm * (b + 1), tokens) / bn) for b in range(math.ceil(tokens / bm))]
    return exact_makespan([float(t) for t in tiles] * varlen_attention.REFERENCE_HEADS, sms)


def exact(frame: pd.DataFrame, per_table: int) -> str:
    """The varlen kernel's blocks list-scheduled one by one (tiles of each row exactly, empty tiles
    as a fluid term), against the closed form, on a seeded sample of mixed shapes."""
    lines = ["| GPU x model, TP | shapes | exact list schedule: APE median / p90 | closed form (shipped): APE "
             "median / p90 |", "|---|---|---|---|"]
    for table, g in frame[frame["regime"] == "mixed"].groupby("table", sort=False):
        g = g.sample(min(per_table, len(g)), random_state=0)
        cm = roofline(g["model"].iloc[0], g["hardware"].iloc[0], int(g["tp"].iloc[0]))
        v, layers, fixed = cm._varlen, cm.model.num_layers, cm._attn_fixed
        tile_s = v.tile_s * varlen_attention.reference_iterations(v.sms) / exact_reference_its(v.sms)
        pred = []
        for r in g.itertuples():
            c, kp, n, kd = int(r.prefill_chunk), int(r.kv_prefill), int(r.n_decode), int(r.kv_decode)
            tiles = math.ceil(c / varlen_attention.BLOCK_M)
            pre = [tile_s * math.ceil((kp + min(varlen_attention.BLOCK_M * (b + 1), c)) / v.block_n)
                   for b in range(tiles)]
            dec = [tile_s * math.ceil((kd + 1) / v.block_n)] * n
            busy = exact_makespan((dec + pre) * v.heads, v.sms) + v.empty_cta_s * v.heads * n * (tiles - 1) / v.sms
            kernel = max(busy, v.kv_read_s(n, tiles, n * (kd + 1), kp + c))
            pred.append((fixed + (c + n) * cm._kv_s) / layers + kernel)
        e = _med_p90(np.array(pred), g["seconds"].to_numpy())
        c = _med_p90(attention_s(g), g["seconds"].to_numpy())
        lines.append(f"| {table} | {len(g)} | {100 * e[0]:.1f} / {100 * e[1]:.1f} % | {100 * c[0]:.1f} / "
                     f"{100 * c[1]:.1f} % |")
    return "\n".join(lines)


# --decode-waves: the decode-only term's two constants per GPU (presets' fa2_decode_tile_s /
# fa2_decode_merge_s), varied over a grid
DECODE_TILE_GRID = np.round(np.arange(3.0, 10.01, 0.25), 2) * 1e-6  # seconds per KV tile of a block
DECODE_MERGE_GRID = np.round(np.arange(0.0, 6.01, 0.5), 1) * 1e-6  # seconds of the kernel that merges splits


def decode_waves(frame: pd.DataFrame) -> str:
    """The roofline's decode-only attention against the measured decode rows: as a KV read (before
    the waves term), with each GPU's shipped constants, and with the constants fitted on the other
    GPU's tables (median + p90 APE), the held-out score."""
    dec = frame[frame["regime"] == "decode"].reset_index(drop=True)
    measured = dec["seconds"].to_numpy()
    keys = list(dec.groupby(["model", "hardware", "tp"]).groups)
    rows = {key: (dec[["model", "hardware", "tp"]].apply(tuple, axis=1) == key).to_numpy() for key in keys}
    sums = dec["sums"].to_numpy()

    def priced(tile: float | None, merge: float) -> np.ndarray:
        out = np.empty(len(dec))
        for (model, hardware, tp), idx in rows.items():
            hw = replace(get_hardware(hardware), fa2_decode_tile_s=tile, fa2_decode_merge_s=merge)
            cm = RooflineCostModel(get_model(model), hw, tp)
            out[idx] = [cm.breakdown(sums[i])["attention"] / cm.model.num_layers for i in np.flatnonzero(idx)]
        return out

    read = priced(None, 0.0)
    shipped = attention_s(dec)
    grid = {(t, m): priced(float(t), float(m)) for t in DECODE_TILE_GRID for m in DECODE_MERGE_GRID}
    pro, ada = (dec["gpu"] == "RTXPRO6000").to_numpy(), (dec["gpu"] == "RTX4090").to_numpy()
    lines = ["| scored on | shapes | KV read (before): APE median / p90 | shipped constants | fitted on | "
             "its constants | held out: APE median / p90 |", "|---|---|---|---|---|---|---|"]
    for test_name, test_rows, fit_name, fit_rows in (("RTX PRO 6000 (4 tables)", pro, "RTX 4090", ada),
                                                     ("RTX 4090", ada, "RTX PRO 6000 (4 tables)", pro)):
        best = min(grid, key=lambda k: sum(_med_p90(grid[k][fit_rows], measured[fit_rows])))
        r, s_, h = (_med_p90(p[test_rows], measured[test_rows]) for p in (read, shipped, grid[best]))
        lines.append(f"| {test_name} | {test_rows.sum()} | {100 * r[0]:.1f} / {100 * r[1]:.1f} % | "
                     f"{100 * s_[0]:.1f} / {100 * s_[1]:.1f} % | {fit_name} | {best[0] * 1e6:.2f} µs, "
                     f"{best[1] * 1e6:.1f} µs | {100 * h[0]:.1f} / {100 * h[1]:.1f} % |")
    for name, rows_ in (("RTX PRO 6000 (4 tables)", pro), ("RTX 4090", ada)):
        own = min(grid, key=lambda k: sum(_med_p90(grid[k][rows_], measured[rows_])))
        o = _med_p90(grid[own][rows_], measured[rows_])
        lines.append(f"\nOwn fit, {name}: {own[0] * 1e6:.2f} µs a tile, {own[1] * 1e6:.1f} µs to merge, "
                     f"APE {100 * o[0]:.1f} / {100 * o[1]:.1f} %")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA, help="the shared gpu data folder (default: %(default)s)")
    ap.add_argument("--fit", action="store_true", help="fit EMPTY_CTA_S on one set of tables, score another")
    ap.add_argument("--skew", action="store_true", help="also price skew.csv's mixed steps with unequal contexts")
    ap.add_argument("--decode-waves", action="store_true",
                    help="also score the decode-only term (FA2's blocks in waves): before, shipped, held out across GPUs")
    ap.add_argument("--exact", type=int, default=0, metavar="N",
                    help="also list-schedule N sampled mixed shapes per table block by block")
    args = ap.parse_args()
    if not (args.data / "SOURCES.md").is_file():
        raise SystemExit(f"error: {args.data} is not the shared GPU data folder (no SOURCES.md); pass --data")
    frame = load(args.data)
    print("## Attention per layer, roofline before (decode read + prefill) and after (FA2 varlen kernel)\n")
    print(gap_table(frame))
    print("\n## Mixed shapes like a busy serving step (chunk >= 512, >= 32 decodes at 256-4096)\n")
    print(serving_like(frame))
    if args.fit:
        print(f"\n## EMPTY_CTA_S fitted on one set, scored on another (mixed shapes; shipped: "
              f"{varlen_attention.EMPTY_CTA_S * 1e6:.2f} µs)\n")
        print(held_out(frame))
    if args.skew:
        print("\n## Unequal decode contexts (skew.csv, mixed steps)\n")
        print(skew(args.data))
    if args.decode_waves:
        print("\n## Decode-only attention: a KV read before, FA2's blocks in waves now\n")
        print(decode_waves(frame))
    if args.exact:
        print("\n## The structure without the closed form: blocks list-scheduled one by one\n")
        print(exact(frame, args.exact))


if __name__ == "__main__":
    main()
