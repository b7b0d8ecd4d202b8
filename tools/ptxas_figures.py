"""ptxas's figures for every kernel of one build, on the CPU (development tool).

    python -m tools.ptxas_figures CONFIG [FIELD=VALUE ...] [--arch sm_90a]

CONFIG: a variant class of torch_mla/ops/registry.py (SparseStepConfig, DecodeStepConfig,
CombineKernelConfig, ...), FIELD=VALUE its fields (integers and true/false parsed). E.g.

    python -m tools.ptxas_figures SparseStepConfig backend=sm90_split dtype=bf16 \
        cache=fp8_ds_mla columns=128
    python -m tools.ptxas_figures CombineKernelConfig dtype=bf16 warps_per_row=16

The DSL assembles its PTX with its own ptxas, also without a GPU, and prints that ptxas's
figures among its remarks under CUTE_DSL_COMPILER_OPT="remarks{ptx}": this tool compiles the
variant in a child process with that option (and a fresh kernel cache directory, so that
nothing is loaded instead of compiled) and prints a line per kernel: its class, registers a
thread, spill stores and loads and stack frame in bytes. Developer knobs (TORCH_MLA_DEV_*) in
the environment apply as they do to any build. Registers and spills of a knob's build need no
GPU machine (docs/kernel-notes.md, session 35).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

_CHILD = "TORCH_MLA_PTXAS_FIGURES_CHILD"


def parse_value(text: str):
    """A field's value from the command line: int, bool (true / false), else the string."""
    if re.fullmatch(r"-?\d+", text):
        return int(text)
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    return text


def figures(remarks: str) -> list[dict]:
    """Each "Compiling entry function" block of the DSL's ptxas remarks: the kernel's name,
    registers, spill stores and loads and stack frame (bytes), in the order ptxas printed
    them."""
    out = []
    for block in remarks.split("Compiling entry function")[1:]:
        name = re.search(r"'([^']+)'", block)
        regs = re.search(r"Used (\d+) registers", block)
        spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", block)
        stack = re.search(r"(\d+) bytes stack frame", block)
        if not (name and regs and spill):
            continue
        out.append({"kernel": short_name(name.group(1)), "registers": int(regs.group(1)),
                    "spill_stores": int(spill.group(1)), "spill_loads": int(spill.group(2)),
                    "stack": int(stack.group(1)) if stack else 0})
    return out


def kernel_figures(output: str, cls: str) -> dict:
    """Registers, spill stores and whether ptxas serialised its wgmma, of the kernel whose
    class name holds `cls`, from ptxas's -v output or the DSL's remarks holding it (a build's
    output under CUTE_DSL_COMPILER_OPT="remarks{ptx}"); {} where the output has none (the DSL
    prints ptxas's output with a remark: a kernel with a stack frame makes one)."""
    text = re.sub(r"\s*\n\s*", " ", output)  # (the remarks wrap long lines)
    rows = [r for r in figures(text) if cls in r["kernel"].rsplit(".", 1)[-1]]
    if not rows:
        return {}
    # (C7512 a small register budget, C7518 a wgmma in flight across a divergent branch, ...:
    # any of them serialises the entry's wgmma; a warning naming another kernel's entry does
    # not count, where the compile tests' earlier parser counted any)
    serialised = re.search(r"wgmma\.mma_async instructions are serialized [^']*'[^']*"
                           + re.escape(cls), text)
    return {"registers": rows[0]["registers"], "spill": rows[0]["spill_stores"],
            "serialised": serialised is not None}


def short_name(entry: str) -> str:
    """The kernel's module and class from the DSL's mangled entry name (the name itself where
    it does not have that shape)."""
    m = re.search(r"torch_mlacute_kernels(\w+?)(MLA\w+?)_object", entry)
    return f"{m.group(1)}.{m.group(2)}" if m else entry[:80]


def build_variant(argv: list[str]) -> None:
    """Compiles the variant argv names (CONFIG FIELD=VALUE ... [--arch A]; registry.build: no
    kernel cache). tools/sass_loads.py's child process builds with it too."""
    from torch_mla.ops import registry

    arch = "sm_90a"
    if "--arch" in argv:
        i = argv.index("--arch")
        arch = argv[i + 1]
        argv = argv[:i] + argv[i + 2:]
    cls = getattr(registry, argv[0])
    fields = dict(kv.split("=", 1) for kv in argv[1:])
    registry.build(cls(**{k: parse_value(v) for k, v in fields.items()}), arch)


def main(argv: list[str]) -> None:
    if not argv or argv[0].startswith("-"):
        raise SystemExit(__doc__)
    if os.environ.get(_CHILD):
        build_variant(argv)
        return
    arch = argv[argv.index("--arch") + 1] if "--arch" in argv else "sm_90a"
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, CUTE_DSL_COMPILER_OPT="remarks{ptx}", TORCH_MLA_CACHE_DIR=cache,
                   **{_CHILD: "1"})
        env.setdefault("CUTE_DSL_ARCH", arch)
        res = subprocess.run([sys.executable, "-m", "tools.ptxas_figures", *argv], env=env,
                             capture_output=True, text=True, timeout=900)
    if res.returncode != 0:
        raise SystemExit(f"the build failed:\n{res.stderr[-4000:]}")
    rows = figures(res.stdout + res.stderr)
    if not rows:
        raise SystemExit("no ptxas figures in the build's output (is this DSL's ptxas remark "
                         "format another?)")
    seen = set()
    for r in rows:  # (the DSL may print a kernel's remarks more than once)
        key = tuple(r.values())
        if key in seen:
            continue
        seen.add(key)
        print(f"{r['kernel']}: {r['registers']} registers, {r['spill_stores']} / "
              f"{r['spill_loads']} bytes spill stores / loads, {r['stack']} bytes stack frame")


if __name__ == "__main__":
    main(sys.argv[1:])
