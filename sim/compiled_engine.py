"""Replicas under the chunked policy as one compiled loop over columns (large simulations).

At a million requests the Python engine (``engine.py`` driving ``schedulers/chunked.py``) costs
~50-80 µs a step in objects, SimPy events and small numpy calls. For the configuration most
large runs use — the ``chunked`` policy (preemption by recompute; the ``vllm-v1`` preset's),
chunked prefill and async scheduling on or off, one replica or several behind any router but
``prefix_aware`` (``power_of_two_choices``' pairs drawn ahead; ``kv_aware``, ``least_kv_usage`` and
``vllm_dp`` scrape the replica arrays), a
generated or trace workload held as columns (``RequestArrays``: shared prompt prefixes by
``prefix_id``, no token ids), prefix caching on or off — this module runs the same
engine as one numba function over arrays: requests are columns (no ``Request`` objects), each
replica's running table, waiting queue (a linked list through the request columns) and KV block
counts are arrays. A step's price is the roofline's arithmetic inside the loop
(``compiled_price.price``, a twin of ``RooflineCostModel.step_time`` under ``SimExecutor.price``:
the same float) when the cost model is a plain roofline, and a GPU profile's
(``compiled_profile.price``, the twin of ``LayerCostModel.iteration_time``) when it is one of
those; any other cost model (a fitted CPU profile) is called from Python once per step
(``SimExecutor.price``, the cost model's own code), which costs ~5-7 µs a step more.

It is a twin of the Python engine, not a different model: events run in the order SimPy's queue
runs them (below), the policy's budget split, KV growth, preemption of the newest running row and
watermark admission are ``ChunkedScheduler``'s, the router's picks ``Router.pick``'s, the updates
``RunningTable.advance``'s, and the iteration records, inter-token latencies and request records
reach the ``MetricsRecorder`` in the same order and groups, so the results are the Python plain
loop's to the last bit (``tests/test_compiled_engine.py`` runs both on randomized scenarios,
preemption, several replicas and exact time ties included, and compares every output; with
several replicas the Python fast-forward stages ITLs in another order, so mean and std ITL may
differ from it in the last bits, as they differ between its own fast-forward and plain loop).
Any change to the chunked policy, the KV accounting, the routers or the engine loop must change
both: that test fails otherwise. ``simulate`` uses it by itself when the compiled step loops are
on (``row_kernels``, runs of 20,000 requests or more) and the scenario is in its class
(``reason_not_compiled`` says why not); ``simulate(compiled=False)`` forces the Python engine.

The prefix cache is ``BlockManager``'s (``kv_cache.py``) kept by key instead of by block id. A
request's keys are its shared prefix's blocks (``prefix_id``: the first ``min(prefix_len,
prompt) // block_size``, the same for every request with that prefix) and, once a preemption by
recompute published its own computed blocks (all, or the prompt's: ``cache_preempted_blocks``),
its own blocks after them. Only a keyed block's identity matters to what happens (which keys are
cached, who holds them, the order they become evictable); blocks no key names are
interchangeable, so they are a count. So each key has a node: cached or not, its holders, its
place in the LRU queue of evictable blocks (a node per shared-prefix block, and for own keys one
per cache block at most, found through a typed dict); each request holding blocks has a row of
bits saying which of its registered blocks hold their key's block (a block it computed while
another request published the same key first holds none). A lookup attaches the longest cached
run of its keys, a publication skips keys cached already, a free walks the registered blocks
back from the last (so a table's tail is evicted first) and makes a keyed block evictable when
its last holder leaves, and an allocation takes never-used blocks before it evicts the least
recently used cached one. The lookup counters (queries and hits, of requests preempted before
apart) and each request's ``num_cached_tokens`` are the Python engine's.

Async scheduling (``Replica``'s ``async_scheduling``: the next step is chosen while this one
runs) is ``Replica._loop``'s: a request sent to a replica during its step waits in the replica's
arrived list and joins the waiting queue after the next schedule (at once when nothing else is
left to schedule), a request that finishes keeps its seat and KV blocks through that schedule,
and a schedule that came out empty is tried again at once when it gave seats and blocks back or
preempted; each step's price overlaps the host term (``SimExecutor.price``).

Event order (SimPy): an event runs at its time, and events of one instant in the order they were
queued, which each event here keeps as a stamp from one counter. The arrival process sends
request k at ``T[k]``, the time its timeout lands on (``T[k-1] + (a[k] - T[k-1])`` when that
delay is positive, else at once, with the request before it), and queues its next timeout after
sending; a replica queues its step's end when it schedules the step, and an idle replica's wakeup
is queued when a request reaches it. The loop runs the earliest (time, stamp) each time, so a
request arriving exactly when a step ends is seen by that step's update only when its timeout was
queued before the step's, and replicas whose steps end on one instant update in the order they
scheduled those steps. The step loops duplicate ``row_kernels``' budget split and step sums on
purpose: numba's on-disk cache does not notice a change in another module's jitted callee.
"""

from __future__ import annotations

import hashlib
import math
import warnings
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from . import compiled_price as cp
from . import compiled_profile as cg
from . import row_kernels as rk
from .batch import StepSums
from .metrics import ITERATION_COLUMNS, MetricsRecorder
from .request import RequestState
from .router import draw_pair
from .workload import RequestArrays

ITL_CAP = MetricsRecorder._ITL_BUFFER  # the recorder's ITL staging buffer: flushed at the same points
ROW_BLOCK = 4096  # iteration rows handed to the recorder at a time

# request columns (int): prompt, output, outputs so far, preemptions, state, rejected, sent by a
# timeout, replica, next in its replica's waiting queue; the prefix cache's (below): the blocks of
# its table it registered (``BlockManager._registered``), whether a preemption published its own
# blocks (it looks them up when admitted again), how many keys its table has, its slot of key bits
# + 1 (0: none), its shared prefix's first key node and number of keys, the prompt tokens its first
# admission found cached; under async scheduling the blocks a finished request holds until the next
# schedule; power_of_two_choices: the pair of replicas its pick compares (a x replicas + b), drawn ahead
_QI = 18
(P_LEN, O_LEN, OUT, PREEMPTS, STATE, REJECT, YIELDED, REPLICA, NEXT_WAITING, REG, REHIT, KEYS, SLOT, PK, PKN,
 CACHED, HELD_BLOCKS, PAIR) = range(_QI)
# request columns (float): arrival (recorded), first scheduled, first token, last token, finish, sent at
_QF = 6
ARRIVAL, FIRST_SCHED, FIRST_TOK, LAST_TOK, FINISH, SENT = range(_QF)
# global scalars
(N_REQ, MAX_SEQS, BUDGET, THRESHOLD, BLOCK, NUM_BLOCKS, WATERMARK, NREP, ROUTER, RR_NEXT, NEXT, A_STAMP, STAMPS,
 AWAIT, ITL_N, ROWS_N, DONE, STEPS, PREEMPTIONS, STARTED, CACHE_MODE, ASYNC, WHOLE_PROMPTS, PRICED, PREFIX_ON,
 MAXK, NPK) = range(27)
_NS = 28
# per-replica scalars: running rows, waiting queue (head, tail, length), free KV blocks, phase, the
# stamp of its pending event, the step's rows and preemptions, requests outstanding (the router's
# count), the step's sums; the prefix cache's evictable blocks (counted in R_FREE too), its LRU
# queue of key nodes (head, tail), the first unused own-key node; under async scheduling the
# requests that arrived during its step (head, tail, length: they reach the waiting queue after
# the next schedule) and the finished ones holding seats and blocks until then (head, tail, length);
# the router's last scrape of its metrics: free KV blocks, blocks its queued prompts need, waiting
# and running requests (vllm_dp: plus the router's picks since); the first unused slot of key bits;
# its block manager's lookup counters in blocks (queries, hits; of requests preempted before: the same)
(R_RUN, R_HEAD, R_TAIL, R_COUNT, R_FREE, R_PHASE, R_STAMP, R_K, R_NPRE, R_OUT, S_SEQS, S_DEC, S_TOKENS, S_PAIRS,
 S_DKV, S_PKV, S_LONGEST, S_PLAIN, S_SAMPLES, R_EVICT, R_LRU_HEAD, R_LRU_TAIL, R_NODE_FREE, R_ARR_HEAD, R_ARR_TAIL,
 R_ARR_COUNT, R_HELD_HEAD, R_HELD_TAIL, R_HELD_COUNT, SC_FREE, SC_QUEUED, SC_WAITING, SC_RUNNING, R_SLOT_FREE,
 R_QUERIES, R_HITS, R_PRE_QUERIES, R_PRE_HITS) = range(38)
_NRS = 40
assert R_TAIL == R_HEAD + 1 and R_COUNT == R_HEAD + 2  # (``_append``'s list layout)
assert R_ARR_TAIL == R_ARR_HEAD + 1 and R_ARR_COUNT == R_ARR_HEAD + 2
assert R_HELD_TAIL == R_HELD_HEAD + 1 and R_HELD_COUNT == R_HELD_HEAD + 2
# per-replica floats: when its pending event happens, when its step started, the step's duration,
# its KV usage at the router's last scrape; row 0 also holds the router's refresh interval and when
# it last scraped
R_TIME, R_START, R_DT, SC_USAGE, R_REFRESH, R_SCRAPED = range(6)
# replica phases: idle (waiting for a request), woken (a request came: it resumes at R_TIME),
# stepping (its step ends at R_TIME), pricing (its step waits for the caller's price)
IDLE, WOKEN, STEPPING, PRICING = range(4)
ROUND_ROBIN, LEAST_OUTSTANDING, KV_AWARE, LEAST_KV_USAGE, VLLM_DP, POWER_OF_TWO = range(6)
ROUTERS = {"round_robin": ROUND_ROBIN, "least_outstanding": LEAST_OUTSTANDING, "kv_aware": KV_AWARE,
           "least_kv_usage": LEAST_KV_USAGE, "vllm_dp": VLLM_DP, "power_of_two_choices": POWER_OF_TWO}
# return codes
DONE_RC, STEP_RC, FLUSH_ITL_RC, ROWS_FULL_RC, NO_PROGRESS_RC, BROKEN_RC = range(6)
# what a request preempted by recompute leaves in the prefix cache (``cache_preempted_blocks``):
# nothing (or prefix caching off), every fully computed block, the prompt's
KEEP_NONE, KEEP_ALL, KEEP_PROMPT = range(3)
# a key node of the prefix cache (one per key: a shared prefix's block i, or a request's own block i,
# ``BlockManager``'s hash-chain keys): whether its block is cached, the requests holding it, the
# nodes before and after it in the LRU queue of evictable blocks (ref 0), and for an own key's node
# its key in the replica's map of own keys (-1: a shared prefix's node, or unused)
K_CACHED, K_REF, K_PREV, K_NEXT, K_OWN = range(5)

_WAITING, _RUNNING, _FINISHED, _REJECTED = (int(RequestState.WAITING), int(RequestState.RUNNING),
                                            int(RequestState.FINISHED), int(RequestState.REJECTED))
_UNSENT = -1


def _send(qi: np.ndarray, s: np.ndarray, rs: np.ndarray, rf: np.ndarray, q: int, now: float) -> None:
    """Request ``q`` arrives now: the router picks its replica (``Router.pick``), which queues it
    (``_enqueue``) — or, under async scheduling while it runs a step, takes it in after its next
    schedule (``Replica.submit``)."""
    nrep = s[NREP]
    r = 0
    if nrep > 1:
        router = s[ROUTER]
        if router == ROUND_ROBIN:
            r = s[RR_NEXT] % nrep
            s[RR_NEXT] += 1
        elif router == LEAST_OUTSTANDING:  # ties to the lowest index
            for i in range(1, nrep):
                if rs[i, R_OUT] < rs[r, R_OUT]:
                    r = i
        elif router == POWER_OF_TWO:  # the one of its pair with fewer outstanding, ties to the lower index
            a, b = qi[PAIR, q] // nrep, qi[PAIR, q] % nrep
            r = a if (rs[a, R_OUT] < rs[b, R_OUT] or (rs[a, R_OUT] == rs[b, R_OUT] and a <= b)) else b
        else:  # from the scrape (``Router._choose``), ties to the least outstanding, then the lowest index
            _scrape(qi, s, rs, rf, now)
            for i in range(1, nrep):
                if router == LEAST_KV_USAGE:
                    u, v = rf[i, SC_USAGE], rf[r, SC_USAGE]
                    if u < v or (u == v and rs[i, R_OUT] < rs[r, R_OUT]):
                        r = i
                elif router == VLLM_DP:  # 4 x waiting + running, ties to the lowest index
                    if 4 * rs[i, SC_WAITING] + rs[i, SC_RUNNING] < 4 * rs[r, SC_WAITING] + rs[r, SC_RUNNING]:
                        r = i
                else:  # kv_aware: the most free blocks net of the prompts queued there
                    a, b = rs[i, SC_FREE] - rs[i, SC_QUEUED], rs[r, SC_FREE] - rs[r, SC_QUEUED]
                    if a > b or (a == b and rs[i, R_OUT] < rs[r, R_OUT]):
                        r = i
            if router == VLLM_DP:
                rs[r, SC_WAITING] += 1  # vLLM counts its pick as waiting there until the next snapshot
    rs[r, R_OUT] += 1
    qi[REPLICA, q] = r
    if s[ASYNC] and rs[r, R_PHASE] == STEPPING:
        _append(qi, rs[r], q, R_ARR_HEAD)
        return
    _enqueue(qi, s, rs, rf, r, q, now)


def _scrape(qi: np.ndarray, s: np.ndarray, rs: np.ndarray, rf: np.ndarray, now: float) -> None:
    """The router reads every replica's metrics when its refresh interval has passed (``Router._scrape``)."""
    refresh = rf[0, R_REFRESH]
    if now - rf[0, R_SCRAPED] < refresh and refresh > 0:
        return
    rf[0, R_SCRAPED] = now
    router = s[ROUTER]
    bs = s[BLOCK]
    for i in range(s[NREP]):
        rs[i, SC_FREE] = rs[i, R_FREE]
        rf[i, SC_USAGE] = (s[NUM_BLOCKS] - rs[i, R_FREE]) / s[NUM_BLOCKS]
        if router == VLLM_DP:
            rs[i, SC_WAITING] = rs[i, R_COUNT]
            rs[i, SC_RUNNING] = rs[i, R_RUN]
        if router == KV_AWARE:
            queued = 0
            q = rs[i, R_HEAD]
            for _ in range(rs[i, R_COUNT]):
                queued += (qi[P_LEN, q] + qi[OUT, q] + bs - 1) // bs
                q = qi[NEXT_WAITING, q]
            rs[i, SC_QUEUED] = queued


def _append(qi: np.ndarray, rsr: np.ndarray, q: int, head: int) -> None:
    """Request ``q`` at the end of one of a replica's lists linked through ``NEXT_WAITING`` (its
    head, tail and length are ``rsr[head]``, ``rsr[head + 1]``, ``rsr[head + 2]``)."""
    qi[NEXT_WAITING, q] = -1
    if rsr[head + 2] == 0:
        rsr[head] = q
    else:
        qi[NEXT_WAITING, rsr[head + 1]] = q
    rsr[head + 1] = q
    rsr[head + 2] += 1


def _enqueue(qi: np.ndarray, s: np.ndarray, rs: np.ndarray, rf: np.ndarray, r: int, q: int, now: float) -> None:
    """Replica ``r`` takes request ``q`` in (``Scheduler.add``): queues it, or reports it done at
    once when the policy rejects it; an idle replica is woken."""
    if qi[REJECT, q]:
        qi[STATE, q] = _REJECTED
        s[DONE] += 1
        rs[r, R_OUT] -= 1
        return
    qi[STATE, q] = _WAITING
    _append(qi, rs[r], q, R_HEAD)
    if rs[r, R_PHASE] == IDLE:  # its wakeup event, queued now
        rs[r, R_PHASE] = WOKEN
        rf[r, R_TIME] = now
        s[STAMPS] += 1
        rs[r, R_STAMP] = s[STAMPS]


def _arrivals(qi: np.ndarray, qf: np.ndarray, s: np.ndarray, rs: np.ndarray, rf: np.ndarray, now: float) -> None:
    """One run of the arrival process (``Cluster.arrivals``) at ``now``: the request it waited for
    and those after it with no delay, then its timeout for the next one."""
    p = s[NEXT]
    n = s[N_REQ]
    if s[STARTED]:
        _send(qi, s, rs, rf, p, now)
        p += 1
    s[STARTED] = 1
    while p < n and not qi[YIELDED, p]:
        _send(qi, s, rs, rf, p, now)
        p += 1
    s[NEXT] = p
    if p < n:
        s[STAMPS] += 1
        s[A_STAMP] = s[STAMPS]


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


def _flush_arrived(qi: np.ndarray, s: np.ndarray, rs: np.ndarray, rf: np.ndarray, r: int, now: float) -> None:
    """The requests that reached replica ``r`` during its step join its queue, in order."""
    q = rs[r, R_ARR_HEAD]
    m = rs[r, R_ARR_COUNT]
    rs[r, R_ARR_COUNT] = 0
    for _ in range(m):
        nxt = qi[NEXT_WAITING, q]
        _enqueue(qi, s, rs, rf, r, q, now)
        q = nxt


def _release_held(qi: np.ndarray, s: np.ndarray, rsr: np.ndarray, kn: np.ndarray, bm: np.ndarray, sl: np.ndarray,
                  own: Any, r: int) -> int:
    """Seats and blocks of the requests that finished before the last schedule come back
    (``Scheduler.release_finished``), in the order they finished; returns how many."""
    m = rsr[R_HELD_COUNT]
    q = rsr[R_HELD_HEAD]
    for _ in range(m):
        _give_back(qi, s, rsr, kn, bm, sl, own, r, q, qi[HELD_BLOCKS, q])
        q = qi[NEXT_WAITING, q]
    rsr[R_HELD_COUNT] = 0
    return m


def _lru_push(kn: np.ndarray, rsr: np.ndarray, node: int) -> None:
    """A cached block whose last holder left becomes evictable, at the recently used end."""
    tail = rsr[R_LRU_TAIL]
    kn[K_PREV, node] = tail
    kn[K_NEXT, node] = -1
    if tail < 0:
        rsr[R_LRU_HEAD] = node
    else:
        kn[K_NEXT, tail] = node
    rsr[R_LRU_TAIL] = node
    rsr[R_EVICT] += 1


def _lru_unlink(kn: np.ndarray, rsr: np.ndarray, node: int) -> None:
    """Take an evictable block out of the LRU queue (evicted, or found again)."""
    prev, nxt = kn[K_PREV, node], kn[K_NEXT, node]
    if prev < 0:
        rsr[R_LRU_HEAD] = nxt
    else:
        kn[K_NEXT, prev] = nxt
    if nxt < 0:
        rsr[R_LRU_TAIL] = prev
    else:
        kn[K_PREV, nxt] = prev
    rsr[R_EVICT] -= 1


def _own_key(s: np.ndarray, r: int, q: int, i: int) -> int:
    """The map key of request ``q``'s own block ``i`` on replica ``r``."""
    return (r * s[N_REQ] + q) * s[MAXK] + i


def _node(qi: np.ndarray, s: np.ndarray, own: Any, r: int, q: int, i: int) -> int:
    """The key node of block ``i`` of request ``q``'s keys (its shared prefix's, then its own),
    -1 for an own key that is not cached."""
    if i < qi[PKN, q]:
        return qi[PK, q] + i
    key = _own_key(s, r, q, i)
    return own[key] if key in own else -1


def _take(rsr: np.ndarray, kn: np.ndarray, own: Any, need: int) -> None:
    """``need`` (<= the free ones) blocks: never-used (or unkeyed) ones first, then cached ones
    evicted, least recently used first (``BlockManager.allocate``)."""
    short = need - (rsr[R_FREE] - rsr[R_EVICT])
    for _ in range(short):
        node = rsr[R_LRU_HEAD]
        _lru_unlink(kn, rsr, node)
        kn[K_CACHED, node] = 0
        key = kn[K_OWN, node]
        if key >= 0:  # an own key's node: unused again
            del own[key]
            kn[K_OWN, node] = -1
            kn[K_NEXT, node] = rsr[R_NODE_FREE]
            rsr[R_NODE_FREE] = node
    rsr[R_FREE] -= need


def _slot(qi: np.ndarray, rsr: np.ndarray, sl: np.ndarray, q: int) -> int:
    """Request ``q``'s row of key bits (taken from the free ones when it first holds blocks)."""
    if qi[SLOT, q] == 0:
        slot = rsr[R_SLOT_FREE]
        rsr[R_SLOT_FREE] = sl[slot]
        qi[SLOT, q] = slot + 1
    return qi[SLOT, q] - 1


def _publish(qi: np.ndarray, s: np.ndarray, rsr: np.ndarray, kn: np.ndarray, bm: np.ndarray, sl: np.ndarray,
             own: Any, r: int, q: int, upto: int) -> None:
    """``BlockManager.cache_computed_blocks``: request ``q``'s blocks from its registered ones to
    ``upto`` are published under their keys, except where the key is cached already (another
    request computed it first: that block of ``q``'s stays unkeyed)."""
    slot = _slot(qi, rsr, sl, q)
    bits = bm[slot]
    for i in range(qi[REG, q], upto):
        if i < qi[PKN, q]:
            node = qi[PK, q] + i
            if kn[K_CACHED, node]:
                bits[i] = 0
                continue
        else:
            key = _own_key(s, r, q, i)
            if key in own:
                bits[i] = 0
                continue
            node = rsr[R_NODE_FREE]
            rsr[R_NODE_FREE] = kn[K_NEXT, node]
            own[key] = node
            kn[K_OWN, node] = key
        kn[K_CACHED, node] = 1
        kn[K_REF, node] = 1
        bits[i] = 1
    qi[REG, q] = upto


def _lookup(qi: np.ndarray, s: np.ndarray, rsr: np.ndarray, kn: np.ndarray, bm: np.ndarray, sl: np.ndarray,
            own: Any, r: int, q: int, limit: int) -> int:
    """``BlockManager.lookup_prefix`` of request ``q``, which holds no blocks: the longest run of
    its first ``limit`` keys that is cached is attached to it; returns how many."""
    found = 0
    while found < limit:  # (attaching a block leaves which keys are cached as it was)
        node = _node(qi, s, own, r, q, found)
        if node < 0 or not kn[K_CACHED, node]:
            break
        if kn[K_REF, node] == 0:
            _lru_unlink(kn, rsr, node)
            rsr[R_FREE] -= 1
        kn[K_REF, node] += 1
        bm[_slot(qi, rsr, sl, q), found] = 1
        found += 1
    qi[REG, q] = found
    return found


def _give_back(qi: np.ndarray, s: np.ndarray, rsr: np.ndarray, kn: np.ndarray, bm: np.ndarray, sl: np.ndarray,
               own: Any, r: int, q: int, blocks: int) -> None:
    """Request ``q`` frees its ``blocks`` (``BlockManager.free``): those past its registered ones
    are free at once; of those before, from the last back, a keyed one loses a holder and becomes
    evictable when it has none left (so a table's tail is evicted before its head), an unkeyed
    one is free."""
    held = 0
    reg = qi[REG, q]
    if reg > 0:
        bits = bm[qi[SLOT, q] - 1]
        for i in range(reg - 1, -1, -1):
            if bits[i]:
                node = _node(qi, s, own, r, q, i)
                left = kn[K_REF, node] - 1
                kn[K_REF, node] = left
                if left == 0:
                    _lru_push(kn, rsr, node)
                else:
                    held += 1
        qi[REG, q] = 0
    rsr[R_FREE] += blocks - held
    if qi[SLOT, q]:
        slot = qi[SLOT, q] - 1
        sl[slot] = rsr[R_SLOT_FREE]
        rsr[R_SLOT_FREE] = slot
        qi[SLOT, q] = 0


def _schedule(qi: np.ndarray, qf: np.ndarray, rt: np.ndarray, rl: np.ndarray, st: np.ndarray, s: np.ndarray,
              rsr: np.ndarray, kn: np.ndarray, bm: np.ndarray, sl: np.ndarray, own: Any, r: int, now: float) -> int:
    """``ChunkedScheduler.schedule`` at ``now`` for one replica (its table ``rt``/``rl``, scratch
    ``st``, scalars ``rsr``, prefix cache ``kn``, ``bm``, ``sl``, ``own``): the step's rows (table rows, tokens) into
    ``st`` rows 0-1, its context and sample flags into rows 2-3, its sums into ``rsr``; returns its
    rows (-1: an allocation failed after preemption, which the Python engine raises on)."""
    n = rsr[R_RUN]
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
        if total > rsr[R_FREE]:
            top = n  # rows from here on are preempted, the newest first
            while total > rsr[R_FREE] and top > 0:
                v = top - 1
                top = v
                total -= want[v]
                q = rt[5, v]
                qi[OUT, q] = rt[2, v]
                qf[LAST_TOK, q] = rl[v]
                qi[PREEMPTS, q] += 1
                qi[STATE, q] = _WAITING
                s[PREEMPTIONS] += 1
                npre += 1
                mode = s[CACHE_MODE]
                if mode != KEEP_NONE:  # (``BlockManager.cache_preempted``: its computed blocks published)
                    c = rt[0, v]
                    if mode == KEEP_PROMPT and c > qi[P_LEN, q]:
                        c = qi[P_LEN, q]
                    qi[REHIT, q] = 1
                    up = c // bs
                    if up > qi[KEYS, q]:  # (its keys go on over its own blocks)
                        qi[KEYS, q] = up
                    if up > qi[REG, q]:
                        _publish(qi, s, rsr, kn, bm, sl, own, r, q, up)
                _give_back(qi, s, rsr, kn, bm, sl, own, r, q, rt[4, v])
                budget += new[v]
                # back to the front of the waiting queue
                qi[NEXT_WAITING, q] = rsr[R_HEAD] if rsr[R_COUNT] else -1
                if rsr[R_COUNT] == 0:
                    rsr[R_TAIL] = q
                rsr[R_HEAD] = q
                rsr[R_COUNT] += 1
            preempted_any = top < n
            for i in range(top):
                if want[i] > 0:
                    if want[i] > rsr[R_FREE]:
                        return -1
                    _take(rsr, kn, own, want[i])
                    rt[4, i] += want[i]
            n = top
            rsr[R_RUN] = n
        else:
            for i in range(n):
                if want[i] > 0:
                    rt[4, i] += want[i]
            _take(rsr, kn, own, total)
    k = 0
    for i in range(n):
        if new[i] > 0:
            st[0, k] = i
            st[1, k] = new[i]
            k += 1
    if not preempted_any:
        # admit waiting requests, oldest first, while budget, seats and blocks (watermark kept) last
        while rsr[R_COUNT] > 0 and budget > 0 and rsr[R_RUN] < s[MAX_SEQS] - rsr[R_HELD_COUNT]:
            q = rsr[R_HEAD]
            tokens = qi[P_LEN, q] + qi[OUT, q]
            # (``BlockManager.lookup_prefix``) its keys: its shared prefix's blocks, then, for one
            # preempted after publishing, its own, to one token short of its tokens
            found = 0
            if s[PREFIX_ON]:
                keys = qi[PKN, q]
                looked = qi[P_LEN, q]
                if qi[REHIT, q]:
                    mine = (tokens - 1) // bs if s[CACHE_MODE] == KEEP_ALL else qi[P_LEN, q] // bs
                    if mine > keys:
                        keys = mine
                    looked = tokens
                qi[KEYS, q] = keys
                limit = min(keys, (looked - 1) // bs)
                found = _lookup(qi, s, rsr, kn, bm, sl, own, r, q, limit)
                if qi[PREEMPTS, q]:  # (vLLM counts the lookups of requests coming back apart)
                    rsr[R_PRE_QUERIES] += limit
                    rsr[R_PRE_HITS] += found
                else:
                    rsr[R_QUERIES] += limit
                    rsr[R_HITS] += found
            computed = found * bs
            chunk = min(tokens - computed, budget, thr)
            need = (computed + chunk + bs - 1) // bs - found
            # chunked prefill off: it waits for a step with room for all of it (capped by the
            # threshold), and so does everyone behind it
            if (need > 0 and rsr[R_FREE] - need < s[WATERMARK]) or (
                    s[WHOLE_PROMPTS] and min(tokens - computed, thr) > budget):
                # (``blocks.drop_cached_prefix``: what it found goes back, at the recently used end)
                if found:
                    _give_back(qi, s, rsr, kn, bm, sl, own, r, q, found)
                break
            rsr[R_HEAD] = qi[NEXT_WAITING, q]
            rsr[R_COUNT] -= 1
            _take(rsr, kn, own, need)
            if s[PREFIX_ON] and qi[PREEMPTS, q] == 0:
                qi[CACHED, q] = computed
            if qf[FIRST_SCHED, q] != qf[FIRST_SCHED, q]:
                qf[FIRST_SCHED, q] = now
            qi[STATE, q] = _RUNNING
            i = rsr[R_RUN]
            rt[0, i] = computed
            rt[1, i] = tokens
            rt[2, i] = qi[OUT, q]
            rt[3, i] = qi[O_LEN, q]
            rt[4, i] = found + need
            rt[5, i] = q
            rl[i] = qf[LAST_TOK, q]
            rsr[R_RUN] = i + 1
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
    rsr[R_K] = k
    rsr[R_NPRE] = npre
    rsr[S_SEQS] = k
    rsr[S_DEC] = n_dec
    rsr[S_TOKENS] = total
    rsr[S_PAIRS] = pairs
    rsr[S_DKV] = decode_kv
    rsr[S_PKV] = prefill_kv
    rsr[S_LONGEST] = longest
    rsr[S_PLAIN] = plain
    rsr[S_SAMPLES] = sampled
    return k


def engine_step(qi: np.ndarray, qf: np.ndarray, rt: np.ndarray, rl: np.ndarray, st: np.ndarray, s: np.ndarray,
                rs: np.ndarray, rf: np.ndarray, kn: np.ndarray, bm: np.ndarray, sl: np.ndarray, own: Any,
                itl: np.ndarray, rows: np.ndarray, dt: float, pf: np.ndarray, pi: np.ndarray, gf: np.ndarray,
                gi: np.ndarray) -> int:
    """Run the replicas' events in SimPy's order — by time, then by when each was queued (its
    stamp): the arrival process's timeout, a replica's step end, an idle replica's wakeup — until
    a replica schedules a step; return ``STEP_RC`` with that replica in ``s[AWAIT]`` and its sums
    in ``rs`` (the caller prices the step and calls again with its duration ``dt``), or with
    ``s[PRICED]`` price it here and run on (1: ``compiled_price.price`` with the roofline's
    constants ``pf``, ``pi``; 2: ``compiled_profile.price`` with a GPU profile's ``gf``, ``gi`` and
    its reading's roofline in ``pf``, ``pi``). ``DONE_RC``
    when every request is done; ``FLUSH_ITL_RC`` / ``ROWS_FULL_RC`` (nothing changed) when the
    ITL or iteration-row buffer must be emptied first; ``NO_PROGRESS_RC`` / ``BROKEN_RC`` on a
    state the Python engine raises on."""
    nrep = s[NREP]
    a = s[AWAIT]
    if a >= 0:  # the step just priced: its end is queued now
        rf[a, R_DT] = dt
        rf[a, R_TIME] = rf[a, R_START] + dt
        s[STAMPS] += 1
        rs[a, R_STAMP] = s[STAMPS]
        rs[a, R_PHASE] = STEPPING
        s[AWAIT] = -1
    if not s[STARTED]:
        _arrivals(qi, qf, s, rs, rf, 0.0)
    while True:
        # the next event: the earliest time, then the earliest queued
        ev = -2
        t = 0.0
        stamp = 0
        if s[NEXT] < s[N_REQ]:
            ev = -1
            t = qf[SENT, s[NEXT]]
            stamp = s[A_STAMP]
        for r in range(nrep):
            ph = rs[r, R_PHASE]
            if ph == WOKEN or ph == STEPPING:
                tr = rf[r, R_TIME]
                if ev == -2 or tr < t or (tr == t and rs[r, R_STAMP] < stamp):
                    ev = r
                    t = tr
                    stamp = rs[r, R_STAMP]
        if ev == -2:
            return DONE_RC
        if ev == -1:
            _arrivals(qi, qf, s, rs, rf, t)
            continue
        r = ev
        now = t
        rsr = rs[r]
        rtr = rt[r]
        rlr = rl[r]
        str_ = st[r]
        knr = kn[r]
        bmr = bm[r]
        slr = sl[r]
        if rsr[R_PHASE] == STEPPING:
            k = rsr[R_K]
            cnt = 0
            for j in range(k):
                if str_[3, j] and rtr[2, str_[0, j]] > 0:
                    cnt += 1
            if s[ITL_N] + cnt > itl.shape[0]:
                return FLUSH_ITL_RC
            if s[ROWS_N] == rows.shape[0]:
                return ROWS_FULL_RC
            ni = s[ITL_N]
            done = str_[6]
            nd = 0
            bs = s[BLOCK]
            for j in range(k):
                i = str_[0, j]
                rtr[0, i] += str_[1, j]
                if str_[1, j] > 1 and s[PREFIX_ON]:  # a chunk: the blocks it filled are published
                    q = rtr[5, i]
                    v = min(qi[KEYS, q], rtr[0, i] // bs)
                    if v > qi[REG, q]:
                        _publish(qi, s, rsr, knr, bmr, slr, own, r, q, v)
                if str_[3, j]:
                    o = rtr[2, i]
                    if o > 0:
                        itl[ni] = now - rlr[i]
                        ni += 1
                    else:
                        q = rtr[5, i]
                        if qf[FIRST_TOK, q] != qf[FIRST_TOK, q]:
                            qf[FIRST_TOK, q] = now
                    o += 1
                    rtr[2, i] = o
                    rtr[1, i] += 1
                    rlr[i] = now
                    if o >= rtr[3, i]:
                        done[nd] = i
                        nd += 1
            s[ITL_N] = ni
            for j in range(nd):
                i = done[j]
                q = rtr[5, i]
                qi[OUT, q] = rtr[2, i]
                qf[LAST_TOK, q] = rlr[i]
                qi[STATE, q] = _FINISHED
                qf[FINISH, q] = now
                if s[ASYNC]:  # (``Scheduler._retire``: its seat and blocks held through the next schedule)
                    qi[HELD_BLOCKS, q] = rtr[4, i]
                    _append(qi, rsr, q, R_HELD_HEAD)
                else:
                    _give_back(qi, s, rsr, knr, bmr, slr, own, r, q, rtr[4, i])
                rsr[R_OUT] -= 1
                s[DONE] += 1
            rsr[R_RUN] = _close_rows(rtr, rlr, done, nd, rsr[R_RUN])
            m = s[ROWS_N]
            rows[m, 0] = r
            rows[m, 1] = rf[r, R_START]
            rows[m, 2] = rf[r, R_DT]
            rows[m, 3] = k
            rows[m, 4] = rsr[S_TOKENS] - rsr[S_PLAIN]
            rows[m, 5] = rsr[S_PLAIN]
            rows[m, 6] = rsr[S_TOKENS]
            rows[m, 7] = s[NUM_BLOCKS] - rsr[R_FREE]
            rows[m, 8] = s[NUM_BLOCKS]
            rows[m, 9] = rsr[R_COUNT]
            rows[m, 10] = rsr[R_RUN]
            rows[m, 11] = 0.0
            rows[m, 12] = rsr[R_NPRE]
            rows[m, 13] = 0.0
            rows[m, 14] = math.nan
            s[ROWS_N] = m + 1
            s[STEPS] += 1
        # the replica runs on (``Replica._loop``): its next step, or idle until a request comes
        while True:
            if rsr[R_ARR_COUNT] and rsr[R_COUNT] == 0 and rsr[R_RUN] == 0:
                _flush_arrived(qi, s, rs, rf, r, now)  # nothing else to schedule: seen at once
            if rsr[R_COUNT] == 0 and rsr[R_RUN] == 0:
                _release_held(qi, s, rsr, knr, bmr, slr, own, r)
                rsr[R_PHASE] = IDLE
                break
            k = _schedule(qi, qf, rtr, rlr, str_, s, rsr, knr, bmr, slr, own, r, now)
            if k < 0:
                return BROKEN_RC
            # (async scheduling) the last step's outputs are processed after this schedule
            released = _release_held(qi, s, rsr, knr, bmr, slr, own, r)
            if rsr[R_ARR_COUNT]:
                _flush_arrived(qi, s, rs, rf, r, now)
            if k > 0:
                break
            if released == 0 and rsr[R_NPRE] == 0:
                return NO_PROGRESS_RC
            # schedule again at once: with the seats and blocks back, or after a schedule whose
            # preemptions took every row and, as vLLM V1 does, admitted nothing
        if rsr[R_PHASE] == IDLE:
            continue
        rf[r, R_START] = now
        if s[PRICED]:  # (its end queued as the caller's price would queue it, below the loop's head)
            if s[PRICED] == 1:
                d = _price(pf, pi, rsr[S_SEQS], rsr[S_DEC], rsr[S_TOKENS], rsr[S_PAIRS], rsr[S_DKV], rsr[S_PKV],
                           rsr[S_LONGEST])
            else:
                k = rsr[R_K]
                d = _price_rows(gf, gi, pf, pi, rsr[S_SEQS], rsr[S_DEC], rsr[S_TOKENS], rsr[S_DKV], str_[1, :k],
                                str_[2, :k])
            rf[r, R_DT] = d
            rf[r, R_TIME] = now + d
            s[STAMPS] += 1
            rsr[R_STAMP] = s[STAMPS]
            rsr[R_PHASE] = STEPPING
            continue
        rsr[R_PHASE] = PRICING
        s[AWAIT] = r
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


_PLAIN = {"_scrape": _scrape, "_append": _append, "_enqueue": _enqueue, "_send": _send, "_arrivals": _arrivals, "_close_rows": _close_rows,
          "_lru_push": _lru_push, "_lru_unlink": _lru_unlink, "_own_key": _own_key, "_node": _node, "_take": _take,
          "_slot": _slot, "_publish": _publish, "_lookup": _lookup, "_give_back": _give_back,
          "_flush_arrived": _flush_arrived, "_release_held": _release_held, "_schedule": _schedule,
          "engine_step": engine_step, "send_times": send_times}
# the step price inside the loop (compiled with it by ``_load``): a roofline's, a GPU profile's
_price, _price_rows = cp.price, cg.price
_loaded: bool | None = None  # None: not tried yet; False: numba could not build it
_SOURCES_FILE = "compiled_engine.sources"  # beside numba's cache: the digest of the files it was built from


def _sources_digest() -> str:
    here = Path(__file__).parent
    digest = hashlib.sha256()
    for name in ("compiled_engine.py", *cp.SOURCES, *cg.SOURCES):
        digest.update((here / name).read_bytes())
    return digest.hexdigest()


def _drop_stale_cache(dispatchers: list[Any]) -> bool:
    """numba keeps a function's machine code on disk until *its own* file changes, but the loop's
    code holds the step prices' (``compiled_price``, ``compiled_profile``) and their callees' from
    other modules too (their ``SOURCES``): when any of those files differs from what the cache was
    built from, every cached function here is
    dropped (recompiled at its first call). False when the cache cannot be checked (compile
    without it then)."""
    try:
        path = Path(dispatchers[0]._cache._cache_path) / _SOURCES_FILE
        digest = _sources_digest()
        try:
            built = path.read_text()
        except OSError:
            built = None
        if built != digest:
            for d in dispatchers:
                d._cache.flush()
            path.write_text(digest)
    except Exception:  # noqa: BLE001 - a numba without these internals, a read-only cache folder
        return False
    return True


def _load() -> bool:
    """Compile (or load from numba's cache) the loop, callees first so the callers bind to them
    (``compiled_price``'s functions on that module, then this one's), and run it once on an empty
    state (the types a run passes); False, with one warning, when that fails (the Python engine
    then runs: the same results)."""
    global _loaded
    if _loaded is None:
        g = globals()
        try:
            import numba

            for cache in (True, False):
                made = []
                for mod in (cp, cg):
                    for name, f in mod.PLAIN.items():
                        made.append(numba.njit(cache=cache, nogil=True)(f))
                        setattr(mod, name, made[-1])
                g["_price"], g["_price_rows"] = cp.price, cg.price
                for name, f in _PLAIN.items():
                    g[name] = numba.njit(cache=cache, nogil=True)(f)
                    made.append(g[name])
                if not cache or _drop_stale_cache(made):
                    break
            empty_i, empty_f = np.zeros((_QI, 0), dtype=np.int64), np.zeros((_QF, 0))
            g["send_times"](empty_f[0], empty_f[1], empty_i[0])
            s = np.zeros(_NS, dtype=np.int64)
            s[NREP], s[AWAIT] = 1, -1
            g["engine_step"](empty_i, empty_f, np.zeros((1, 6, 1), dtype=np.int64), np.zeros((1, 1)),
                             np.zeros((1, 7, 1), dtype=np.int64), s, np.zeros((1, _NRS), dtype=np.int64),
                             np.zeros((1, 6)), np.zeros((1, 5, 1), dtype=np.int64), np.zeros((1, 1, 1), dtype=np.int8),
                             np.zeros((1, 1), dtype=np.int64), _own_map(), np.zeros(1),
                             np.zeros((1, len(ITERATION_COLUMNS))), 0.0, np.zeros(cp._NF),
                             np.zeros(cp._NI, dtype=np.int64), np.zeros(1), np.zeros(cg._NGI, dtype=np.int64))
            _loaded = True
        except Exception as e:  # noqa: BLE001 - the optional fast path falls back
            g.update(_PLAIN)
            for mod in (cp, cg):
                for name, f in mod.PLAIN.items():
                    setattr(mod, name, f)
            g["_price"], g["_price_rows"] = cp.price, cg.price
            _loaded = False
            warnings.warn(f"servesim: the compiled engine is unavailable ({type(e).__name__}: {e}); running the "
                          "Python engine (same results, slower)", RuntimeWarning, stacklevel=3)
    return _loaded


def reason_not_compiled(sc: Any, requests: Any, scheduler: Any, executor: Any) -> str | None:
    """Why ``simulate`` runs this scenario on the Python engine (None: the compiled one can)."""
    from .schedulers import ChunkedScheduler

    if not rk.ON:
        return "the compiled step loops are off (runs under 20,000 requests, SERVESIM_JIT=0 or no numba)"
    if sc.cluster.disagg is not None:
        return "a disaggregated cluster"
    if sc.cluster.num_replicas > 1 and sc.cluster.router not in ROUTERS:
        return (f"router {sc.cluster.router} (the compiled engine routes round_robin, least_outstanding, kv_aware, "
                "least_kv_usage, vllm_dp and power_of_two_choices)")
    if type(scheduler) is not ChunkedScheduler:
        return f"scheduler {sc.scheduler_name} (the compiled engine runs the chunked policy)"
    cfg = scheduler.config
    # (policy priority needs no check: columns' requests all have priority 0, under which its
    # victim is fcfs's, the newest row, and the chunked policy orders nothing else by priority)
    if cfg.preemption_mode != "recompute":
        return f"preemption_mode {cfg.preemption_mode}"
    if not isinstance(requests, RequestArrays):
        return "the workload is request objects (sessions or a trace with content hashes)"
    if scheduler.kv.enable_prefix_caching and requests.token_ids is not None:
        # (shared prefixes are keyed by prefix_id: ``BlockManager._prompt_keys``; token ids by their content)
        return "prefix caching over prompt token ids"
    table = _cache_bytes(requests, scheduler) if scheduler.kv.enable_prefix_caching else 0
    if table > CACHE_BYTES_MOST:
        return (f"prefix caching with a {table / 2**20:.0f} MiB key table per replica "
                f"(seats x the longest request's blocks, and a node per shared-prefix and cache block; the "
                f"compiled engine holds {CACHE_BYTES_MOST >> 20} MiB)")
    if not hasattr(executor, "price"):
        return "an executor that is not the cost model's (SimExecutor)"
    if scheduler.max_num_seqs > ITL_CAP:
        return f"max_num_seqs above {ITL_CAP}"
    if not _load():
        return "numba could not build the compiled engine (see the warning)"
    return None


CACHE_BYTES_MOST = 1 << 29  # bytes of prefix-cache tables per replica the compiled engine allocates at most


def _key_layout(requests: RequestArrays, block_size: int) -> tuple[np.ndarray, np.ndarray, int, int, int]:
    """The requests' shared-prefix keys: each one's number of them and its prefix numbered densely
    (a trace's prefix ids may be any non-negative ints; only equality matters), the keys of the
    longest shared prefix, how many prefixes, and the longest key list (a key's position is below
    a request's tokens over the block size)."""
    pid = requests.prefix_id
    shared = pid >= 0
    pkn = np.where(shared, np.minimum(requests.prefix_len, requests.prompt_len) // block_size, 0)
    dense = np.zeros(len(pid), dtype=np.int64)
    kinds = 0
    if shared.any():
        uniq, inverse = np.unique(pid[shared], return_inverse=True)
        dense[shared] = inverse
        kinds = len(uniq)
    longest = int(((requests.prompt_len + requests.output_len) // block_size).max(initial=0)) + 1
    return pkn, dense, int(pkn.max(initial=0)), kinds, longest


def _cache_bytes(requests: RequestArrays, scheduler: Any) -> int:
    """Bytes of each replica's prefix-cache tables (``_prefix_cache``): a row of key bits as long
    as the longest key list for each request that can hold blocks at once, and a key node (5 int64)
    per shared-prefix block and per cache block."""
    _, _, width, kinds, longest = _key_layout(requests, scheduler.kv.block_size)
    return (scheduler.max_num_seqs + 2) * longest + 40 * (kinds * width + scheduler.kv.num_blocks)


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
    cfg = scheduler.config
    if not cfg.chunked_prefill:  # (``ChunkedScheduler.reject_reason``: it could need more than a step)
        budget, cap = scheduler.max_num_batched_tokens, cfg.long_prefill_token_threshold
        if not cap or cap > budget:  # min(prompt + output - 1, cap) > budget
            bad |= p - 1 > budget - o
    return bad


def _prefix_cache(requests: RequestArrays, scheduler: Any, qi: np.ndarray, s: np.ndarray, rs: np.ndarray,
                  nrep: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, Any]:
    """Each replica's prefix cache, empty: key nodes (a shared prefix's blocks, then one node per
    block for own keys, chained as unused), key bits (a row per request holding blocks: which of
    its registered blocks hold their key's block), the free rows, and the map of own keys to their
    nodes; and the requests' prefix key columns."""
    kv = scheduler.kv
    bs = kv.block_size
    on = kv.enable_prefix_caching
    s[PREFIX_ON] = on
    keep = {"none": KEEP_NONE, "all": KEEP_ALL, "prompt": KEEP_PROMPT}[scheduler.cache_preempted]
    s[CACHE_MODE] = keep if on else KEEP_NONE
    rs[:, R_LRU_HEAD] = rs[:, R_LRU_TAIL] = -1
    if not on:
        empty = np.zeros((nrep, 5, 1), dtype=np.int64)
        return empty, np.zeros((nrep, 1, 1), dtype=np.int8), np.zeros((nrep, 1), dtype=np.int64), _own_map()
    pkn, dense, width, kinds, s[MAXK] = _key_layout(requests, bs)  # (width: key nodes per shared prefix)
    qi[PKN] = pkn
    qi[PK] = dense * width
    npk = kinds * width
    s[NPK] = npk
    nodes = npk + kv.num_blocks  # (an own key's block is one of the cache's blocks)
    kn = np.zeros((nrep, 5, nodes), dtype=np.int64)
    kn[:, K_OWN] = -1
    kn[:, K_NEXT, npk:] = np.arange(npk + 1, nodes + 1)
    kn[:, K_NEXT, nodes - 1] = -1
    rs[:, R_NODE_FREE] = npk
    slots = scheduler.max_num_seqs + 2  # (holders: the running and held rows, and one being admitted)
    sl = np.tile(np.arange(1, slots + 1, dtype=np.int64), (nrep, 1))
    return kn, np.zeros((nrep, slots, int(s[MAXK])), dtype=np.int8), sl, _own_map()


def _own_map() -> Any:
    """The map of own keys to their nodes: numba's typed dict (the compiled loop's)."""
    from numba import typed, types

    return typed.Dict.empty(types.int64, types.int64)


def run_compiled(requests: RequestArrays, scheduler: Any, executor: Any, recorder: MetricsRecorder,
                 on_progress: Callable[[int], None] | None = None, num_replicas: int = 1,
                 router: str = "round_robin", router_refresh_s: float = 0.0, seed: int = 0,
                 replica_kv: list[SimpleNamespace] | None = None) -> int:
    """Simulate ``requests`` on ``num_replicas`` replicas behind ``router``, each with
    ``scheduler``'s policy and sizes, with the compiled loop, each step priced by
    ``executor.price`` (``SimExecutor``); records into ``recorder`` exactly what the Python
    engine's plain loop would, each replica's prefix-cache counters included. Returns the number
    of steps; ``replica_kv``, when given, gets each replica's block-manager counters (the
    attributes of ``BlockManager`` that a run's summary reads)."""
    if not _load():
        raise RuntimeError("the compiled engine is unavailable (numba could not build it)")
    n = len(requests)
    nrep = num_replicas
    kv = scheduler.kv
    qi = np.zeros((_QI, n), dtype=np.int64)
    qf = np.full((_QF, n), math.nan)
    qi[P_LEN] = requests.prompt_len
    qi[O_LEN] = requests.output_len
    qi[STATE] = _UNSENT
    qi[REPLICA] = -1
    reject = _rejected(requests, scheduler)
    qi[REJECT] = reject
    if router == "power_of_two_choices" and nrep > 1:  # (``Router``: one pair per pick, from the seed's generator)
        rng = np.random.default_rng(seed)
        qi[PAIR] = [a * nrep + b for a, b in (draw_pair(rng, nrep) for _ in range(n))]
    qf[ARRIVAL] = requests.arrival_time
    yielded = np.empty(n, dtype=np.int64)
    send_times(requests.arrival_time, qf[SENT], yielded)
    qi[YIELDED] = yielded
    cap = max(scheduler.max_num_seqs, 1)
    rt = np.zeros((nrep, 6, cap), dtype=np.int64)
    rl = np.zeros((nrep, cap))
    st = np.zeros((nrep, 7, cap), dtype=np.int64)
    s = np.zeros(_NS, dtype=np.int64)
    s[N_REQ] = n
    s[MAX_SEQS] = scheduler.max_num_seqs
    s[BUDGET] = scheduler.max_num_batched_tokens
    s[THRESHOLD] = scheduler.config.long_prefill_token_threshold or scheduler.max_num_batched_tokens
    s[BLOCK] = kv.block_size
    s[NUM_BLOCKS] = kv.num_blocks
    s[WATERMARK] = kv.watermark_blocks
    s[NREP] = nrep
    s[ROUTER] = ROUTERS.get(router, ROUND_ROBIN)
    s[AWAIT] = -1
    rs = np.zeros((nrep, _NRS), dtype=np.int64)
    rs[:, R_FREE] = kv.num_blocks
    s[ASYNC] = scheduler.config.async_scheduling
    s[WHOLE_PROMPTS] = not scheduler.config.chunked_prefill
    kn, bm, sl, own = _prefix_cache(requests, scheduler, qi, s, rs, nrep)
    rf = np.zeros((nrep, 6))
    rf[0, R_REFRESH] = router_refresh_s
    rf[0, R_SCRAPED] = -math.inf
    itl = np.empty(ITL_CAP)
    rows = np.empty((ROW_BLOCK, len(ITERATION_COLUMNS)))
    hist = recorder.itl_histogram  # (flushes whatever the recorder staged before)
    step = engine_step
    price, with_rows = executor.price, executor.prices_rows
    # (a roofline's or a GPU profile's steps priced inside the loop)
    pf, pi = np.zeros(cp._NF), np.zeros(cp._NI, dtype=np.int64)
    gf, gi = np.zeros(1), np.zeros(cg._NGI, dtype=np.int64)
    packed = cp.pack(executor)
    if packed is not None:
        s[PRICED] = 1
        pf, pi = packed
    elif (profile := cg.pack(executor)) is not None:
        s[PRICED] = 2
        gf, gi, pf, pi = profile
    done_seen = 0
    dt = 0.0
    while True:
        rc = step(qi, qf, rt, rl, st, s, rs, rf, kn, bm, sl, own, itl, rows, dt, pf, pi, gf, gi)
        if rc == STEP_RC:
            r = int(s[AWAIT])
            n_seqs, n_dec, tokens, pairs, dkv, pkv, longest = rs[r, S_SEQS:S_LONGEST + 1].tolist()
            sums = StepSums(n_seqs, n_dec, tokens, pairs, dkv, pkv)
            if with_rows(sums):  # (a model that reads the rows: the step's new and context tokens)
                dt = price(sums, longest, st[r, 1, :n_seqs], st[r, 2, :n_seqs])
            else:
                dt = price(sums, longest)
            continue
        if rc == FLUSH_ITL_RC:
            hist.add(itl[: s[ITL_N]])
            s[ITL_N] = 0
            continue
        if rc == ROWS_FULL_RC:
            recorder.on_iteration_rows(rows[: s[ROWS_N]])
            s[ROWS_N] = 0
            if on_progress is not None:
                done = int(s[DONE])
                on_progress(done - done_seen)
                done_seen = done
            continue
        break
    if rc != DONE_RC:
        raise RuntimeError(f"compiled engine: {'no progress' if rc == NO_PROGRESS_RC else 'allocation failed'} "
                           f"with {rs[:, R_COUNT].sum()} waiting, {rs[:, R_RUN].sum()} running and "
                           f"{rs[:, R_FREE].tolist()} of {kv.num_blocks} KV blocks free")
    if s[ROWS_N]:
        recorder.on_iteration_rows(rows[: s[ROWS_N]])
    recorder.on_itl(itl[: s[ITL_N]])  # (staged as the Python engine leaves them: fewer than a buffer)
    if on_progress is not None:
        on_progress(int(s[DONE]) - done_seen)
    if s[DONE] != n or (rs[:, R_FREE] != kv.num_blocks).any() or rs[:, R_RUN].any() or rs[:, R_COUNT].any():
        raise AssertionError(f"compiled engine: {s[DONE]} of {n} requests done, {rs[:, R_FREE].tolist()} of "
                             f"{kv.num_blocks} KV blocks free at the end")
    reasons = np.full(n, None, dtype=object)
    for i in np.flatnonzero(reject).tolist():
        reasons[i] = scheduler.reject_reason(requests[i])
        if reasons[i] is None:
            raise AssertionError(f"compiled engine: request {i} rejected without a reason")
    state = qi[STATE].astype(np.int8)
    recorder.on_request_columns({
        "request_id": np.arange(n, dtype=np.int64),
        "replica": qi[REPLICA].copy(),
        "arrival_time": qf[ARRIVAL].copy(),
        "first_scheduled_time": qf[FIRST_SCHED].copy(),
        "first_token_time": qf[FIRST_TOK].copy(),
        "finish_time": qf[FINISH].copy(),
        "prompt_len": qi[P_LEN].copy(),
        "output_len": qi[O_LEN].copy(),
        "num_output_tokens": qi[OUT].copy(),
        "num_preemptions": qi[PREEMPTS].copy(),
        "num_cached_tokens": qi[CACHED].copy(),
        "state": state,
        "reject_reason": reasons,
    })
    recorder.check_done(n)
    scheduler.num_preemptions = int(s[PREEMPTIONS])
    for r in range(nrep):  # (``simulate.drive``: each replica's counters, in tokens)
        counts = SimpleNamespace(block_size=kv.block_size, prefix_queries=int(rs[r, R_QUERIES]),
                                 prefix_hits=int(rs[r, R_HITS]), preempted_prefix_queries=int(rs[r, R_PRE_QUERIES]),
                                 preempted_prefix_hits=int(rs[r, R_PRE_HITS]))
        recorder.on_prefix_cache(counts.prefix_queries * kv.block_size, counts.prefix_hits * kv.block_size)
        if replica_kv is not None:
            replica_kv.append(counts)
    return int(s[STEPS])
