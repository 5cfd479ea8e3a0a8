"""Static batching: a batch forms when the replica is idle and runs until every member is done.

Up to ``max_num_seqs`` waiting requests, oldest first, join a batch if the KV cache can reserve
their prompt plus their whole output up front (so nothing is ever preempted). The first step
prefills every prompt; then each step decodes one token for every member still generating. A
member that finishes returns its response at once but keeps its seat and its blocks idle until
the whole batch ends; nobody joins mid-batch. Such a member leaves the running table when it
finishes (so the rows left all generate, and a stretch of their decode steps can be fast-forwarded)
and is kept aside with its blocks, counted among the running, until the batch ends.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import model_validator

from ..batch import Batch
from ..kv_cache import BlockManager
from ..request import Request, RequestState
from .base import PolicyConfig, Scheduler


class StaticConfig(PolicyConfig):
    """Static batching; ``max_num_seqs`` is the batch size."""

    type: Literal["static"] = "static"

    @model_validator(mode="after")
    def _never_preempts(self) -> StaticConfig:
        if self.preemption_mode != "recompute":
            # static reserves KV up front and never preempts; a mode other than the default is a mistake
            raise ValueError("preemption_mode has no effect on a static scheduler (it never preempts); remove it")
        return self


class StaticScheduler(Scheduler):
    config_type = StaticConfig

    def __init__(self, config: StaticConfig, block_manager: BlockManager) -> None:
        super().__init__(config, block_manager)
        self._members: list[Request] = []  # the running batch, in admission order
        self._idle = 0  # members done, holding their seat and blocks until the batch ends

    @property
    def num_running(self) -> int:
        return self.run.n + self._idle

    def decodes_ahead(self) -> bool:
        # a batch in flight admits nobody: once its prompts are in, every step decodes every member
        # still generating (the running rows), with its KV reserved up front
        return self.run.n > 0

    def admits_transfer(self, request: Request) -> bool:
        # a batch forms only with each member's whole output reserved
        return self._fits_to_completion(request)

    def schedule(self, now: float) -> Batch:
        if self.run.n == 0:
            self._form_batch(now, self.max_num_seqs)
        return self._step_batch()

    def _form_batch(self, now: float, size: int) -> None:
        """Admit up to ``size`` waiting requests, oldest first, while their whole KV can be reserved."""
        run = self.run
        while self.waiting and run.n < size:
            req = self.waiting[0]
            if not self.kv.allocate(req, self.max_kv_tokens(req)):
                break
            self.waiting.popleft()
            self._admit(req, now)
            self._members.append(req)

    def _step_batch(self) -> Batch:
        """One step of the running batch: every member still generating (every running row; the
        finished ones wait aside) computes what it owes."""
        run = self.run
        n = run.n
        return self._make_batch(None, run.tokens[:n] - run.computed[:n])

    def _retire(self, req: Request, now: float) -> None:
        req.state = RequestState.FINISHED
        req.finish_time = now  # the response goes out now; the seat and blocks stay until the batch ends

    def _on_rows_finished(self, rows: np.ndarray) -> None:
        super()._on_rows_finished(rows)
        self._idle += len(rows)
        if self.run.n == 0:  # the batch is over: every member's blocks come back, in admission order
            for req in self._members:
                self.kv.free(req)
            self._members = []
            self._idle = 0
