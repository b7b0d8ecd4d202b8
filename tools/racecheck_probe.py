"""Does compute-sanitizer's racecheck follow a named barrier's arrive -> wait ordering? (H100/H200)

    compute-sanitizer --tool racecheck --racecheck-report hazard \
        python tools/racecheck_probe.py MODE [ldmatrix] [8warps]

Two groups of 2 warps (4 with ``8warps``); in each of 4 rounds every thread reads a word that
the other group then overwrites. A reader arrives at the writer's barrier (4 + 1 - g, all
threads) once it has read; a writer waits at its own (4 + g) before it writes. By the PTX
memory model the arrive orders the read before the write, so every mode but 0 is race-free and
prints the same values:
    0: no arrive or wait (a true WAR race: the control);
    1: arrive, then wait at once;
    2: group 1 spins between its arrive and its wait (group 0 writes meanwhile);
    3: group 0 spins there instead, so group 1 has arrived and passed its own wait long before
       group 0 writes;
    4: as 3, and group 1 also meets at a barrier of its own (2, its group's threads) between
       its arrive and its wait;
    5: as 4, twice: what the portable kernel's late quad may do between its arrive at the other
       quad's rope barrier and that quad's exchange store (sm80_decode.py, _stage);
    6: group 1 spins before its read, so group 0 has long been blocked in its wait when group
       1 reads and arrives (the portable kernel's late quad reads its rope columns while the
       early quad waits at its rope barrier).
With ``ldmatrix`` the reads are ldmatrix.x1 (lane l of a warp gets the same word as its plain
load would), the instruction the portable kernel reads its K tiles with.
H200 (docs/kernel-notes.md, session 7): mode 0 thousands of errors; modes 1-6 none, except
with ``ldmatrix 8warps`` in modes 4 and 5 (384 and 128 errors, the latter 0 in a second run):
racecheck then reports the arrive-ordered pair, a false positive, which is what it reports on
the portable kernel's rope barriers."""

import sys

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cute.runtime import from_dlpack
from cutlass.cutlass_dsl import T, dsl_user_op

from torch_mla.cute_kernels.sm80_decode import bar_arrive, bar_sync

MODE = int(sys.argv[1])
LDMATRIX = "ldmatrix" in sys.argv[2:]
N = 256 if "8warps" in sys.argv[2:] else 128  # threads; a group is half of them
H = N // 2


@dsl_user_op
def ldmatrix_x1(addr: Int32, *, loc=None, ip=None) -> Float32:
    """ldmatrix.x1: lanes 0-7 give the 8 row addresses (16 bytes each) of one 8x8 b16 tile;
    lane l gets word l % 4 of row l / 4, i.e. word l of the 128 bytes when rows are contiguous."""
    w = llvm.inline_asm(T.i32(), [Int32(addr).ir_value(loc=loc, ip=ip)],
                        "ldmatrix.sync.aligned.m8n8.x1.shared.b16 {$0}, [$1];", "=r,r",
                        has_side_effects=True, is_align_stack=False,
                        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)
    return Float32(llvm.bitcast(T.f32(), w, loc=loc, ip=ip))


@cute.jit
def spin_zero() -> Float32:
    """0, after ~200k dependent multiplies (some hundred microseconds)."""
    spin = Float32(1.0)
    for _ in cutlass.range(200000, unroll=1):
        spin = spin * Float32(1.0000001)
    return spin - spin


@cute.kernel
def probe(out: cute.Tensor):
    tid = cute.arch.thread_idx()[0]
    s = cutlass.utils.SmemAllocator().allocate_tensor(Float32, cute.make_layout(N))
    s[tid] = Float32(tid)
    cute.arch.sync_threads()
    g = tid // H
    acc = Float32(0.0)
    for it in cutlass.range(4, unroll=1):
        if cutlass.const_expr(MODE == 6):
            if g == 1:  # group 0 reaches its wait (below) first and blocks there
                acc += spin_zero()
        if cutlass.const_expr(LDMATRIX):  # word (tid + H) % N too (lane l: the warp's l)
            base = s.iterator.toint() + ((tid // 32 * 32 + H) % N) * 4
            acc += ldmatrix_x1(base + (tid % 8) * 16)
        else:
            acc += s[(tid + H) % N]  # a word the other group overwrites below
        if cutlass.const_expr(MODE >= 1):
            bar_arrive(4 + 1 - g, N)
            # The group that spins (modes 2..5): 1, the reader of group 0's words, in mode 2,
            # else 0, the writer of group 1's.
            if cutlass.const_expr(2 <= MODE <= 5):
                if g == (1 if MODE == 2 else 0):
                    acc += spin_zero()  # the other group goes on meanwhile
            if g == 1:
                for _ in cutlass.range_constexpr(max(min(MODE, 5) - 3, 0)):  # modes 4, 5: 1, 2 x
                    bar_sync(2, H)
            bar_sync(4 + g, N)
        s[tid] = Float32(it)
        bar_sync(0, N)
    out[tid] = acc


@cute.jit
def launch(out: cute.Tensor):
    probe(out).launch(grid=(1, 1, 1), block=(N, 1, 1), smem=4 * N + 512)


if __name__ == "__main__":
    o = torch.zeros(N, device="cuda")
    launch(from_dlpack(o))
    torch.cuda.synchronize()
    # every mode: thread t sums the other group's words: its initial value, then rounds 0..2
    want = torch.tensor([(t + H) % N + 0 + 1 + 2 for t in range(N)], dtype=torch.float32)
    ok = torch.equal(o.cpu(), want)
    print(f"mode {MODE}{' ldmatrix' if LDMATRIX else ''} {N} threads: values "
          f"{'as expected' if ok else 'WRONG'}")
