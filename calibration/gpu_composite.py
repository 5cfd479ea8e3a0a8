"""A GPU profile joined from several published sources (H100, A100: no single LLMServingSim folder).

Roles, in order of preference (every choice is written into ``provenance.assembly``):

- GEMMs (qkv, o, gate_up, down) and the LM head: the LLMServingSim v0 ``layers.csv`` when it
  measured the same model (its q/k/v and gate/up GEMMs summed), else Vidur's ``mlp.csv`` for the
  GEMMs and the default roofline's LM-head term (``RooflineCostModel``), labelled;
- small ops (norms, rotary, activation, embedding): Vidur's ``mlp.csv`` (vLLM-like fused kernels;
  its separate residual ``add`` is left out because vLLM fuses it into the RMSNorm; the
  activation scaled by intermediate size when Vidur measured another model), else the v0 file
  (unfused Hugging Face kernels, slower: said so);
- attention: inference-sim decode grid (batch x KV length) and causal-prefill points; prefill with
  cached context and chunk sizes off the points come from a fit on query-key pairs; a mixed step
  adds its prefill and decode parts (less one shared launch), which LLMServingSim's RTX data
  shows underestimates mixed steps under FlashAttention 2 (decode rows run in the prefill kernel
  there; the H100 runs FA3, unmeasured); without any attention source, the default roofline's
  attention term (``RooflineCostModel``, its FA2 varlen term included) at every node, labelled;
- TP all-reduce: Vidur's ``all_reduce.csv`` at the TP degree within one node (NCCL on a DGX); else the
  link model;
- sampler: no source measures it on these GPUs; a labelled estimate (launch + reading the logits).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from servesim.sim.cost_model import RooflineCostModel
from servesim.sim.layer_cost_model import tail_slope
from servesim.sim.presets import ModelConfig, get_hardware, kv_heads_per_rank

from . import gpu_profile as gp
from .importers import SourceError, inference_sim, llmservingsim, numeric, read_csv, vidur
from .source_checks import check_hardware_matches, check_ops_cover

GEMMS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# the small ops Vidur's mlp.csv measures (its input_layernorm stands in for the final norm too) ...
VIDUR_SMALL_OPS = ("layernorm", "layernorm_post", "rotary_emb", "act_fn", "embedding")
# ... and those a v0 layers.csv gives when it is the only source of them
V0_SMALL_OPS = (*VIDUR_SMALL_OPS, "final_layernorm")
# the columns of Vidur's mlp.csv that give the layer it measured
VIDUR_SHAPE = ("n_embd", "n_expanded_embd", "n_head", "n_kv_head")
# roofline constants where one of decode / prefill attention was measured and the other not (no
# shipped profile), and the sampler estimate
FLOPS_EFF, BW_EFF, LAUNCH_S = 0.6, 0.8, 10e-6
SAMPLER_LAUNCH_S = 20e-6


def _need_ops(table: pd.DataFrame, path: Any, ops: Sequence[str]) -> None:
    """A source table (op per column) holds every op the profile is built from, each at every token
    count of the table (``check_ops_cover`` names a shorter range); else ``SourceError``."""
    missing = [op for op in ops if op not in table.columns]
    if missing:
        raise SourceError(f"{path}: no rows for op {missing[0]!r} (has: {', '.join(map(str, table.columns))}); "
                          "give the source's complete table")
    check_ops_cover(table, str(path), ops, "tokens")
    holes = table[list(ops)].isna()
    if holes.to_numpy().any():  # these tables are read at their own token counts, not interpolated
        op = holes.columns[holes.any().to_numpy()][0]
        raise SourceError(f"{path}: no row for op {op!r} at tokens {table.index[holes[op].to_numpy()][0]}; give every "
                          "op every token count of the table")


def _sources(opts: Any) -> list[tuple[str, Path]]:
    out = [(opts.fmt, Path(p)) for p in opts.paths]
    for item in opts.extra:
        fmt, sep, path = item.partition(":")
        if not sep or fmt not in ("llmservingsim", "vidur", "inference-sim"):
            raise SourceError(f"--with {item!r}: expected FORMAT:PATH with FORMAT llmservingsim, vidur or inference-sim")
        out.append((fmt, Path(path)))
    return out


def _role(fmt: str, path: Path) -> str:
    """What a source is used for; one source per role."""
    if fmt == "llmservingsim":
        return "LLMServingSim v0 layers.csv"
    if fmt == "vidur":
        return "Vidur all_reduce.csv" if path.name == "all_reduce.csv" else "Vidur mlp.csv"
    return f"inference-sim {inference_sim.heads(path)[0]} file"


def _layer_shape(path: Path) -> pd.Series:
    """The layer a Vidur mlp.csv measured (``VIDUR_SHAPE``): whole numbers, the same on every row."""
    df = numeric(read_csv(path, VIDUR_SHAPE), path, VIDUR_SHAPE, positive=VIDUR_SHAPE, whole=VIDUR_SHAPE)
    for c in VIDUR_SHAPE:
        other = df[df[c] != df[c].iloc[0]]
        if len(other):
            raise SourceError(f"{path}: rows {df.index[0] + 2} and {other.index[0] + 2} measure different layers ({c} "
                              f"{df[c].iloc[0]:g} vs {other[c].iloc[0]:g}); give one model's mlp.csv")
    return df.iloc[0]


def _on_grid(xs: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """y(x) resampled at xs: linear inside, linear with the top quarter's slope beyond."""
    order = np.argsort(x)
    x, y = x[order].astype(float), y[order].astype(float)
    out = np.interp(xs, x, y)
    slope = tail_slope(x, y)
    return np.where(xs > x[-1], y[-1] + slope * (xs - x[-1]), out)


def assemble_composite(opts: Any, model: ModelConfig, link: dict[str, Any]) -> tuple[gp.Assembly, None, None]:
    """(assembly, None, None): attention checks happen here, not on an LLMServingSim 4-D sweep."""
    hw = get_hardware(opts.hardware)
    tp = opts.tp
    v0 = mlp = allreduce = None
    v0_path = mlp_path = None
    decode = prefill = None
    provs, notes = [], []
    first: dict[str, Path] = {}
    for fmt, path in _sources(opts):
        role = _role(fmt, path)
        if role in first:
            raise SourceError(f"{path}: a second {role} (the first: {first[role]}); give one")
        first[role] = path
        if fmt == "llmservingsim":
            if path.is_dir():
                raise SourceError(f"{path}: an LLMServingSim profile folder is a whole profile; import it alone")
            df, prov = llmservingsim.read_v0_layers(path)
            check_hardware_matches(prov.gpu, opts.hardware, str(path))
            v0, v0_path = df[df["tp"] == tp], path
            if v0.empty:
                raise SourceError(f"{path}: no rows for tp {tp}")
            provs.append(prov)
        elif fmt == "vidur" and path.name == "all_reduce.csv":
            df, prov = vidur.read_all_reduce(path)
            check_hardware_matches(prov.gpu, opts.hardware, str(path))
            # tensor parallelism stays inside one node: Vidur's A100 file also times each degree
            # spread over two nodes (devices_per_node < num_workers), 10-30x slower at large messages
            at_tp = df[df["num_workers"] == tp]
            allreduce = at_tp[at_tp["devices_per_node"] >= tp]
            sizes = sorted(set(allreduce["bytes"]))
            if tp > 1 and not sizes and len(at_tp):
                raise SourceError(f"{path}: num_workers {tp} is only timed across nodes (devices_per_node "
                                  f"{sorted(set(at_tp['devices_per_node']))}); tensor parallelism needs one node")
            if tp > 1 and not sizes:
                raise SourceError(f"{path}: no rows for num_workers {tp} (has {sorted(set(df['num_workers']))})")
            if tp > 1 and len(sizes) < 2:
                raise SourceError(f"{path}: one message size at num_workers {tp} ({sizes[0]} bytes); the all-reduce "
                                  "table needs at least two")
            provs.append(prov)
        elif fmt == "vidur":
            df, prov = vidur.read_mlp(path)
            check_hardware_matches(prov.gpu, opts.hardware, str(path))
            mlp = df[df["tp"] == tp]
            if mlp.empty:
                raise SourceError(f"{path}: no rows for tensor parallel {tp} (has {sorted(set(df['tp']))})")
            mlp_dims = _layer_shape(path)
            mlp_path = path
            provs.append(prov)
        else:
            kind, _gpu, q_heads, kv_heads, dim, file_tp = inference_sim.heads(path)
            if (q_heads, kv_heads, dim) != (model.num_heads, model.num_kv_heads, model.head_dim):
                raise SourceError(f"{path}: measures {q_heads} query / {kv_heads} KV heads of dim {dim}; "
                                  f"{model.name} has {model.num_heads} / {model.num_kv_heads} of dim {model.head_dim}")
            if file_tp != tp:
                raise SourceError(f"{path}: measures attention at tp {file_tp}, --tp is {tp}")
            if kind == "decode":
                decode, prov = inference_sim.read_decode(path)
                batches, kvs = sorted(set(decode["batch"])), sorted(set(decode["kv_len"]))
                if len(batches) < 2 or len(kvs) < 2:
                    raise SourceError(f"{path}: a decode grid needs at least two batch sizes and two KV lengths, has "
                                      f"batch {batches} x KV {kvs}")
            else:
                prefill, prov = inference_sim.read_prefill(path)
                if len(prefill) < 4:
                    raise SourceError(f"{path}: the prefill fit needs at least 4 sequence lengths (3 terms, checked "
                                      f"leave-one-out), has {len(prefill)}")
            check_hardware_matches(prov.gpu, opts.hardware, str(path))
            provs.append(prov)
    if v0 is None and mlp is None:
        raise SourceError("no dense-op source: give a Vidur mlp.csv or the LLMServingSim v0 layers.csv")
    v0_same_model = v0 is not None and model.name == "llama-3.1-8b"
    if v0 is not None and not v0_same_model:
        raise SourceError(f"the LLMServingSim v0 layers.csv measures Llama-3.1-8B, not {model.name}")

    if mlp is not None:  # Vidur's layer shape: its hidden size for any op, all of it for its GEMMs
        shape = {k: int(mlp_dims[k]) for k in ("n_embd", "n_expanded_embd", "n_head", "n_kv_head")}
        ours = {"n_embd": model.hidden_size, "n_expanded_embd": model.intermediate_size, "n_head": model.num_heads,
                "n_kv_head": model.num_kv_heads}
        need = ("n_embd",) if v0_same_model else tuple(ours)
        bad = [k for k in need if shape[k] != ours[k]]
        if bad:
            raise SourceError(f"{mlp_path}: measures a layer with {bad[0]} = {shape[bad[0]]}, {model.name} has "
                              f"{ours[bad[0]]}" + ("" if v0_same_model else " (its GEMMs would be another model's)"))

    # ---- token ops ----
    if v0_same_model:
        g = v0.pivot_table(index="tokens", columns="op", values="seconds", aggfunc="median").sort_index()
        _need_ops(g, v0_path, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head",
                               *(() if mlp is not None else V0_SMALL_OPS)))
        xs = g.index.to_numpy()
        gemm = {"qkv_proj": g["q_proj"] + g["k_proj"] + g["v_proj"], "o_proj": g["o_proj"],
                "gate_up_proj": g["gate_proj"] + g["up_proj"], "down_proj": g["down_proj"]}
        gemm_src = "LLMServingSim v0 H100 layers.csv (q+k+v and gate+up summed)"
    else:
        g = mlp.pivot_table(index="tokens", columns="op", values="seconds", aggfunc="median").sort_index()
        _need_ops(g, mlp_path, GEMMS)
        xs = g.index.to_numpy()
        gemm = {k: g[k] for k in GEMMS}
        gemm_src = "Vidur mlp.csv"
    dense_ops: dict[str, dict[str, Any]] = {
        k: {"per": "layer", "count": 1, "seconds": np.asarray(v, dtype=float).tolist(), "source": gemm_src}
        for k, v in gemm.items()}
    if mlp is not None:
        s = mlp.pivot_table(index="tokens", columns="op", values="seconds", aggfunc="median").sort_index()
        _need_ops(s, mlp_path, VIDUR_SMALL_OPS)
        sx = s.index.to_numpy()
        act_scale = (model.intermediate_size / tp) / (float(mlp_dims["n_expanded_embd"]) / tp)
        for op, per, count, scale in (("layernorm", "layer", 1, 1.0), ("layernorm_post", "layer", 1, 1.0),
                                      ("rotary_emb", "layer", 1, 1.0), ("act_fn", "layer", 1, act_scale),
                                      ("embedding", "step", 1, 1.0), ("final_layernorm", "step", 1, 1.0)):
            col = "layernorm" if op == "final_layernorm" else op
            dense_ops[op] = {"per": per, "count": count, "seconds": (_on_grid(xs, sx, s[col].to_numpy()) * scale).tolist(),
                             "native": (sx, s[col].to_numpy() * scale),
                             "source": "Vidur mlp.csv" + (f" x {scale:.3f} (intermediate size)" if scale != 1 else "")
                             + (" (input_layernorm, as the final norm)" if op == "final_layernorm" else "")}
        notes.append("Small ops (norms, rotary, activation, embedding) from Vidur's mlp.csv; Vidur's separate "
                     "residual add is left out (vLLM fuses it into the RMSNorm); the final norm is Vidur's "
                     "input_layernorm" + (f"; act_fn scaled x{act_scale:.3f} for the intermediate size"
                                          if act_scale != 1 else "") + ".")
    else:
        for op, per in (("layernorm", "layer"), ("layernorm_post", "layer"), ("rotary_emb", "layer"),
                        ("act_fn", "layer"), ("embedding", "step"), ("final_layernorm", "step")):
            dense_ops[op] = {"per": per, "count": 1, "seconds": g[op].tolist(),
                             "source": "LLMServingSim v0 layers.csv (unfused Hugging Face kernel: slower than vLLM's)"}
        notes.append("Small ops from the v0 layers.csv: unfused Hugging Face kernels, slower than vLLM's fused ones.")
    notes.append(f"GEMMs from {gemm_src}.")

    # ---- LM head and sampler ----
    seqs = np.array([1, 2, 4, 8, 16, 32, 64, 128, 256, 512], dtype=float)
    if v0_same_model:
        lm = _on_grid(seqs, xs.astype(float), g["lm_head"].to_numpy())
        lm_src = "LLMServingSim v0 layers.csv lm_head at M = rows"
    else:
        roof = RooflineCostModel(model, hw, tp)
        lm = np.array([roof.breakdown((n, n, n, 0, n, 0))["lm_head"] for n in seqs.astype(int).tolist()])
        lm_src = (f"roofline (not measured in these sources): servesim's RooflineCostModel LM head term, the "
                  f"weights at {roof.bandwidth_efficiency:g} x HBM and the FLOPs at {roof.flops_efficiency:g} x "
                  f"peak blended, + a {hw.kernel_floor_s * 1e6:g} us kernel floor")
    sampler = SAMPLER_LAUNCH_S + 3 * seqs * model.vocab_size * 4 / (hw.hbm_bandwidth * BW_EFF)
    sampler_src = (f"estimate (no source measures the sampler on this GPU): {SAMPLER_LAUNCH_S * 1e6:g} us + reading "
                   f"the fp32 logits 3 times at {BW_EFF:g} x HBM bandwidth")
    notes.append(f"LM head: {lm_src}. Sampler: {sampler_src}.")

    # ---- attention ----
    grid, att_check, att_src = _attention(model, hw, tp, decode, prefill, notes)

    # ---- all-reduce ----
    ar_check = None  # held-out error of a measured table
    if tp == 1:
        ar = {"type": "none"}
    elif allreduce is not None and len(allreduce):
        t = allreduce.groupby("bytes")["seconds"].median().sort_index()
        ar_check = gp.check_allreduce(t.index.to_numpy(), t.to_numpy())
        secs = gp.monotone_seconds(t.to_numpy())  # NCCL's small-message noise: a monotone fit
        ar = {"type": "table", "count": 2 * model.num_layers + 1, "bytes_per_token": model.hidden_size * model.dtype_bytes,
              "bytes": t.index.astype(float).tolist(), "seconds": secs.tolist(),
              "source": f"Vidur all_reduce.csv, {tp} GPUs in one node (median per size, isotonic regression)"}
        notes.append(f"TP all-reduce: Vidur's all_reduce.csv at {tp} GPUs in one node (NCCL on a DGX; its two-node "
                     f"rows left out), the median per message size made monotone by isotonic regression; "
                     f"{ar['count']} calls a step (two per layer, one after the embedding) of {ar['bytes_per_token']} "
                     f"bytes per token, read log-log between {t.index[0]:g} and {t.index[-1]:g} bytes and linear "
                     "beyond with the slope of the largest quarter of the sizes.")
    else:
        ar = gp.allreduce_link(model, tp, link["bandwidth"], link["latency_s"], link["source"])
        notes.append(f"TP all-reduce: no measured table for {tp} GPUs: {ar['count']} ring all-reduces a step over "
                     f"the link model ({link['source']}).")
    asm = gp.Assembly(model=model, hardware=opts.hardware, tp=tp, dense_tokens=[int(x) for x in xs],
                      dense_ops=dense_ops, seq_sequences=[int(x) for x in seqs],
                      seq_ops={"lm_head": lm.tolist(), "sampler": sampler.tolist()},
                      seq_sources={"lm_head": lm_src, "sampler": sampler_src}, grid=grid, attention_source=att_src,
                      allreduce=ar, sources=[p.to_dict() for p in provs], assembly_notes=notes,
                      allreduce_check=ar_check)
    asm.attention_check = att_check
    asm.seq_native = {"lm_head": (xs, g["lm_head"].to_numpy()) if v0_same_model else None, "sampler": None}
    return asm, None, None


def _attention(model: ModelConfig, hw: Any, tp: int, decode: pd.DataFrame | None, prefill: pd.DataFrame | None,
               notes: list[str]) -> tuple[gp.Grid, dict[str, Any], str]:
    """The 4-D grid from inference-sim's decode grid and prefill points, or a labelled roofline."""
    kv_bytes = 2 * kv_heads_per_rank(model, tp) * model.head_dim * model.dtype_bytes  # one layer, one token
    flops_per_pair = 4 * (model.num_heads // tp) * model.head_dim
    pcs = np.array([0, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192], dtype=float)
    kps = np.array([0, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072], dtype=float)
    check: dict[str, Any] = {}
    if decode is not None:
        d = decode.pivot_table(index="batch", columns="kv_len", values="seconds", aggfunc="median").sort_index()
        # a row slower at its shortest context than at the next is a warm-up outlier (SOURCES.md)
        fixed = 0
        for b in d.index:
            row = d.loc[b].dropna()
            if len(row) >= 2 and row.iloc[0] > row.iloc[1]:
                d.loc[b, row.index[0]] = row.iloc[1]
                fixed += 1
        ns = np.array([0, *d.index.tolist()], dtype=float)
        kvs = np.array([0, *d.columns.tolist()], dtype=float)
        dec = np.full((len(ns), len(kvs)), np.nan)
        dec[1:, 1:] = d.to_numpy()
        dec[:, 0] = dec[:, 1]
        check["decode"] = _decode_holdout(d)
        notes.append(f"Decode attention: inference-sim grid, batch {int(ns[1])}..{int(ns[-1])} x KV "
                     f"{int(kvs[1])}..{int(kvs[-1])} ({fixed} warm-up outlier(s) at the shortest context replaced by "
                     "the next context's time; shorter contexts take the first context's time).")
        src = "inference-sim decode grid"
    else:
        ns = np.array([0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512], dtype=float)
        kvs = np.array([0, 16, 64, 256, 1024, 4096, 16384, 65536, 131072], dtype=float)
        if prefill is None:  # nothing measured: the default roofline's attention, cell by cell
            return _roofline_attention(model, hw, tp, pcs, kps, ns, kvs, notes)
        dec = LAUNCH_S + ns[:, None] * kvs[None, :] * kv_bytes / (hw.hbm_bandwidth * BW_EFF)
        notes.append(f"Decode attention: ROOFLINE, no decode attention measured on this GPU in these sources: "
                     f"{LAUNCH_S * 1e6:g} us + KV read at {BW_EFF:g} x HBM bandwidth.")
        src = "roofline decode"
    if prefill is not None:
        x = prefill["seq_len"].to_numpy(dtype=float)
        feats = np.stack([np.ones_like(x), x, x * (x + 1) / 2], axis=1)
        coef = gp.nnls_relative(feats, prefill["seconds"].to_numpy())
        loo = []
        for i in range(len(x)):
            m = np.arange(len(x)) != i
            c = gp.nnls_relative(feats[m], prefill["seconds"].to_numpy()[m])
            loo.append(float(feats[i] @ c))
        # the table of a composite profile IS this fit: both columns report its leave-one-out error
        loo_err = gp.ape_summary(np.array(loo), prefill["seconds"].to_numpy())
        check["prefill"] = {"table": loo_err, "fit": loo_err, "note": "leave-one-out over the prefill points"}

        def pre(pc: np.ndarray, kp: np.ndarray) -> np.ndarray:
            return coef[0] + coef[1] * pc + coef[2] * pc * (kp + (pc + 1) / 2)

        notes.append(f"Prefill attention: fit to inference-sim's {len(x)} causal prefill points "
                     f"({int(x.min())}..{int(x.max())} tokens, empty cache): {coef[0] * 1e6:.2f} us + "
                     f"{coef[1] * 1e9:.3f} ns/token + {coef[2] * 1e12:.4f} ps per query-key pair; a chunk over "
                     "cached context is priced by its pairs (no measurement with cached context exists).")
        src += " + inference-sim prefill fit"
    else:
        def pre(pc: np.ndarray, kp: np.ndarray) -> np.ndarray:
            pairs = pc * (kp + (pc + 1) / 2)
            return LAUNCH_S + np.maximum(pairs * flops_per_pair / (hw.peak_flops * FLOPS_EFF),
                                         (pc + kp) * kv_bytes / (hw.hbm_bandwidth * BW_EFF))

        notes.append(f"Prefill attention: ROOFLINE, no prefill attention measured on this GPU in these sources "
                     f"({FLOPS_EFF:g} x peak FLOP/s or {BW_EFF:g} x HBM, + {LAUNCH_S * 1e6:g} us).")
        src += " + roofline prefill"
    pc4, kp4 = np.meshgrid(pcs, kps, indexing="ij")
    p2 = np.where(pc4 > 0, pre(pc4, np.where(pc4 > 0, kp4, 0.0)), np.nan)
    shared = min(float(np.nanmin(p2)), float(np.nanmin(dec[1:, 1:])))
    arr = np.empty((len(pcs), len(kps), len(ns), len(kvs)))
    for i in range(len(pcs)):
        for j in range(len(kps)):
            for k in range(len(ns)):
                p = p2[i, j] if pcs[i] > 0 else 0.0
                dd = dec[k, :] if ns[k] > 0 else np.zeros(len(kvs))
                both = (pcs[i] > 0) and (ns[k] > 0)
                arr[i, j, k, :] = p + dd - (shared if both else 0.0)
    arr[0, :, 0, :] = np.nan  # the empty step: set by fill_gaps, never priced
    arr = gp.fill_gaps(arr, [pcs, kps, ns, kvs])  # decode-grid holes (none in the published files)
    notes.append(f"Mixed steps: prefill part + decode part - one shared launch ({shared * 1e6:.1f} us). On "
                 "LLMServingSim's RTX PRO 6000 data this composition underestimates mixed steps (the decode rows "
                 "run in the prefill kernel there), so mixed steps on this profile are optimistic.")
    axes = {"prefill_chunk": pcs.astype(int).tolist(), "kv_prefill": kps.astype(int).tolist(),
            "n_decode": ns.astype(int).tolist(), "kv_decode": kvs.astype(int).tolist()}
    measured = 0 if decode is None else int(decode.shape[0]) + (0 if prefill is None else len(prefill))
    return gp.Grid(axes, arr, measured, int(arr.size - measured)), check, src


def _roofline_attention(model: ModelConfig, hw: Any, tp: int, pcs: np.ndarray, kps: np.ndarray, ns: np.ndarray,
                        kvs: np.ndarray, notes: list[str]) -> tuple[gp.Grid, dict[str, Any], str]:
    """The 4-D grid from ``RooflineCostModel``'s attention term (one layer: KV write, launch floors and
    the kernel) at each node: one prefill chunk of ``pcs`` tokens over ``kps`` cached ones beside
    ``ns`` decode rows of ``kvs`` context. Where vLLM runs FlashAttention 2 this is the FA2 varlen
    term for every step with a prefill row (``sim/varlen_attention.py``), so the profile prices
    attention as the default roofline does instead of as a decode read plus a prefill."""
    layer_s = RooflineCostModel(model, hw, tp).attention_layer_s
    arr = np.full((len(pcs), len(kps), len(ns), len(kvs)), np.nan)
    for i, pc in enumerate(pcs.astype(int).tolist()):
        for j, kp in enumerate(kps.astype(int).tolist()):
            if pc == 0 and j:
                arr[0, j] = arr[0, 0]  # a decode-only step has no cached prefill context
                continue
            for k, nd in enumerate(ns.astype(int).tolist()):
                if pc == 0 and nd == 0:
                    continue  # the empty step: set by fill_gaps, never priced
                for m, kv in enumerate(kvs.astype(int).tolist()):
                    arr[i, j, k, m] = layer_s(pc, kp, nd, kv)
    arr = gp.fill_gaps(arr, [pcs, kps, ns, kvs])
    varlen = "; steps with a prefill row as FlashAttention 2's varlen kernel (sim/varlen_attention.py)" \
        if hw.flash_attention == 2 and hw.sm_count else "; a mixed step is its decode read plus its prefill"
    notes.append(f"Attention: ROOFLINE, no attention measured on this GPU in these sources: servesim's "
                 f"RooflineCostModel attention term per layer at every grid node (KV write, launch floors, KV read "
                 f"at {hw.stream_bandwidth_fraction:g} x HBM, prefill at {hw.attention_flops_fraction:g} x peak "
                 f"FLOP/s{varlen}).")
    axes = {"prefill_chunk": pcs.astype(int).tolist(), "kv_prefill": kps.astype(int).tolist(),
            "n_decode": ns.astype(int).tolist(), "kv_decode": kvs.astype(int).tolist()}
    return gp.Grid(axes, arr, 0, int(arr.size)), {}, "roofline (RooflineCostModel attention term)"


def _decode_holdout(d: pd.DataFrame) -> dict[str, Any]:
    """Held-out error of the decode grid: a seeded 20 % of its interior points predicted from the
    rest (linear between the nearest measured neighbours along KV length, as the grid is read), and of
    an NNLS fit."""
    arr = d.to_numpy()
    xs = np.asarray(d.columns, dtype=float)
    pts = [(i, j) for i in range(arr.shape[0]) for j in range(1, arr.shape[1] - 1) if np.isfinite(arr[i, j])]
    mask = gp.split_mask(len(pts), keep_ends=False)
    held = [p for p, m in zip(pts, mask, strict=True) if m]
    if not held:  # a grid of two KV lengths has no interior point to hold out
        return {"table": {"n": 0}, "fit": {"n": 0}}
    train = arr.copy()
    for i, j in held:
        train[i, j] = np.nan
    pred_t, meas = [], []
    for i, j in held:
        line = gp._fill_line(train[i], xs, "inside")
        pred_t.append(line[j])
        meas.append(arr[i, j])
    b = np.asarray(d.index, dtype=float)
    tr = [(i, j) for i in range(arr.shape[0]) for j in range(arr.shape[1])
          if np.isfinite(train[i, j])]
    feats = np.array([[1.0, b[i], b[i] * xs[j]] for i, j in tr])
    coef = gp.nnls_relative(feats, np.array([train[i, j] for i, j in tr]))
    pred_f = np.array([[1.0, b[i], b[i] * xs[j]] for i, j in held]) @ coef
    return {"table": gp.ape_summary(np.array(pred_t), np.array(meas)),
            "fit": gp.ape_summary(pred_f, np.array(meas))}
