"""A sweep's finished points, recorded as they finish, so an interrupted sweep can ``--resume``.

``points.jsonl`` in the sweep folder: the first line is the sweep's *spec* (base scenario as read,
``--set`` overrides, grid keys and values as typed), then one line per finished point: its index,
status, error, summary values and ``wall_s``. Each line goes out in one ``write`` on an append-only
file, so a process killed mid-sweep leaves every earlier line whole; a torn last line (killed in
the middle of that write) is dropped when the file is read back, and the file is rewritten without
it (atomically) before new points are appended.

A point whose worker died (``Outcome.lost``) is not recorded: ``--resume`` runs it again. A point
that failed on its own (an invalid value, an error in the simulation) is recorded as failed: it
would fail the same way again.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import UserError
from ..outputs import write_text

POINTS_FILE = "points.jsonl"
POINTS_FORMAT = "servesim-sweep-points/1"


def _plain(x: Any) -> Any:
    """numpy scalars as the Python values JSON knows (floats round-trip exactly through repr)."""
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.floating):
        return float(x)
    if isinstance(x, np.bool_):
        return bool(x)
    return str(x)  # a YAML date or other scalar in the spec: compared as text


def to_line(record: Mapping[str, Any]) -> str:
    return json.dumps(record, default=_plain, sort_keys=False) + "\n"


def read_back(record: Mapping[str, Any]) -> dict[str, Any]:
    """The record as it reads back from the points file (a table built from these is the same
    whether its points ran now or in an earlier, interrupted sweep)."""
    return json.loads(to_line(record))


def spec_differences(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """Which parts of the sweep differ: 'base scenario', '--set', 'grid' (empty when the same)."""
    parts = (("scenario", "base scenario"), ("set", "--set overrides"), ("grid", "grid"))
    norm = read_back(current)  # the recorded spec went through JSON: compare like with like
    return [name for key, name in parts if recorded.get(key) != norm.get(key)]


class PointsLog:
    """The points file of one sweep folder; ``done`` holds the recorded points by index."""

    def __init__(self, path: Path, done: dict[int, dict[str, Any]]) -> None:
        self.path = path
        self.done = done

    @classmethod
    def start(cls, out_dir: Path, spec: Mapping[str, Any]) -> PointsLog:
        """A new points file holding only the spec (an old one in the folder is replaced)."""
        path = out_dir / POINTS_FILE
        write_text(path, to_line({"format": POINTS_FORMAT, **spec}))
        return cls(path, {})

    @classmethod
    def resume(cls, out_dir: Path, spec: Mapping[str, Any]) -> PointsLog:
        """The points already recorded, after checking the folder holds this very sweep."""
        path = out_dir / POINTS_FILE
        if not path.is_file():
            raise UserError(f"--resume: {path} does not exist, so there is nothing to resume; run without --resume")
        text = path.read_text(encoding="utf-8", errors="replace")
        lines = text.split("\n")
        whole = lines[:-1]  # the part after the last newline is empty, or a torn line
        records = []
        for line in whole:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                break  # cannot happen with one write per line, unless the file was edited: keep what came before
        if not records or not isinstance(records[0], dict) or records[0].get("format") != POINTS_FORMAT:
            raise UserError(f"--resume: {path} is not a servesim sweep points file; use another --out or drop --resume")
        differ = spec_differences(records[0], spec)
        if differ:
            raise UserError(f"--resume: {path} records a different sweep ({', '.join(differ)} differ); rerun the "
                            f"command that made it, or drop --resume to start this sweep over")
        done = {int(r["point"]): r for r in records[1:] if isinstance(r, dict) and "point" in r}
        if lines[-1] or len(records) < len(whole):
            # a torn or unreadable tail: rewrite the file without it before appending to it
            write_text(path, "".join(to_line(r) for r in records))
        return cls(path, done)

    def append(self, record: Mapping[str, Any]) -> dict[str, Any]:
        """Record one finished point; returns it as it reads back (what a resumed sweep will see)."""
        line = to_line(record)
        back = read_back(record)
        # Ctrl-C / SIGTERM wait until the line is written and counted, so "N points finished" is exact
        held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
            try:
                data = line.encode()
                while data:  # a regular file takes it whole; loop in case a write comes back short
                    data = data[os.write(fd, data):]
            finally:
                os.close(fd)
            self.done[int(back["point"])] = back
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
        return back
