"""A serving request: its lengths, its progress through the engine, and its timestamps.

Progress follows vLLM v1's token catch-up arithmetic: a request holds ``num_tokens`` tokens
(prompt plus what it has generated so far) and ``num_computed_tokens`` of them have their KV in
the cache. A step schedules some new tokens for it; when it catches up with ``num_tokens`` the
model samples one more output token. Prefill, chunked prefill, decode and recompute after
preemption are all the same arithmetic.

While a request is running, its hot counters live in the scheduler's numpy arrays
(``schedulers/base.py``); the fields here are written back whenever it leaves the running set.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum


class RequestState(IntEnum):
    WAITING = 0
    RUNNING = 1
    SWAPPED = 2
    FINISHED = 3
    REJECTED = 4


@dataclass(slots=True, eq=False)
class Request:
    """One request. Times are seconds since the start of the run; lengths are tokens."""

    request_id: int
    arrival_time: float
    prompt_len: int
    output_len: int
    # Requests with the same prefix_id share their first prefix_len prompt tokens (a system
    # prompt, a few-shot preamble). Used for prefix caching when no token ids are given.
    prefix_id: int = -1
    prefix_len: int = 0
    priority: int = 0  # lower value = served first under policy "priority" (vLLM convention)
    prompt_token_ids: list[int] | None = None  # live mode and exact prefix hashing
    # Content as runs (segment_id, tokens), prompt then output, for prefix-cache keys at any block
    # size (multi-turn sessions, Mooncake hash_ids; sim/prefix_keys.py). None: the fields above.
    segments: Sequence[tuple[int, int]] | None = None
    # Multi-turn sessions (sim/sessions.py): the turn released think_time_s after this one ends.
    next_turn: Request | None = None
    think_time_s: float = 0.0
    session_id: int = -1

    # progress
    num_prompt_tokens: int = -1  # the prompt the engine sees; grows when a soft reset folds outputs in
    num_computed_tokens: int = 0
    num_output_tokens: int = 0
    state: RequestState = RequestState.WAITING
    replica: int = -1

    # timestamps (seconds); nan until they happen
    first_scheduled_time: float = math.nan
    first_token_time: float = math.nan
    last_token_time: float = math.nan
    finish_time: float = math.nan

    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    reject_reason: str | None = None
    output_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.num_prompt_tokens < 0:
            self.num_prompt_tokens = self.prompt_len

    @property
    def num_tokens(self) -> int:
        """Tokens that exist for this request: the original prompt plus every output so far."""
        return self.prompt_len + self.num_output_tokens

    def all_token_ids(self) -> list[int]:
        """Prompt then generated tokens (live mode)."""
        return list(self.prompt_token_ids or []) + self.output_token_ids

    def reset_progress(self) -> None:
        """Forget everything computed (a fresh copy of the workload's request)."""
        self.num_prompt_tokens = self.prompt_len
        self.num_computed_tokens = 0
        self.num_output_tokens = 0
        self.state = RequestState.WAITING
        self.replica = -1
        self.first_scheduled_time = math.nan
        self.first_token_time = math.nan
        self.last_token_time = math.nan
        self.finish_time = math.nan
        self.num_preemptions = 0
        self.num_cached_tokens = 0
        self.reject_reason = None
        self.output_token_ids = []
