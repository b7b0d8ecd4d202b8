"""Failing loudly from device code: a message on stdout, then a trap that ends the grid.

A trap makes the launch fail with a sticky CUDA error ("unspecified launch failure"): the next
synchronising call raises and the CUDA context is unusable, as after a device-side assert. The
printf buffer is flushed at that synchronisation, so the message shows before the error. Kernels
call it only behind a runtime ``check`` flag and a rare condition, so the check costs a compare
and a predicated branch per value. Never in a kernel that issues wgmma: a printf is a function
call, and ptxas then serialises every wgmma of the kernel (the SM90 decode ran 2.5x slower with
one, docs/log.md, 2026-12-01 "input checks in the combine"); such kernels leave the checks to
the combine.
"""

from __future__ import annotations

import cutlass.cute as cute


def fail(fmt: str, *args) -> None:
    """printf(fmt, *args) (C format, e.g. %d), then trap. Called from device code (traced
    inline: no control flow here, the caller's ``if`` guards it)."""
    cute.printf(fmt, *args)
    cute.arch.inline_ptx("trap;")
