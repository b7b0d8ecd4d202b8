"""Inline-PTX helpers the kernels share: shared/global memory accesses the DSL has no op for,
e4m3 conversions, register pins, bulk copies, named barriers without .aligned, tcgen05 fences and
the L2 eviction-policy operand. Each is one instruction (or a fixed short sequence) traced inline
where it is called; names are public because every kernel module imports them from here.
"""

from __future__ import annotations

import struct

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass._mlir.dialects import llvm, nvvm
from cutlass.cutlass_dsl import T, dsl_user_op

# L2 cache-policy operand of the cache-page TMA loads (PTX createpolicy encoding of evict_first,
# CUTLASS's CacheHintSm90::EVICT_FIRST). Each page is read by the part's m-block CTAs within a few
# microseconds and never again, so its lines should be the first to go. Measured on the H200:
# 2.4-4.8 us faster on the small anchor rows (docs/kernel-notes.md, v7). The trace before it had
# pairs of blocks taking 5.3-8.6 us in a launch's first ~30 us against 4.0 later; the suspected
# cause, write-backs of dirty lines that earlier kernels left in L2 and the page loads evicted,
# is not confirmed.
L2_EVICT_FIRST = 0x12F0000000000000


@dsl_user_op
def int_as_f32(x: Int32, *, loc=None, ip=None) -> Float32:
    """The float32 whose bits are x."""
    return Float32(llvm.inline_asm(T.f32(), [Int32(x).ir_value(loc=loc, ip=ip)], "mov.b32 $0, $1;",
                                   "=f,r", has_side_effects=False, is_align_stack=False,
                                   asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dsl_user_op
def bf16x2_to_f16x2(word: Int32, mul: Float32, to: str = "f16", *, loc=None, ip=None) -> Int32:
    """Two bf16 values (one word, the first in the low half) times mul (a power of two: exact
    in float32), rounded to f16 (to="bf16": to bf16, exact), in the same order."""
    asm = ("{ .reg .b32 a, b; .reg .f32 lo, hi; shl.b32 a, $1, 16; and.b32 b, $1, 0xFFFF0000; "
           "mov.b32 lo, a; mov.b32 hi, b; mul.f32 lo, lo, $2; mul.f32 hi, hi, $2; "
           f"cvt.rn.{to}x2.f32 $0, hi, lo; }}")
    args = [Int32(word).ir_value(loc=loc, ip=ip), Float32(mul).ir_value(loc=loc, ip=ip)]
    return Int32(llvm.inline_asm(T.i32(), args, asm, "=r,r,f", has_side_effects=False,
                                 is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
                                 loc=loc, ip=ip))


@dsl_user_op
def pin_f32(x: Float32, *, loc=None, ip=None) -> Float32:
    """x through an empty asm with side effects: the compiler may not move its computation
    across this point (fence_operand)."""
    return Float32(llvm.inline_asm(T.f32(), [Float32(x).ir_value(loc=loc, ip=ip)], "", "=f,0",
                                   has_side_effects=True, is_align_stack=False,
                                   asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dsl_user_op
def pin_b32(x: Int32, *, loc=None, ip=None) -> Int32:
    """pin_f32 for a 32-bit integer register."""
    return Int32(llvm.inline_asm(T.i32(), [Int32(x).ir_value(loc=loc, ip=ip)], "", "=r,0",
                                 has_side_effects=True, is_align_stack=False,
                                 asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dsl_user_op
def bulk_s2g(dst_addr, src_addr, nbytes: int, *, loc=None, ip=None) -> None:
    """cp.async.bulk global <- shared::cta of nbytes (16-byte aligned), in a bulk group."""
    cute.arch.inline_ptx(
        "cp.async.bulk.global.shared::cta.bulk_group [{$r0}], [{$r1}], {$r2};",
        read_only_args=[cutlass.Int64(dst_addr), Int32(src_addr), Int32(nbytes)],
        loc=loc, ip=ip,
    )


def _cp_async(dst: Int32, src, src_size: Int32, nbytes: int, op: str, loc, ip) -> None:
    """cp.async.<op>.shared.global of nbytes from global address src to shared::cta address
    dst, of which the first src_size are read and the rest zero-filled."""
    args = [Int32(dst).ir_value(loc=loc, ip=ip), cutlass.Int64(src).ir_value(loc=loc, ip=ip),
            Int32(src_size).ir_value(loc=loc, ip=ip)]
    llvm.inline_asm(None, args, f"cp.async.{op}.shared.global [$0], [$1], {nbytes}, $2;",
                    "r,l,r", has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@dsl_user_op
def cp_async16(dst: Int32, src, src_size: Int32, *, loc=None, ip=None) -> None:
    """16 bytes from global address src to shared::cta address dst (cp.async.cg: through L2
    only), of which the first src_size (0 or 16) are read and the rest zero-filled: src_size 0
    reads nothing."""
    _cp_async(dst, src, src_size, 16, "cg", loc, ip)


@dsl_user_op
def cp_async8(dst: Int32, src, src_size: Int32, *, loc=None, ip=None) -> None:
    """cp_async16 for 8 bytes (cp.async.ca: 8 is not a .cg size), src_size 0 or 8."""
    _cp_async(dst, src, src_size, 8, "ca", loc, ip)


def _sreg64(name: str, loc, ip) -> cutlass.Int64:
    """The 64-bit special register %name, read in program order (side effects)."""
    return cutlass.Int64(llvm.inline_asm(T.i64(), [], f"mov.u64 $0, %{name};", "=l",
                                         has_side_effects=True, is_align_stack=False,
                                         asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dsl_user_op
def globaltimer(*, loc=None, ip=None) -> cutlass.Int64:
    """%globaltimer (ns): trace builds only (tools/trace_decode.py)."""
    return _sreg64("globaltimer", loc, ip)


@dsl_user_op
def clock64(*, loc=None, ip=None) -> cutlass.Int64:
    """%clock64 (the SM's cycles): trace builds only (tools/trace_sparse.py)."""
    return _sreg64("clock64", loc, ip)


def _load_words(n: int, addr, asm: str, addr_reg: str, loc, ip) -> list:
    """n 32-bit words from one load instruction `asm` (outputs $0..$n-1, address $n), with
    side effects: it stays in program order with the barriers around it."""
    res = llvm.inline_asm(
        llvm.StructType.get_literal([T.i32()] * n), [addr.ir_value(loc=loc, ip=ip)], asm,
        ",".join(["=r"] * n + [addr_reg]), has_side_effects=True, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)
    return [Int32(llvm.extractvalue(T.i32(), res, [i], loc=loc, ip=ip)) for i in range(n)]


@dsl_user_op
def lds128(addr: Int32, *, loc=None, ip=None):
    """Four 32-bit words from shared::cta address addr (16-byte aligned): one ld.shared.v4."""
    return _load_words(4, Int32(addr), "ld.shared.v4.b32 {$0, $1, $2, $3}, [$4];", "r", loc, ip)


def _e4m3_asm(to_bf16: bool, scaled: bool = False, hw: bool = True,
              early: bool = False, peer: bool = False) -> str:
    """PTX: 16 e4m3 values in $2..$5 (little-endian bytes) -> 16 f16 or bf16 values stored as
    two 16-byte chunks at shared addresses $0 (values 0-7) and $1 (values 8-15); scaled: each
    value times the float32 in $6 first (the product rounded to float32, then to the 16-bit
    type, as the reference dequantizes: fp32, then the cast).

    cvt.rn.f16x2.e4m3x2 is exact (every e4m3 value, subnormals included, is a normal f16).
    For bf16: f16 -> f32 (exact) -> bf16x2 (exact: 3 significant bits, exponents -9..8, so
    neither a denormal nor a rounding ever occurs). Of cvt's x2 forms the upper half of the
    result comes from the upper input (upper byte; first f32 operand), so value k of the
    chunk sits in bits 16 (k % 2) of word k // 2, as in memory.

    hw=False (before SM89, which has no e4m3 cvt): a pair's bytes are spread to the low bytes
    of the two halves (prmt) and moved into f16 fields: sign to bit 15, exponent and mantissa
    (7 bits) to bits 7-13. That f16 is the e4m3 value times 2^-8 exactly (the exponent biases
    are 7 and 15; an e4m3 subnormal lands as an f16 subnormal of the same digits), and the
    multiply by 256 (mul.rn.f16x2) is exact. NaN bytes (0x7f, 0xff) become +-480, not NaN:
    the kernels never read a byte that no entry names.

    early: values 0-7 are stored as soon as they are converted (fewer registers live at once:
    the sparse producer warpgroup's 56).

    peer: each chunk also goes to the same place in a peer CTA's shared memory (st.async; the
    next two operands: the peer's shared::cluster address minus the local one, and the peer's
    mbarrier, whose transaction count each 16-byte store completes)."""
    lines = ["{", ".reg .b16 a<8>, l<8>, u<8>;",
             ".reg .b32 h<8>, x<8>, s<8>" + (", pa<2>;" if peer else ";"),
             ".reg .f32 fl<8>, fu<8>, sc;"]
    delta, pbar = (7, 8) if scaled else (6, 7)

    def store(dst: int, regs: str) -> list:
        out = [f"st.shared.v4.b32 [${dst}], {{{regs}}};"]
        if peer:
            out += [f"add.u32 pa{dst}, ${dst}, ${delta};",
                    f"st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [pa{dst}], "
                    f"{{{regs}}}, [${pbar}];"]
        return out

    if not hw:
        lines += [".reg .b32 k256;", "mov.b32 k256, 0x5c005c00;"]  # 256.0 in both f16 halves
    if scaled:
        lines.append("mov.b32 sc, $6;")
    for w in range(4):
        lines.append(f"mov.b32 {{a{2 * w}, a{2 * w + 1}}}, ${2 + w};")
    for i in range(8):
        if hw:
            lines.append(f"cvt.rn.f16x2.e4m3x2 h{i}, a{i};")
        else:
            sel = "0x4140" if i % 2 == 0 else "0x4342"  # bytes 0, 1 (or 2, 3) -> bytes 0, 2
            lines += [f"prmt.b32 x{i}, ${2 + i // 2}, 0, {sel};",
                      f"and.b32 s{i}, x{i}, 0x00800080;", f"shl.b32 s{i}, s{i}, 8;",
                      f"and.b32 x{i}, x{i}, 0x007f007f;", f"shl.b32 x{i}, x{i}, 7;",
                      f"or.b32 h{i}, s{i}, x{i};", f"mul.rn.f16x2 h{i}, h{i}, k256;"]
        if to_bf16 or scaled:
            lines += [f"mov.b32 {{l{i}, u{i}}}, h{i};", f"cvt.f32.f16 fl{i}, l{i};",
                      f"cvt.f32.f16 fu{i}, u{i};"]
            if scaled:
                lines += [f"mul.rn.f32 fl{i}, fl{i}, sc;", f"mul.rn.f32 fu{i}, fu{i}, sc;"]
            pack = "bf16x2" if to_bf16 else "f16x2"
            lines.append(f"cvt.rn.{pack}.f32 h{i}, fu{i}, fl{i};")
        if early and i == 3:
            lines += store(0, "h0, h1, h2, h3")
    if not early:
        lines += store(0, "h0, h1, h2, h3")
    lines += store(1, "h4, h5, h6, h7") + ["}"]
    return "\n".join(lines)


@dsl_user_op
def e4m3_store16(dst0: Int32, dst1: Int32, words, to_bf16: bool, scale=None, hw: bool = True,
                 early: bool = False, peer=None, *, loc=None, ip=None) -> None:
    """16 e4m3 values (four words) -> f16/bf16 at shared addresses dst0 (values 0-7) and dst1
    (values 8-15), times scale (a float32 word, as Int32) if given; hw: the SM89 cvt, else
    integer ops; early: values 0-7 stored before 8-15 are converted; peer: (delta, mbarrier),
    the chunks also stored at dst + delta in a peer CTA by st.async, completing bytes on that
    shared::cluster mbarrier address."""
    regs = ([dst0, dst1, *words] + ([] if scale is None else [scale])
            + ([] if peer is None else list(peer)))
    args = [Int32(x).ir_value(loc=loc, ip=ip) for x in regs]
    llvm.inline_asm(None, args, _e4m3_asm(to_bf16, scale is not None, hw, early,
                                          peer is not None),
                    ",".join(["r"] * len(regs)), has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@dsl_user_op
def e4m3x4_f16(word: Int32, *, loc=None, ip=None):
    """Four e4m3 values (one word, little-endian bytes) -> two words of f16x2: bytes 0-1, then
    bytes 2-3 (cvt.rn.f16x2.e4m3x2: exact; the higher byte to the upper half, as in memory)."""
    res = llvm.inline_asm(
        llvm.StructType.get_literal([T.i32()] * 2), [Int32(word).ir_value(loc=loc, ip=ip)],
        "{ .reg .b16 l, h;\nmov.b32 {l, h}, $2;\ncvt.rn.f16x2.e4m3x2 $0, l;\n"
        "cvt.rn.f16x2.e4m3x2 $1, h; }",
        "=r,=r,r", has_side_effects=False, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)
    return [Int32(llvm.extractvalue(T.i32(), res, [i], loc=loc, ip=ip)) for i in range(2)]


def _asm2(asm: str, a, b, constraints: str, loc, ip) -> Int32:
    """The 32-bit result ($0) of inline PTX `asm` on two operands ($1, $2; DSL scalars), without
    side effects."""
    return Int32(llvm.inline_asm(
        T.i32(), [a.ir_value(loc=loc, ip=ip), b.ir_value(loc=loc, ip=ip)], asm, constraints,
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc, ip=ip))


@dsl_user_op
def prmt(a: Int32, b: Int32, selector: int, *, loc=None, ip=None) -> Int32:
    """prmt.b32: the four bytes of the result picked by selector's nibbles (lowest first) from
    a's bytes (0-3) and b's (4-7)."""
    return _asm2(f"prmt.b32 $0, $1, $2, {selector:#x};", Int32(a), Int32(b), "=r,r,r", loc, ip)


@dsl_user_op
def hmul2(a: Int32, b: Int32, *, loc=None, ip=None) -> Int32:
    """mul.rn.f16x2: two f16 products (each word two f16 values)."""
    return _asm2("mul.rn.f16x2 $0, $1, $2;", Int32(a), Int32(b), "=r,r,r", loc, ip)


@dsl_user_op
def f16x2(lo: Float32, hi: Float32, *, loc=None, ip=None) -> Int32:
    """Two float32 values rounded to f16, packed (lo in the low half): cvt.rn.f16x2.f32."""
    return pack16x2(lo, hi, False, loc=loc, ip=ip)


@dsl_user_op
def pack16x2(lo: Float32, hi: Float32, bf16: bool, *, loc=None, ip=None) -> Int32:
    """Two float32 values rounded to bf16 (bf16) or f16, packed (lo in the low half)."""
    op = "cvt.rn.bf16x2.f32" if bf16 else "cvt.rn.f16x2.f32"
    return _asm2(f"{op} $0, $1, $2;", Float32(hi), Float32(lo), "=r,f,f", loc, ip)


def _store_global(addr, args: list, asm: str, constraints: str, loc, ip) -> None:
    """An inline-asm st.global to 64-bit address addr ($0) of args ($1 ..)."""
    llvm.inline_asm(None, [cutlass.Int64(addr).ir_value(loc=loc, ip=ip)]
                    + [a.ir_value(loc=loc, ip=ip) for a in args], asm, constraints,
                    has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@dsl_user_op
def stg_b32x4(addr, words: list, *, loc=None, ip=None) -> None:
    """Four 32-bit words to global address addr (16-byte aligned): one st.global.v4.b32."""
    _store_global(addr, [Int32(w) for w in words], "st.global.v4.b32 [$0], {$1, $2, $3, $4};",
                  "l,r,r,r,r", loc, ip)


@dsl_user_op
def lds32(addr: Int32, *, loc=None, ip=None) -> Int32:
    """One 32-bit word of shared memory."""
    return _load_words(1, Int32(addr), "ld.shared.b32 $0, [$1];", "r", loc, ip)[0]


@dsl_user_op
def lds64(addr: Int32, *, loc=None, ip=None):
    """Two 32-bit words from shared::cta address addr (8-byte aligned): one ld.shared.v2."""
    return _load_words(2, Int32(addr), "ld.shared.v2.b32 {$0, $1}, [$2];", "r", loc, ip)


@dsl_user_op
def sts(addr: Int32, words, *, loc=None, ip=None) -> None:
    """One, two or four 32-bit words to shared::cta address addr (st.shared, .v2, .v4)."""
    n = len(words)
    vec = {1: "", 2: ".v2", 4: ".v4"}[n]
    regs = ", ".join(f"${i + 1}" for i in range(n))
    regs = regs if n == 1 else "{" + regs + "}"
    args = [Int32(x).ir_value(loc=loc, ip=ip) for x in (addr, *words)]
    llvm.inline_asm(None, args, f"st.shared{vec}.b32 [$0], {regs};", ",".join(["r"] * (n + 1)),
                    has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@dsl_user_op
def ldg128(addr, *, loc=None, ip=None):
    """Four 32-bit words from global address addr (16-byte aligned), read-only path."""
    return _load_words(4, cutlass.Int64(addr), "ld.global.nc.v4.b32 {$0, $1, $2, $3}, [$4];",
                       "l", loc, ip)


@dsl_user_op
def ldg_or_zero(n: int, addr, ok: Int32, l1: str = "no_allocate", l2: int = 0, *, loc=None,
                ip=None) -> list:
    """n (1, 2 or 4) 32-bit words from global address addr (4n-byte aligned) by the read-only
    path, or zeros without any read where ok is 0. l1: the L1 eviction priority (no_allocate:
    read once); l2: an L2 prefetch size in bytes (64, 128 or 256: the L2 also fetches the
    aligned block around addr), 0 for none."""
    out = ", ".join(f"${i}" for i in range(n))
    vec = ("" if n == 1 else f".v{n}") if not l2 else f".L2::{l2}B" + ("" if n == 1 else f".v{n}")
    res = llvm.inline_asm(
        llvm.StructType.get_literal([T.i32()] * n),
        [cutlass.Int64(addr).ir_value(loc=loc, ip=ip), Int32(ok).ir_value(loc=loc, ip=ip)],
        "{ .reg .pred p; setp.ne.b32 p, $" + str(n + 1) + ", 0; "
        + " ".join(f"mov.b32 ${i}, 0;" for i in range(n))
        + f" @p ld.global.nc.L1::{l1}{vec}.b32 " + (out if n == 1 else "{" + out + "}")
        + f", [${n}]; }}",
        ",".join(["=r"] * n + ["l", "r"]), has_side_effects=True, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)
    return [Int32(llvm.extractvalue(T.i32(), res, [i], loc=loc, ip=ip)) for i in range(n)]


@dsl_user_op
def mbarrier_wait_cluster(bar, parity, *, loc=None, ip=None) -> None:
    """Waits for the phase of parity `parity` of the shared::cta mbarrier at bar to complete,
    with acquire semantics at cluster scope (mbarrier.try_wait.parity.acquire.cluster, retried):
    the wait to pair with a peer CTA's release (its cluster-scoped arrival, or its st.async
    bytes' completion), where the DSL's mbarrier_wait acquires at CTA scope."""
    llvm.inline_asm(None, [Int32(bar).ir_value(loc=loc, ip=ip),
                           Int32(parity).ir_value(loc=loc, ip=ip)],
                    "{ .reg .pred p; WAIT: "
                    "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [$0], $1; "
                    "@!p bra WAIT; }", "r,r", has_side_effects=True,
                    is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@dsl_user_op
def mapa_shared(addr, rank, *, loc=None, ip=None) -> Int32:
    """The shared::cluster address of shared::cta address addr (32-bit) in the CTA of rank
    `rank` of this cluster (mapa)."""
    return _asm2("mapa.shared::cluster.u32 $0, $1, $2;", Int32(addr), Int32(rank), "=r,r,r",
                 loc, ip)


@dsl_user_op
def prefetch_l2(addr, ok: Int32, *, loc=None, ip=None) -> None:
    """Brings the line of global address addr into L2 (prefetch.global.L2), where ok is not 0."""
    llvm.inline_asm(None, [cutlass.Int64(addr).ir_value(loc=loc, ip=ip),
                           Int32(ok).ir_value(loc=loc, ip=ip)],
                    "{ .reg .pred p; setp.ne.b32 p, $1, 0; @p prefetch.global.L2 [$0]; }", "l,r",
                    has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@dsl_user_op
def cp_async_mbarrier_arrive(bar: Int32, *, loc=None, ip=None) -> None:
    """cp.async.mbarrier.arrive (not .noinc) on the shared::cta mbarrier at bar: the phase also
    waits for this thread's cp.async copies issued so far, without counting as one of its
    expected arrivals."""
    llvm.inline_asm(None, [Int32(bar).ir_value(loc=loc, ip=ip)],
                    "cp.async.mbarrier.arrive.shared::cta.b64 [$0];", "r",
                    has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@dsl_user_op
def e4m3x4(a: Float32, b: Float32, c: Float32, d: Float32, *, loc=None, ip=None) -> Int32:
    """Four fp32 values -> one word of four e4m3 bytes (a in the lowest), rounded to nearest
    and saturated at +-448 (cvt's upper half takes its first operand)."""
    return Int32(llvm.inline_asm(
        T.i32(), [Float32(x).ir_value(loc=loc, ip=ip) for x in (a, b, c, d)],
        "{ .reg .b16 lo, hi;\n"
        "cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;\n"
        "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3;\n"
        "mov.b32 $0, {lo, hi}; }",
        "=r,f,f,f,f", has_side_effects=False, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


# The dither of a non-negative fp32 value p before its e4m3 rounding (e4m3_dither): p + d x
# step, step = e4m3's step at p (2^(e - 3) for p's exponent e, e4m3's subnormal step 2^-9 below
# 2^-6: p's bits raised to DITHER_FLOOR_BITS first), d = (b' + 0.5) / 256 - 0.5 with b' = p's
# bits 8-15 with their top bit flipped: a float in [1, 2) with b' as its top mantissa bits, plus
# DITHER_OFFSET. The bits below the rounding point of e4m3 act as the random source
# (docs/kernels/keysm.md, "Fast mode's error"). The flip keeps a value e4m3 holds exactly (bits
# 8-15 all 0: d = +1/512) where it is: unflipped, d = -0.498 took an exact power of two, P's
# 2^8 at each row's largest key among them, below itself, where the step is half and it
# rounded down (256 -> 240). |d| < 1/2, so 0 stays 0 (rounded from 2^-18).
DITHER_FLOOR_BITS = 0x3C800000  # 2^-6
DITHER_STEP_BITS = 0x01800000  # 3 << 23: e4m3's 3 mantissa bits
DITHER_OFFSET = -1.498046875  # -(1.5 - 1/512), exact in fp32
# The instructions ($1: p, $0: the result); tests/test_fp8.py runs them on the CPU.
DITHER_ASM = ("{ .reg .b32 b, e, f; .reg .f32 d, st;\n"
              "mov.b32 b, $1;\n"
              f"max.s32 e, b, {DITHER_FLOOR_BITS};\n"
              "and.b32 e, e, 0x7F800000;\n"
              f"sub.s32 e, e, {DITHER_STEP_BITS};\n"
              "and.b32 f, b, 0xFF00;\n"
              "xor.b32 f, f, 0x8000;\n"
              "shl.b32 f, f, 7;\n"
              "or.b32 f, f, 0x3F800000;\n"
              "mov.b32 d, f;\n"
              "mov.b32 st, e;\n"
              f"add.f32 d, d, 0f{struct.pack('>f', DITHER_OFFSET).hex().upper()};\n"
              "fma.rn.f32 $0, d, st, $1; }")


@dsl_user_op
def e4m3_dither(p: Float32, *, loc=None, ip=None) -> Float32:
    """p (>= 0) plus its dither (see DITHER_OFFSET's comment): DITHER_ASM, seven integer and
    two float instructions (the movs are free). sm90_decode.e4m3_dither_model is its Python
    model."""
    x = Float32(p).ir_value(loc=loc, ip=ip)
    return Float32(llvm.inline_asm(T.f32(), [x], DITHER_ASM, "=f,f", has_side_effects=False,
                                   is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
                                   loc=loc, ip=ip))


E4M3_MAX = 448.0  # the largest finite e4m3 value
# A row's largest |value| is raised to this before its factors are taken (e4m3_row_factors).
E4M3_AMAX_FLOOR = 448.0 * 2.0**-126


def e4m3_row_factors(amax: Float32):
    """(inv, scale) that quantize a row whose largest magnitude is amax to e4m3 (x inv lands in
    +-448) and dequantize it (x scale = amax / 448). amax is first raised to 448 x 2^-126, so
    both factors are finite normal floats: an all-zero row quantizes to zeros with a finite
    scale (its scores 0, masked keys -inf; a 0 scale would make them -inf x 0 = NaN), a row
    below it keeps 448 / amax finite (its zeros stay 0, not 0 x inf). Traced inline."""
    a = cute.arch.fmax(amax, Float32(E4M3_AMAX_FLOOR))
    return Float32(E4M3_MAX) / a, a * Float32(1.0 / E4M3_MAX)


@dsl_user_op
def unpack16x2(w: Int32, bf16: bool, *, loc=None, ip=None):
    """A word of two bf16 (or fp16) values -> the two as fp32 (low half first)."""
    body = ("{ .reg .b32 t;\nshl.b32 $0, $2, 16;\nand.b32 $1, $2, 0xffff0000; }" if bf16 else
            "{ .reg .b16 l, h;\nmov.b32 {l, h}, $2;\ncvt.f32.f16 $0, l;\ncvt.f32.f16 $1, h; }")
    res = llvm.inline_asm(
        llvm.StructType.get_literal([T.f32()] * 2), [Int32(w).ir_value(loc=loc, ip=ip)], body,
        "=f,=f,r", has_side_effects=False, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)
    return [Float32(llvm.extractvalue(T.f32(), res, [i], loc=loc, ip=ip)) for i in range(2)]


@cute.jit
def fence_operand(t: cute.Tensor):
    """Pins a register fragment at this point of the program (CUTLASS's warpgroup_fence_operand):
    values are computed before it and read after it. Without it the compiler sinks, e.g., the
    bf16 conversion of P between the wgmma that read it, and ptxas then serializes every wgmma."""
    if const_expr(t.element_type == Float32):
        for i in cutlass.range_constexpr(cute.size(t)):
            t[i] = pin_f32(t[i])
    else:
        t32 = cute.recast_tensor(t, Int32)
        for i in cutlass.range_constexpr(cute.size(t32)):
            t32[i] = pin_b32(t32[i])


def bar_sync(barrier_id, number_of_threads):
    """barrier.cta.sync without .aligned: the warps that meet there may come from different
    instructions (the stage barrier's two sites, a quad waiting where the other arrives). An
    aligned bar.sync asks every thread of the CTA to execute that very instruction; synccheck
    reports the stage barrier's two sites as divergence when they are aligned."""
    nvvm.barrier_cta_sync(Int32(barrier_id).ir_value(),
                          thread_count=Int32(number_of_threads).ir_value(), aligned=False)


def bar_arrive(barrier_id, number_of_threads):
    """barrier.cta.arrive without .aligned (see bar_sync)."""
    cute.arch.barrier_arrive(barrier_id=barrier_id, number_of_threads=number_of_threads,
                             aligned=False)


@dsl_user_op
def tcgen05_before_sync(*, loc=None, ip=None) -> None:
    """Orders this thread's earlier tcgen05 operations before its next barrier arrive."""
    nvvm.tcgen05_fence(nvvm.Tcgen05FenceKind.BEFORE_THREAD_SYNC, loc=loc, ip=ip)


@dsl_user_op
def tcgen05_after_sync(*, loc=None, ip=None) -> None:
    """Orders this thread's later tcgen05 operations after the barrier wait it just passed."""
    nvvm.tcgen05_fence(nvvm.Tcgen05FenceKind.AFTER_THREAD_SYNC, loc=loc, ip=ip)
