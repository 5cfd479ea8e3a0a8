"""Disaggregated prefill/decode: a prefill pool, a decode pool, and KV transfers between them.

A request is routed to a prefill instance, which computes its prompt and first token (a copy of
the request with one output token, as vLLM's disaggregated proxy sends ``max_tokens=1``). The
prefill instance then *holds* the prompt's KV blocks until they have been sent. A decode
instance is chosen by the decode router; the decode instance *pulls* the KV when it can give it
blocks (DistServe, OSDI'24 §4.4: decoding instances fetch KV from prefill instances when they have
memory, so a full decode pool leaves the KV waiting in the prefill instances' memory, which then
admit no new prefills: backpressure; vLLM's NIXL connector and Dynamo likewise allocate the
decode blocks first and free the prefill blocks only once the transfer is done). Pulls into one
decode instance are served first come first served, and wait while that instance has preempted
requests queued, so recompute is not starved by new arrivals.

The transfer runs on the prefill instance's link (``disagg_config.LinkConfig``), one at a time
per instance, overlapped with the prefill instance's next steps (the engine does not wait for
it). When it lands, the request joins the decode instance with its prompt computed and its first
token out: that moment is its TTFT. Requests that no decode instance could ever hold (or that a
prefill instance rejects) are rejected with a reason at once.

End-of-run check (on top of the cluster's): every finished request was prefilled exactly once and,
with more than one output token, transferred exactly once; no pull is queued, no transfer in
flight, no block held; every instance in both pools gave back every KV block.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
import simpy

from .cluster import Cluster
from .disagg_config import DisaggConfig
from .engine import Replica, check_conservation
from .request import Request, RequestState
from .router import Router


class PrefillRecorder:
    """A prefill instance's recorder: its iterations count, its one-token copies are not requests."""

    def __init__(self, recorder: Any) -> None:
        self._rec = recorder

    def on_iteration(self, **kwargs: object) -> None:
        self._rec.on_iteration(**kwargs)

    def on_itl(self, itl: np.ndarray) -> None:
        pass

    def on_request_done(self, req: Request) -> None:
        pass


@dataclass(slots=True)
class _Pull:
    req: Request
    prefill: int  # index in the prefill pool
    holder: Request | None  # holds the prompt's blocks on the prefill instance until sent
    ready_at: float  # when the prefill finished (seconds)


class DisaggCluster(Cluster):
    """Prefill replicas, decode replicas, their routers and the KV link."""

    def __init__(self, env: simpy.Environment, prefill: list[Replica], decode: list[Replica], cfg: DisaggConfig,
                 kv_bytes_per_token: float, link_ranks: int, *, refresh_s: float = 0.0, seed: int = 0) -> None:
        super().__init__(env, prefill + decode, seed=seed)
        self.prefill = prefill
        self.decode = decode
        self.cfg = cfg
        self.kv_bytes_per_token = kv_bytes_per_token
        self.link_ranks = link_ranks
        self.prefill_router = Router(prefill, cfg.prefill_router, refresh_s=refresh_s, seed=seed)
        self.decode_router = Router(decode, cfg.decode_router, refresh_s=refresh_s, seed=seed + 1)
        self._nic = [simpy.Resource(env, capacity=1) for _ in prefill]
        self._pulls: list[deque[_Pull]] = [deque() for _ in decode]
        self._decode_of: dict[int, int] = {id(r): i for i, r in enumerate(decode)}
        self._real: dict[int, Request] = {}  # request id -> the request, while its copy is in prefill
        self.num_prefills: dict[int, int] = {}
        self.num_transfers: dict[int, int] = {}
        self._upstream = 0  # requests not yet handed to a decode instance (prefill, held, pulled, in flight)
        self._upstream_done: simpy.Event | None = None  # made when the arrivals end and some remain
        self._held_on = [0] * len(prefill)  # blocks held for transfers, per prefill instance
        # per transfer: (request id, waited for decode KV s, on the link s incl. NIC queue, bytes)
        self.transfers: list[tuple[int, float, float, float]] = []
        # prefills whose prompt blocks are to be held once the copy's own come back (async scheduling)
        self._pending_holds: list[list[_Pull]] = [[] for _ in prefill]
        for p, rep in enumerate(prefill):
            rep.on_done = self._prefill_done
            rep.on_released = lambda p=p: self._holds_released(p)
            # a prefill instance short of blocks while some hold prompts still to send waits for them
            rep.blocks_due = lambda p=p: self._held_on[p] > 0
        for d, rep in enumerate(decode):
            rep.on_done = self._count_done
            # under async scheduling a finished request's blocks come back after on_done: pull then
            rep.on_released = lambda d=d: self._try_pulls(d)
        # a decode instance is handed requests when their KV arrives over the link, which the
        # arrival process cannot announce: no replica here fast-forwards (see Replica.next_arrival)
        for rep in self.replicas:
            rep.next_arrival = None

    # ---- arrival and prefill -------------------------------------------------------------------
    def _send(self, req: Request) -> None:
        reason = self.decode[0].scheduler.reject_reason(req)
        if reason is not None:
            self._reject(req, f"decode pool: {reason}")
            return
        copy = Request(req.request_id, req.arrival_time, req.prompt_len, 1, req.prefix_id, req.prefix_len,
                       req.priority, req.prompt_token_ids, segments=req.segments)
        self._real[req.request_id] = req
        self._upstream += 1
        self.prefill_router.pick(copy, self.env.now).submit(copy)

    def _reject(self, req: Request, reason: str) -> None:
        req.state = RequestState.REJECTED
        req.reject_reason = reason
        req.replica = -1
        self.decode[0].recorder.on_request_done(req)
        self._count_done(req)

    def _answered(self, req: Request) -> None:
        if req.state == RequestState.FINISHED and req.replica >= 0:
            rep = self.replicas[req.replica]
            self.decode_router.on_done(rep)
            self._try_pulls(self._decode_of[id(rep)])

    def _prefill_done(self, copy: Request) -> None:
        p = copy.replica
        rep = self.prefill[p]
        self.prefill_router.on_done(rep)
        req = self._real.pop(copy.request_id)
        if copy.state == RequestState.REJECTED:
            self._upstream_left()
            self._reject(req, f"prefill pool: {copy.reject_reason}")
            return
        self.num_prefills[req.request_id] = self.num_prefills.get(req.request_id, 0) + 1
        now = self.env.now
        req.first_scheduled_time = copy.first_scheduled_time
        req.num_cached_tokens = copy.num_cached_tokens
        req.num_preemptions += copy.num_preemptions
        if req.output_len == 1:  # the prefill's token is the whole answer: nothing to decode
            req.num_output_tokens = 1
            req.num_computed_tokens = req.prompt_len
            req.first_token_time = req.last_token_time = req.finish_time = now
            req.state = RequestState.FINISHED
            req.replica = -1
            self._upstream_left()
            self.decode[0].recorder.on_request_done(req)
            self._count_done(req)
            return
        # the copy's blocks went back when it finished (with async scheduling: after the instance's
        # next schedule, in this same instant); hold as many again until the KV is sent
        pull = _Pull(req, p, Request(-1 - req.request_id, now, req.prompt_len, 1), now)
        if rep.scheduler.kv.holds(copy):
            self._pending_holds[p].append(pull)
        else:
            self._hold(pull)
        d = self._decode_of[id(self.decode_router.pick(req, now))]
        self._pulls[d].append(pull)
        self._try_pulls(d)

    def _hold(self, pull: _Pull) -> None:
        kv = self.prefill[pull.prefill].scheduler.kv
        if pull.holder is not None and kv.allocate(pull.holder, pull.req.prompt_len):
            self._held_on[pull.prefill] += kv.num_blocks_of(pull.holder)
        else:
            pull.holder = None  # shared prefix blocks stayed in use: nothing left to hold

    def _holds_released(self, p: int) -> None:
        """Prefill instance ``p`` gave back its finished copies' blocks: hold the prompts still to send."""
        pending, self._pending_holds[p] = self._pending_holds[p], []
        for pull in pending:
            self._hold(pull)

    # ---- pull and transfer ---------------------------------------------------------------------
    def _try_pulls(self, d: int) -> None:
        """Start the queued pulls into decode instance ``d`` that its KV can take now, in order."""
        queue = self._pulls[d]
        sched = self.decode[d].scheduler
        kv = sched.kv
        while queue:
            if sched.num_swapped or any(not kv.holds(w) and w.num_preemptions for w in sched.waiting):
                return  # preempted and swapped requests get the freed blocks first
            pull = queue[0]
            if not sched.admits_transfer(pull.req) or not kv.allocate(pull.req, pull.req.prompt_len + 1, watermark=True):
                return
            queue.popleft()
            self.env.process(self._transfer(pull, d))

    def _transfer(self, pull: _Pull, d: int):  # noqa: ANN202 - a SimPy process
        env = self.env
        req = pull.req
        start = env.now
        nbytes = req.prompt_len * self.kv_bytes_per_token
        with self._nic[pull.prefill].request() as slot:
            yield slot
            yield env.timeout(self.cfg.link.transfer_seconds(nbytes, self.link_ranks))
        if pull.holder is not None:
            kv = self.prefill[pull.prefill].scheduler.kv
            self._held_on[pull.prefill] -= kv.num_blocks_of(pull.holder)
            kv.free(pull.holder)
            self.prefill[pull.prefill].poke()  # a prefill waiting for blocks can start now
        self.num_transfers[req.request_id] = self.num_transfers.get(req.request_id, 0) + 1
        self.transfers.append((req.request_id, start - pull.ready_at, env.now - start, nbytes))
        req.num_computed_tokens = req.prompt_len
        req.num_output_tokens = 1
        req.first_token_time = req.last_token_time = env.now
        self._upstream_left()
        # (holding every block it needs to start, it is queued ahead of requests that must allocate:
        # Scheduler.add)
        self.decode[d].submit(req)

    def _upstream_left(self) -> None:
        self._upstream -= 1
        if self._upstream == 0 and self._upstream_done is not None and not self._upstream_done.triggered:
            self._upstream_done.succeed()

    def _close(self):  # noqa: ANN202 - a SimPy process step
        # a prefill instance whose KV is all held for transfers waits for them, so stays open too
        if self._upstream:
            self._upstream_done = self.env.event()
            yield self._upstream_done
        for rep in self.replicas:
            rep.close()

    # ---- end of run ----------------------------------------------------------------------------
    def run(self, requests: list[Request]) -> None:
        """Replay ``requests`` to the end, then check conservation across both pools and the link."""
        self.env.process(self.arrivals(requests))
        self.env.run()
        check_conservation(requests, self.replicas, self.num_done)
        for req in requests:
            n_pre = self.num_prefills.get(req.request_id, 0)
            n_xfer = self.num_transfers.get(req.request_id, 0)
            if req.state == RequestState.FINISHED and (n_pre != 1 or n_xfer != (req.output_len > 1)):
                raise AssertionError(f"request {req.request_id} finished after {n_pre} prefills and {n_xfer} "
                                     "transfers (expected 1 and 1)")
            if n_pre > 1 or n_xfer > 1:
                raise AssertionError(f"request {req.request_id} prefilled {n_pre} or transferred {n_xfer} times")
        held = sum(self._held_on)
        if any(self._pulls) or any(self._pending_holds) or held or self._real or self._upstream:
            raise AssertionError(f"KV left between pools: {sum(map(len, self._pulls))} pulls queued, "
                                 f"{held} blocks held, {self._upstream} requests upstream")

    def pool_summary(self, iterations: Any, makespan_s: float) -> dict[str, Any]:
        """Per pool: instances, busy share, mean queue, peak KV use; and the KV transfers."""
        out: dict[str, Any] = {}
        for name, reps in (("prefill", self.prefill), ("decode", self.decode)):
            ids = [r.replica_id for r in reps]
            it = iterations[iterations["replica"].isin(ids)] if len(iterations) else iterations
            busy = float(it["duration"].sum()) if len(it) else 0.0
            dur = it["duration"].to_numpy() if len(it) else np.zeros(0)
            wait = it["num_waiting"].to_numpy() if len(it) else np.zeros(0)
            out[name] = {
                "instances": len(reps),
                "busy_fraction": busy / (makespan_s * len(reps)) if makespan_s > 0 else None,
                "mean_waiting": float((wait * dur).sum() / dur.sum()) if dur.sum() > 0 else 0.0,
                "peak_kv_usage": float((it["kv_blocks_used"] / it["kv_blocks_total"]).max()) if len(it) else 0.0,
            }
        t = np.array([x[1:] for x in self.transfers]) if self.transfers else np.zeros((0, 3))
        out["kv_transfer"] = {
            "count": len(self.transfers),
            "mean_wait_for_decode_kv_ms": float(t[:, 0].mean() * 1e3) if len(t) else 0.0,
            "p99_wait_for_decode_kv_ms": float(np.percentile(t[:, 0], 99) * 1e3) if len(t) else 0.0,
            "mean_transfer_ms": float(t[:, 1].mean() * 1e3) if len(t) else 0.0,
            "p99_transfer_ms": float(np.percentile(t[:, 1], 99) * 1e3) if len(t) else 0.0,
            "total_gb": float(t[:, 2].sum() / 1e9) if len(t) else 0.0,
        }
        return out
