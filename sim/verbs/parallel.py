"""Run many independent simulations: in this process, on local worker processes, or on Ray.

``TaskRunner.map(fn, tasks)`` returns one ``Outcome`` per task, in task order, whatever order the
workers finish in, so a sweep's table does not depend on the backend or on timing. A task that
raises does not stop the others: its outcome carries the error as one line. ``fn`` must be a
module-level function (it is pickled to the workers) and the results must be picklable.

A worker process that dies (killed, out of memory) need not be the task's fault: a local task
whose pool broke runs again on a fresh pool, and alone on a one-worker pool if that breaks too; a
Ray task is retried by Ray (``RAY_RETRIES``). A task that still gets no answer comes back ``lost``
with a one-line error, never silently missing.
Ctrl-C (or SIGTERM, which the CLI turns into one) reaches only the parent: the workers ignore
SIGINT and the runner terminates them on its way out, so nothing keeps running after the parent.

Local workers start with ``forkserver``: forking a process that already runs threads (a Ray
driver, a notebook kernel, tqdm's monitor) is unsafe, and the fork server imports servesim once so
each worker starts in milliseconds.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
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
    lost: bool = False  # its worker died (killed, out of memory): running it again may well succeed

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


LOCAL_ATTEMPTS = 2  # pool runs of a task whose worker died before it is run alone (see _map_pool)
RAY_RETRIES = 2  # Ray reruns a task whose worker died this many times

OnDone = Callable[[int, Outcome], None]  # (task index, its outcome), called as each task finishes


def check_workers(workers: int | None) -> None:
    """``--workers`` is a positive count or absent (one per CPU core); 0 is not "auto"."""
    if workers is not None and workers < 1:
        raise UserError(f"--workers {workers}: give 1 or more worker processes (1 runs in this process), "
                        f"or leave it out for one per CPU core ({default_workers()})")


def _init_worker() -> None:
    """Worker initializer: Ctrl-C is the parent's to handle (see the module docstring); and tqdm's
    lock a thread lock: its default, a multiprocessing semaphore, would be reported leaked when the
    runner terminates this worker."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    tqdm.set_lock(threading.RLock())


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
        check_workers(workers)
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
            try:
                self._start_ray()
            except BaseException:
                self._bar.close()
                raise
        elif self.workers > 1:
            self._pool = self._new_pool()
        return self

    def _new_pool(self, workers: int | None = None) -> ProcessPoolExecutor:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["servesim.sim.simulate"])
        return ProcessPoolExecutor(max_workers=workers or self.workers, mp_context=ctx, initializer=_init_worker)

    def _stop_pool(self, kill: bool) -> None:
        """Shut the pool down; ``kill``: terminate running tasks instead of waiting for them."""
        if self._pool is None:
            return
        if kill:
            # no public way to stop a running task (terminate_workers() comes in Python 3.14)
            procs = list((getattr(self._pool, "_processes", None) or {}).values())
            # shutdown(wait=False) forgets its manager thread, so a later shutdown(wait=True) joins
            # nothing: kept here and joined below. Left running, it closes its wake-up pipe while
            # the interpreter's exit hook writes to it, and an "Exception ignored ... Bad file
            # descriptor" traceback follows the interrupted line on stderr.
            manager = getattr(self._pool, "_executor_manager_thread", None)
            self._pool.shutdown(wait=False, cancel_futures=True)
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.join()
            if manager is not None:
                manager.join(timeout=30)  # bounded: Ctrl-C must end the run even if it hangs
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._pool = None

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if self._bar is not None:
            self._bar.close()
        self._stop_pool(kill=exc_type is not None)
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
            try:
                ray.init(address=self.ray_address, include_dashboard=False, log_to_driver=False,
                         configure_logging=False)
            except ConnectionError as e:
                raise UserError(f"--ray {self.ray_address}: no Ray cluster to join ({str(e).split('. ')[0]}); start one "
                                f"with 'ray start --head', or give --ray without an address to start Ray here") from None
            self._ray_started = True
        self._remote = ray.remote(num_cpus=1, max_retries=RAY_RETRIES)(guarded)

    def map(self, fn: Callable[[Any], Any], tasks: Sequence[Any], desc: str | None = None,
            on_done: OnDone | None = None) -> list[Outcome]:
        """``fn`` over ``tasks``; outcomes in task order. The progress bar counts finished tasks.

        ``on_done(index, outcome)`` is called in this process as each task finishes, in the order
        they finish (a sweep records its points with it).
        """
        bar = self._bar
        if bar is None:
            raise RuntimeError("use TaskRunner as a context manager")
        bar.total += len(tasks)
        if desc:
            bar.set_description(desc, refresh=False)
        bar.refresh()
        out: list[Outcome | None] = [None] * len(tasks)

        def finished(i: int, o: Outcome) -> None:
            out[i] = o
            bar.update(1)
            if on_done is not None:
                on_done(i, o)

        if self.backend == "ray":
            self._map_ray(fn, tasks, finished)
        elif self._pool is None:
            for i, t in enumerate(tasks):
                finished(i, guarded(fn, t))
        else:
            self._map_pool(fn, tasks, finished)
        return [o for o in out if o is not None]

    def _map_pool(self, fn: Callable[[Any], Any], tasks: Sequence[Any], finished: OnDone) -> None:
        # A dead worker breaks its whole pool: every unfinished task fails with it, the innocent
        # ones too. So a failed task goes back into a fresh pool once; one that fails twice then
        # runs alone on a one-worker pool, where a death can only be its own: only then is it lost.
        attempts = [0] * len(tasks)
        shared = list(range(len(tasks)))
        while shared:
            failed = self._run_on_pool(fn, tasks, shared, finished)
            for i in failed:
                attempts[i] += 1
            shared = sorted(i for i in failed if attempts[i] < LOCAL_ATTEMPTS)
            for i in sorted(i for i in failed if attempts[i] >= LOCAL_ATTEMPTS):
                again = self._run_on_pool(fn, tasks, [i], finished, workers=1)
                if again:
                    finished(i, Outcome(error=f"its worker process died, also when run alone (killed or out "
                                              f"of memory): {again[i]}", lost=True))

    def _run_on_pool(self, fn: Callable[[Any], Any], tasks: Sequence[Any], indices: Sequence[int],
                     finished: OnDone, workers: int | None = None) -> dict[int, Any]:
        """Run ``indices`` on the pool (a fresh one of ``workers`` if given); those whose pool broke."""
        if workers is not None:
            self._stop_pool(kill=True)
        if self._pool is None:
            self._pool = self._new_pool(workers)
        futures: dict[Future, int] = {self._pool.submit(guarded, fn, tasks[i]): i for i in indices}
        failed: dict[int, Any] = {}
        pending = set(futures)
        while pending:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            for f in done:
                try:
                    finished(futures[f], f.result())
                except Exception as e:  # noqa: BLE001 - a worker died (killed, out of memory)
                    failed[futures[f]] = one_line_error(e)
        if failed or workers is not None:
            self._stop_pool(kill=True)  # broken, or the one-worker pool: the next round makes its own
        return failed

    def _map_ray(self, fn: Callable[[Any], Any], tasks: Sequence[Any], finished: OnDone) -> None:
        import ray

        refs = [self._remote.remote(fn, t) for t in tasks]
        index = {r: i for i, r in enumerate(refs)}
        pending = list(refs)
        try:
            while pending:
                # everything that is ready within half a second: cheap on long lists, live progress
                done, pending = ray.wait(pending, num_returns=len(pending), timeout=0.5)
                for r in done:
                    try:
                        o = ray.get(r)
                    except Exception as e:  # noqa: BLE001 - its worker died more often than Ray retries
                        o = Outcome(error=f"its Ray worker died {RAY_RETRIES + 1} times: {one_line_error(e)}",
                                    lost=True)
                    finished(index[r], o)
        except BaseException:
            for r in pending:  # interrupted: stop what is still running on the cluster
                ray.cancel(r, force=True)
            raise
