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

from collections.abc import Sequence

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
