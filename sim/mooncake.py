"""Reader for the Mooncake trace format (FAST'25 traces, github.com/kvcache-ai/Mooncake).

One JSON object a line: ``timestamp`` (milliseconds), ``input_length``, ``output_length`` and
``hash_ids``, the hashes of the prompt's consecutive 512-token blocks, equal across requests
exactly where their prompts agree. Each hash becomes a segment of 512 tokens (the last one the
prompt's remainder), so the prefix cache keys blocks of any size from them (``prefix_keys.py``):
with 16-token blocks a shared 512-token hash is 32 shared blocks; with a block size that does not
divide 512 a block that straddles two hashes is shared only when both are. Prompt tokens beyond
the listed hashes are the request's own (counted in ``num_prompt_beyond_hashes``); hashes beyond
the prompt are ignored.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .config_model import INT_MAX
from .errors import WorkloadError, not_a_file

MOONCAKE_BLOCK = 512  # tokens per hash id


@dataclass(slots=True)
class MooncakeTrace:
    arrival_time: np.ndarray  # seconds from the first kept request, sorted
    prompt_len: np.ndarray
    output_len: np.ndarray
    segments: list[tuple[tuple[int, int], ...]]
    num_prompt_beyond_hashes: int = 0  # requests whose hash_ids cover less than their prompt


def prompt_segments(hash_ids: list[int], input_length: int, own_id: int) -> tuple[tuple[int, int], ...]:
    """The prompt as (hash id, tokens) runs; uncovered tokens are one run under ``own_id``."""
    segs = []
    left = input_length
    for h in hash_ids:
        if left <= 0:
            break
        take = min(MOONCAKE_BLOCK, left)
        segs.append((int(h), take))
        left -= take
    if left > 0:
        segs.append((own_id, left))
    return tuple(segs)


def _number(obj: dict, key: str) -> float:
    """A finite JSON number (not a boolean, which Python would take as 0 or 1)."""
    v = obj[key]
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise ValueError(f"{key} must be a finite number, got {json.dumps(v)}")
    return float(v)


def _count(obj: dict, key: str) -> int:
    """A token count: a whole number up to 2**32 (a float like 1e30 is not a length)."""
    v = _number(obj, key)
    if v != int(v) or not abs(v) <= INT_MAX:
        raise ValueError(f"{key} must be a whole number of tokens up to {INT_MAX}, got {json.dumps(obj[key])}")
    return int(v)


def _hash(h: object) -> int:
    if isinstance(h, bool) or not isinstance(h, int):
        raise ValueError(f"hash_ids must be integers, got {json.dumps(h)}")
    return h


def read_mooncake(path: Path, time_scale: float = 1.0, start: int = 0, limit: int | None = None,
                  where: str = "workload.trace") -> MooncakeTrace:
    """Read a Mooncake JSONL trace; one-line ``WorkloadError`` naming the line for a bad row."""
    if why := not_a_file(path):
        raise WorkloadError(f"{where}.path: {why}")
    if path.stat().st_size == 0:
        raise WorkloadError(f"{where}.path: {path} is empty")
    rows = []
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
                if not isinstance(obj, dict):
                    raise ValueError(f"a JSON object per line, got {type(obj).__name__}")
                hashes = obj.get("hash_ids", [])
                if not isinstance(hashes, list):
                    raise ValueError(f"hash_ids must be a list of integers, got {json.dumps(hashes)[:60]}")
                row = (_number(obj, "timestamp"), _count(obj, "input_length"), _count(obj, "output_length"),
                       [_hash(h) for h in hashes])
            except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError, RecursionError) as e:
                raise WorkloadError(f"{where}: {path} line {lineno} is not a Mooncake record "
                                    f"(timestamp, input_length, output_length, hash_ids): {e}") from None
            if row[1] < 1 or row[2] < 1:
                raise WorkloadError(f"{where}: {path} line {lineno}: input_length and output_length must be >= 1")
            rows.append(row)
    rows = rows[start:]
    order = sorted(range(len(rows)), key=lambda i: rows[i][0])[:limit]
    if not order:
        raise WorkloadError(f"{where}: no requests left in {path} (start={start})")
    rows = [rows[i] for i in order]
    t = np.array([r[0] for r in rows]) / 1000.0
    beyond = sum(len(r[3]) * MOONCAKE_BLOCK < r[1] for r in rows)
    # the request's own tail segment: negative ids never collide with hash ids (non-negative)
    segs = [prompt_segments(r[3], r[1], -1 - i) for i, r in enumerate(rows)]
    return MooncakeTrace((t - t[0]) * time_scale, np.array([r[1] for r in rows]), np.array([r[2] for r in rows]),
                         segs, beyond)
