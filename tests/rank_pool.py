"""Gloo ranks that live for the whole test session.

A fresh rank pays about 9 s to import torch, transformers, PEFT and bitsandbytes before it runs a line of a test;
the suite starts dozens of rank groups. So each worker here imports once, then serves tasks: `run(fn, ...)` sends
fn and its arguments to the workers kept for that world size, which join a new process group (a new port each
time), call fn(info, *args), save the result, leave the group and wait for the next task (the idea of torch's own
multi-process test harness, which keeps its workers between tests).

Workers whose task failed, hung or left its group unclean (a test that makes the ranks part ways on purpose) are
killed and replaced on the next task, so one bad test cannot leak a broken process group into the next.

Workers are forked from a server process that imported those libraries once (multiprocessing's forkserver, with
the environment the session started with): the first worker pays the imports, every later one (the other sets,
each replacement) starts at once. The server never computes or joins a group, so a fork of it is a process that
has just imported, as a spawned worker was.
"""

from __future__ import annotations

import atexit
import faulthandler
import gc
import os
import socket
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# torch's default seed in a new process: each task starts from the generator state a fresh process would have
FRESH_PROCESS_SEED = 67280421310721


@dataclass
class TaskReport:
    ok: bool
    error: str = ""  # the task's traceback when it failed
    reusable: bool = True  # False: the worker leaves (its process group may be half-broken)
    assertion: bool = False  # it failed an assertion (tests/mutation_check.py counts only those as a catch)
    died: bool = False  # a signal ended the worker before it reported (a segfault in native code)


class RanksFailed(AssertionError):
    """A task failed on some ranks; `rank_assertions`: which of those failed an assertion rather than crashed."""

    def __init__(self, message: str, rank_assertions: list[bool]) -> None:
        super().__init__(message)
        self.rank_assertions = rank_assertions


@dataclass
class Task:
    fn: Callable
    args: tuple
    rank: int
    world_size: int
    port: int
    out_dir: str
    fake: bool


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_retiring = False


def retire_this_worker() -> None:
    """Called from a task: this worker leaves after the task (its process group was left in a state that only
    a process exit cleans up, as a rank that ended a run with a user error leaves it)."""
    global _retiring
    _retiring = True


# the forkserver imports these before it forks any worker (tests.rank_pool itself: the workers' target)
PRELOAD = ["tests.rank_pool", "torch.distributed", "bitsandbytes", "peft", "transformers", "qlora_fsdp.api",
           "tests.helpers"]
_SESSION_ENV = dict(os.environ)  # at import (collection), before any test changes the environment


def _warm_imports() -> None:
    """What nearly every task imports: paid once per worker instead of once per task (and, preloaded by the
    forkserver, once for all workers)."""
    import bitsandbytes  # noqa: F401
    import peft  # noqa: F401
    import transformers  # noqa: F401

    import qlora_fsdp.api  # noqa: F401
    import tests.helpers  # noqa: F401


def package_globals() -> dict[tuple[str, str], int]:
    """The identity of every public module-level name of the package: a test that patches one (a constant, a
    function) and does not put it back changes this."""
    return {(name, key): id(value) for name, module in list(sys.modules.items())
            if name.startswith("qlora_fsdp") and module is not None
            for key, value in vars(module).items() if not key.startswith("_")}


def patched_names(before: dict[tuple[str, str], int]) -> list[str]:
    now = package_globals()
    return [f"{module}.{key}" for (module, key), ident in before.items() if now.get((module, key), ident) != ident]


def _serve(conn: Connection) -> None:
    """A worker's life: import, then run tasks until told to stop or until a task leaves it unusable."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    faulthandler.enable()  # a segfault prints every thread's Python stack to the session's stderr
    torch.set_num_threads(1)
    _warm_imports()
    # what the imports made lives as long as the worker: out of the collector's sight (a full collection walked half
    # a million objects, 0.27 s, at every task's end and at every automatic one)
    gc.freeze()
    baseline_env = dict(os.environ)
    conn.send("ready")
    while True:
        try:
            task = conn.recv()
        except EOFError:
            break
        if task is None:
            break
        report = _run_task(task, baseline_env)
        conn.send(report)
        if not report.reusable:
            break
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no C++ destructors against a finalizing interpreter (see _run_task's teardown)


def _fresh_process_state(task: Task, baseline_env: dict[str, str]) -> None:
    """What a task may have changed for the next one: environment, seed, default dtype, thread count."""
    os.environ.clear()
    os.environ.update(baseline_env)
    os.environ.update(RANK=str(task.rank), LOCAL_RANK=str(task.rank), WORLD_SIZE=str(task.world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(task.port))
    torch.manual_seed(FRESH_PROCESS_SEED)
    torch.set_default_dtype(torch.float32)
    torch.set_num_threads(1)


def _run_task(task: Task, baseline_env: dict[str, str]) -> TaskReport:
    from qlora_fsdp.distributed import cleanup, init_distributed, init_fake_distributed

    global _retiring
    _retiring = False
    _fresh_process_state(task, baseline_env)
    package = package_globals()
    try:
        info = (init_fake_distributed(task.world_size, torch.device("cpu")) if task.fake else init_distributed())
        result = task.fn(info, *task.args)
        torch.save(result, Path(task.out_dir) / f"rank{task.rank}.pt")
        del result
    except BaseException as error:
        from tests.mutation_outcomes import failed_an_assertion

        return TaskReport(ok=False, error=traceback.format_exc(), reusable=False,
                          assertion=failed_an_assertion(error))
    if _retiring:
        return TaskReport(ok=True, reusable=False)
    left_patched = patched_names(package)
    if left_patched:  # the next task must see the package as imported: this set of workers is replaced
        print(f"rank pool: {task.fn.__name__} left {', '.join(left_patched)} patched; replacing its workers",
              file=sys.stderr, flush=True)
        return TaskReport(ok=True, reusable=False)
    clean = task.fake or _barrier_before_teardown()
    try:
        cleanup()
    except BaseException:
        clean = False
    _forget_compiled_code()
    gc.collect()
    return TaskReport(ok=True, reusable=clean)


def _barrier_before_teardown() -> bool:
    """No rank leaves the group while another still uses it. Some tests make the ranks part ways on purpose (a
    timeout test leaves one rank behind); their results are written, but such a worker is not reused."""
    try:
        if dist.is_initialized():
            dist.barrier()
        return True
    except RuntimeError:
        return False


def _forget_compiled_code() -> None:
    if "torch._dynamo" in sys.modules:
        torch._dynamo.reset()


class RankPool:
    """Sets of workers, one set per world size (and one for fake worlds), started on first need and kept for the
    session; `run` is `run_ranks` without the spawns.

    The workers of a set always run the same tasks together, so every rank of a group has the same history: a
    gloo group whose ranks had taken part in different numbers of earlier groups hung in its first all-reduce
    (two workers of a 2-rank task joined by two fresh ones for a 4-rank one). A set one of whose workers must
    leave is replaced whole, for the same reason."""

    def __init__(self) -> None:
        self._sets: dict[tuple[int, bool], list[tuple[mp.Process, Connection]]] = {}

    def run(self, fn: Callable, world_size: int, args: tuple, out_dir: Path, fake: bool,
            timeout: float) -> list[Any]:
        key = (world_size, fake)
        reports = self._attempt(fn, key, args, out_dir, timeout)
        if any(report.died for report in reports):
            # A worker killed by a signal (seen once in CI: SIGSEGV on one rank after its backward, never on this
            # machine) says nothing about the code under test unless it happens again: rerun the
            # task once on fresh workers, and say so. A deterministic crash fails the second time too.
            first = "; ".join(report.error for report in reports if report.died)
            warnings.warn(f"{fn.__name__}: {first}; rerun once on fresh workers", RuntimeWarning, stacklevel=2)
            reports = self._attempt(fn, key, args, out_dir, timeout)
        failed = [f"rank {rank}: {report.error or 'no report'}" for rank, report in enumerate(reports)
                  if not report.ok]
        if failed:
            raise RanksFailed(f"{fn.__name__} failed on {len(failed)} of {len(reports)} ranks:\n" + "\n".join(failed),
                              [report.assertion for report in reports if not report.ok])
        return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(len(reports))]

    def _attempt(self, fn: Callable, key: tuple[int, bool], args: tuple, out_dir: Path,
                 timeout: float) -> list[TaskReport]:
        workers = self._ready_set(key, 1 if key[1] else key[0])
        port = free_port()
        for rank, (_, conn) in enumerate(workers):
            conn.send(Task(fn, args, rank, key[0], port, str(out_dir), key[1]))
        reports = self._collect(workers, timeout)
        if not all(report.reusable for report in reports):
            self._discard(key)
        return reports

    def _ready_set(self, key: tuple[int, bool], n: int) -> list[tuple[mp.Process, Connection]]:
        if key not in self._sets:
            workers = [_start_worker() for _ in range(n)]  # started together: they import side by side
            self._sets[key] = workers
            for _, conn in workers:
                if not conn.poll(600) or conn.recv() != "ready":
                    self._discard(key)
                    raise RuntimeError(f"a pool worker for world size {key[0]} did not start")  # not a test's failure
        return self._sets[key]

    def _collect(self, workers: list[tuple[mp.Process, Connection]], timeout: float) -> list[TaskReport]:
        deadline = time.monotonic() + timeout
        reports = []
        for process, conn in workers:
            try:
                ready = conn.poll(max(0.0, deadline - time.monotonic()))
                reports.append(conn.recv() if ready else
                               TaskReport(ok=False, error=f"no result after {timeout:.0f} s", reusable=False))
            except (EOFError, OSError):
                process.join(10)  # reaped, so its exit code (the signal that killed it) is known
                reports.append(TaskReport(ok=False, error=f"worker died (exit code {process.exitcode})",
                                          reusable=False, died=(process.exitcode or 0) < 0))
        return reports

    def _discard(self, key: tuple[int, bool]) -> None:
        for process, conn in self._sets.pop(key, []):
            process.kill()
            process.join(10)
            conn.close()

    def close(self) -> None:
        for key, workers in list(self._sets.items()):
            for _, conn in workers:
                try:
                    conn.send(None)
                except OSError:
                    pass
            for process, _ in workers:
                process.join(10)
            self._discard(key)
        _stop_forkserver()


def _forkserver() -> Any:
    """The context workers are made in; its server starts on first use with the session's first environment (a
    test that set a variable in this process and then needed a new worker would hand it to every later one)."""
    from multiprocessing import forkserver

    context = mp.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    now = dict(os.environ)
    os.environ.clear()
    os.environ.update(_SESSION_ENV)
    try:
        forkserver.ensure_running()
    finally:
        os.environ.clear()
        os.environ.update(now)
    return context


def _stop_forkserver() -> None:
    """End the server and wait for it: it reaped every worker, so the session's CPU time (`/usr/bin/time make
    test`) counts theirs only once this process has reaped it."""
    from multiprocessing import forkserver

    forkserver._forkserver._stop()


def _start_worker() -> tuple[mp.Process, Connection]:
    context = _forkserver()
    parent_end, child_end = context.Pipe()
    # not a daemon: a task may start processes of its own (data loader workers)
    process = context.Process(target=_serve, args=(child_end,))
    process.start()
    child_end.close()
    return process, parent_end


_POOL: RankPool | None = None


def session_pool() -> RankPool:
    global _POOL
    if _POOL is None:
        _POOL = RankPool()
        atexit.register(_POOL.close)
    return _POOL
