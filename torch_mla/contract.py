"""The kernels' argument contract, defined once: what each compiled kernel's ``__call__`` takes,
in order, and how those arguments look to the compiler (CuTe DSL fake tensors with symbolic
sizes) and to torch (the shapes the ops' fake implementations return).

The decode arguments (every decode kernel and the decode step take them in this order)::

    q           (b, rows, 576)          q's dtype (the bytes, uint8, of an e4m3 q in fast mode)
    kv          (n_blocks, 64, 576)     one KV head of the paged cache (an e4m3 cache as bytes)
    block_table (b, max_blocks) int32
    seqlens     (b,) int32
    metadata    (parts, 8) int32        the schedule (columns: torch_mla.constants.META_*)
    num_splits  (b + 1,) int32          the schedule's prefix sums of pieces per request
    out         (b, rows, 512)          q's dtype (bf16 for an e4m3 q)
    lse         (b, h_q, s_q) float32
    oacc        (slots, rows, 512) f32  the split partials, slots = b + parts
    lseacc      (slots, rows) float32
    scale_log2  float32                 softmax_scale * log2(e)

rows = s_q * h_q (the query rows of one KV head). The decode step adds ``combine_variant``
(int32) and the stream; over a float8_e4m3fn cache also ``kv_scale``, ``q_scale`` (float32
(1,)) and ``q_scaled`` (int32: 1 when q_scale applies). A decode kernel alone takes the stream
after scale_log2. The combine, the schedule kernel and append_kv take their own lists below,
built from the same definitions.

Pure Python at import (no torch, no DSL): the fake impls and the registry read it in any process;
the builders import the DSL when called (by a compile, in kernels' compile entries).
"""

from __future__ import annotations

import dataclasses

from .constants import (
    D_QK,
    D_ROPE,
    D_V,
    FP8_DS_MLA_BYTES,
    KEYSM_COLUMNS,
    METADATA_WIDTH,
    PAGE_SIZE,
)


@dataclasses.dataclass(frozen=True)
class Arg:
    """One kernel argument. shape None: a scalar. Dims are ints or size names (a name shared by
    two arguments is one size to the compiler; "?" is a size of its own). Strides: ints,
    "dyn" (a runtime int64) or "row" (a runtime int64, a multiple of 16 bytes: TMA and vector
    loads need 16-byte aligned rows)."""

    dtype: str  # "q", "kv", "out" (the kernel's dtypes), "i32", "f32" or "stream"
    shape: tuple | None = None
    stride: tuple = ()
    align: int = 16  # bytes the data pointer is assumed aligned to


ARGS = {
    "q": Arg("q", ("b", "rows", D_QK), ("row", D_QK, 1)),
    "kv": Arg("kv", ("n_blocks", PAGE_SIZE, D_QK), ("row", "row", 1)),
    "block_table": Arg("i32", ("b", "max_blocks"), ("dyn", 1), 4),
    "seqlens": Arg("i32", ("b",), (1,), 4),
    "metadata": Arg("i32", ("parts", METADATA_WIDTH), (METADATA_WIDTH, 1), 4),
    "num_splits": Arg("i32", ("?",), (1,), 4),  # b + 1 (the DSL has no affine sizes)
    "out": Arg("out", ("b", "rows", D_V), ("row", D_V, 1)),
    "lse": Arg("f32", ("b", "h_q", "s_q"), ("dyn", "dyn", 1), 4),
    "oacc": Arg("f32", ("slots", "rows", D_V), ("row", D_V, 1)),
    "lseacc": Arg("f32", ("slots", "rows"), ("dyn", 1), 4),
    "scale_log2": Arg("f32"),
    "combine_variant": Arg("i32"),  # an index into constants.COMBINE_VARIANTS
    "kv_scale": Arg("f32", (1,), (1,), 4),
    "q_scale": Arg("f32", (1,), (1,), 4),
    "q_scaled": Arg("i32"),
    "num_pages": Arg("i32"),  # the cache's page count (the combine checks page ids)
    "check": Arg("i32"),  # the schedule kernel's value check on (1) or off (0)
    "stream": Arg("stream"),
    # sparse decode (cute_kernels/sm80_sparse_decode.py): the op's own tensors
    "sparse_q": Arg("q", ("b", "s_q", "h_q", D_QK), ("row", "row", "row", 1)),
    "indices": Arg("i32", ("b", "s_q", "topk"), ("dyn", "dyn", 1), 4),
    "topk_length": Arg("i32", ("b",), (1,), 4),
    "sparse_out": Arg("out", ("b", "s_q", "h_q", D_V), ("row", "row", "row", 1)),
    # DeepSeek-V3.2's 656-byte FP8 rows, as bytes
    "kv_fp8_ds_mla": Arg("kv", ("n_blocks", PAGE_SIZE, FP8_DS_MLA_BYTES), ("row", "row", 1)),
    # the DSA indexer's logits (cute_kernels/sm90_indexer.py): "rows" (s_q * H), "d" and
    # "s_q" are compile-time sizes there (fake_args' static)
    "index_q": Arg("q", ("b", "rows", "d"), ("row", "row", 1)),
    "index_weights": Arg("f32", ("b", "rows"), ("dyn", 1), 4),
    "index_cache": Arg("kv", ("n_blocks", PAGE_SIZE, "d"), ("row", "row", 1)),
    "index_scale": Arg("f32", ("n_blocks", PAGE_SIZE), ("row", 1)),
    "logits": Arg("f32", ("b", "s_q", "max_len"), ("dyn", "dyn", 1), 4),
    "pages_per_cta": Arg("i32"),
}

DECODE_ARGS = ("q", "kv", "block_table", "seqlens", "metadata", "num_splits", "out", "lse",
               "oacc", "lseacc", "scale_log2")
FP8_ARGS = ("kv_scale", "q_scale", "q_scaled")
DECODE_KERNEL_ARGS = DECODE_ARGS + ("stream",)
STEP_ARGS = DECODE_ARGS + ("combine_variant", "stream")
COMBINE_ARGS = ("num_splits", "oacc", "lseacc", "out", "lse", "block_table", "seqlens",
                "num_pages", "stream")
SCHEDULE_ARGS = ("seqlens", "metadata", "num_splits", "check", "stream")
# Sparse decode's step: the schedule is over b * s_q one-token requests (num_splits has
# b * s_q + 1 entries), oacc and lseacc have h_q rows. The FP8 caches come as bytes: a
# float8_e4m3fn one (then kv_scale follows the stream) or the 656-byte rows (sparse_step_args).
SPARSE_STEP_ARGS = ("sparse_q", "kv", "indices", "topk_length", "metadata", "num_splits",
                    "sparse_out", "lse", "oacc", "lseacc", "scale_log2", "combine_variant",
                    "stream")
SPARSE_DIMS = ("b", "s_q", "h_q", "n_blocks", "topk", "parts", "slots", "rows")
# The indexer's logits: q [b, s_q * H, D] (the op's [b, s_q, H, D] viewed), weights [b, s_q * H],
# the index cache, block_table, cache_seqlens, logits [b, s_q, max_len], the CTA's page count;
# over a float8_e4m3fn cache (q and cache as bytes) also index_scale, after the stream.
INDEXER_ARGS = ("index_q", "index_weights", "index_cache", "block_table", "seqlens", "logits",
                "pages_per_cta", "stream")
INDEXER_DIMS = ("b", "n_blocks", "max_blocks", "max_len")
# The sizes created first, in this order (then the others as they first appear): the order
# the compile signatures have always had.
DECODE_DIMS = ("b", "rows", "n_blocks", "max_blocks", "parts", "slots", "h_q", "s_q")
COMBINE_DIMS = ("b", "rows", "slots", "h_q", "s_q")


# --- the DSA indexer kernel's limits (cute_kernels/sm90_indexer.py) ---------------------------

INDEXER_HEAD_DIMS = (64, 128)
INDEXER_MAX_COLUMNS = 128  # s_q * H: the MMA's N (an accumulator of N / 2 fp32 registers)


def indexer_unsupported(head_dim: int, heads: int, s_q: int) -> str | None:
    """Why the indexer kernel does not take this problem, or None: head_dim 64 or 128, heads a
    multiple of 8 (>= 8), s_q >= 1 and s_q * heads <= INDEXER_MAX_COLUMNS."""
    if head_dim not in INDEXER_HEAD_DIMS:
        return f"the indexer kernel takes head_dim 64 or 128, got {head_dim}"
    if heads < 8 or heads % 8:
        return f"the indexer kernel takes a multiple of 8 heads, got {heads}"
    if s_q < 1 or s_q * heads > INDEXER_MAX_COLUMNS:
        return (f"the indexer kernel takes s_q * heads <= {INDEXER_MAX_COLUMNS}, got s_q {s_q} "
                f"x {heads} heads")
    return None


# --- the keys-on-M SM90 kernel's query columns (cute_kernels/sm90_keysm_decode.py) ------------

def keysm_columns_for(rows: int, max_rows: int = KEYSM_COLUMNS[-1]) -> int:
    """The query columns (KEYSM_COLUMNS: 8, 16, 32, 64) a keys-on-M CTA takes for ``rows``
    (s_q * h_q of one KV head): the smallest that holds them, or 0 past ``max_rows``."""
    return next((n for n in KEYSM_COLUMNS if n >= rows), 0) if rows <= max_rows else 0


# --- torch side: the shapes of the ops' results (fake_impls, the host launch) ---------------

def decode_out_shape(batch: int, s_q: int, h_q: int, d_v: int = D_V) -> tuple:
    """mla_decode's out: [batch, s_q, h_q, d_v] (the kernels write it as (b, rows, d_v))."""
    return (batch, s_q, h_q, d_v)


def decode_lse_shape(batch: int, s_q: int, h_q: int) -> tuple:
    """mla_decode's lse, float32: [batch, h_q, s_q] (the kernels' lse argument)."""
    return (batch, h_q, s_q)


def schedule_shapes(batch: int, num_parts: int) -> tuple[tuple, tuple]:
    """get_decode_schedule's (metadata int32 [num_parts, 8], num_splits int32 [batch + 1])."""
    return (num_parts, METADATA_WIDTH), (batch + 1,)


# --- DSL side: compile signatures (import the DSL when called) -------------------------------

def has_pdl(arch: str) -> bool:
    """Programmatic dependent launch (griddepcontrol) exists from sm_90 on."""
    return int(arch[3:].rstrip("af")) >= 90


def has_e4m3_cvt(arch: str) -> bool:
    """The e4m3 conversions (cvt ... e4m3x2) exist from sm_89 on."""
    return int(arch[3:].rstrip("af")) >= 89


def sparse_step_args(cache: str = "plain") -> tuple:
    """The sparse decode step's arguments over a cache format ("plain", "e4m3",
    "fp8_ds_mla")."""
    if cache == "fp8_ds_mla":
        return tuple("kv_fp8_ds_mla" if a == "kv" else a for a in SPARSE_STEP_ARGS)
    return SPARSE_STEP_ARGS + (("kv_scale",) if cache == "e4m3" else ())


def dsl_dtype(name: str):
    """The DSL element type of a registry dtype name ("bf16", "fp16", "fp32", "int32", ...)."""
    import cutlass

    return {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16, "fp32": cutlass.Float32,
            "int32": cutlass.Int32, "int64": cutlass.Int64, "uint8": cutlass.Uint8}[name]


def fake_tensor(dtype, shape: tuple, stride: tuple, align: int = 16):
    """A fake tensor for cute.compile (sizes and strides ints or cute.sym_int values)."""
    import cutlass.cute as cute

    return cute.runtime.make_fake_tensor(dtype, shape, stride=stride, assumed_align=align)


def fake_args(names: tuple, dtype=None, *, dims: tuple = (), q_bytes: bool = False,
              kv_bytes: bool = False, static: dict | None = None) -> list:
    """The compile-time stand-ins of arguments ``names`` (keys of ARGS), in order.

    dtype: the DSL element type of q, kv and out; q_bytes / kv_bytes: q / kv as uint8 (an e4m3
    q in fast mode, an e4m3 cache: the kernels only move and convert the bytes, and DLPack
    needs no fp8 type). dims: the size names created first, in this order. static: size names
    that are compile-time ints in this build (e.g. {"d": 128})."""
    import cutlass
    import cutlass.cute as cute

    sizes = {d: cute.sym_int() for d in dims}
    sizes.update(static or {})
    elem = {"q": cutlass.Uint8 if q_bytes else dtype, "kv": cutlass.Uint8 if kv_bytes else dtype,
            "out": dtype, "i32": cutlass.Int32, "f32": cutlass.Float32}

    def size(d):
        if isinstance(d, int):
            return d
        if d == "?":
            return cute.sym_int()
        if d not in sizes:
            sizes[d] = cute.sym_int()
        return sizes[d]

    out = []
    for name in names:
        arg = ARGS[name]
        if arg.dtype == "stream":
            out.append(cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True))
            continue
        dt = elem[arg.dtype]
        if arg.shape is None:
            out.append(dt(1.0) if dt is cutlass.Float32 else dt(0))
            continue
        shape = tuple(size(d) for d in arg.shape)
        row = 16 * 8 // dt.width  # elements in 16 bytes
        stride = tuple(s if isinstance(s, int) else
                       cute.sym_int64(divisibility=row) if s == "row" else cute.sym_int64()
                       for s in arg.stride)
        out.append(fake_tensor(dt, shape, stride, arg.align))
    return out


def compile_kernel(kernel, args: list, arch: str):
    """cute.compile of kernel for arch (a compile option: no GPU, no CUTE_DSL_ARCH needed),
    with TVM-FFI (a launch takes torch tensors and runs on the current stream). The DSL's
    deprecation notices about its own names stay inside (a first call compiles: the caller's
    warning filters, "error" in tests among them, are not the DSL's business)."""
    import warnings

    import cutlass.cute as cute

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return cute.compile(kernel, *args, options=f"--enable-tvm-ffi --gpu-arch {arch}")


def compile_decode_kernel(kernel, dtype, arch: str, extra: list = ()):
    """Compiles a decode kernel object (any class taking DECODE_KERNEL_ARGS) for arch; extra:
    trailing fake arguments of development builds (e.g. a trace table)."""
    return compile_kernel(kernel, fake_args(DECODE_KERNEL_ARGS, dtype, dims=DECODE_DIMS)
                          + list(extra), arch)


def compile_step_kernel(step, dtype, arch: str):
    """Compiles a decode step object (cute_kernels/decode_step.py: STEP_ARGS, then FP8_ARGS
    when ``step.kv_fp8``) for arch; an e4m3 q (``step.decode.q_fp8``) comes as bytes."""
    kv_fp8 = getattr(step, "kv_fp8", False)
    names = STEP_ARGS + (FP8_ARGS if kv_fp8 else ())
    return compile_kernel(step, fake_args(names, dtype, dims=DECODE_DIMS, kv_bytes=kv_fp8,
                                          q_bytes=getattr(step.decode, "q_fp8", False)), arch)


def compile_sparse_step_kernel(step, dtype, arch: str, cache: str):
    """Compiles a sparse decode step object for arch over cache format `cache` (the registry
    config's: sparse_step_args of it; an FP8 cache as bytes, with kv_scale for "e4m3")."""
    return compile_kernel(step, fake_args(sparse_step_args(cache), dtype, dims=SPARSE_DIMS,
                                          kv_bytes=cache != "plain"), arch)


def compile_combine_kernel(kernel, dtype, arch: str):
    """Compiles a combine object (cute_kernels/combine.py: COMBINE_ARGS) for arch."""
    return compile_kernel(kernel, fake_args(COMBINE_ARGS, dtype, dims=COMBINE_DIMS), arch)


def compile_schedule_kernel(kernel, arch: str):
    """Compiles a schedule object (cute_kernels/schedule.py: SCHEDULE_ARGS, every size its own)
    for arch."""
    return compile_kernel(kernel, fake_args(SCHEDULE_ARGS), arch)


def compile_append_kernel(kernel, slot_dtype, arch: str):
    """Compiles an append object (cute_kernels/append_kv.py) for arch: (kv_cache [num_blocks,
    64, 1, 576], kv_c [T, 512], k_pe [T, 64] (row strides multiples of 8 elements, 16-byte
    aligned), slot_mapping [T] of slot_dtype, check_range int, check_repeats int, [AppendKVFp8:
    kv_scale float32 [1],] stream). An fp8 cache comes as its bytes (uint8)."""
    import cutlass
    import cutlass.cute as cute

    T = cute.sym_int()
    src = kernel.source_dtype
    cache_div = 16 if kernel.fp8 else 8  # 16-byte aligned rows either way
    args = [
        # Page stride int64: a cache past 2^31 elements (4 GB in bf16) is addressed right.
        fake_tensor(kernel.cache_dtype, (cute.sym_int(), PAGE_SIZE, 1, D_QK),
                    (cute.sym_int64(divisibility=cache_div), D_QK, D_QK, 1)),
        fake_tensor(src, (T, D_V), (cute.sym_int64(divisibility=8), 1)),
        fake_tensor(src, (T, D_ROPE), (cute.sym_int64(divisibility=8), 1)),
        fake_tensor(slot_dtype, (T,), (1,), slot_dtype.width // 8),
        cutlass.Int32(1),
        cutlass.Int32(1),
    ]
    if kernel.fp8:
        args.append(fake_tensor(cutlass.Float32, (1,), (1,), 4))
    args.append(cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True))
    return compile_kernel(kernel, args, arch)


def compile_indexer_kernel(kernel, fp8: bool, head_dim: int, rows: int, s_q: int, arch: str):
    """Compiles an indexer object (cute_kernels/sm90_indexer.py: INDEXER_ARGS, then
    index_scale when fp8) for arch: head_dim, rows (s_q * H) and s_q are compile-time sizes;
    an e4m3 q and cache come as bytes."""
    import cutlass

    names = INDEXER_ARGS + (("index_scale",) if fp8 else ())
    return compile_kernel(kernel, fake_args(names, cutlass.BFloat16, dims=INDEXER_DIMS,
                                            q_bytes=fp8, kv_bytes=fp8,
                                            static={"d": head_dim, "rows": rows, "s_q": s_q}),
                          arch)
