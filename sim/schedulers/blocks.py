"""Policy building blocks that engine presets compose: chunk sizing, admission reserves, victims, queue order.

Each block is a small pure function over the scheduler's state (the ``RunningTable``, the waiting
queue, the ``BlockManager``). The composed schedulers (``composed.py``, ``retracting.py``,
``dynamic_batcher.py``) and the vLLM-style ones share them, so an engine preset is a choice of
blocks and knob values, never a copy of a scheduler.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from ..kv_cache import BlockManager
from ..request import Request
from .running import RunningTable


# ---- budget --------------------------------------------------------------------------------------
def chunk_tokens(remaining: int, budget: int, cap: int = 0, unit: int = 1) -> int:
    """Prefill tokens one request gets this step: its ``remaining`` tokens, cut to ``budget`` and ``cap``.

    ``cap`` (0 = none) is a per-request limit such as vLLM's ``long_prefill_token_threshold`` or
    SGLang's ``chunked_prefill_size``. A chunk that stops short of the prompt's end is rounded down
    to a multiple of ``unit`` tokens (TensorRT-LLM cuts context chunks at KV-block boundaries), and
    may therefore be 0.
    """
    limit = budget if cap <= 0 else min(budget, cap)
    if remaining <= limit:
        return max(remaining, 0)
    if unit > 1:
        return (max(limit, 0) // unit) * unit
    return max(limit, 0)


# ---- KV reserves -----------------------------------------------------------------------------------
def blocks_to_completion(run: RunningTable, block_size: int) -> int:
    """Blocks the running requests still need to reach their last token, summed (TensorRT-LLM's
    ``GUARANTEED_NO_EVICT`` reserve): KV for prompt + output - 1 tokens, minus the blocks each holds."""
    n = run.n
    if n == 0:
        return 0
    final_tokens = run.tokens[:n] - run.out[:n] + run.out_len[:n] - 1
    need = (final_tokens + block_size - 1) // block_size - run.nblocks[:n]
    return int(np.maximum(need, 0).sum())


def request_blocks_to_completion(kv: BlockManager, req: Request) -> int:
    """Blocks a queued request needs to finish, net of the prompt blocks it already holds (cache hits)."""
    return max(kv.blocks_for(req.prompt_len + req.output_len - 1) - kv.num_blocks_of(req), 0)


def estimated_future_tokens(run: RunningTable, ratio: float, clip: int) -> float:
    """SGLang's reserve for the running requests: ``min(outputs left, clip) * new_token_ratio`` each (tokens)."""
    n = run.n
    if n == 0:
        return 0.0
    left = np.minimum(run.out_len[:n] - run.out[:n], clip)
    return float(left.sum()) * ratio


# ---- admission mechanics ----------------------------------------------------------------------------
def attach_cached_prefix(kv: BlockManager, req: Request) -> tuple[bool, int, int]:
    """Look a queued request up in the prefix cache: ``(fresh, cached tokens, computed tokens)``.

    A request holding no blocks (fresh, or preempted by recompute) gets its cached prompt blocks
    attached; call ``drop_cached_prefix`` if it is then not admitted.
    """
    fresh = not kv.holds(req)
    cached = kv.lookup_prefix(req) if fresh else 0
    return fresh, cached, cached if fresh else req.num_computed_tokens


def drop_cached_prefix(kv: BlockManager, req: Request, cached: int) -> None:
    """Give back the cached blocks ``attach_cached_prefix`` attached to a request left waiting."""
    if cached:
        kv.free(req)


# ---- victims --------------------------------------------------------------------------------------
def latest_arrival(run: RunningTable, candidates: np.ndarray) -> int:
    """The candidate row that arrived last (ties: the row admitted last).

    TensorRT-LLM keeps its active requests in arrival order, so a request paused and resumed keeps
    its old place instead of becoming the newest.
    """
    rows = candidates.nonzero()[0]
    arrivals = np.fromiter((run.reqs[i].arrival_time for i in rows.tolist()), dtype=np.float64, count=len(rows))
    latest = rows[arrivals == arrivals.max()]
    return int(latest[-1])


def fewest_outputs_longest_prompt(run: RunningTable, candidates: np.ndarray) -> int:
    """SGLang's retraction victim: the running request with the fewest output tokens so far, the longest
    prompt among those (it frees the most cache for the least lost decoding)."""
    rows = candidates.nonzero()[0]
    out = run.out[rows]
    fewest = rows[out == out.min()]
    prompt = run.tokens[fewest] - run.out[fewest]
    return int(fewest[np.flatnonzero(prompt == prompt.max())[0]])


# ---- queue --------------------------------------------------------------------------------------
def move_to_tail(waiting: deque[Request], req: Request) -> None:
    """Put a request that was just re-queued at the head (``Scheduler._preempt_row``: first, or behind
    queued requests that hold their blocks) at the tail instead."""
    for k, queued in enumerate(waiting):
        if queued is req:
            del waiting[k]
            waiting.append(req)
            return


def longest_prefix_first(
    waiting: deque[Request], kv: BlockManager, fallback_queue_len: int, dedup_tokens: int
) -> deque[Request]:
    """SGLang's ``lpm`` order: most cached prompt tokens first; plain FCFS once the queue is long.

    Above ``fallback_queue_len`` waiting requests the (expensive) matching is skipped and the queue
    keeps its arrival order, as SGLang does. A request with at most ``dedup_tokens`` cached tokens
    whose prompt starts like an earlier request in the queue is moved behind the others for this
    round (SGLang's in-batch prefix caching: let one of them fill the cache first). The sort is
    stable, so ties keep arrival order.
    """
    if len(waiting) > fallback_queue_len or len(waiting) < 2 or not kv.enable_prefix_caching:
        return waiting
    seen: set[int] = set()
    keyed = []
    dedup_blocks = max(-(-dedup_tokens // kv.block_size), 1)  # blocks that cover dedup_tokens
    for pos, req in enumerate(waiting):
        cached = kv.peek_prefix(req)
        deferred = False
        if cached <= dedup_tokens:
            keys = kv.prefix_keys(req)[:dedup_blocks]
            # keys form a hash chain: the last one matching means the whole run matches
            if len(keys) == dedup_blocks and keys[-1] in seen:
                deferred = True
            else:
                seen.update(keys)
        keyed.append((deferred, -cached, pos, req))
    keyed.sort(key=lambda k: k[:3])
    return deque(k[3] for k in keyed)
