"""Decode steps through CUDA graphs against the eager forward, on one GPU: same logits? how much faster?

For each decode batch (rows x contexts, each row's context drawn between half and all of the
nominal one) the same step runs through a plain ``ModelRunner`` and through one with
``use_decode_graphs`` (what ``live.cuda_graphs`` / ``calibrate --cuda-graphs`` use), over one
shared KV cache of random values: rows share their earlier blocks and own the block their new
token is written to, so a 256 x 2k batch needs 2 GB of cache, not 64 GB. Prints and writes
``graphs.csv``: the logits' max relative difference, the share of equal greedy tokens, and the
median wall time of a whole step (inputs prepared, forward, greedy tokens back on the host) eager
and graphed, interleaved. With ``--piecewise`` also prefill-only and mixed steps (a prompt chunk
beside decode rows) through ``use_piecewise_graphs`` (``live.piecewise_graphs``): the ``chunk``
column is the prompt chunk's tokens (0: a decode step), ``padded`` the capture size the step ran at.

    python benchmarks/gpu_graphs.py --out results/gpu-run        # a CUDA GPU, llama-3.1-8b bf16 Triton
    python benchmarks/gpu_graphs.py --piecewise --out ...        # + prefill / mixed steps through the pieces
    python benchmarks/gpu_graphs.py --cpu-smoke --out /tmp/g     # the plumbing on a CPU (tiny model, no capture)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

ROWS = (1, 3, 16, 50, 128, 250)  # 3, 50 and 250 pad to capture sizes 4, 56 and 256
CONTEXTS = (512, 2048)
MIXED = ((0, 500), (16, 500), (64, 1000), (120, 2000))  # --piecewise: (decode rows, prompt chunk) beside them


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--reps", type=int, default=15, help="timed steps per batch and path (15)")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads (2, as calibrate)")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny model on the CPU, eager padded path")
    ap.add_argument("--piecewise", action="store_true",
                    help="also prefill and mixed steps through live.piecewise_graphs' pieces against eager ones")
    ap.add_argument("--out", default="results/gpu-run")
    args = ap.parse_args(argv)
    import torch
    from servesim.kernels.model import LlamaModel
    from servesim.kernels.runner import KVCache, ModelRunner
    from servesim.sim.batch import Batch
    from servesim.sim.presets import get_model
    from servesim.sim.request import Request

    cuda = not args.cpu_smoke
    if cuda and not torch.cuda.is_available():
        print("no CUDA device: this benchmark measures a GPU (--cpu-smoke checks the script)", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    rows_list, contexts, mixed = (ROWS, CONTEXTS, MIXED) if cuda else ((1, 3, 8), (32, 64), ((0, 20), (3, 40)))
    mixed = mixed if args.piecewise else ()
    cfg = get_model("tiny" if args.cpu_smoke else args.model)
    dtype, device, backend = (torch.bfloat16, "cuda", "triton") if cuda else (torch.float32, "cpu", "torch")
    bs = 16
    max_ctx = max(contexts)
    shared = max_ctx // bs  # blocks every row may read
    chunk_blocks = max((c for _, c in mixed), default=0) // bs + 1
    num_blocks = shared + max(rows_list) + chunk_blocks
    model = LlamaModel(cfg, dtype=dtype, device=device, seed=0, backend=backend)
    cache = KVCache(cfg, num_blocks, bs, dtype=dtype, device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    cache.tensor.copy_(torch.randn(cache.tensor.shape, generator=gen, dtype=dtype, device=device))
    plain = ModelRunner(model, cache, bs)
    graphed = ModelRunner(model, cache, bs)
    reserved = torch.cuda.memory_reserved if cuda else (lambda: 0)
    before = reserved()
    t0 = time.perf_counter()
    graphs = graphed.use_decode_graphs(max(rows_list), max_ctx + bs)
    pieces = graphed.use_piecewise_graphs(max(b + c for b, c in mixed), max_ctx + bs) if mixed else None
    capture_s = time.perf_counter() - t0
    graph_gib = (reserved() - before) / 2**30  # the graphs' pools and the static buffers
    print(f"{cfg.name} on {torch.cuda.get_device_name() if cuda else 'cpu'}: {len(graphs.sizes)} capture sizes "
          f"{graphs.sizes[0]}..{graphs.sizes[-1]}{f', {len(pieces.sizes)} piecewise chains' if pieces else ''} "
          f"captured={graphs.capture} in {capture_s:.1f} s, "
          f"{graph_gib:.2f} GiB more reserved", flush=True)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rng = np.random.default_rng(0)
    out_rows = []
    print(f"{'rows':>5} {'chunk':>5} {'ctx':>5} {'max_rel_diff':>12} {'same_tokens':>11} {'eager_ms':>9} "
          f"{'graph_ms':>9} {'speedup':>7}")
    cases = [(ctx, b, 0) for ctx in contexts for b in rows_list] + [(ctx, b, c) for ctx in contexts for b, c in mixed]
    for ctx, b, chunk in cases:
        lens = rng.integers(ctx // 2, ctx, b)  # cached tokens of each row; its new token is at position len
        reqs, tables = [], []
        for i, n in enumerate(lens.tolist()):
            reqs.append(Request(i, 0.0, n + 1, 1, prompt_token_ids=rng.integers(0, cfg.vocab_size, n + 1).tolist()))
            tables.append(list(range(n // bs)) + [shared + i])  # own block for the token it writes
        q, cached = [1] * b, lens.tolist()
        if chunk:  # a prompt's first chunk beside the decodes, in blocks of its own
            reqs.append(Request(b, 0.0, chunk, 1, prompt_token_ids=rng.integers(0, cfg.vocab_size, chunk).tolist()))
            tables.append(list(range(shared + max(rows_list), shared + max(rows_list) + chunk_blocks)))
            q, cached = [*q, chunk], [*cached, 0]
        batch = Batch.of(reqs, q, cached, [True] * len(reqs))
        want = plain.compute_logits(batch, tables).clone()
        got = graphed.compute_logits(batch, tables).clone()
        rel = ((got - want).abs().max() / want.abs().max()).item()
        same = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
        times: dict[str, list[float]] = {"eager": [], "graph": []}
        for _ in range(args.reps):
            for name, runner in (("eager", plain), ("graph", graphed)):
                sync()
                t = time.perf_counter()
                runner.execute(batch, tables)  # argmax .tolist() waits for the GPU
                times[name].append(time.perf_counter() - t)
        eager, graph = (statistics.median(times[k]) * 1e3 for k in ("eager", "graph"))
        padded = pieces.padded(b + chunk) if chunk else graphs.padded(b)
        row = {"rows": b, "chunk": chunk, "context": ctx, "padded": padded, "max_rel_diff": rel,
               "same_tokens": same, "eager_ms": eager, "graph_ms": graph, "speedup": eager / graph}
        out_rows.append(row)
        print(f"{b:>5} {chunk:>5} {ctx:>5} {rel:>12.2e} {same:>11.3f} {eager:>9.2f} {graph:>9.2f} "
              f"{eager / graph:>7.2f}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(out_rows).to_csv(out / "graphs.csv", index=False, na_rep="nan")
    print(f"capture {capture_s:.2f} s; torch {torch.__version__}; wrote {out / 'graphs.csv'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
