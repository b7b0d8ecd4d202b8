"""Does compute-sanitizer's racecheck follow a named barrier's arrive -> wait ordering? (H100/H200)

    compute-sanitizer --tool racecheck --racecheck-report hazard \
        python tools/racecheck_probe.py MODE

Two groups of 2 warps; in each of 4 rounds every thread reads a word that the other group then
overwrites. A reader arrives at the writer's barrier (4 + 1 - g, 128 threads) once it has read;
a writer waits at its own (4 + g) before it writes. By the PTX memory model the arrive orders
the read before the write, so every mode but 0 is race-free and prints the same values:
    0: no arrive or wait (a true WAR race: the control);
    1: arrive, then wait at once;
    2: the reading group waits long after the other group has written;
    3: as 2, and the reading group also meets at its own barrier (1 + g, 64 threads) between
       its arrive and its wait, as the portable kernel's quads do (sm80_decode.py, rope
       barriers).
H200, compute-sanitizer of CUDA 13 (2026-12-01): mode 0 reports 2048 hazards, modes 1 and 2
none, mode 3 512 (WAR: the arrive-ordered read and write). So racecheck loses an arrive's
ordering once the arriving thread passes another barrier before its own wait: its reports on
the portable kernel's rope-barrier pair are of that kind (docs/kernel-notes.md)."""

import sys

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32
from cutlass.cute.runtime import from_dlpack

from torch_mla.cute_kernels.sm80_decode import bar_arrive, bar_sync

MODE = int(sys.argv[1])


@cute.kernel
def probe(out: cute.Tensor):
    tid = cute.arch.thread_idx()[0]
    s = cutlass.utils.SmemAllocator().allocate_tensor(Float32, cute.make_layout(128))
    s[tid] = Float32(tid)
    cute.arch.sync_threads()
    g = tid // 64
    acc = Float32(0.0)
    for it in cutlass.range(4, unroll=1):
        acc += s[(tid + 64) % 128]  # a word the other group overwrites below
        if cutlass.const_expr(MODE == 1):
            bar_arrive(4 + 1 - g, 128)
            bar_sync(4 + g, 128)
        if cutlass.const_expr(MODE >= 2):
            if g == 1:
                bar_arrive(4, 128)
                spin = Float32(1.0)
                for _ in cutlass.range(200000, unroll=1):  # the other group writes meanwhile
                    spin = spin * Float32(1.0000001)
                acc += spin - spin
                if cutlass.const_expr(MODE == 3):
                    bar_sync(2, 64)
                bar_sync(5, 128)
            else:
                bar_arrive(5, 128)
                if cutlass.const_expr(MODE == 3):
                    bar_sync(1, 64)
                bar_sync(4, 128)
        s[tid] = Float32(it)
        bar_sync(0, 128)
    out[tid] = acc


@cute.jit
def launch(out: cute.Tensor):
    probe(out).launch(grid=(1, 1, 1), block=(128, 1, 1), smem=1024)


if __name__ == "__main__":
    o = torch.zeros(128, device="cuda")
    launch(from_dlpack(o))
    torch.cuda.synchronize()
    # every mode: thread t sums the other group's words: its initial value, then rounds 0..2
    want = torch.tensor([(t + 64) % 128 + 0 + 1 + 2 for t in range(128)], dtype=torch.float32)
    print(f"mode {MODE}: values {'as expected' if torch.equal(o.cpu(), want) else 'WRONG'}")
