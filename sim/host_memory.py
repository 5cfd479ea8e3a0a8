"""What the machine running servesim can hold: a scenario whose tables would not fit is refused.

A simulation allocates, per replica, a running table with one row per seat (``max_num_seqs``),
free lists with one entry per device and per host KV block, and, per request, the ``Request``,
its inter-token latencies and its row of the results. A scenario that asks for more than the
host's physical memory fails at load, naming the field that asks for the most and how far it may
go, instead of dying in numpy ("Unable to allocate 43.7 TiB") or in the kernel's OOM killer.

The bytes per item are measured (``tests/test_bad_inputs.py`` holds the row and block sizes to
what the tables allocate); the per-request figure is the marginal peak of a typical run, so the
check refuses what would not fit by a wide margin, not a run that is merely close to the limit.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

# RunningTable (sim/schedulers/running.py): six int64 counters and one float64 per row, plus the
# row's slot in the list of requests.
ROW_BYTES = 64
# BlockManager (sim/kv_cache.py): one free-list entry per block, a list slot and an int object
# (measured 51 B per block, device and host blocks alike).
BLOCK_BYTES = 48
# A simulated request from generation to the written results: measured 12.3 KB per request
# (tracemalloc peak of quickstart.yaml, 1000 vs 4000 requests, mean 250 output tokens).
REQUEST_BYTES = 12 * 1024
# A replica's scheduler, block manager, SimPy process and metrics, besides the tables above.
REPLICA_BYTES = 16 * 1024
REPLICAS_FIELD = "cluster.num_replicas"
# What a multi-seed verb (plan, compare) keeps of each run until it writes its results: the run's
# scenario copy (measured 1.3 KB for compare's, 3.2 KB for plan's) and its summary (42 floats);
# plan also pools each run's request rows (ten 8-byte columns, POOLED_REQUEST_BYTES each).
SEED_RUN_BYTES = 2 * 1024
POOLED_REQUEST_BYTES = 80
# A sweep or search point: its validated scenario (measured 7.8 KiB for quickstart.yaml's) and its row.
GRID_POINT_BYTES = 7 * 1024


def host_memory_bytes() -> int | None:
    """Physical memory of this machine (bytes), or None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def format_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'; binary units, as the OOM messages of numpy and the kernel use."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
    return f"{n:.3g} PiB"  # pragma: no cover - the loop returns


@dataclass(frozen=True, slots=True)
class Demand:
    """``count`` items of ``bytes_each``, ``per`` times over (replicas), set by the scenario's ``field``."""

    field: str  # the dotted scenario field that sets count, as the user wrote it
    what: str  # "running-table rows", "KV blocks", "requests"
    count: float
    bytes_each: int
    per: int = 1
    items_per_unit: float = 1.0  # items per unit of the field (host blocks per GiB of swap_space_gb)
    unit: str = ""  # the field's unit, for its limit ("GiB")

    @property
    def bytes(self) -> float:
        return self.count * self.bytes_each * self.per


def over_host_memory(demands: list[Demand], host: int | None = None) -> tuple[str, str] | None:
    """(field, one-line reason) when the demands together exceed the host's memory, else None.

    The field named is the one asking for the most; its limit is what fits with the rest as given.
    """
    host = host_memory_bytes() if host is None else host
    total = sum(d.bytes for d in demands)
    if host is None or total <= host:
        return None
    replicated = [d for d in demands if d.per > 1]
    each = sum(d.bytes / d.per for d in replicated)
    if replicated and total - sum(d.bytes for d in replicated) + each <= host:
        # one replica fits: the replica count is what to lower
        per = replicated[0].per
        limit = int((host - (total - per * each)) // each)
        return REPLICAS_FIELD, (
            f"{per} replicas need {format_bytes(per * each)} of host memory to simulate ({format_bytes(each)} each: "
            f"running table and KV block lists) and this machine has {format_bytes(host)}: at most {limit}"
        )
    worst = max(demands, key=lambda d: d.bytes)
    room = host - (total - worst.bytes)
    items = max(room // (worst.bytes_each * worst.per), 0)
    limit = f"{items:.0f}" if worst.items_per_unit == 1 else f"{items / worst.items_per_unit:.4g}{worst.unit}"
    times = f" x {worst.per} replicas" if worst.per > 1 else ""
    return worst.field, (
        f"{_count(worst.count)} {worst.what}{times} need {format_bytes(worst.bytes)} of host memory to simulate "
        f"({worst.bytes_each} B each; the scenario in all {format_bytes(total)}) and this machine has "
        f"{format_bytes(host)}: at most {limit} with the rest of the scenario as it is"
    )


def _count(n: float) -> str:
    return f"{n:.0f}" if n < 1e15 else f"{n:.3g}"
