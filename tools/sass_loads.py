"""Where ptxas put a kernel's global loads against its mbarrier waits, on the CPU (dev tool).

    python -m tools.sass_loads CONFIG [FIELD=VALUE ...] [--arch sm_90a] [--kernel NAME]
                               [--after E4M3] [--before 160] [--dump FILE]

CONFIG, FIELD=VALUE: a registry variant, as tools/ptxas_figures.py takes them (e.g.
``SparseStepConfig backend=sm90_split dtype=bf16 cache=fp8_ds_mla columns=128``); developer
knobs (TORCH_MLA_DEV_*) in the environment apply. The variant is compiled in a child process
with a fresh kernel cache and ``CUTE_DSL_KEEP=cubin``; nvdisasm disassembles the cubin and this
prints, for the kernel whose entry name contains NAME (default: the first whose name holds
"Split", else the first), the region from `before` instructions ahead of the first instruction
whose opcode contains `after` (default E4M3: the fp8 conversion) to the last such: every global
load (LDG, LDGSTS), every mbarrier wait and arrival (SYNCS), every MEMBAR and fence, and the
first later instruction to read any register an LDG writes ("first use"), where the warp stalls
for that load's data. Instruction indices count from the kernel's first instruction.

Why: PTX orders a load and a later mbarrier.try_wait only one way (an acquire keeps later loads
after it, not earlier ones), and ld.global.nc loads are free to move, so ptxas may issue a load
that the source placed before a wait after it; the PTX does not show that, the SASS does
(docs/kernels/sparse.md, session 37).

nvdisasm is not a dependency: set NVDISASM to its path, or put it on PATH (it comes with a CUDA
toolkit, and as NVIDIA's ``nvidia-cuda-nvdisasm`` wheel: ``pip download --no-deps
nvidia-cuda-nvdisasm``, then unzip it outside the repository; bin/nvdisasm inside).
--dump FILE writes the kernel's whole SASS there.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile

from tools.ptxas_figures import build_variant

_CHILD = "TORCH_MLA_SASS_LOADS_CHILD"
_LINE = re.compile(r"\s+/\*([0-9a-f]+)\*/\s+(.*?)\s*;")
_KEEP = ("LDG", "SYNCS", "MEMBAR", "FENCE", "CCTL", "BAR.", "ERRBAR")


def instructions(sass: str) -> list[tuple[int, str, str]]:
    """(offset, opcode, instruction without its predicate) of each SASS line of nvdisasm's
    output."""
    out = []
    for line in sass.splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        ins = re.sub(r"^@!?U?P[T0-9]+\s+", "", m.group(2).strip())
        out.append((int(m.group(1), 16), ins.split()[0], ins))
    return out


def kernels(sass: str) -> dict[str, str]:
    """nvdisasm's output split by function: {entry name: its text}."""
    parts = re.split(r"\n\s*\.section\s+\.text\.(\S+?),", sass)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def _registers(operand: str) -> list[str]:
    return re.findall(r"\bR\d+\b", operand)


# Opcodes with no register destination: every register they name is read.
_NO_DEST = ("ST", "SYNCS.ARRIVE", "RED", "BRA", "BAR", "MEMBAR", "FENCE", "CCTL", "LDGSTS",
            "ARRIVES", "EXIT", "RET", "WARPSYNC", "NOP", "ERRBAR", "BSYNC", "BSSY")


def _operands(op: str, args: list[str]) -> tuple[list[str], list[str]]:
    """(registers written, registers read) of one instruction: the leading predicate operands
    and the register after them are its destinations (none for _NO_DEST's opcodes); a bracketed
    address and every later operand are read. A destination's width (LDG.64 / .128, .WIDE)
    is not counted here."""
    if op.startswith(_NO_DEST):
        return [], [r for a in args for r in _registers(a)]
    i = 0
    while i < len(args) and re.fullmatch(r"!?U?P[T0-9]+", args[i]):
        i += 1
    dest = []
    if i < len(args) and not args[i].startswith("[") and _registers(args[i]):
        dest = _registers(args[i])[:1]
        i += 1
    return dest, [r for a in args[i:] for r in _registers(a)]


def load_order(ins: list[tuple[int, str, str]], after: str = "E4M3",
               before: int = 160) -> list[str]:
    """The lines the module docstring describes (load, wait, fence, first use), for ins."""
    hits = [i for i, (_, op, _) in enumerate(ins) if after in op]
    if not hits:
        return []
    pending: dict[str, int] = {}  # register -> the LDG that writes it, not yet read
    out = []
    for i in range(max(hits[0] - before, 0), hits[-1] + 1):
        _, op, text = ins[i]
        head, _, operands = text.partition(" ")
        dest, read = _operands(op, [a.strip() for a in operands.split(",")])
        loads = sorted({pending[r] for r in read if r in pending})
        if loads:  # (the first read of any register of each of these loads)
            out.append(f"{i:6d}    first use of the load{'s' * (len(loads) > 1)} at "
                       f"{', '.join(map(str, loads))}: {head}")
            pending = {r: k for r, k in pending.items() if k not in loads}
        for r in dest:  # (a register written again before any read: its load is not waited on)
            pending.pop(r, None)
        if op.startswith("LDG") and not op.startswith("LDGSTS") and dest and dest[0] != "RZ":
            n = 4 if ".128" in op else 2 if ".64" in op else 1
            first = int(dest[0][1:])
            for k in range(n):
                pending[f"R{first + k}"] = i
        if op.startswith(("LDG",) + _KEEP):
            out.append(f"{i:6d}  {text}")
    return out


def _option(argv: list[str], name: str, default):
    if name not in argv:
        return argv, default
    i = argv.index(name)
    return argv[:i] + argv[i + 2:], argv[i + 1]


def main(argv: list[str]) -> None:
    if os.environ.get(_CHILD):
        build_variant(argv)
        return
    argv, arch = _option(argv, "--arch", "sm_90a")
    argv, name = _option(argv, "--kernel", None)
    argv, after = _option(argv, "--after", "E4M3")
    argv, before = _option(argv, "--before", "160")
    argv, dump = _option(argv, "--dump", None)
    if not argv or argv[0].startswith("-"):
        raise SystemExit(__doc__)
    nvdisasm = os.environ.get("NVDISASM") or shutil.which("nvdisasm")
    if not nvdisasm:
        raise SystemExit("no nvdisasm: set NVDISASM or put it on PATH (see this module's "
                         "docstring)")
    with tempfile.TemporaryDirectory() as tmp:
        cache, keep = os.path.join(tmp, "cache"), os.path.join(tmp, "keep")
        os.makedirs(keep)
        env = dict(os.environ, TORCH_MLA_CACHE_DIR=cache, CUTE_DSL_KEEP="cubin",
                   CUTE_DSL_DUMP_DIR=keep, CUTE_DSL_ARCH=arch, **{_CHILD: "1"})
        res = subprocess.run([sys.executable, "-m", "tools.sass_loads", *argv, "--arch", arch],
                             env=env, capture_output=True, text=True, timeout=900)
        if res.returncode != 0:
            raise SystemExit(f"the build failed:\n{res.stderr[-4000:]}")
        cubins = [os.path.join(keep, f) for f in os.listdir(keep) if f.endswith(".cubin")]
        if not cubins:
            raise SystemExit("the build kept no cubin (CUTE_DSL_KEEP=cubin)")
        sass = "".join(subprocess.run([nvdisasm, "-c", c], capture_output=True, text=True,
                                      check=True).stdout for c in cubins)
    found = kernels(sass)
    pick = [k for k in found if name in k] if name else (
        [k for k in found if "Split" in k] or list(found))
    if not pick:
        raise SystemExit(f"no kernel named like {name!r}; kernels: {list(found)}")
    text = found[pick[0]]
    if dump:
        with open(dump, "w") as f:
            f.write(text)
    print(f"# {pick[0][:120]}")
    lines = load_order(instructions(text), after, int(before))
    print("\n".join(lines) if lines else f"(no instruction with {after!r} in its opcode)")


if __name__ == "__main__":
    main(sys.argv[1:])
