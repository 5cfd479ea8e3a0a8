"""GPU check of the attention kernels: correctness against the torch reference, then decode bandwidth.

On CUDA: every Triton kernel (prefill, paged decode incl. split-KV, mixed decode + chunked prefill,
write_kv) is compared with the torch backend in bf16 at Llama-3.1-8B shapes (32 query heads, 8 KV
heads, head_dim 128, block_size 16). Then decode paged attention is timed with
``triton.testing.do_bench`` over batch sizes x context lengths; achieved bandwidth (KV bytes read /
time) is reported against a measured device-to-device copy bandwidth. A table is printed and
CSV + JSON (versions, device, date) are written under ``--out``.

    python benchmarks/gpu_kernels.py --out /tmp/gpu_kernels
    python benchmarks/gpu_kernels.py --cpu-smoke --out /tmp/gpu_smoke   # tiny shapes, interpreter
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import json
import os
import platform
import sys
import time
from pathlib import Path

HEADS_Q, HEADS_KV, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16  # Llama-3.1-8B attention
BATCHES = (1, 8, 32, 64, 128, 256)
CONTEXTS = (512, 1024, 2048, 4096, 8192)
BF16_TOL = 1e-2


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # no default: results/gpu/ is tracked (it holds the published-measurement report), and a
    # measurement of this machine's GPU does not belong in the repository unless put there on purpose
    p.add_argument("--out", required=True, help="directory for the CSV and JSON results, e.g. /tmp/gpu_kernels")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="tiny shapes on the CPU under TRITON_INTERPRET=1 (checks the script, not speed)")
    p.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    p.add_argument("--contexts", type=int, nargs="+", default=list(CONTEXTS))
    return p.parse_args(argv)


def _rel_err(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _paged_inputs(torch, context_lens, q_lens, heads_q, heads_kv, head_dim, block_size, dtype, device, gen):
    """A shuffled paged cache holding the given contexts (+ this step's queries), and the queries."""
    seq_lens = [c + n for c, n in zip(context_lens, q_lens, strict=True)]
    per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(per_seq)
    shape = (num_blocks, block_size, heads_kv, head_dim)
    k_cache = torch.empty(shape, device=device, dtype=dtype).normal_(generator=gen)
    v_cache = torch.empty(shape, device=device, dtype=dtype).normal_(generator=gen)
    perm = torch.randperm(num_blocks, device=device, generator=gen).to(torch.int32)
    tables = torch.zeros(len(seq_lens), max(per_seq), device=device, dtype=torch.int32)
    start = 0
    for b, n in enumerate(per_seq):
        tables[b, :n] = perm[start : start + n]
        start += n
    q = torch.empty(sum(q_lens), heads_q, head_dim, device=device, dtype=dtype).normal_(generator=gen)
    qsl = torch.tensor([0, *q_lens], device=device).cumsum(0).to(torch.int32)
    sl = torch.tensor(seq_lens, device=device, dtype=torch.int32)
    return q, k_cache, v_cache, tables, sl, qsl


def check_correctness(torch, attn, device, dtype, shapes) -> list[dict]:
    """Triton vs torch backend for every op; returns one record per check."""
    heads_q, heads_kv, head_dim, block_size = shapes["heads_q"], shapes["heads_kv"], shapes["head_dim"], shapes["block_size"]
    gen = torch.Generator(device=device).manual_seed(0)
    results = []

    def record(name, err):
        results.append({"check": name, "rel_err": err, "passed": err < BF16_TOL})
        print(f"  {name:<40} rel_err {err:.2e}  {'ok' if err < BF16_TOL else 'FAIL'}")

    lens = shapes["prefill_lens"]
    total = sum(lens)
    q = torch.empty(total, heads_q, head_dim, device=device, dtype=dtype).normal_(generator=gen)
    k = torch.empty(total, heads_kv, head_dim, device=device, dtype=dtype).normal_(generator=gen)
    v = torch.empty(total, heads_kv, head_dim, device=device, dtype=dtype).normal_(generator=gen)
    cu = torch.tensor([0, *lens], device=device).cumsum(0).to(torch.int32)
    outs = {b: attn.prefill_attention(q, k, v, cu, max(lens), backend=b,
                                      out=torch.full_like(q, float("nan"))) for b in ("torch", "triton")}
    record("prefill_attention", _rel_err(outs["triton"], outs["torch"]))

    for name, ctx, qlen in shapes["paged_cases"]:
        inputs = _paged_inputs(torch, ctx, qlen, heads_q, heads_kv, head_dim, block_size, dtype, device, gen)
        outs = {b: attn.paged_attention(*inputs, max(qlen), backend=b, out=torch.full_like(inputs[0], float("nan")))
                for b in ("torch", "triton")}
        record(f"paged_attention {name}", _rel_err(outs["triton"], outs["torch"]))

    num_blocks, t = 64, 3 * block_size + 5
    slots = torch.randperm(num_blocks * block_size, device=device, generator=gen)[:t].long()
    slots[::7] = -1
    kv = [torch.empty(t, heads_kv, head_dim, device=device, dtype=dtype).normal_(generator=gen) for _ in range(2)]
    caches = {}
    for b in ("torch", "triton"):
        kc = torch.zeros(num_blocks, block_size, heads_kv, head_dim, device=device, dtype=dtype)
        vc = torch.zeros_like(kc)
        attn.write_kv(kv[0], kv[1], kc, vc, slots, backend=b)
        caches[b] = (kc, vc)
    same = all(torch.equal(x, y) for x, y in zip(caches["torch"], caches["triton"], strict=True))
    results.append({"check": "write_kv", "rel_err": 0.0 if same else float("inf"), "passed": same})
    print(f"  {'write_kv':<40} {'identical' if same else 'FAIL: caches differ'}")
    return results


def _timer(torch, device):
    """ms per call: do_bench on CUDA; a plain wall-clock loop on the CPU smoke run."""
    if device == "cuda":
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, warmup=25, rep=100)

    def cpu_time(fn):
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    return cpu_time


def copy_bandwidth(torch, device, timer, nbytes: int) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting the read and the write."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3)


def bench_decode(torch, attn, device, dtype, timer, batches, contexts, shapes, copy_bw) -> list[dict]:
    heads_q, heads_kv, head_dim, block_size = shapes["heads_q"], shapes["heads_kv"], shapes["head_dim"], shapes["block_size"]
    gen = torch.Generator(device=device).manual_seed(1)
    rows = []
    for batch in batches:
        for ctx in contexts:
            row = {"batch": batch, "context": ctx, "heads_q": heads_q, "heads_kv": heads_kv, "head_dim": head_dim,
                   "block_size": block_size, "dtype": str(dtype).removeprefix("torch.")}
            try:
                # seq_len = ctx: the decode query's own K/V is the last cached token.
                inputs = _paged_inputs(torch, [ctx - 1] * batch, [1] * batch, heads_q, heads_kv, head_dim,
                                       block_size, dtype, device, gen)
                out = torch.empty_like(inputs[0])
                ms = timer(lambda inputs=inputs, out=out: attn.paged_attention(*inputs, 1, backend="triton", out=out))
                kv_bytes = 2 * batch * ctx * heads_kv * head_dim * inputs[1].element_size()
                row.update(status="ok", time_us=ms * 1e3, kv_bytes=kv_bytes, gbps=kv_bytes / (ms * 1e-3) / 1e9,
                           frac_of_copy_bw=kv_bytes / (ms * 1e-3) / copy_bw,
                           splits=attn._decode_splits(batch, heads_kv, inputs[3].shape[1] * block_size))
                del inputs, out
            except torch.OutOfMemoryError:
                row.update(status="oom")
            if device == "cuda":
                torch.cuda.empty_cache()
            rows.append(row)
            print(_fmt_row(row))
    return rows


def _fmt_row(r: dict) -> str:
    if r["status"] != "ok":
        return f"{r['batch']:>6} {r['context']:>8}   skipped ({r['status']})"
    return (f"{r['batch']:>6} {r['context']:>8} {r['splits']:>6} {r['time_us']:>10.1f} {r['gbps']:>9.1f} "
            f"{100 * r['frac_of_copy_bw']:>8.1f}%")


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # must precede the import of the kernels
    import torch
    import triton
    from servesim.kernels import attention as attn

    if args.cpu_smoke:
        device = "cpu"
        shapes = {"heads_q": 4, "heads_kv": 2, "head_dim": 32, "block_size": 4, "prefill_lens": [1, 9, 20]}
        batches, contexts, copy_bytes = [1, 2], [8, 24], 1 << 20
        attn._MIN_TOKENS_PER_SPLIT = 8  # tiny contexts still take the split-KV path
        paged_cases = [("decode (split-KV)", [7, 30], [1, 1]), ("chunk mid-block", [6], [9]),
                       ("mixed decode + chunks", [11, 0, 5], [1, 7, 12])]
    elif torch.cuda.is_available():
        device = "cuda"
        shapes = {"heads_q": HEADS_Q, "heads_kv": HEADS_KV, "head_dim": HEAD_DIM, "block_size": BLOCK_SIZE,
                  "prefill_lens": [1, 100, 1000, 2048]}
        batches, contexts, copy_bytes = args.batches, args.contexts, 1 << 31
        paged_cases = [("decode batch 1 (split-KV)", [4095], [1]),
                       ("decode batch 16", [17 * i + 3 for i in range(16)], [1] * 16),
                       ("chunk mid-block", [1000], [512]),
                       ("mixed decode + chunks", [500, 0, 37, 2000], [1, 300, 64, 1])]
    else:
        print("no CUDA device: run with --cpu-smoke to check the script on a CPU", file=sys.stderr)
        return 2
    shapes["paged_cases"] = paged_cases
    dtype = torch.bfloat16
    name = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu"
    print(f"device {name}; torch {torch.__version__}; triton {triton.__version__}")

    print("correctness, triton vs torch (bf16):")
    checks = check_correctness(torch, attn, device, dtype, shapes)
    timer = _timer(torch, device)
    copy_bw = copy_bandwidth(torch, device, timer, copy_bytes)
    print(f"device-to-device copy bandwidth: {copy_bw / 1e9:.1f} GB/s (read + write)")
    print(f"{'batch':>6} {'context':>8} {'splits':>6} {'time_us':>10} {'GB/s':>9} {'of copy':>9}")
    rows = bench_decode(torch, attn, device, dtype, timer, batches, contexts, shapes, copy_bw)

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    fields = ["batch", "context", "heads_q", "heads_kv", "head_dim", "block_size", "dtype", "status",
              "splits", "time_us", "kv_bytes", "gbps", "frac_of_copy_bw"]
    csv_path = out_dir / f"decode_attention_{stamp}.csv"
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    meta = {"date_utc": stamp, "device": name, "torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version(), "cpu_smoke": args.cpu_smoke, "dtype": "bfloat16",
            "copy_bandwidth_gbps": copy_bw / 1e9,
            "shapes": {k: v for k, v in shapes.items() if k != "paged_cases"},
            "correctness": checks, "decode": rows}
    json_path = out_dir / f"decode_attention_{stamp}.json"
    json_path.write_text(json.dumps(meta, indent=2))
    print(f"wrote {csv_path} and {json_path}")
    return 0 if all(c["passed"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
