"""Many runs recorded as they finish, so an interrupted verb can ``--resume`` (sweep, compare).

The points file (``points.jsonl`` in a sweep folder, ``runs.jsonl`` in a compare folder): the
first line is the *spec*, what makes two invocations the same job (for a sweep: base scenario as
read, ``--set`` overrides, grid keys and values as typed), then one line per finished task: its
index, status, error, value (a run's summary) and ``wall_s``. Each line goes out in one ``write``
on an append-only file, so a process killed midway leaves every earlier line whole; a torn last
line (killed in the middle of that write) is dropped when the file is read back, and the file is
rewritten without it (atomically) before new lines are appended.

The verb builds its table from these records, whether a task ran now or in an earlier,
interrupted invocation, so a resumed job's table is the uninterrupted one's. A task whose worker
died (``Outcome.lost``) is not recorded: ``--resume`` runs it again. A task that failed on its own
(an invalid value, an error in the simulation) is recorded as failed: it would fail the same way.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import UserError
from ..outputs import Interrupted, begin_folder, write_text
from .parallel import Outcome, TaskRunner

POINTS_FORMAT = "servesim-points/1"


def _plain(x: Any) -> Any:
    """numpy scalars as the Python values JSON knows (floats round-trip exactly through repr)."""
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.floating):
        return float(x)
    if isinstance(x, np.bool_):
        return bool(x)
    return str(x)  # a YAML date or other scalar in a spec: compared as text


def to_line(record: Mapping[str, Any]) -> str:
    return json.dumps(record, default=_plain) + "\n"


def read_back(record: Mapping[str, Any]) -> dict[str, Any]:
    """The record as it reads back from the points file."""
    return json.loads(to_line(record))


class PointsLog:
    """One points file; ``done`` holds the recorded tasks by index."""

    def __init__(self, path: Path, done: dict[int, dict[str, Any]]) -> None:
        self.path = path
        self.done = done

    @classmethod
    def start(cls, path: Path, spec: Mapping[str, Any]) -> PointsLog:
        """A new points file holding only the spec (an old one is replaced)."""
        write_text(path, to_line({"format": POINTS_FORMAT, **spec}))
        return cls(path, {})

    @classmethod
    def resume(cls, path: Path, spec: Mapping[str, Any], labels: Mapping[str, str], job: str = "job") -> PointsLog:
        """The tasks already recorded, after checking the file records this very job.

        ``labels`` names each spec key for the refusal (``{"grid": "grid", ...}``).
        """
        if not path.is_file():
            raise UserError(f"--resume: {path} does not exist, so there is nothing to resume; run without --resume")
        lines = path.read_text(encoding="utf-8", errors="replace").split("\n")
        whole = lines[:-1]  # the part after the last newline is empty, or a torn line
        records = []
        for line in whole:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                break  # cannot happen with one write per line, unless the file was edited: keep what came before
        if not records or not isinstance(records[0], dict) or records[0].get("format") != POINTS_FORMAT:
            raise UserError(f"--resume: {path} is not a servesim points file; use another --out or drop --resume")
        now = read_back(spec)  # the recorded spec went through JSON: compare like with like
        differ = [labels.get(k, k) for k in now if records[0].get(k) != now[k]]
        if differ:
            raise UserError(f"--resume: {path} records a different {job} ({', '.join(differ)} differ); rerun the "
                            f"command that made it, or drop --resume to start over")
        done = {int(r["point"]): r for r in records[1:] if isinstance(r, dict) and "point" in r}
        if lines[-1] or len(records) < len(whole):
            # a torn or unreadable tail: rewrite the file without it before appending to it
            write_text(path, "".join(to_line(r) for r in records))
        return cls(path, done)

    def append(self, record: Mapping[str, Any]) -> dict[str, Any]:
        """Record one finished task; returns it as it reads back (what a resumed job will see)."""
        line = to_line(record)
        back = read_back(record)
        # Ctrl-C / SIGTERM wait until the line is written and counted, so "N finished" is exact
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


@dataclass
class Recorded:
    """What became of each task: ``records`` (finished, now or earlier) and ``lost`` (worker died)."""

    records: dict[int, dict[str, Any]] = field(default_factory=dict)
    lost: dict[int, Outcome] = field(default_factory=dict)
    resumed: int = 0  # tasks taken from the points file instead of run now

    def get(self, i: int) -> dict[str, Any] | None:
        """Task ``i`` as status / error / value / wall_s, or None when it never ran."""
        if i in self.records:
            return self.records[i]
        o = self.lost.get(i)
        return None if o is None else {"status": "lost", "error": o.error, "value": None, "wall_s": o.wall_s}


@dataclass(frozen=True)
class Recording:
    """Where and how a verb records its tasks: ``path`` inside the output folder, ``markers`` the
    folder's result files (removed before a new run, written by the verb when it is done)."""

    out_dir: Path
    filename: str
    spec: Mapping[str, Any]
    labels: Mapping[str, str]  # spec key -> its name in a refusal ("grid", "--set overrides")
    job: str  # what the file records, for a refusal: "sweep", "comparison"
    resume: bool = False
    markers: tuple[str, ...] = ()


def run_recorded(fn: Callable[[Any], Any], tasks: Mapping[int, Any], make_runner: Callable[[], TaskRunner],
                 recording: Recording | None, noun: str) -> Recorded:
    """``fn`` over ``tasks`` (index -> task), each outcome recorded as it finishes.

    With ``recording.resume`` the recorded tasks are kept and only the others run. Ctrl-C or
    SIGTERM raises ``Interrupted`` saying how many ``noun`` finished and where they are recorded.
    """
    log = None
    if recording is not None and recording.resume:
        # read, and refuse another job's file, before anything in the folder changes
        log = PointsLog.resume(recording.out_dir / recording.filename, recording.spec, recording.labels,
                               recording.job)
    result = Recorded(records=dict(log.done) if log else {})
    todo = [i for i in tasks if i not in result.records]
    result.resumed = len(tasks) - len(todo)

    def done(k: int, o: Outcome) -> None:
        i = todo[k]
        if o.lost:
            result.lost[i] = o
            return
        rec = {"point": i, "status": "ok" if o.ok else "failed", "error": o.error or "",
               "value": o.value if o.ok else None, "wall_s": o.wall_s}
        result.records[i] = log.append(rec) if log else read_back(rec)

    try:
        # the runner starts first: an unreachable Ray cluster is an error before the folder is touched
        with make_runner() if todo else contextlib.nullcontext() as runner:
            if recording is not None:
                out = begin_folder(recording.out_dir, *recording.markers)  # no old table outlives a new run
                log = log or PointsLog.start(out / recording.filename, recording.spec)
            if todo:
                runner.map(fn, [tasks[i] for i in todo], on_done=done)
    except KeyboardInterrupt:
        finished = len(log.done) if log else len(result.records)  # log.done counts a task once its line is written
        where = (f"recorded in {log.path}; the same command with --resume runs the other {len(tasks) - finished}"
                 if log else "not recorded (no output folder)")
        raise Interrupted(f"interrupted: {finished} of {len(tasks)} {noun} finished, {where}") from None
    return result
