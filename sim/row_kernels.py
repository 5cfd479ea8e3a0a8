"""Compiled loops for the per-step array work over the running rows (large runs).

A simulated step is ~40 small numpy calls at 0.3-1 µs each (a mask, a count, a gather, an add,
each over the same few hundred rows): at a million requests that constant is most of the run.
The loops here do one piece of a step's work in one pass, compiled by numba: a step's rows and
aggregates (``batch_rows``), its outcome on the table (``advance_rows``), the finished rows
closed up (``close_rows``), the rows that need KV blocks (``blocks_short``, ``full_rows``) and
chunked prefill's split of the token budget (``split_budget``); and one piece of arithmetic, the
roofline's FA2 varlen attention term of a mixed step (``varlen_layer_s``: ``varlen_attention.
layer_seconds`` itself, registered with ``compile_with_loops``), whose float operations cost more
than the rest of the cost model, and a GPU profile's reading of its 4-D attention grid
(``grid_inside``: ``layer_cost_model.grid_inside``, registered the same way) and its skew α
(``skew_alpha``). They are mechanics, not policy:
which rows run and how many tokens each computes is decided by the policy in plain Python, and
the policy modules read the same either way. The callers look them up on this module at each
call (``rk.batch_rows(...)``): ``use`` replaces the plain functions with their compiled versions.

Every loop does the same integer and float operations, in the same order, as the numpy code it
stands in for, which stays as the path for runs too small to pay for compiling (``want``) and
for machines without numba; ``tests/test_row_kernels.py`` checks the two paths give identical
runs. Loading the compiled loops costs ~0.6 s and ~80-115 MB once per process (LLVM's code
generator), so ``simulate`` turns them on for runs of ``MIN_REQUESTS`` or more; ``SERVESIM_JIT=1``
(always) or ``0`` (never) overrides. The first run on a machine also compiles them (a few seconds)
and keeps the machine code in ``__pycache__`` (``cache=True``).
"""

from __future__ import annotations

import importlib.util
import os
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

ON = False  # the compiled loops are in use (read by the callers every step)
MIN_REQUESTS = 20_000  # runs this large turn them on (``want``)
_KERNELS: list[str] = []  # names of the loops, compiled in place by ``use``
# functions of other modules compiled with the loops, registered by those modules (this one
# imports none of them): name -> (the plain function, argument tuples to load it for)
_ELSEWHERE: dict[str, tuple[Callable[..., Any], tuple[tuple[Any, ...], ...]]] = {}
# varlen_attention.layer_seconds, layer_cost_model.grid_inside and skew_alpha compiled
# (``compile_with_loops``); None until the loops load
varlen_layer_s: Callable[..., float] | None = None
grid_inside: Callable[..., float] | None = None
skew_alpha: Callable[..., float] | None = None
_loaded = False


def _compiled(f: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a loop to be compiled when the loops are first turned on. Until then the module holds
    the plain Python function (numba is not even imported: ~55 MB and ~0.2 s a small run need not
    pay)."""
    _KERNELS.append(f.__name__)
    return f


def compile_with_loops(name: str, *warm: tuple[Any, ...]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator for a plain-scalar function of another module (the FA2 term's arithmetic): the
    loops compile it too and publish it here as ``name`` (loaded for the argument types in
    ``warm``). The function itself is returned unchanged: its module keeps calling it as Python."""
    def register(f: Callable[..., Any]) -> Callable[..., Any]:
        _ELSEWHERE[name] = (f, warm)
        if _loaded:  # (registered after the loops loaded: compile it now)
            _compile_elsewhere(name)
        return f
    return register


def _compile_elsewhere(name: str) -> None:
    import numba

    f, warm = _ELSEWHERE[name]
    g = globals()
    g[name] = numba.njit(cache=True, nogil=True)(f)
    for args in warm:
        g[name](*args)


def available() -> bool:
    """Whether numba is installed (without importing it)."""
    return importlib.util.find_spec("numba") is not None


def want(num_requests: int) -> bool:
    """Whether a run of ``num_requests`` requests should use the compiled loops."""
    env = os.environ.get("SERVESIM_JIT", "").strip()
    if env in ("0", "1"):
        return env == "1"
    return num_requests >= MIN_REQUESTS


def use(on: bool) -> bool:
    """Turn the compiled loops on (compiling or loading them the first time) or off; returns
    whether they are on (False without numba)."""
    global ON, _loaded
    if on and not _loaded:
        on = available() and _load()
    ON = on
    return ON


def _load() -> bool:
    """Compile (or load from the cache) every loop in place; False, with one warning, when numba is
    installed but cannot be used (e.g. a numpy newer than it supports): the numpy path runs."""
    global _loaded
    g = globals()
    plain = {name: g[name] for name in _KERNELS}
    try:
        import numba

        for name in _KERNELS:
            g[name] = numba.njit(cache=True, nogil=True)(plain[name])
        _warm()
        for name in _ELSEWHERE:
            _compile_elsewhere(name)
    except Exception as e:  # noqa: BLE001 - any failure of the optional fast path falls back
        g.update(plain)
        g.update(dict.fromkeys(_ELSEWHERE))
        warnings.warn(f"servesim: compiled step loops unavailable ({type(e).__name__}: {e}); "
                      f"using the numpy path (same results, slower; SERVESIM_JIT=0 silences this)",
                      RuntimeWarning, stacklevel=3)
        return False
    _loaded = True
    return True


def _warm() -> None:
    """Load (or compile) every loop for the argument types a run passes, so that cost falls here
    rather than inside the first steps."""
    ints = np.zeros((7, 4), dtype=np.int64)
    last = np.zeros(4)
    rows = np.arange(2, dtype=np.int64)
    new = np.ones(2, dtype=np.int64)
    ro = new.copy()
    ro.flags.writeable = False
    flags = np.ones(2, dtype=bool)
    out = np.zeros(4, dtype=np.int64)
    ro_rows = rows.copy()
    ro_rows.flags.writeable = False
    for r in (rows, ro_rows):  # (a whole-table step's rows and ones are read-only views)
        for q in (new, ro):
            batch_rows(ints[0], ints[1], r, q, out, flags)
            advance_rows(ints, last, r, q, flags, 1.0, last, out, out)
    for q in (new, ro):
        blocks_short(ints[4], ints[0], q, 16, out, out, out)
    full_rows(ints[0], ints[4], 2, 16, 0, out)
    close_rows(ints, rows[1:], 2)
    split_budget(ints[0], ints[1], 2, 8, 8, out)


@_compiled
def batch_rows(computed: np.ndarray, tokens: np.ndarray, rows: np.ndarray, q: np.ndarray, ctx: np.ndarray,
               samples: np.ndarray) -> tuple[int, int, int, int, int, int, int, int, int]:
    """A step's per-row context and sample flags, written into ``ctx`` and ``samples``, and its
    aggregates, in one pass over ``rows`` (row j computes ``q[j]`` tokens): ``batch.step_sums``'
    six figures, the largest ctx + 1 over rows with q == 1 (0 without one), the plain decodes
    (q == 1, sampling, ctx > 0) and the rows that sample. A row samples when its computation
    reaches the end of its tokens."""
    k = rows.shape[0]
    n_dec = total = pairs = decode_kv = prefill_kv = longest = plain = sampled = 0
    for j in range(k):
        i = rows[j]
        c = computed[i]
        qj = q[j]
        s = c + qj >= tokens[i]
        ctx[j] = c
        samples[j] = s
        if s:
            sampled += 1
        total += qj
        if qj == 1:
            n_dec += 1
            decode_kv += c + 1
            if c + 1 > longest:
                longest = c + 1
            if s and c > 0:
                plain += 1
        else:
            pairs += qj * c + qj * (qj + 1) // 2
            prefill_kv += c + qj
    return k, n_dec, total, pairs, decode_kv, prefill_kv, longest, plain, sampled


@_compiled
def advance_rows(ints: np.ndarray, last: np.ndarray, rows: np.ndarray, new: np.ndarray, samples: np.ndarray,
                 now: float, itl: np.ndarray, first: np.ndarray, done: np.ndarray) -> tuple[int, int, int]:
    """Apply a finished step to table ``rows`` (row j computed ``new[j]`` tokens; ``samples[j]``:
    it emitted one). ``ints`` rows 0-3 are computed, tokens, out, out_len and ``last`` the time of
    each row's last token (``RunningTable``). Writes the inter-token latencies of the emitted
    tokens into ``itl``, the rows that emitted their first token into ``first`` and the rows now
    done into ``done``, each in step order, and returns how many of each."""
    ni = nf = nd = 0
    for j in range(rows.shape[0]):
        i = rows[j]
        ints[0, i] += new[j]
        if samples[j]:
            o = ints[2, i]
            if o > 0:
                itl[ni] = now - last[i]
                ni += 1
            else:
                first[nf] = i
                nf += 1
            o += 1
            ints[2, i] = o
            ints[1, i] += 1
            last[i] = now
            if o >= ints[3, i]:
                done[nd] = i
                nd += 1
    return ni, nf, nd


@_compiled
def blocks_short(nblocks: np.ndarray, computed: np.ndarray, new: np.ndarray, block_size: int, rows: np.ndarray,
                 blocks: np.ndarray, counts: np.ndarray) -> int:
    """Rows i < len(new) whose ``computed[i] + new[i]`` tokens need more than the ``nblocks[i]``
    blocks they hold, written in row order into ``rows`` with the blocks each then holds
    (``blocks``) and takes (``counts``); returns how many."""
    k = 0
    for i in range(new.shape[0]):
        w = computed[i] + new[i]
        nb = nblocks[i]
        if w > nb * block_size:
            b = (w + block_size - 1) // block_size
            rows[k] = i
            blocks[k] = b
            counts[k] = b - nb
            k += 1
    return k


@_compiled
def close_rows(ints: np.ndarray, gone: np.ndarray, n: int) -> int:
    """Remove columns ``gone`` (ascending, distinct, < n) of ``ints[:, :n]``, moving the later
    ones down in order; returns the columns left, or -1 (nothing moved) if ``gone`` is not
    ascending and distinct."""
    for g in range(1, gone.shape[0]):
        if gone[g] <= gone[g - 1]:
            return -1
    if gone.shape[0] == 0:
        return n
    dst = gone[0]
    g = 0
    for src in range(gone[0], n):
        if g < gone.shape[0] and src == gone[g]:
            g += 1
            continue
        for r in range(ints.shape[0]):
            ints[r, dst] = ints[r, src]
        dst += 1
    return dst


@_compiled
def full_rows(computed: np.ndarray, nblocks: np.ndarray, n: int, block_size: int, free: int, rows: np.ndarray) -> int:
    """Rows i < n whose computed tokens fill every block they hold (a decode there needs one
    more), written into ``rows``; returns how many. When they are ``free`` or fewer, each of them
    is counted one block more in ``nblocks`` (the blocks the caller then hands out); otherwise
    ``nblocks`` is left as it was."""
    k = 0
    for i in range(n):
        if computed[i] >= nblocks[i] * block_size:
            rows[k] = i
            k += 1
    if k <= free:
        for j in range(k):
            nblocks[rows[j]] += 1
    return k


@_compiled
def split_budget(computed: np.ndarray, tokens: np.ndarray, n: int, budget: int, threshold: int,
                 new: np.ndarray) -> tuple[int, int, int]:
    """Chunked prefill's split of a step's token budget over running rows 0..n-1, written into
    ``new`` (length n): one token to each decoding row (one token pending) in table order while
    the budget lasts, then what is left to the rows still prefilling, in table order, each capped
    at ``threshold``.

    Returns (budget left, leading decode rows, rows given tokens). The leading decode rows are
    the rows before the first prefilling one (n: none prefills) when every decode fits, else 0.
    """
    n_dec = 0
    for i in range(n):
        if tokens[i] - computed[i] == 1:
            n_dec += 1
    lead = 0
    if n_dec <= budget:
        lead = -1
        for i in range(n):
            if tokens[i] - computed[i] == 1:
                new[i] = 1
            else:
                new[i] = 0
                if lead < 0:
                    lead = i
        if lead < 0:
            lead = n
    else:
        left = budget
        for i in range(n):
            if left > 0 and tokens[i] - computed[i] == 1:
                new[i] = 1
                left -= 1
            else:
                new[i] = 0
        n_dec = budget
    budget -= n_dec
    given = n_dec
    for i in range(n):
        if budget <= 0:
            break
        need = tokens[i] - computed[i]
        if need != 1:
            chunk = min(need, budget, threshold)
            new[i] = chunk
            budget -= chunk
            if chunk != 0:
                given += 1
    return budget, lead, given

