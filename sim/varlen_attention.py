"""FlashAttention-2's varlen forward, as vLLM V1 runs it for a step with prefill rows: thread blocks
scheduled on the GPU's SMs.

What the kernel does (read in vllm-project/flash-attention, the FA2 fork vLLM ships as
``vllm_flash_attn``: ``csrc/flash_attn/flash_api.cpp`` ``mha_varlen_fwd``,
``src/flash_fwd_launch_template.h`` ``run_mha_fwd_splitkv_dispatch`` / ``run_flash_splitkv_fwd``,
``src/flash_fwd_kernel.h`` ``compute_attn_1rowblock_splitkv``):

- vLLM V1's FlashAttention backend makes one ``flash_attn_varlen_func`` call per layer for the
  whole step, prefill chunks and decodes together, with ``max_seqlen_q`` = the longest row's new
  tokens (``vllm/v1/attention/backends/flash_attn.py``, ``FlashAttentionImpl.forward``).
- With a paged KV cache the split-KV kernel runs, one thread block per (query tile of
  ``BLOCK_M`` = 64 rows, sequence, query head), each walking its keys ``block_n`` at a time (128
  for head dims 81-128). The grid gives *every* sequence the longest row's number of query tiles;
  tiles past a sequence's own queries return at once (``m_block * kBlockM >= actual_seqlen_q``).
- KV splits and GQA packing (one block for the query heads of a KV head) are set up only when
  ``max_seqlen_q == 1`` ("Only apply split-k for decoding"): in a decode-only step. Once a prefill
  row is present, a decode row is one block per *query* head that walks its whole context alone,
  computing a full 64-row tile for its single query, and reads its KV once per query head.

The model, per layer, in tile iterations of ``tile_s`` seconds (one SM on one 64 x ``block_n``
tile): blocks are list-scheduled on ``sm_count`` SMs in launch order (heads outermost), which the
closed form ``makespan`` follows; blocks that exit at once cost ``EMPTY_CTA_S`` of an SM each; the
KV read is a floor: the query heads of a KV head run one after the other (heads are the grid's
slowest axis), so decode rows' KV is read once while one KV head's share of it fits in L2, and
otherwise again for every wave the group's blocks span (an L2 that thrashes, as the RTX 4090's does
from one shape to the next). ``tile_s`` is not a new constant: it is set so that the hardware's
``attention_flops_fraction`` keeps meaning what it was measured as, a 2048-token prefill of 32
heads of 128 at that fraction of peak (``REFERENCE_*``). A step enters by its row sums
(``StepSums``) and its longest decode context: decode rows' work at their mean context, the
schedule's end at the longest; several prefill rows enter as their mean row.
``benchmarks/mixed_attention.py`` scores it against LLMServingSim's measured attention tables.

A decode-only step (``max_seqlen_q == 1``) runs the split-KV path FA2 keeps for decoding: each KV
head's query heads packed into one block, keys split so the blocks fill the GPU
(``fa2_num_splits``). With short contexts those blocks are latency-bound, not bandwidth-bound, and
the measured times step with their waves over the SMs; ``decode_waves_s`` prices that where the
GPU's latency per KV tile was measured (``HardwareConfig.fa2_decode_tile_s``), and the roofline
takes the larger of it and the KV read (``--decode-waves`` in the benchmark).
"""

from __future__ import annotations

import math
from functools import lru_cache

from . import row_kernels as rk
from .presets import HardwareConfig, ModelConfig

BLOCK_M = 64  # query rows of a thread block (run_mha_fwd_splitkv_dispatch: "Fixed for all head dimensions")
# An SM's cost of a thread block that exits at once (launch and retire), seconds: the one fitted
# constant. benchmarks/mixed_attention.py --fit on the four RTX PRO 6000 tables' mixed shapes
# (median + p90 APE); the RTX 4090 table alone gives 0.40 us, and either value scores the other
# GPU within half a point of that GPU's own fit.
EMPTY_CTA_S = 0.55e-6
# The shape the hardware's attention_flops_fraction was measured on: a causal prefill of this many
# tokens, no cached context, this many query heads of this head dim (sim/presets.py sources).
REFERENCE_TOKENS, REFERENCE_HEADS, REFERENCE_HEAD_DIM = 2048, 32, 128


def num_splits(blocks: int, slots: int, kv_tiles: int, most: int = 128) -> int:
    """Pieces FA2 splits each row's keys into in a decode-only step, as vLLM's flash-attention fork
    chooses them (``csrc/flash_attn/flash_api.cpp``, ``num_splits_heuristic``, which the kernel
    calls with twice the SM count as ``slots``): one when the ``blocks`` nearly fill the slots; else
    the fewest splits whose last wave is at least 85 % as full as the fullest choice's, counting only
    split counts that change the ``kv_tiles`` each split walks. Plain loops, so that the compiled
    engine's price (``compiled_price``) compiles this very function; ``fa2_num_splits`` caches it."""
    if blocks >= 0.8 * slots:
        return 1
    top = min(most, slots, kv_tiles)
    best = 0.0
    for s in range(1, top + 1):
        if s > 1 and -(-kv_tiles // s) == -(-kv_tiles // (s - 1)):
            continue  # the same tiles per split as one split fewer
        waves = blocks * s / slots
        best = max(best, waves / math.ceil(waves))
    for s in range(1, top + 1):  # the fewest splits within 85 % of the best fill
        if s > 1 and -(-kv_tiles // s) == -(-kv_tiles // (s - 1)):
            continue
        waves = blocks * s / slots
        if waves / math.ceil(waves) >= 0.85 * best:
            return s
    return 1  # (unreachable: the best split qualifies)


fa2_num_splits = lru_cache(maxsize=8192)(num_splits)


def block_n(head_dim: int) -> int:
    """Keys a thread block reads per iteration (run_mha_fwd_splitkv_dispatch in vLLM's fork)."""
    return 256 if head_dim <= 80 else 128 if head_dim <= 128 else 64


def prefill_iterations(q: float, ctx: float, bn: int) -> tuple[float, float, float]:
    """(tile iterations of all its query tiles, query tiles, iterations of the longest tile) of one
    prefill row of ``q`` new tokens over ``ctx`` cached ones, one head. Query tile b sees ctx +
    min(64 (b + 1), q) keys (causal), rounded up to ``bn`` (half a block on average)."""
    tiles = math.ceil(q / BLOCK_M)
    keys = tiles * ctx + BLOCK_M * tiles * (tiles - 1) / 2 + q
    return keys / bn + tiles / 2, tiles, math.ceil((ctx + q) / bn)


def makespan(work: float, blocks: float, longest: float, long_work: float, long_blocks: float, long_longest: float,
             sms: int) -> float:
    """Seconds for ``blocks`` thread blocks of ``work`` SM-seconds in all, the longest ``longest``,
    list-scheduled on ``sms`` SMs; ``long_*`` describe the class of blocks the longest belongs to.

    Two readings, each exact where the other fails, and the smaller is kept: (a) waves of the mean
    block, the last one ending with the longest (equal blocks: ceil(blocks / sms) of them; one
    wave: the longest); (b) the long class alone in waves, the other blocks filling in as a fluid
    (a wave of long blocks beside many short ones does not become two waves). Against an exact
    list schedule of the same blocks (7,500 sampled shapes of the five measured grids, each tile
    exact): median 2 %, p90 11 %.
    """
    waves = (work / blocks) * ((blocks - 1) // sms) + longest
    by_class = (long_work / long_blocks) * ((long_blocks - 1) // sms) + long_longest + (work - long_work) / sms
    return min(waves, by_class)


@rk.compile_with_loops("varlen_layer_s", *(  # (a GPU's L2 in bytes is an int; 0.0 where none is known)
    (8, 4, 1e-6, 128, 1e-7, 4, 1e-9, 256, l2, 3, 2, 9, 8, 9, 5) for l2 in (40 << 20, 0.0)))
def layer_seconds(heads: int, sms: int, tile_s: float, bn: int, empty_cta_s: float, group: int, kv_token_s: float,
                  head_token_bytes: float, l2_bytes: float, n: int, n_dec: int, tokens: int, decode_kv: int,
                  prefill_kv: int, longest_decode_kv: int | None) -> float:
    """``FA2VarlenAttention.layer_s`` from the GPU's constants (its attributes of the same names;
    ``bn`` is ``block_n``): plain scalars and ``prefill_iterations``, ``makespan`` and
    ``FA2VarlenAttention.kv_read_s`` written out, so that ``row_kernels`` can compile this very
    function for large runs (``row_kernels.varlen_layer_s``). ``longest_decode_kv`` None or 0: none
    given."""
    rows = n - n_dec
    q = (tokens - n_dec) / rows
    ctx = prefill_kv / rows - q
    # prefill_iterations(q, ctx, bn)
    tiles = math.ceil(q / BLOCK_M)
    keys = tiles * ctx + BLOCK_M * tiles * (tiles - 1) / 2 + q
    its = keys / bn + tiles / 2
    pre_longest = math.ceil((ctx + q) / bn)
    dec_mean = math.ceil(decode_kv / n_dec / bn) if n_dec else 0
    # the longest decode block ends the schedule: with few decode rows it is most of it
    dec_longest = math.ceil(longest_decode_kv / bn) if n_dec and longest_decode_kv else dec_mean
    pre_work = heads * rows * its * tile_s
    dec_work = heads * n_dec * dec_mean * tile_s
    blocks = heads * (n_dec + rows * tiles)
    if dec_longest >= pre_longest:
        long_work, long_blocks, long_longest = dec_work, heads * n_dec, dec_longest * tile_s
    else:
        long_work, long_blocks, long_longest = pre_work, heads * rows * tiles, pre_longest * tile_s
    # makespan(...)
    work = pre_work + dec_work
    waves = (work / blocks) * ((blocks - 1) // sms) + max(dec_longest, pre_longest) * tile_s
    by_class = (long_work / long_blocks) * ((long_blocks - 1) // sms) + long_longest + (work - long_work) / sms
    busy = min(waves, by_class)
    # each decode row also launches tiles - 1 blocks per head that return at once
    busy += empty_cta_s * heads * n_dec * (tiles - 1) / sms
    # kv_read_s(n_dec, rows * tiles, decode_kv, prefill_kv)
    rereads = 1.0
    if decode_kv * head_token_bytes > l2_bytes:
        rereads = min(group, max(1.0, group * (n_dec + rows * tiles) / sms))
    return max(busy, (prefill_kv + rereads * decode_kv) * kv_token_s)


class FA2VarlenAttention:
    """One layer's attention, in seconds, for a step with at least one prefill row (q > 1), on a
    GPU where vLLM runs FlashAttention 2 (``HardwareConfig.flash_attention == 2``)."""

    def __init__(self, model: ModelConfig, hardware: HardwareConfig, kv_heads: int, heads: int,
                 stream_rate: float, empty_cta_s: float | None = None) -> None:
        """``heads`` / ``kv_heads``: query / KV heads on one TP rank; ``stream_rate``: bytes/s the KV
        read reaches; ``empty_cta_s``: SM seconds of a block that exits at once (``EMPTY_CTA_S``)."""
        if not hardware.sm_count:
            raise ValueError(f"{hardware.name}: the FA2 varlen attention term needs sm_count")
        self.heads, self.group, self.sms = heads, heads // kv_heads, hardware.sm_count
        self.kv_heads = kv_heads
        self.decode_tile_s = hardware.fa2_decode_tile_s
        self.decode_merge_s = hardware.fa2_decode_merge_s
        self.block_n = block_n(model.head_dim)
        self.empty_cta_s = EMPTY_CTA_S if empty_cta_s is None else empty_cta_s
        self.kv_token_s = 2 * kv_heads * model.head_dim * model.dtype_bytes / stream_rate  # K and V, one layer
        self.head_token_bytes = 2 * model.head_dim * model.dtype_bytes  # K and V of one KV head
        self.l2_bytes = hardware.l2_bytes or 0.0
        self.tile_s = reference_tile_s(hardware) * self.block_n * model.head_dim / (128 * REFERENCE_HEAD_DIM)

    def layer_s(self, n: int, n_dec: int, tokens: int, decode_kv: int, prefill_kv: int,
                longest_decode_kv: int | None = None) -> float:
        """Seconds of one layer's varlen attention kernel (not its launch floor or KV write) for a
        step of ``n`` rows, ``n_dec`` of them decodes, ``tokens`` new tokens, decode rows' KV
        ``decode_kv`` = sum(ctx + 1) and prefill rows' ``prefill_kv`` = sum(ctx + q);
        ``longest_decode_kv``: the largest decode ctx + 1 (None: every decode row at the mean).
        ``layer_seconds`` with this GPU's constants; with the compiled step loops on, a step's
        integer sums take its compiled version (``row_kernels.varlen_layer_s``)."""
        if rk.ON and type(n + n_dec + tokens + decode_kv + prefill_kv) is int:  # (int unless one is not)
            layer = rk.varlen_layer_s
            longest_decode_kv = longest_decode_kv or 0  # (the compiled one takes an int)
        else:
            layer = layer_seconds
        return layer(self.heads, self.sms, self.tile_s, self.block_n, self.empty_cta_s, self.group,
                     self.kv_token_s, self.head_token_bytes, self.l2_bytes, n, n_dec, tokens, decode_kv,
                     prefill_kv, longest_decode_kv)

    def decode_waves_s(self, n: int, decode_kv: float) -> tuple[float, float]:
        """A decode-only step of ``n`` rows reading ``decode_kv`` KV tokens together, per layer:
        (seconds of its thread blocks in waves, seconds of the merge kernel a split adds).

        With ``max_seqlen_q == 1`` FA2 packs each KV head's query heads into one block and splits
        keys (``fa2_num_splits``): one block per (row, KV head, split), each walking its keys
        ``block_n`` at a time at ``decode_tile_s`` a tile (latency-bound: a few query rows, one
        block per SM), in waves over the SMs; rows at their mean context. The caller takes the
        larger of this and the KV read, which wins once rows hold a few thousand tokens."""
        tiles = math.ceil(decode_kv / n / self.block_n)
        blocks = n * self.kv_heads
        splits = fa2_num_splits(blocks, 2 * self.sms, tiles)
        waves = -(-(blocks * splits) // self.sms)
        return waves * -(-tiles // splits) * self.decode_tile_s, self.decode_merge_s if splits > 1 else 0.0

    def kv_read_s(self, n_dec: int, prefill_tiles: float, decode_kv: int, prefill_kv: int) -> float:
        """Seconds of the layer's KV read from memory: prefill rows' once per KV head; decode rows'
        too while one KV head's decode KV fits in L2 (the group's query heads run one after the
        other over it), else once per wave the group's blocks span."""
        rereads = 1.0
        if decode_kv * self.head_token_bytes > self.l2_bytes:
            rereads = min(self.group, max(1.0, self.group * (n_dec + prefill_tiles) / self.sms))
        return (prefill_kv + rereads * decode_kv) * self.kv_token_s


def reference_tile_s(hardware: HardwareConfig) -> float:
    """Seconds of one 64 x 128 tile iteration (head dim 128) on one SM, such that the reference
    prefill (``REFERENCE_*``) takes its causal FLOPs at ``peak_flops x attention_flops_fraction``."""
    tokens, heads = REFERENCE_TOKENS, REFERENCE_HEADS
    seconds = 4 * REFERENCE_HEAD_DIM * heads * tokens * (tokens + 1) / 2 / (
        hardware.peak_flops * hardware.attention_flops_fraction)
    return seconds / reference_iterations(hardware.sm_count)


def reference_iterations(sms: int) -> float:
    """The reference prefill's makespan on ``sms`` SMs, in tile iterations."""
    its, tiles, longest = prefill_iterations(REFERENCE_TOKENS, 0, block_n(REFERENCE_HEAD_DIM))
    work, blocks = REFERENCE_HEADS * its, REFERENCE_HEADS * tiles
    return makespan(work, blocks, longest, work, blocks, longest, sms)
