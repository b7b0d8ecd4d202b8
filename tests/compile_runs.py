"""The compile tests' Python processes, started ahead of the tests that read them.

Without a GPU most of the suite's time is the kernel builds of tests/test_kernel_compile.py: a
Python process a variant, each 5-40 s of one core, one after another. A test declares its
process with `@ahead(plan)`, plan mapping some of its parameters to a Run. When the session's
tests are collected (conftest.py), each selected test's Run starts in a pool of WORKERS threads
beside the tests that run meanwhile; the test calls `result(run)` with the same Run and gets
that process's result, waiting if it is still going (or starting it if nothing did). What runs
and what each test asserts stay as they were: only when a process runs moves. Tests marked
skip are left out (a skipif condition is not evaluated: its Run would still start).

A Run's environment is the one this module saw when conftest.py imported it, not one a test
may have patched by the time its process starts; each Run gets fresh empty directories for the
variables in `fresh`, removed at the session's end unless the process failed on its own (a
failing build's PTX stays for a look; the kept directories are printed). At the session's end
(pytest's -x, an interrupt) the processes still running are killed with their children (each
runs in its own process group) and those not started are dropped.
"""

import concurrent.futures
import dataclasses
import inspect
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading

# (TORCH_MLA_TEST_WORKERS=1: one process at a time, in the order the tests were collected)
WORKERS = int(os.environ.get("TORCH_MLA_TEST_WORKERS", "0")) or min(os.cpu_count() or 1, 4)
_BASE_ENV = dict(os.environ)
_pool = None
_runs: dict = {}
_lock = threading.Lock()
_live: set = set()  # the processes running now
_dirs: list = []  # (directory, whether its process succeeded)
_stopping = False


@dataclasses.dataclass(frozen=True)
class Run:
    """`python *args`: env is (name, value) pairs over the base environment (value None:
    unset); each name in fresh is set to a new empty directory."""

    args: tuple
    env: tuple = ()
    fresh: tuple = ("CUTE_DSL_DUMP_DIR",)
    timeout: int = 600
    cwd: str | None = None


def python(*args, env: dict | None = None, fresh=("CUTE_DSL_DUMP_DIR",), timeout=600,
           cwd=None) -> Run:
    """A Run of `python *args` (strings), env as a dict."""
    return Run(tuple(str(a) for a in args), tuple(sorted((env or {}).items())), tuple(fresh),
               timeout, cwd)


def _execute(run: Run) -> subprocess.CompletedProcess:
    env = dict(_BASE_ENV)
    for name, value in run.env:
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    argv = [sys.executable, *run.args]
    with _lock:
        if _stopping:
            raise RuntimeError("the session ended before this process started")
        made = [tempfile.mkdtemp(prefix="torch_mla_test_") for _ in run.fresh]
        env.update(zip(run.fresh, made))
        try:
            proc = subprocess.Popen(argv, env=env, cwd=run.cwd, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, start_new_session=True)
        except OSError:
            for d in made:
                os.rmdir(d)
            raise
        _live.add(proc)
    ok = False
    try:
        try:
            out, err = proc.communicate(timeout=run.timeout)
        except subprocess.TimeoutExpired:
            _kill(proc)
            out, err = proc.communicate()
            raise subprocess.TimeoutExpired(argv, run.timeout, out, err) from None
        ok = proc.returncode == 0
        return subprocess.CompletedProcess(argv, proc.returncode, out, err)
    finally:
        with _lock:
            _live.discard(proc)
            _dirs.extend((d, ok or _stopping) for d in made)  # (killed at the end: removed)


def _kill(proc) -> None:
    """proc and its children (its process group: ptxas, cc)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _submit(run: Run) -> concurrent.futures.Future:
    global _pool
    if _pool is None:
        _pool = concurrent.futures.ThreadPoolExecutor(WORKERS, "compile-run")
    if run not in _runs:
        _runs[run] = _pool.submit(_execute, run)
    return _runs[run]


def result(run: Run) -> subprocess.CompletedProcess:
    """The finished process of run (its exceptions, e.g. a timeout, raised here)."""
    return _submit(run).result()


def ahead(plan):
    """Marks a test whose process is plan(**the test's parameters that plan names), a Run."""
    def mark(test):
        test.compile_plan = plan
        return test
    return mark


def start(items) -> None:
    """Starts the Runs of the collected tests that have one, in collection order."""
    for item in items:
        plan = getattr(getattr(item, "function", None), "compile_plan", None)
        if plan is None or item.get_closest_marker("skip") is not None:
            continue
        params = getattr(getattr(item, "callspec", None), "params", {})
        names = inspect.signature(plan).parameters
        _submit(plan(**{k: v for k, v in params.items() if k in names}))


def stop() -> None:
    """Drops the Runs not yet started, kills the running ones, removes the directories of the
    processes that succeeded."""
    global _stopping
    with _lock:
        _stopping = True
        for proc in _live:
            _kill(proc)
    if _pool is not None:
        _pool.shutdown(wait=True, cancel_futures=True)
    for d, ok in _dirs:
        if ok:
            shutil.rmtree(d, ignore_errors=True)
        else:
            sys.stderr.write(f"compile_runs: kept {d} (its process failed)\n")
