"""Prefix-cache keys of a prompt described as content segments, at any KV block size.

A request may carry ``segments``: its tokens as runs ``(segment_id, length)`` in order, where a
segment id names a piece of content (a turn of a conversation, a 512-token Mooncake block). Two
requests whose segment runs agree up to token t hold the same first t tokens. The key of block i
(tokens ``[i*B, (i+1)*B)``) names everything up to the block's end: the chain of the whole
segments before it plus the segment it ends in and the offset it ends at. So a block size that
does not divide the segments' size still gets exact keys, and keys agree across requests exactly
when their token prefixes do (given that a segment id names one content; an occurrence shorter
than another is its prefix).

Only ints are hashed, so keys are the same in every process (no string-hash randomisation).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

_ROOT = 0x5E9_3E47  # the chain value before any segment


def segment_block_keys(segments: Sequence[tuple[int, int]], block_size: int, num_tokens: int) -> list[int]:
    """Keys of the full blocks among the first ``num_tokens`` tokens (at most what the segments cover)."""
    keys: list[int] = []
    n_blocks = num_tokens // block_size
    chain = _ROOT
    start = 0  # first token of the current segment
    i = 0
    for seg_id, length in segments:
        end = start + length
        while i < n_blocks and (i + 1) * block_size <= end:
            keys.append(hash((chain, seg_id, (i + 1) * block_size - start)))
            i += 1
        if i >= n_blocks:
            break
        chain = hash((chain, seg_id, length))
        start = end
    return keys


def segments_len(segments: Sequence[tuple[int, int]]) -> int:
    """Tokens the segments cover."""
    return sum(length for _, length in segments)


class SegmentRuns(Sequence[tuple[int, int]]):
    """The first ``n`` runs of a list shared by a conversation's turns (each turn's prompt is the
    previous one plus two runs): constant memory per request instead of a copy of the history,
    which made a conversation of T turns hold ~T**2 references."""

    __slots__ = ("_n", "_runs")

    def __init__(self, runs: list[tuple[int, int]], n: int) -> None:
        self._runs, self._n = runs, n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):  # type: ignore[override]  # noqa: ANN001, ANN204
        if isinstance(i, slice):
            return [self._runs[j] for j in range(*i.indices(self._n))]
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError(i)
        return self._runs[i]

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return itertools.islice(self._runs, self._n)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and len(other) == self._n and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]  # mutable underneath, like a list

    def __repr__(self) -> str:
        return f"SegmentRuns({list(self)!r})"
