"""Run many independent simulations: in this process, on local worker processes, or on Ray.

``TaskRunner.map(fn, tasks)`` returns one ``Outcome`` per task, in task order, whatever order the
workers finish in, so a sweep's table does not depend on the backend or on timing. A task that
raises does not stop the others: its outcome carries the error as one line. ``fn`` must be a
module-level function (it is pickled to the workers) and the results must be picklable.

Local workers start with ``forkserver``: forking a process that already runs threads (a Ray
driver, a notebook kernel, tqdm's monitor) is unsafe, and the fork server imports servesim once so
each worker starts in milliseconds.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from ..errors import UserError, one_line_error


@dataclass(slots=True)
class Outcome:
    value: Any = None
    error: str | None = None  # one line; None when the task succeeded
    wall_s: float = 0.0  # seconds the task ran on its worker

    @property
    def ok(self) -> bool:
        return self.error is None


def guarded(fn: Callable[[Any], Any], task: Any) -> Outcome:
    """Run ``fn(task)`` and catch whatever it raises, so one bad task cannot end the batch."""
    import time

    t0 = time.perf_counter()
    try:
        value = fn(task)
    except Exception as e:  # noqa: BLE001 - reported per task, see module docstring
        return Outcome(error=one_line_error(e), wall_s=time.perf_counter() - t0)
    return Outcome(value=value, wall_s=time.perf_counter() - t0)


def default_workers() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


class TaskRunner:
    """One pool of workers kept for several ``map`` calls (plan's bisection reuses it).

    ``backend``: "local" (``workers`` processes; ``workers=1`` runs in this process, no pool) or
    "ray" (``ray_address``: None starts or joins Ray the way ``ray.init()`` does, "auto" joins the
    running cluster, "ray://host:10001" a remote one). Use it as a context manager.
    """

    def __init__(self, backend: str = "local", workers: int | None = None, ray_address: str | None = None,
                 progress: bool = True, desc: str = "") -> None:
        if backend not in ("local", "ray"):
            raise ValueError(f"unknown backend {backend!r}")
        self.backend = backend
        self.workers = workers or default_workers()
        self.ray_address = ray_address
        self.progress = progress
        self.desc = desc
        self._pool: ProcessPoolExecutor | None = None
        self._ray_started = False
        self._remote = None
        self._bar: tqdm | None = None

    def __enter__(self) -> TaskRunner:
        # One bar for the runner's life: plan's bisection adds tasks step by step to the same bar.
        self._bar = tqdm(total=0, desc=self.desc, unit="run", disable=not self.progress, leave=False,
                         mininterval=0.5)
        if self.backend == "ray":
            self._start_ray()
        elif self.workers > 1:
            ctx = mp.get_context("forkserver")
            ctx.set_forkserver_preload(["servesim.sim.simulate"])
            self._pool = ProcessPoolExecutor(max_workers=self.workers, mp_context=ctx)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        if self._ray_started:
            import ray

            ray.shutdown()
            self._ray_started = False

    def _start_ray(self) -> None:
        try:
            import ray
        except ImportError:
            raise UserError("--ray needs the ray extra: pip install -e '.[ray]'") from None
        if not ray.is_initialized():
            ray.init(address=self.ray_address, include_dashboard=False, log_to_driver=False,
                     configure_logging=False)
            self._ray_started = True
        self._remote = ray.remote(num_cpus=1)(guarded)

    def map(self, fn: Callable[[Any], Any], tasks: Sequence[Any], desc: str | None = None) -> list[Outcome]:
        """``fn`` over ``tasks``; outcomes in task order. The progress bar counts finished tasks."""
        bar = self._bar
        if bar is None:
            raise RuntimeError("use TaskRunner as a context manager")
        bar.total += len(tasks)
        if desc:
            bar.set_description(desc, refresh=False)
        bar.refresh()
        if self.backend == "ray":
            return self._map_ray(fn, tasks, bar)
        if self._pool is None:
            out = []
            for t in tasks:
                out.append(guarded(fn, t))
                bar.update(1)
            return out
        return self._map_pool(fn, tasks, bar)

    def _map_pool(self, fn: Callable[[Any], Any], tasks: Sequence[Any], bar: tqdm) -> list[Outcome]:
        assert self._pool is not None
        futures: dict[Future, int] = {self._pool.submit(guarded, fn, t): i for i, t in enumerate(tasks)}
        out: list[Outcome | None] = [None] * len(tasks)
        pending = set(futures)
        while pending:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            for f in done:
                try:
                    out[futures[f]] = f.result()
                except Exception as e:  # noqa: BLE001 - a worker died (killed, out of memory)
                    out[futures[f]] = Outcome(error=f"worker failed: {one_line_error(e)}")
                bar.update(1)
        return [o for o in out if o is not None]

    def _map_ray(self, fn: Callable[[Any], Any], tasks: Sequence[Any], bar: tqdm) -> list[Outcome]:
        import ray

        refs = [self._remote.remote(fn, t) for t in tasks]
        index = {r: i for i, r in enumerate(refs)}
        out: list[Outcome | None] = [None] * len(tasks)
        pending = list(refs)
        while pending:
            # everything that is ready within half a second: cheap on long lists, live progress
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=0.5)
            for r in done:
                try:
                    out[index[r]] = ray.get(r)
                except Exception as e:  # noqa: BLE001 - the task's worker died
                    out[index[r]] = Outcome(error=f"ray worker failed: {one_line_error(e)}")
                bar.update(1)
        return [o for o in out if o is not None]
