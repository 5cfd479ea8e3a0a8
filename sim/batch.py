"""The Batch a scheduler hands the executor: the seam between policy and execution.

One row per scheduled request: how many new tokens it computes this step and how many of its
tokens are already in the KV cache. Rows are numpy arrays so the cost model and the metrics can
work on whole steps at once; ``requests`` holds the matching Request objects for the live
executor, which also reads block tables from the scheduler's block manager.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .request import Request


@dataclass(slots=True)
class Batch:
    num_new_tokens: np.ndarray  # int64, tokens computed for each request this step
    num_context_tokens: np.ndarray  # int64, tokens of each request already in the KV cache
    # Rows whose computation reaches the end of their tokens sample one output token.
    samples: np.ndarray  # bool
    # Running-table slots of the rows (scheduler-private bookkeeping).
    slots: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    preempted: list[Request] = field(default_factory=list)
    # KV block copies done before the step: (device block, host block) and (host, device) pairs.
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    # The Request of each row is looked up only when asked for (live mode, tests): simulation
    # never needs the objects, and building the list every step is a measurable cost.
    _source: list[Request] | None = None
    _requests: list[Request] | None = None

    @property
    def requests(self) -> list[Request]:
        if self._requests is None:
            src = self._source or []
            self._requests = [src[i] for i in self.slots.tolist()]
        return self._requests

    @property
    def size(self) -> int:
        return len(self.num_new_tokens)

    @property
    def is_empty(self) -> bool:
        return len(self.num_new_tokens) == 0 and not self.swap_out and not self.swap_in

    @property
    def num_tokens(self) -> int:
        return int(self.num_new_tokens.sum())

    @property
    def num_decode_tokens(self) -> int:
        """Rows computing exactly one token that samples (plain decodes)."""
        return int(np.count_nonzero((self.num_new_tokens == 1) & self.samples & (self.num_context_tokens > 0)))

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_tokens - self.num_decode_tokens

    @property
    def num_swap_blocks(self) -> int:
        return len(self.swap_out) + len(self.swap_in)

    @staticmethod
    def of(requests: list[Request], num_new_tokens, num_context_tokens, samples=None) -> Batch:  # noqa: ANN001
        """A batch built by hand (tests, calibration): rows in the order of ``requests``.

        ``samples`` defaults to "every row reaches the end of its request's tokens".
        """
        new = np.asarray(num_new_tokens, dtype=np.int64)
        ctx = np.asarray(num_context_tokens, dtype=np.int64)
        if samples is None:
            samples = ctx + new >= np.asarray([r.num_tokens for r in requests], dtype=np.int64)
        return Batch(new, ctx, np.asarray(samples, dtype=bool), np.arange(len(requests), dtype=np.int64),
                     _source=list(requests))

    @staticmethod
    def empty() -> Batch:
        z = np.zeros(0, dtype=np.int64)
        return Batch(z, z.copy(), np.zeros(0, dtype=bool), z.copy())
