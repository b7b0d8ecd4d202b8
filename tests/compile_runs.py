"""The compile tests' Python processes, started ahead of the tests that read them.

Without a GPU most of the suite's time is the kernel builds of tests/test_kernel_compile.py: a
Python process a variant, each 5-40 s of one core, one after another. A test declares its
process with `@ahead(plan)`, plan mapping some of its parameters to a Run. When the session's
tests are collected (conftest.py), each selected test's Run starts in a pool of WORKERS threads
beside the tests that run meanwhile; the test calls `result(run)` with the same Run and gets
that process's result, waiting if it is still going (or starting it if nothing did). What runs
and what each test asserts stay as they were: only when a process runs moves.

A Run's environment is the session's at collection, not the one a test may have patched by the
time its process starts; each Run gets fresh empty directories for the variables in `fresh`.
"""

import concurrent.futures
import dataclasses
import inspect
import os
import shutil
import subprocess
import sys
import tempfile

# (TORCH_MLA_TEST_WORKERS=1: one process at a time, in the order the tests were collected)
WORKERS = int(os.environ.get("TORCH_MLA_TEST_WORKERS", "0")) or min(os.cpu_count() or 1, 4)
_BASE_ENV = dict(os.environ)
_pool = None
_runs: dict = {}
_dirs: list = []


@dataclasses.dataclass(frozen=True)
class Run:
    """`python *args`: env is (name, value) pairs over the session's environment (value None:
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
    for name in run.fresh:
        _dirs.append(tempfile.mkdtemp(prefix="torch_mla_test_"))
        env[name] = _dirs[-1]
    return subprocess.run([sys.executable, *run.args], env=env, cwd=run.cwd,
                          capture_output=True, text=True, timeout=run.timeout)


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
    """Drops the Runs not yet started, waits for the running ones, removes their directories."""
    if _pool is not None:
        _pool.shutdown(wait=True, cancel_futures=True)
    for d in _dirs:
        shutil.rmtree(d, ignore_errors=True)
