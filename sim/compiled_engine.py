"""One replica under the chunked policy as one compiled loop over columns (large simulations).

At a million requests the Python engine (``engine.py`` driving ``schedulers/chunked.py``) costs
~50-80 µs a step in objects, SimPy events and small numpy calls. For the configuration most
large runs use — one replica, the ``chunked`` policy (fcfs, preemption by recompute, no async
scheduling), prefix caching off, a generated or trace workload held as columns
(``RequestArrays``) — this module runs the same
engine as one numba function over arrays: requests are columns (no ``Request`` objects), the
running table, the waiting queue and the KV block counts are arrays, and Python is left with
one call per step to the executor's price (``SimExecutor.price``, the cost model's own code, so
every step's duration is the same float).

It is a twin of the Python engine, not a different model: the arrivals are delivered in the
order SimPy's event queue delivers them (below), the policy's budget split, KV growth,
preemption of the newest running row and watermark admission are ``ChunkedScheduler``'s, the
updates are ``RunningTable.advance``'s, and the iteration records, inter-token latencies and
request records reach the ``MetricsRecorder`` in the same order and groups, so the results are
equal to the last bit (``tests/test_compiled_engine.py`` runs both engines on randomized
scenarios, preemption included, and compares every output). Any change to the chunked policy,
the KV accounting or the engine loop must change both: that test fails otherwise.
``simulate`` uses it by itself when the compiled step loops are on (``row_kernels``, runs of
20,000 requests or more) and the scenario is in its class (``reason_not_compiled`` says why
not); ``simulate(compiled=False)`` forces the Python engine.

Arrival order (SimPy, one replica): the arrival process sends request k at ``T[k]``, the time its
timeout lands on (``T[k-1] + (a[k] - T[k-1])`` when that delay is positive, else at once, with
the request before it). A step scheduled at ``ts`` ends at ``te``; the requests sent before the
replica's update at ``te`` are those with ``T < te``, and those at ``te`` only when the first of
them is the arrival that was pending when the step was scheduled (its timeout was queued before
the step's, and SimPy breaks ties by queueing order); an idle replica wakes at its next
arrival's ``T`` after every request sent at once with it.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from . import row_kernels as rk
from .batch import StepSums
from .metrics import ITERATION_COLUMNS, MetricsRecorder
from .request import RequestState
from .workload import RequestArrays

ITL_CAP = MetricsRecorder._ITL_BUFFER  # the recorder's ITL staging buffer: flushed at the same points
ROW_BLOCK = 4096  # iteration rows handed to the recorder at a time

# request columns (int): prompt, output, outputs so far, preemptions, state, rejected, sent by a timeout
_QI = 7
P_LEN, O_LEN, OUT, PREEMPTS, STATE, REJECT, YIELDED = range(_QI)
# request columns (float): arrival (recorded), first scheduled, first token, last token, finish, sent at
_QF = 6
ARRIVAL, FIRST_SCHED, FIRST_TOK, LAST_TOK, FINISH, SENT = range(_QF)
# scalars
(N_REQ, MAX_SEQS, BUDGET, THRESHOLD, BLOCK, NUM_BLOCKS, WATERMARK, N_RUN, W_HEAD, W_COUNT, FREE, NEXT, PHASE,
 PENDING, K, NPRE, ITL_N, ROWS_N, DONE, STEPS, PREEMPTIONS, S_SEQS, S_DEC, S_TOKENS, S_PAIRS, S_DKV, S_PKV,
 S_LONGEST, S_PLAIN, S_SAMPLES) = range(30)
_NS = 32
# float scalars: the clock (a step's start until its update)
NOW = 0
# return codes
DONE_RC, STEP_RC, FLUSH_ITL_RC, ROWS_FULL_RC, NO_PROGRESS_RC, BROKEN_RC = range(6)

_WAITING, _RUNNING, _FINISHED, _REJECTED = (int(RequestState.WAITING), int(RequestState.RUNNING),
                                            int(RequestState.FINISHED), int(RequestState.REJECTED))
_UNSENT = -1


def _send(qi: np.ndarray, wq: np.ndarray, s: np.ndarray, r: int) -> None:
    """Request ``r`` reaches the replica: queued, or recorded done if the policy rejects it."""
    if qi[REJECT, r]:
        qi[STATE, r] = _REJECTED
        s[DONE] += 1
        return
    qi[STATE, r] = _WAITING
    cap = wq.shape[0]
    wq[(s[W_HEAD] + s[W_COUNT]) % cap] = r
    s[W_COUNT] += 1


def _send_at_once(qi: np.ndarray, wq: np.ndarray, s: np.ndarray) -> None:
    """The arrival process's next request and those it sends with it (no timeout between)."""
    p = s[NEXT]
    n = s[N_REQ]
    _send(qi, wq, s, p)
    p += 1
    while p < n and not qi[YIELDED, p]:
        _send(qi, wq, s, p)
        p += 1
    s[NEXT] = p


def _close_rows(rt: np.ndarray, rl: np.ndarray, gone: np.ndarray, m: int, n: int) -> int:
    """Remove table rows ``gone[:m]`` (ascending) keeping order; returns the rows left."""
    if m == 0:
        return n
    dst = gone[0]
    g = 0
    for src in range(gone[0], n):
        if g < m and src == gone[g]:
            g += 1
            continue
        for c in range(rt.shape[0]):
            rt[c, dst] = rt[c, src]
        rl[dst] = rl[src]
        dst += 1
    return dst


def _schedule(qi: np.ndarray, qf: np.ndarray, rt: np.ndarray, rl: np.ndarray, wq: np.ndarray, st: np.ndarray,
              s: np.ndarray, now: float) -> int:
    """``ChunkedScheduler.schedule`` at ``now``: the step's rows (table rows, tokens) into ``st``
    rows 0-1, its context and sample flags into rows 2-3, its sums into ``s``; returns its rows."""
    n = s[N_RUN]
    budget = s[BUDGET]
    thr = s[THRESHOLD]
    bs = s[BLOCK]
    new = st[4]  # per table row: tokens this step
    preempted_any = False
    npre = 0
    if n:
        # the budget: one token to each decoding row while it lasts, then prefill chunks in order
        n_dec = 0
        for i in range(n):
            if rt[1, i] - rt[0, i] == 1:
                n_dec += 1
        if n_dec <= budget:
            for i in range(n):
                new[i] = 1 if rt[1, i] - rt[0, i] == 1 else 0
        else:
            left = budget
            for i in range(n):
                if left > 0 and rt[1, i] - rt[0, i] == 1:
                    new[i] = 1
                    left -= 1
                else:
                    new[i] = 0
            n_dec = budget
        budget -= n_dec
        for i in range(n):
            if budget <= 0:
                break
            need = rt[1, i] - rt[0, i]
            if need != 1:
                chunk = min(need, budget, thr)
                new[i] = chunk
                budget -= chunk
        # KV blocks for the rows' new tokens; short: preempt the newest rows until the rest fit
        want = st[5]
        total = 0
        for i in range(n):
            w = 0
            if new[i] > 0:
                b = (rt[0, i] + new[i] + bs - 1) // bs
                if b > rt[4, i]:
                    w = b - rt[4, i]
            want[i] = w
            total += w
        if total > s[FREE]:
            gone = st[6]
            ng = 0
            top = n  # rows at or above this one are preempted (newest first)
            while total > s[FREE] and top > 0:
                v = top - 1
                top = v
                total -= want[v]
                r = rt[5, v]
                qi[OUT, r] = rt[2, v]
                qf[LAST_TOK, r] = rl[v]
                qi[PREEMPTS, r] += 1
                qi[STATE, r] = _WAITING
                s[PREEMPTIONS] += 1
                npre += 1
                s[FREE] += rt[4, v]
                budget += new[v]
                cap = wq.shape[0]
                s[W_HEAD] = (s[W_HEAD] - 1) % cap  # back to the front of the queue
                s[W_COUNT] += 1
                wq[s[W_HEAD]] = r
            for v in range(top, n):
                gone[ng] = v
                ng += 1
            preempted_any = ng > 0
            # (the victims are the rows top..n-1, in preemption order n-1 first)
            for i in range(top):
                if want[i] > 0:
                    if want[i] > s[FREE]:
                        return -1
                    s[FREE] -= want[i]
                    rt[4, i] += want[i]
            n = top
            s[N_RUN] = n
        else:
            for i in range(n):
                if want[i] > 0:
                    rt[4, i] += want[i]
            s[FREE] -= total
    k = 0
    for i in range(n):
        if new[i] > 0:
            st[0, k] = i
            st[1, k] = new[i]
            k += 1
    if not preempted_any:
        # admit waiting requests, oldest first, while budget, seats and blocks (watermark kept) last
        cap = wq.shape[0]
        while s[W_COUNT] > 0 and budget > 0 and s[N_RUN] < s[MAX_SEQS]:
            r = wq[s[W_HEAD]]
            tokens = qi[P_LEN, r] + qi[OUT, r]
            chunk = min(tokens, budget, thr)
            need = (chunk + bs - 1) // bs
            if need > 0 and s[FREE] - need < s[WATERMARK]:
                break
            s[W_HEAD] = (s[W_HEAD] + 1) % cap
            s[W_COUNT] -= 1
            s[FREE] -= need
            if qf[FIRST_SCHED, r] != qf[FIRST_SCHED, r]:
                qf[FIRST_SCHED, r] = now
            qi[STATE, r] = _RUNNING
            i = s[N_RUN]
            rt[0, i] = 0
            rt[1, i] = tokens
            rt[2, i] = qi[OUT, r]
            rt[3, i] = qi[O_LEN, r]
            rt[4, i] = need
            rt[5, i] = r
            rl[i] = qf[LAST_TOK, r]
            s[N_RUN] = i + 1
            st[0, k] = i
            st[1, k] = chunk
            k += 1
            budget -= chunk
    # the step's context, sample flags and sums (row_kernels.batch_rows)
    n_dec = total = pairs = decode_kv = prefill_kv = longest = plain = sampled = 0
    for j in range(k):
        i = st[0, j]
        c = rt[0, i]
        qj = st[1, j]
        smp = c + qj >= rt[1, i]
        st[2, j] = c
        st[3, j] = 1 if smp else 0
        if smp:
            sampled += 1
        total += qj
        if qj == 1:
            n_dec += 1
            decode_kv += c + 1
            if c + 1 > longest:
                longest = c + 1
            if smp and c > 0:
                plain += 1
        else:
            pairs += qj * c + qj * (qj + 1) // 2
            prefill_kv += c + qj
    s[K] = k
    s[NPRE] = npre
    s[S_SEQS] = k
    s[S_DEC] = n_dec
    s[S_TOKENS] = total
    s[S_PAIRS] = pairs
    s[S_DKV] = decode_kv
    s[S_PKV] = prefill_kv
    s[S_LONGEST] = longest
    s[S_PLAIN] = plain
    s[S_SAMPLES] = sampled
    return k


def engine_step(qi: np.ndarray, qf: np.ndarray, rt: np.ndarray, rl: np.ndarray, wq: np.ndarray, st: np.ndarray,
                s: np.ndarray, sf: np.ndarray, itl: np.ndarray, rows: np.ndarray, dt: float) -> int:
    """Finish the step in flight (it took ``dt`` seconds), then run the replica up to its next
    step and return ``STEP_RC`` with that step's sums in ``s`` (the caller prices it and calls
    again with its duration); ``DONE_RC`` when every request is done; ``FLUSH_ITL_RC`` /
    ``ROWS_FULL_RC`` (nothing changed) when the ITL or iteration-row buffer must be emptied first;
    ``NO_PROGRESS_RC`` / ``BROKEN_RC`` on a state the Python engine raises on."""
    if s[PHASE] == 1:
        k = s[K]
        cnt = 0
        for j in range(k):
            if st[3, j] and rt[2, st[0, j]] > 0:
                cnt += 1
        if s[ITL_N] + cnt > itl.shape[0]:
            return FLUSH_ITL_RC
        if s[ROWS_N] == rows.shape[0]:
            return ROWS_FULL_RC
        ts = sf[NOW]
        te = ts + dt
        # the arrivals SimPy delivers before the step's end
        n_req = s[N_REQ]
        pending = s[PENDING]
        while s[NEXT] < n_req:
            t = qf[SENT, s[NEXT]]
            if t < te or (t == te and s[NEXT] == pending):
                _send_at_once(qi, wq, s)
            else:
                break
        sf[NOW] = te
        now = te
        ni = s[ITL_N]
        done = st[6]
        nd = 0
        for j in range(k):
            i = st[0, j]
            rt[0, i] += st[1, j]
            if st[3, j]:
                o = rt[2, i]
                if o > 0:
                    itl[ni] = now - rl[i]
                    ni += 1
                else:
                    r = rt[5, i]
                    if qf[FIRST_TOK, r] != qf[FIRST_TOK, r]:
                        qf[FIRST_TOK, r] = now
                o += 1
                rt[2, i] = o
                rt[1, i] += 1
                rl[i] = now
                if o >= rt[3, i]:
                    done[nd] = i
                    nd += 1
        s[ITL_N] = ni
        for j in range(nd):
            i = done[j]
            r = rt[5, i]
            qi[OUT, r] = rt[2, i]
            qf[LAST_TOK, r] = rl[i]
            qi[STATE, r] = _FINISHED
            qf[FINISH, r] = now
            s[FREE] += rt[4, i]
            s[DONE] += 1
        s[N_RUN] = _close_rows(rt, rl, done, nd, s[N_RUN])
        m = s[ROWS_N]
        rows[m, 0] = 0.0
        rows[m, 1] = ts
        rows[m, 2] = dt
        rows[m, 3] = k
        rows[m, 4] = s[S_TOKENS] - s[S_PLAIN]
        rows[m, 5] = s[S_PLAIN]
        rows[m, 6] = s[S_TOKENS]
        rows[m, 7] = s[NUM_BLOCKS] - s[FREE]
        rows[m, 8] = s[NUM_BLOCKS]
        rows[m, 9] = s[W_COUNT]
        rows[m, 10] = s[N_RUN]
        rows[m, 11] = 0.0
        rows[m, 12] = s[NPRE]
        rows[m, 13] = 0.0
        rows[m, 14] = math.nan
        s[ROWS_N] = m + 1
        s[STEPS] += 1
        s[PHASE] = 0
    while True:
        if s[W_COUNT] == 0 and s[N_RUN] == 0:
            if s[NEXT] >= s[N_REQ]:
                return DONE_RC
            sf[NOW] = qf[SENT, s[NEXT]]  # idle until the next arrival
            _send_at_once(qi, wq, s)
            continue
        k = _schedule(qi, qf, rt, rl, wq, st, s, sf[NOW])
        if k < 0:
            return BROKEN_RC
        if k == 0:
            return NO_PROGRESS_RC
        s[PENDING] = s[NEXT]
        s[PHASE] = 1
        return STEP_RC


def send_times(arrival: np.ndarray, sent: np.ndarray, yielded: np.ndarray) -> None:
    """When the arrival process sends each request (``Cluster.arrivals``: a timeout of the
    positive delay from the clock, else at once) and whether a timeout preceded it."""
    now = 0.0
    for k in range(arrival.shape[0]):
        delay = arrival[k] - now
        if delay > 0:
            now = now + delay
            yielded[k] = 1
        else:
            yielded[k] = 0
        sent[k] = now


_PLAIN = {"_send": _send, "_send_at_once": _send_at_once, "_close_rows": _close_rows, "_schedule": _schedule,
          "engine_step": engine_step, "send_times": send_times}
_loaded: bool | None = None  # None: not tried yet; False: numba could not build it


def _load() -> bool:
    """Compile (or load from numba's cache) the loop, callees first so the callers bind to them,
    and run it once on an empty state (the types a run passes); False, with one warning, when
    that fails (the Python engine then runs: the same results)."""
    global _loaded
    if _loaded is None:
        g = globals()
        try:
            import numba

            for name, f in _PLAIN.items():
                g[name] = numba.njit(cache=True, nogil=True)(f)
            empty_i, empty_f = np.zeros((_QI, 0), dtype=np.int64), np.zeros((_QF, 0))
            g["send_times"](empty_f[0], empty_f[1], empty_i[0])
            g["engine_step"](empty_i, empty_f, np.zeros((6, 1), dtype=np.int64), np.zeros(1),
                             np.zeros(1, dtype=np.int64), np.zeros((7, 1), dtype=np.int64),
                             np.zeros(_NS, dtype=np.int64), np.zeros(1), np.zeros(1),
                             np.zeros((1, len(ITERATION_COLUMNS))), 0.0)
            _loaded = True
        except Exception as e:  # noqa: BLE001 - the optional fast path falls back
            g.update(_PLAIN)
            _loaded = False
            warnings.warn(f"servesim: the compiled engine is unavailable ({type(e).__name__}: {e}); running the "
                          "Python engine (same results, slower)", RuntimeWarning, stacklevel=3)
    return _loaded


def reason_not_compiled(sc: Any, requests: Any, scheduler: Any, executor: Any) -> str | None:
    """Why ``simulate`` runs this scenario on the Python engine (None: the compiled one can)."""
    from .schedulers import ChunkedScheduler

    if not rk.ON:
        return "the compiled step loops are off (runs under 20,000 requests, SERVESIM_JIT=0 or no numba)"
    if sc.cluster.num_replicas != 1 or sc.cluster.disagg is not None:
        return "more than one replica"
    if type(scheduler) is not ChunkedScheduler:
        return f"scheduler {sc.scheduler_name} (the compiled engine runs the chunked policy)"
    cfg = scheduler.config
    if cfg.policy != "fcfs":
        return f"scheduler.policy {cfg.policy}"
    if cfg.preemption_mode != "recompute":
        return f"preemption_mode {cfg.preemption_mode}"
    if cfg.async_scheduling:
        return "async_scheduling"
    if scheduler.kv.enable_prefix_caching:
        return "prefix caching"
    if not isinstance(requests, RequestArrays):
        return "the workload is request objects (sessions or a trace with content hashes)"
    if not hasattr(executor, "price"):
        return "an executor that is not the cost model's (SimExecutor)"
    if scheduler.max_num_seqs > ITL_CAP:
        return f"max_num_seqs above {ITL_CAP}"
    if not _load():
        return "numba could not build the compiled engine (see the warning)"
    return None


def _rejected(requests: RequestArrays, scheduler: Any) -> np.ndarray:
    """Which requests ``Scheduler.reject_reason`` refuses (a mask; it reads only their lengths)."""
    p, o = requests.prompt_len, requests.output_len
    kv = scheduler.kv
    bad = (p < 1) | (o < 1)
    # (each comparison rearranged so that no sum of two lengths is formed: int64 would wrap)
    if scheduler.config.max_model_len is not None:
        bad |= p > scheduler.config.max_model_len - o  # prompt + output > max_model_len
    # blocks_for(prompt + output - 1) > usable blocks, i.e. prompt + output - 1 > usable * block_size
    bad |= p - 1 > (kv.num_blocks - kv.watermark_blocks) * kv.block_size - o
    return bad


def run_compiled(requests: RequestArrays, scheduler: Any, executor: Any, recorder: MetricsRecorder,
                 on_progress: Callable[[int], None] | None = None) -> int:
    """Simulate ``requests`` on one replica of ``scheduler``'s policy and sizes with the compiled
    loop, each step priced by ``executor.price`` (``SimExecutor``); records into ``recorder``
    exactly what the Python engine would. Returns the number of steps."""
    if not _load():
        raise RuntimeError("the compiled engine is unavailable (numba could not build it)")
    n = len(requests)
    kv = scheduler.kv
    qi = np.zeros((_QI, n), dtype=np.int64)
    qf = np.full((_QF, n), math.nan)
    qi[P_LEN] = requests.prompt_len
    qi[O_LEN] = requests.output_len
    qi[STATE] = _UNSENT
    reject = _rejected(requests, scheduler)
    qi[REJECT] = reject
    qf[ARRIVAL] = requests.arrival_time
    yielded = np.empty(n, dtype=np.int64)
    send_times(requests.arrival_time, qf[SENT], yielded)
    qi[YIELDED] = yielded
    cap = max(scheduler.max_num_seqs, 1)
    rt = np.zeros((6, cap), dtype=np.int64)
    rl = np.zeros(cap)
    wq = np.zeros(max(n, 1), dtype=np.int64)
    st = np.zeros((7, cap), dtype=np.int64)
    s = np.zeros(_NS, dtype=np.int64)
    s[N_REQ] = n
    s[MAX_SEQS] = scheduler.max_num_seqs
    s[BUDGET] = scheduler.max_num_batched_tokens
    s[THRESHOLD] = scheduler.config.long_prefill_token_threshold or scheduler.max_num_batched_tokens
    s[BLOCK] = kv.block_size
    s[NUM_BLOCKS] = kv.num_blocks
    s[WATERMARK] = kv.watermark_blocks
    s[FREE] = kv.num_blocks
    sf = np.zeros(1)
    itl = np.empty(ITL_CAP)
    rows = np.empty((ROW_BLOCK, len(ITERATION_COLUMNS)))
    hist = recorder.itl_histogram  # (flushes whatever the recorder staged before)
    step = engine_step
    price, with_rows = executor.price, executor.prices_rows
    done_seen = 0
    dt = 0.0
    while True:
        rc = step(qi, qf, rt, rl, wq, st, s, sf, itl, rows, dt)
        if rc == STEP_RC:
            n_seqs, n_dec, tokens, pairs, dkv, pkv, longest = s[S_SEQS:S_LONGEST + 1].tolist()
            sums = StepSums(n_seqs, n_dec, tokens, pairs, dkv, pkv)
            if with_rows(sums):  # (a model that reads the rows: the step's new and context tokens)
                dt = price(sums, longest, st[1, :n_seqs], st[2, :n_seqs])
            else:
                dt = price(sums, longest)
            continue
        if rc == FLUSH_ITL_RC:
            hist.add(itl[: s[ITL_N]])
            s[ITL_N] = 0
            continue
        if rc == ROWS_FULL_RC:
            recorder.on_iteration_rows(0, rows[: s[ROWS_N]])
            s[ROWS_N] = 0
            if on_progress is not None:
                done = int(s[DONE])
                on_progress(done - done_seen)
                done_seen = done
            continue
        break
    if rc != DONE_RC:
        raise RuntimeError(f"compiled engine: {'no progress' if rc == NO_PROGRESS_RC else 'allocation failed'} "
                           f"at {sf[NOW]} s with {s[W_COUNT]} waiting, {s[N_RUN]} running and "
                           f"{s[FREE]}/{s[NUM_BLOCKS]} KV blocks free")
    if s[ROWS_N]:
        recorder.on_iteration_rows(0, rows[: s[ROWS_N]])
    recorder.on_itl(itl[: s[ITL_N]])  # (staged as the Python engine leaves them: fewer than a buffer)
    if on_progress is not None:
        on_progress(int(s[DONE]) - done_seen)
    if s[DONE] != n or s[FREE] != kv.num_blocks or s[N_RUN] or s[W_COUNT]:
        raise AssertionError(f"compiled engine: {s[DONE]} of {n} requests done, {s[FREE]}/{kv.num_blocks} KV "
                             "blocks free at the end")
    reasons = np.full(n, None, dtype=object)
    for i in np.flatnonzero(reject).tolist():
        reasons[i] = scheduler.reject_reason(requests[i])
        if reasons[i] is None:
            raise AssertionError(f"compiled engine: request {i} rejected without a reason")
    state = qi[STATE].astype(np.int8)
    recorder.on_request_columns({
        "request_id": np.arange(n, dtype=np.int64),
        "replica": np.zeros(n, dtype=np.int64),
        "arrival_time": qf[ARRIVAL].copy(),
        "first_scheduled_time": qf[FIRST_SCHED].copy(),
        "first_token_time": qf[FIRST_TOK].copy(),
        "finish_time": qf[FINISH].copy(),
        "prompt_len": qi[P_LEN].copy(),
        "output_len": qi[O_LEN].copy(),
        "num_output_tokens": qi[OUT].copy(),
        "num_preemptions": qi[PREEMPTS].copy(),
        "num_cached_tokens": np.zeros(n, dtype=np.int64),
        "state": state,
        "reject_reason": reasons,
    })
    recorder.check_done(n)
    scheduler.num_preemptions = int(s[PREEMPTIONS])
    return int(s[STEPS])
