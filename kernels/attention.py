"""Attention for the live model: varlen causal prefill, paged attention, and the KV-cache write.

Each op has one entry point with ``backend="triton" | "torch"``. The Triton kernels are
flash-attention style (online softmax, fp32 accumulation, the score matrix is never materialised);
the torch versions are exact references that double as the CPU fast path of live mode.

Paged attention follows vLLM's unified Triton kernel: one kernel serves decode (one query per
sequence) and chunked prefill (several queries whose earlier context is already cached). A program
owns one sequence, one KV head and a tile of BLOCK_Q query positions; the G = Hq // Hkv query heads
that share the KV head are packed into the tile's rows, so K/V are read once per KV head.

On a machine without a GPU the Triton kernels run under Triton's interpreter, which is chosen when
the kernels are decorated, i.e. when this module is imported: set ``TRITON_INTERPRET=1`` in the
environment BEFORE importing this module (or anything that imports it). The torch backend works
without triton installed.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch backend must keep working on a bare CPU install
    triton = None
    tl = None

BACKENDS = ("torch", "triton")

if triton is not None:

    @triton.jit
    def _attn_fwd_kernel(
        q_ptr, k_ptr, v_ptr, o_ptr, ws_acc_ptr, ws_ml_ptr,
        q_start_ptr, seq_lens_ptr, block_table_ptr,
        scale_log2,
        stride_qt, stride_qh, stride_qd,
        stride_ot, stride_oh, stride_od,
        stride_kb, stride_ks, stride_kh, stride_kd,
        stride_vb, stride_vs, stride_vh, stride_vd,
        stride_bt, block_size,
        G: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        HEAD_DIM: tl.constexpr, PAGED: tl.constexpr, DOT_FP32: tl.constexpr, PREC: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
    ):
        tile = tl.program_id(0) // NUM_SPLITS
        split = tl.program_id(0) % NUM_SPLITS
        seq = tl.program_id(1)
        kv_head = tl.program_id(2)
        q_start = tl.load(q_start_ptr + seq)
        q_len = tl.load(q_start_ptr + seq + 1) - q_start
        if tile * BLOCK_Q >= q_len:
            return
        if PAGED:
            seq_len = tl.load(seq_lens_ptr + seq)
        else:
            seq_len = q_len
        ctx_len = seq_len - q_len

        # Row r of the tile is query position tile*BLOCK_Q + r // G of query head kv_head*G + r % G.
        offs_m = tl.arange(0, BLOCK_M)
        q_idx = tile * BLOCK_Q + offs_m // G
        head = kv_head * G + offs_m % G
        row_ok = (offs_m < BLOCK_Q * G) & (q_idx < q_len)
        q_pos = ctx_len + q_idx
        offs_d = tl.arange(0, HEAD_DIM)
        q_row = (q_start + q_idx).to(tl.int64)
        q = tl.load(
            q_ptr + q_row[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
            mask=row_ok[:, None], other=0.0,
        )
        if DOT_FP32:
            q = q.to(tl.float32)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        # Causal: nothing past the tile's last query position is ever needed.
        kv_end = tl.minimum(seq_len, ctx_len + (tile + 1) * BLOCK_Q)
        kv_lo = 0
        if NUM_SPLITS > 1:
            # Split-KV (decode only): this program covers one BLOCK_N-aligned slice of the context.
            per_split = tl.cdiv(tl.cdiv(kv_end, NUM_SPLITS), BLOCK_N) * BLOCK_N
            kv_lo = split * per_split
            kv_end = tl.minimum(kv_end, kv_lo + per_split)
        for start in range(kv_lo, kv_end, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            n_ok = offs_n < kv_end
            if PAGED:
                # Per-token gather through the block table: BLOCK_N need not equal block_size.
                blk = tl.load(block_table_ptr + seq * stride_bt + offs_n // block_size, mask=n_ok, other=0)
                blk = blk.to(tl.int64)
                k_off = blk * stride_kb + (offs_n % block_size) * stride_ks
                v_off = blk * stride_vb + (offs_n % block_size) * stride_vs
            else:
                tok = (q_start + offs_n).to(tl.int64)
                k_off = tok * stride_ks
                v_off = tok * stride_vs
            k = tl.load(
                k_ptr + k_off[None, :] + kv_head * stride_kh + offs_d[:, None] * stride_kd,
                mask=n_ok[None, :], other=0.0,
            )
            v = tl.load(
                v_ptr + v_off[:, None] + kv_head * stride_vh + offs_d[None, :] * stride_vd,
                mask=n_ok[:, None], other=0.0,
            )
            if DOT_FP32:
                s = tl.dot(q, k.to(tl.float32), input_precision=PREC)
            else:
                s = tl.dot(q, k, input_precision=PREC)
            s = s * scale_log2
            keep = (offs_n[None, :] <= q_pos[:, None]) & n_ok[None, :]
            s = tl.where(keep, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # Padding rows see only -inf; pin their max so exp2 gives 0 instead of NaN.
            m_new = tl.where(m_new > float("-inf"), m_new, 0.0)
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            # P is rounded to V's dtype as on the tensor cores, also when the interpreter upcasts.
            p_lo = p.to(v.dtype)
            if DOT_FP32:
                acc += tl.dot(p_lo.to(tl.float32), v.to(tl.float32), input_precision=PREC)
            else:
                acc += tl.dot(p_lo, v, input_precision=PREC)
            m_i = m_new
        if NUM_SPLITS > 1:
            # Unnormalised partials per (sequence, head, split); an empty split leaves m=-inf, l=0.
            part = (seq * (tl.num_programs(2) * G) + head) * NUM_SPLITS + split
            tl.store(ws_acc_ptr + part[:, None].to(tl.int64) * HEAD_DIM + offs_d[None, :], acc,
                     mask=row_ok[:, None])
            tl.store(ws_ml_ptr + part * 2, m_i, mask=row_ok)
            tl.store(ws_ml_ptr + part * 2 + 1, l_i, mask=row_ok)
        else:
            acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(
                o_ptr + q_row[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :] * stride_od,
                acc.to(o_ptr.dtype.element_ty), mask=row_ok[:, None],
            )

    @triton.jit
    def _merge_splits_kernel(
        o_ptr, ws_acc_ptr, ws_ml_ptr, q_start_ptr,
        stride_ot, stride_oh, stride_od,
        NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr,
    ):
        seq = tl.program_id(0)
        head = tl.program_id(1)
        q_start = tl.load(q_start_ptr + seq)
        if tl.load(q_start_ptr + seq + 1) == q_start:
            return
        part = (seq * tl.num_programs(1) + head) * NUM_SPLITS + tl.arange(0, NUM_SPLITS)
        m = tl.load(ws_ml_ptr + part * 2)
        l_s = tl.load(ws_ml_ptr + part * 2 + 1)
        offs_d = tl.arange(0, HEAD_DIM)
        acc = tl.load(ws_acc_ptr + part[:, None].to(tl.int64) * HEAD_DIM + offs_d[None, :])
        m_max = tl.max(m, 0)  # split 0 always holds position 0, so m_max is finite
        w = tl.exp2(m - m_max)
        o = tl.sum(acc * w[:, None], 0) / tl.sum(l_s * w, 0)
        tl.store(o_ptr + q_start.to(tl.int64) * stride_ot + head * stride_oh + offs_d * stride_od,
                 o.to(o_ptr.dtype.element_ty))

    @triton.jit
    def _write_kv_kernel(
        k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
        stride_kt, stride_kh, stride_kd,
        stride_vt, stride_vh, stride_vd,
        stride_kcb, stride_kcs, stride_kch, stride_kcd,
        stride_vcb, stride_vcs, stride_vch, stride_vcd,
        num_kv_heads, block_size,
        BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot < 0:
            return
        blk = slot // block_size
        off = slot % block_size
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, HEAD_DIM)
        mask = (h < num_kv_heads)[:, None]
        k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :] * stride_kd, mask=mask)
        v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :] * stride_vd, mask=mask)
        kc = kc_ptr + blk * stride_kcb + off * stride_kcs + h[:, None] * stride_kch + d[None, :] * stride_kcd
        vc = vc_ptr + blk * stride_vcb + off * stride_vcs + h[:, None] * stride_vch + d[None, :] * stride_vcd
        tl.store(kc, k.to(kc_ptr.dtype.element_ty), mask=mask)
        tl.store(vc, v.to(vc_ptr.dtype.element_ty), mask=mask)

    # The interpreter's tl.dot mishandles bf16 (numpy has no bf16), so it gets fp32 operands.
    _INTERPRETED = not isinstance(_attn_fwd_kernel, triton.runtime.jit.JITFunction)


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "triton" and triton is None:
        raise ValueError("backend='triton' needs the triton package; install servesim[kernels]")


def _check_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str) -> int:
    num_q_heads, head_dim, num_kv_heads = q.shape[1], q.shape[2], k.shape[-2]
    if backend == "triton" and not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"triton attention needs one dtype for q, k, v; got {q.dtype}, {k.dtype}, {v.dtype}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"query heads ({num_q_heads}) must be a multiple of KV heads ({num_kv_heads})")
    if backend == "triton" and (head_dim < 16 or head_dim & (head_dim - 1)):
        raise ValueError(f"triton attention needs a power-of-two head_dim >= 16, got {head_dim}")
    return num_q_heads // num_kv_heads


def _out_buffer(q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.empty_like(q)
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(f"out must match q: {tuple(q.shape)} {q.dtype} on {q.device}, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}")
    return out


def _tile_shape(group: int, max_query_len: int) -> tuple[int, int]:
    """(BLOCK_M rows, BLOCK_Q query positions) of a tile; rows = positions x packed query heads."""
    # tl.dot needs >= 16 rows; decode wants few wasted rows, prefill wants big tiles.
    rows = 16 if max_query_len <= 1 else 64
    block_m = max(rows, triton.next_power_of_2(group))
    return block_m, block_m // group


# Split-KV kicks in when a decode batch would launch fewer programs than this (about 2 per SM).
_SPLIT_TARGET_PROGRAMS = 256
_MIN_TOKENS_PER_SPLIT = 256
_MAX_SPLITS = 16


def _decode_splits(num_seqs: int, num_kv_heads: int, max_context: int) -> int:
    """KV splits per decode program: enough programs to fill the GPU, >= 256 tokens per split."""
    want = triton.cdiv(_SPLIT_TARGET_PROGRAMS, num_seqs * num_kv_heads)
    most = triton.cdiv(max_context, _MIN_TOKENS_PER_SPLIT)
    splits = max(1, min(want, most, _MAX_SPLITS))
    return 1 << (splits.bit_length() - 1)  # a power of two: the merge kernel aranges over splits


def _launch_attn(q, k, v, out, q_start, seq_lens, block_tables, max_query_len, scale, paged):
    group = q.shape[1] // k.shape[-2]
    block_m, block_q = _tile_shape(group, max_query_len)
    head_dim = q.shape[2]
    num_seqs, num_kv_heads = q_start.numel() - 1, k.shape[-2]
    splits = 1
    if paged and max_query_len == 1:
        # The block table's width bounds the context without a device sync.
        splits = _decode_splits(num_seqs, num_kv_heads, block_tables.shape[1] * k.shape[1])
    ws_acc = ws_ml = out  # placeholders, never touched when splits == 1
    if splits > 1:
        ws_acc = torch.empty(num_seqs, q.shape[1], splits, head_dim, device=q.device, dtype=torch.float32)
        ws_ml = torch.empty(num_seqs, q.shape[1], splits, 2, device=q.device, dtype=torch.float32)
    if paged:
        stride_kb, stride_ks, stride_kh, stride_kd = k.stride()
        stride_vb, stride_vs, stride_vh, stride_vd = v.stride()
        block_size, stride_bt = k.shape[1], block_tables.stride(0)
    else:
        stride_kb, (stride_ks, stride_kh, stride_kd) = 0, k.stride()
        stride_vb, (stride_vs, stride_vh, stride_vd) = 0, v.stride()
        block_size, stride_bt = 1, 0
    grid = (triton.cdiv(max_query_len, block_q) * splits, num_seqs, num_kv_heads)
    _attn_fwd_kernel[grid](
        q, k, v, out, ws_acc, ws_ml, q_start, seq_lens, block_tables,
        scale * math.log2(math.e),
        *q.stride(), *out.stride(),
        stride_kb, stride_ks, stride_kh, stride_kd,
        stride_vb, stride_vs, stride_vh, stride_vd,
        stride_bt, block_size,
        G=group, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=64,
        HEAD_DIM=head_dim, PAGED=paged, DOT_FP32=_INTERPRETED,
        PREC="ieee" if q.dtype == torch.float32 else "tf32", NUM_SPLITS=splits,
        num_warps=4,
    )
    if splits > 1:
        _merge_splits_kernel[(num_seqs, q.shape[1])](
            out, ws_acc, ws_ml, q_start, *out.stride(), NUM_SPLITS=splits, HEAD_DIM=head_dim,
        )


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of the last q.shape[0] positions of a sequence over all its k/v, in fp32.

    q: [Lq, Hq, D], k/v: [L, Hkv, D] with Lq <= L -> [Lq, Hq, D] in fp32.
    """
    lq, length = q.shape[0], k.shape[0]
    qt, kt, vt = (x.transpose(0, 1).float() for x in (q, k, v))
    gqa = q.shape[1] != k.shape[1]
    if lq == length or lq == 1:
        # Square: top-left causal is exact. One query: it is the last position and sees everything.
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=lq > 1, scale=scale, enable_gqa=gqa)
    else:
        pos = torch.arange(length, device=q.device)
        mask = pos[None, :] <= (length - lq + torch.arange(lq, device=q.device))[:, None]
        o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return o.transpose(0, 1)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                      max_seqlen: int, scale: float | None = None, backend: str = "torch",
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal self-attention over packed variable-length sequences (no cache), with GQA.

    q: [T, Hq, D]; k, v: [T, Hkv, D]; cu_seqlens: int32 [B+1] token offsets of the sequences;
    max_seqlen: longest sequence in tokens (must be >= the real maximum). Query head h reads KV head
    h // (Hq // Hkv). scale defaults to 1/sqrt(D). Writes into ``out`` when given. Returns [T, Hq, D].
    """
    _check_backend(backend)
    _check_heads(q, k, v, backend)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = _out_buffer(q, out)
    if q.shape[0] == 0 or cu_seqlens.numel() < 2:
        return out
    if backend == "triton":
        cu = cu_seqlens.to(torch.int32)
        _launch_attn(q, k, v, out, cu, cu, cu, max_seqlen, scale, paged=False)
        return out
    bounds = cu_seqlens.tolist()
    for s, e in zip(bounds[:-1], bounds[1:], strict=True):
        if e > s:
            out[s:e] = _sdpa(q[s:e], k[s:e], v[s:e], scale)
    return out


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                    max_query_len: int, scale: float | None = None, backend: str = "torch",
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of packed queries over a paged KV cache: decode and chunked prefill in one call.

    q: [T, Hq, D], sequence b owning rows query_start_loc[b]:query_start_loc[b+1] (int32 [B+1]);
    k_cache, v_cache: [num_blocks, block_size, Hkv, D]; block_tables: int32 [B, max_blocks] physical
    blocks of each sequence in order (unused entries are never read); seq_lens: int32 [B] tokens of
    sequence b including this step's queries, whose K/V are already in the cache. Query i of
    sequence b sits at position seq_lens[b] - q_len_b + i and attends causally to positions up to
    it. max_query_len: longest q_len_b in tokens (must be >= the real maximum). scale defaults to
    1/sqrt(D). Writes into ``out`` when given. Returns [T, Hq, D].
    """
    _check_backend(backend)
    _check_heads(q, k_cache, v_cache, backend)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = _out_buffer(q, out)
    if q.shape[0] == 0 or seq_lens.numel() == 0:
        return out
    if backend == "triton":
        _launch_attn(q, k_cache, v_cache, out, query_start_loc.to(torch.int32), seq_lens.to(torch.int32),
                     block_tables.to(torch.int32), max_query_len, scale, paged=True)
        return out
    _paged_attention_torch(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out)
    return out


def _paged_attention_torch(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out):
    block_size = k_cache.shape[1]
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    q_lens = [e - s for s, e in zip(starts[:-1], starts[1:], strict=True)]
    decode = [b for b, n in enumerate(q_lens) if n == 1]
    if decode:
        _decode_torch(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, decode, scale, out)
    for b, n in enumerate(q_lens):
        if n <= 1:
            continue
        blocks = block_tables[b, : -(-lens[b] // block_size)].long()
        k = k_cache.index_select(0, blocks).flatten(0, 1)[: lens[b]]
        v = v_cache.index_select(0, blocks).flatten(0, 1)[: lens[b]]
        out[starts[b] : starts[b] + n] = _sdpa(q[starts[b] : starts[b] + n], k, v, scale)


def _decode_torch(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, rows, scale, out):
    """All single-query sequences in one padded, masked SDPA call (the common live-mode step)."""
    block_size = k_cache.shape[1]
    idx = torch.tensor(rows, device=q.device)
    lens = seq_lens.to(q.device)[idx].long()
    num_blocks = -(-int(lens.max()) // block_size)
    table = block_tables[idx, :num_blocks].long()
    # Entries past a sequence's last block are arbitrary (maybe out of range): point them at block 0.
    used = torch.arange(num_blocks, device=q.device)[None, :] < (-(-lens // block_size))[:, None]
    table = torch.where(used, table, 0)
    # index_select of whole blocks is ~10x faster on a CPU than advanced indexing with a 2-D table.
    gathered = (len(rows), num_blocks * block_size, *k_cache.shape[2:])
    k = k_cache.index_select(0, table.flatten()).view(gathered).transpose(1, 2).float()  # [B, Hkv, L, D]
    v = v_cache.index_select(0, table.flatten()).view(gathered).transpose(1, 2).float()
    mask = torch.arange(k.shape[2], device=q.device)[None, :] < lens[:, None]
    q_rows = query_start_loc.to(q.device)[idx].long()
    # One query attends to the whole context, so the G heads sharing a KV head are just G "rows":
    # folding them beats enable_gqa (no K/V repeat), about 2x on a CPU.
    num_kv_heads, head_dim = k.shape[1], k.shape[3]
    qd = q[q_rows].float().view(len(rows), num_kv_heads, -1, head_dim)  # [B, Hkv, G, D]
    o = F.scaled_dot_product_attention(qd, k, v, attn_mask=mask[:, None, None, :], scale=scale)
    out[q_rows] = o.reshape(len(rows), -1, head_dim).to(out.dtype)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, backend: str = "torch") -> None:
    """Scatter this step's keys and values into the paged cache, in place.

    k, v: [T, Hkv, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D]; slot_mapping: int64 [T],
    slot = block_id * block_size + offset within the block; a negative slot skips that token
    (padding).
    """
    _check_backend(backend)
    if k.shape[0] == 0:
        return
    block_size = k_cache.shape[1]
    if backend == "triton":
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        if head_dim & (head_dim - 1):
            raise ValueError(f"triton write_kv needs a power-of-two head_dim, got {head_dim}")
        _write_kv_kernel[(k.shape[0],)](
            k, v, k_cache, v_cache, slot_mapping,
            *k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride(),
            num_kv_heads, block_size,
            BLOCK_H=triton.next_power_of_2(num_kv_heads), HEAD_DIM=head_dim,
        )
        return
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache[slots // block_size, slots % block_size] = k[keep].to(k_cache.dtype)
    v_cache[slots // block_size, slots % block_size] = v[keep].to(v_cache.dtype)
