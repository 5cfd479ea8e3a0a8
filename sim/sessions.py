"""Multi-turn conversations: each turn's prompt resends the conversation so far.

A session is a system prompt (shared by every session) and N turns. Turn k's prompt is the
system prompt, every earlier user message and reply, then the new user message; its reply
follows. The next turn is sent ``think_time`` seconds after the reply ends (``cluster.py``), so a
session is a closed loop. Content is described as segments (``prefix_keys.py``): one id for the
system prompt, one per user message and one per reply, so the prefix cache finds the earlier
turns (reply included: a finished request's full blocks are cached) at any block size.

This module assembles requests from drawn numbers; ``workload.py`` draws them.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from .prefix_keys import SegmentRuns
from .request import Request

SYSTEM_SEGMENT = 1  # segment ids: 1 the system prompt, 2 + 2*id a user message, 3 + 2*id its reply


def build_sessions(
    starts: np.ndarray,
    turns: np.ndarray,
    new_tokens: np.ndarray,
    reply_tokens: np.ndarray,
    think_s: np.ndarray,
    system_prompt_len: int,
) -> list[Request]:
    """Requests of the sessions starting at ``starts`` (seconds, sorted) with ``turns[s]`` turns each.

    ``new_tokens``, ``reply_tokens`` and ``think_s`` hold one value per turn, session by session.
    Request ids run session by session; a later turn's ``arrival_time`` is its session's start
    until the cluster releases it.
    """
    reqs: list[Request] = []
    t = 0
    for s, (start, n) in enumerate(zip(starts.tolist(), turns.tolist(), strict=True)):
        history: list[tuple[int, int]] = [(SYSTEM_SEGMENT, system_prompt_len)] if system_prompt_len else []
        context = system_prompt_len
        prev: Request | None = None
        for _ in range(n):
            rid = len(reqs)
            user, reply = int(new_tokens[t]), int(reply_tokens[t])
            history.append((2 + 2 * rid, user))
            history.append((3 + 2 * rid, reply))
            req = Request(rid, start, context + user, reply, session_id=s, think_time_s=float(think_s[t]),
                          segments=SegmentRuns(history, len(history)))
            context += user + reply
            if prev is not None:
                prev.next_turn = req
            reqs.append(req)
            prev = req
            t += 1
    return reqs


def later_turns(requests: Iterable[Request]) -> set[int]:
    """Request ids of the turns sent only when the turn before them is answered (think time
    later): their arrival, and live their prompt's token ids, are outcomes of the run."""
    return {r.next_turn.request_id for r in requests if r.next_turn is not None}
