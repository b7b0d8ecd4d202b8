"""Every compiled kernel variant torch_mla has, keyed by a frozen config, and how to build it.

A variant is (config, arch). The config names the disk-cache entry (``config.name``, e.g.
"step_sm90", and ``config.key()``, e.g. {"dtype": "bf16", "causal": False, "kv": "e4m3"}) and
the compile entry that builds it (``config.entry``: a function at the end of its kernel's file
in cute_kernels/, taking (config, arch)). The dispatch (ops/dispatch.py), precompile and the
disk cache (ops/kernel_cache.py) read this module; nothing else spells a key.

API (stable, for the ops, precompile, tests and tools):
    DecodeStepConfig, DecodeConfig, SparseStepConfig, IndexerConfig, CombineKernelConfig,
    ScheduleConfig, AppendKVConfig
    compiled(config, arch)    the compiled kernel (memory, disk cache, else compiled and stored)
    build(config, arch)       compiles it now (no cache)
    variants(dtypes, causal, kernels, arch)   what precompile builds, as Variant(config, arch)
    SM90_ARCH, SM100_ARCH, PORTABLE_ARCHS, FP8_APPEND_ARCHS, ARCHS, gpu_arch, dtype_name

Uses neither torch nor the DSL: a cache hit loads a library without either (kernel_cache.py).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from typing import Any, ClassVar, NamedTuple

from ..constants import (
    COMBINE_VARIANTS,
    KEYSM_COLUMNS,
    KEYSM_DEFAULT_ROWS,
    KEYSM_FAST_COLUMNS,
    KEYSM_RS_COLUMNS,
)
from ..contract import indexer_unsupported
from . import kernel_cache


def gpu_arch(major: int, minor: int) -> str:
    """The ``--gpu-arch`` a GPU of this compute capability gets kernels compiled for: its own
    arch, with the arch-specific suffix from 9.0 on (sm_80, sm_86, sm_89, sm_90a, sm_100a,
    sm_120a, ...)."""
    return f"sm_{major}{minor}" + ("a" if major >= 9 else "")


SM90_ARCH = "sm_90a"
SM100_ARCH = "sm_100a"
# The small kernels (schedule, append_kv) and the portable decode kernel use no arch-specific
# instruction: they run on every arch from SM80 up, compiled for the device's own (sm_90a on
# H100/H200, the SM90 kernel's arch, so that precompiling sm_90a covers all of them). The
# arches nvidia-cutlass-dsl compiles for.
PORTABLE_ARCHS = {cap: gpu_arch(*cap) for cap in [(8, 0), (8, 6), (8, 7), (8, 9), (9, 0),
                                                   (10, 0), (10, 3), (11, 0), (12, 0), (12, 1)]}
# Arches with the e4m3 cvt (cvt.rn.satfinite.e4m3x2.f32, SM89 and later): append_kv's fp8 kernel.
FP8_APPEND_ARCHS = frozenset(a for cap, a in PORTABLE_ARCHS.items() if cap >= (8, 9))
# The arches torch_mla has kernels for: SM90's own, and the portable kernels'.
ARCHS = tuple(dict.fromkeys((SM90_ARCH, *PORTABLE_ARCHS.values())))

# Element types by the names the configs (and so the disk-cache keys) use.
_NAMES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float8_e4m3fn": "e4m3",
          "int32": "int32", "int64": "int64"}


def dtype_name(dtype) -> str:
    """The config name of a torch dtype (torch.bfloat16 -> "bf16", torch.float8_e4m3fn ->
    "e4m3", torch.int64 -> "int64")."""
    return _NAMES[str(dtype).removeprefix("torch.")]


class _Config:
    """What every config offers: its cache entry's name and key, its compile entry."""

    name: ClassVar[str]
    entry: ClassVar[str]  # "<module in cute_kernels>:<function(config, arch)>"

    def key(self) -> dict:
        """The disk-cache config of this variant (str/int/bool values, in field order)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


# The keys-on-M step backends (module cute_kernels/<backend>_decode.py): the kernel, its
# ping-pong variant over an e4m3 cache (exact mode) and that variant's fast mode.
KEYSM_BACKENDS = ("sm90_keysm", "sm90_keysm_rs", "sm90_keysm_fast")


@dataclasses.dataclass(frozen=True)
class DecodeStepConfig(_Config):
    """The decode kernel of ``backend`` and the combine behind one host call (what mla_decode
    runs; cute_kernels/decode_step.py).

    backend: "sm90" (MLADecodeSm90, sm_90a), "sm100" (MLADecodeSm100, sm_100a), "sm80" (the
    portable MLADecodeSm80, any arch from sm_80) or "sm90_keysm" (MLADecodeSm90KeysM, sm_90a,
    keys on the MMA's M side, by default where s_q * h_q <= 32: dispatch.keysm_columns;
    ``columns``, the query rows a CTA takes, 8, 16, 32 or 64, is part of its build), and over a
    float8_e4m3fn cache its ping-pong variant "sm90_keysm_rs" (exact mode; 8, 16, 32 or 64
    columns) and "sm90_keysm_fast" (its fast mode, compute="fp8"; 8, 16 or 32). dtype: "bf16"
    or "fp16", q's and out's.
    kv_fp8 (sm90, sm90_keysm*): over a float8_e4m3fn cache. compute="fp8" (with kv_fp8): fast
    mode (MLADecodeSm90Fast; sm90_keysm_fast); q_fp8 (sm90 only): its q is float8_e4m3fn
    (passed as bytes; out is dtype).
    tiles (sm80 only): the portable kernel's (block_m, block_n, stages) instead of
    Sm80DecodeConfig.from_heuristic(arch), for tools that compare tile shapes.
    p_dither (sm90 fast mode only): P dithered before its e4m3 rounding (MLADecodeSm90Fast;
    opt-in, TORCH_MLA_FAST_DITHER=1; run on an H100 in session 26)."""

    backend: str
    dtype: str
    causal: bool
    kv_fp8: bool = False
    compute: str = "exact"
    q_fp8: bool = False
    tiles: tuple[int, int, int] | None = None
    columns: int = 0
    p_dither: bool = False

    kind: ClassVar[str] = "step"

    def __post_init__(self):
        object.__setattr__(self, "causal", bool(self.causal))
        if (self.backend not in ("sm90", "sm80", "sm100") + KEYSM_BACKENDS
                or self.dtype not in ("bf16", "fp16")):
            raise ValueError(f"no decode kernel for backend {self.backend!r}, dtype "
                             f"{self.dtype!r}")
        keysm = self.backend in KEYSM_BACKENDS
        if keysm != (self.columns in KEYSM_COLUMNS):
            raise ValueError(f"columns={self.columns}: the {self.backend} kernel takes one of "
                             f"{KEYSM_COLUMNS}, the others none")
        if keysm and (self.compute == "fp8") != (self.backend == "sm90_keysm_fast"):
            raise ValueError(f"the {self.backend} kernel runs compute="
                             f"{'fp8' if self.backend == 'sm90_keysm_fast' else 'exact'!r} only")
        pp_columns = {"sm90_keysm_rs": KEYSM_RS_COLUMNS,
                      "sm90_keysm_fast": KEYSM_FAST_COLUMNS}.get(self.backend)
        if pp_columns and (not self.kv_fp8 or self.q_fp8 or self.columns not in pp_columns):
            raise ValueError(f"the {self.backend} kernel reads a float8_e4m3fn cache with "
                             f"bf16/fp16 q and columns in {pp_columns}")
        if self.kv_fp8 and self.backend not in ("sm90",) + KEYSM_BACKENDS:
            raise ValueError(f"no float8_e4m3fn-cache kernel for backend {self.backend!r}")
        if (self.compute == "fp8" and not self.kv_fp8) or (self.q_fp8 and self.compute != "fp8"):
            raise ValueError(f"compute={self.compute!r}, q_fp8={self.q_fp8} needs kv_fp8 and "
                             "fast mode")
        if self.p_dither and (self.backend != "sm90" or self.compute != "fp8"):
            raise ValueError("p_dither is the SM90 kernel's fast mode's (backend sm90, "
                             "compute='fp8')")
        if self.tiles is not None:
            if self.backend != "sm80":
                raise ValueError("tiles are the portable (sm80) kernel's")
            object.__setattr__(self, "tiles", tuple(self.tiles))

    @property
    def name(self) -> str:
        return f"{self.kind}_{self.backend}"

    entry: ClassVar[str] = "decode_step:compile_step"

    def key(self) -> dict:
        config = {"dtype": self.dtype, "causal": self.causal}
        if self.kv_fp8:
            config["kv"] = "e4m3"  # (bf16/fp16-cache entries keep their names)
        if self.compute == "fp8":
            config["compute"] = "fp8"
        if self.q_fp8:
            config["q"] = "e4m3"
        if self.tiles:
            config["tiles"] = "x".join(map(str, self.tiles))
        if self.columns:
            config["columns"] = self.columns
        if self.p_dither:
            config["p"] = "dither"
        return config


@dataclasses.dataclass(frozen=True)
class DecodeConfig(DecodeStepConfig):
    """The decode kernel of ``backend`` alone (benchmarks, tools; the ops run the step): the
    16-bit cache kernels, on the DECODE_KERNEL_ARGS of torch_mla/contract.py."""

    kind: ClassVar[str] = "decode"

    def __post_init__(self):
        super().__post_init__()
        if self.kv_fp8:
            raise ValueError("the decode kernel alone is built for 16-bit caches; a "
                             "float8_e4m3fn cache's runs in its step (DecodeStepConfig)")

    entry: ClassVar[str] = "decode_base:compile_decode"


# The sparse backends (SparseStepConfig: which cache formats each takes).
SPARSE_BACKENDS = ("sm80", "sm90", "sm90_keysm", "sm90_keysm_rs", "sm90_producer", "sm90_split")
SPARSE_KEYSM_COLUMNS = (8, 16, 32)  # the keys-on-M sparse kernel: one consumer warpgroup
# its ping-pong variant (at 64 columns its two warpgroups split the columns, 32 each)
SPARSE_KEYSM_RS_COLUMNS = (8, 16, 32, 64)
# the split kernel's cluster pair over the 656-byte rows: a token's two 64-row m-blocks
SPARSE_SPLIT_PAIR = 128


def sparse_caches(dtype: str) -> tuple[str, ...]:
    """The cache formats a sparse step with q of `dtype` reads: "plain", "e4m3", and with bf16
    q "fp8_ds_mla" (the 656-byte rows' RoPE values are bf16)."""
    return ("plain", "e4m3", "fp8_ds_mla") if dtype == "bf16" else ("plain", "e4m3")


@dataclasses.dataclass(frozen=True)
class SparseStepConfig(_Config):
    """Sparse decode and its combine behind one host call (mla_decode_sparse;
    cute_kernels/<backend>_sparse_decode.py): backend "sm80" (the portable kernel, any arch
    from sm_80), "sm90" (the wgmma kernel, sm_90a; the dispatch's choice by shape) or
    "sm90_keysm" (the keys-on-M kernel, sm_90a, ``columns`` 8, 16 or 32 query rows a CTA),
    "sm90_keysm_rs" (its ping-pong variant, the FP8 caches only, 8, 16, 32 or 64 columns; opt-in,
    TORCH_MLA_SPARSE_KEYSM_RS=1), "sm90_producer" (the SM90 one with a producer warpgroup that
    gathers and dequantizes, the 16-bit cache and the 656-byte rows; opt-in,
    TORCH_MLA_SPARSE_PRODUCER=1), "sm90_split" (the same with FlashMLA's split of the consumer
    warpgroups: the default over the 16-bit cache and the 656-byte rows at 64-128 heads,
    TORCH_MLA_SPARSE_PRODUCER=split: wherever the SM90 kernel runs; ``columns`` 128 over the
    656-byte rows: a token's two m-blocks as a cluster pair sharing the conversion, where the
    split runs there),
    dtype "bf16" or "fp16" (q's and out's), cache "plain" (q's dtype), "e4m3"
    (float8_e4m3fn with a per-tensor scale) or "fp8_ds_mla" (DeepSeek-V3.2's 656-byte rows,
    bf16 only). short (sm90_split over the 656-byte rows only): the split's build for parts of
    few blocks (ops.sparse.split_short_parts), its epilogue and first entries tuned for
    latency."""

    backend: str
    dtype: str
    cache: str = "plain"
    columns: int = 0
    short: bool = False

    def __post_init__(self):
        columns = {"sm90_keysm": SPARSE_KEYSM_COLUMNS,
                   "sm90_keysm_rs": SPARSE_KEYSM_RS_COLUMNS,
                   "sm90_split": (0, SPARSE_SPLIT_PAIR)}.get(self.backend, (0,))
        if (self.backend not in SPARSE_BACKENDS or self.dtype not in ("bf16", "fp16")
                or self.columns not in columns
                or (self.backend == "sm90_split" and self.columns and self.cache != "fp8_ds_mla")
                or (self.short and (self.backend != "sm90_split" or self.cache != "fp8_ds_mla"))
                or (self.backend == "sm90_keysm_rs" and self.cache == "plain")
                or (self.backend in ("sm90_producer", "sm90_split") and self.cache == "e4m3")):
            raise ValueError(f"no sparse decode kernel for backend {self.backend!r}, dtype "
                             f"{self.dtype!r}, columns {self.columns}, short {self.short}")
        if self.cache not in sparse_caches(self.dtype):
            raise ValueError(f"no sparse decode kernel for backend {self.backend!r}, dtype "
                             f"{self.dtype!r} over a {self.cache!r} cache")

    @property
    def name(self) -> str:
        return f"sparse_step_{self.backend}"

    def key(self) -> dict:
        config = {"dtype": self.dtype}
        if self.cache != "plain":
            config["kv"] = self.cache  # (16-bit-cache entries keep their names)
        if self.columns:
            config["columns"] = self.columns
        if self.short:
            config["short"] = True
        return config

    @property
    def entry(self) -> str:
        return f"{self.backend}_sparse_decode:compile_sparse_step"


@dataclasses.dataclass(frozen=True)
class IndexerConfig(_Config):
    """The DSA indexer's logits kernel (cute_kernels/sm90_indexer.py, sm_90a): dtype "bf16" or
    "e4m3" (q's and the index cache's), head_dim, heads and s_q within
    contract.indexer_unsupported's limits."""

    dtype: str
    head_dim: int
    heads: int
    s_q: int

    name: ClassVar[str] = "indexer_sm90"
    entry: ClassVar[str] = "sm90_indexer:compile_indexer"

    def __post_init__(self):
        why = indexer_unsupported(self.head_dim, self.heads, self.s_q)
        if self.dtype not in ("bf16", "e4m3"):
            why = f"the indexer kernel takes bf16 or e4m3, got {self.dtype!r}"
        if why:
            raise ValueError(why)


@dataclasses.dataclass(frozen=True)
class CombineKernelConfig(_Config):
    """The combine alone (cute_kernels/combine.py): out dtype, warps per output row and pieces
    a warp loads at once (one of constants.COMBINE_VARIANTS)."""

    dtype: str
    warps_per_row: int
    unroll: int = 4

    name: ClassVar[str] = "combine"
    entry: ClassVar[str] = "combine:compile_combine"

    def key(self) -> dict:
        config = {"dtype": self.dtype, "warps_per_row": self.warps_per_row}
        if self.unroll != 4:
            config["unroll"] = self.unroll  # (unroll 4 entries keep their names)
        return config


@dataclasses.dataclass(frozen=True)
class ScheduleConfig(_Config):
    """The one-launch schedule kernel (cute_kernels/schedule.py): one variant per arch."""

    name: ClassVar[str] = "schedule"
    entry: ClassVar[str] = "schedule:compile_schedule"


@dataclasses.dataclass(frozen=True)
class AppendKVConfig(_Config):
    """append_kv (cute_kernels/append_kv.py): the cache's dtype ("bf16", "fp16" or "e4m3"), the
    sources' ("bf16", "fp16" or "fp32") and the slots' ("int32" or "int64")."""

    cache: str
    source: str
    slot: str

    name: ClassVar[str] = "append_kv"
    entry: ClassVar[str] = "append_kv:compile_append_kv"


def build(config: _Config, arch: str) -> Any:
    """Compiles the variant now (imports the DSL and the kernel's module), without the cache."""
    module, function = config.entry.split(":")
    return getattr(importlib.import_module(f"torch_mla.cute_kernels.{module}"), function)(
        config, arch)


def compiled(config: _Config, arch: str) -> Any:
    """The compiled variant: from this process's memory, else the disk cache, else compiled
    and stored (kernel_cache.load_or_build). A callable taking the kernel's arguments (torch
    tensors, ints, floats; torch_mla/contract.py) through TVM-FFI."""
    return kernel_cache.load_or_build(config.name, config.key(), arch,
                                      functools.partial(build, config, arch))


# --- what precompile builds -------------------------------------------------------------------

class Variant(NamedTuple):
    config: _Config
    arch: str

    @property
    def name(self) -> str:
        return self.config.name

    def key(self) -> dict:
        return self.config.key()


# Groups of variants, by precompile's --kernels names.
KERNELS = ("step", "fp8_step", "fp8_fast", "fp8_dither", "sparse", "sparse_rs",
           "sparse_producer", "sparse_split", "keysm",
           "keysm64", "keysm_rs", "keysm_fast", "decode", "combine", "portable", "schedule",
           "append_kv")
DEFAULT_KERNELS = ("step", "fp8_step", "fp8_fast", "keysm", "keysm_rs", "keysm_fast", "sparse",
                   "schedule", "append_kv")
APPEND_SOURCES = ("bf16", "fp16", "fp32")
APPEND_SLOTS = ("int32", "int64")


def variants(dtypes: list[str] | tuple = ("bf16", "fp16"),
             causal: tuple[bool, ...] = (False, True), kernels: list[str] | tuple = DEFAULT_KERNELS,
             arch: str = SM90_ARCH) -> list[Variant]:
    """The variants of groups ``kernels`` the dispatch can pick on arch: the decode step (the
    SM90 kernel on sm_90a, the portable one elsewhere; "portable" adds the portable step on
    sm_90a, what TORCH_MLA_PORTABLE=1 runs there), on sm_90a the step over a float8_e4m3fn cache
    ("fp8_step"; "fp8_fast": its fast mode, q in each dtype and, for bf16 output, in
    float8_e4m3fn; "fp8_dither": the same with P dithered, what TORCH_MLA_FAST_DITHER=1 runs,
    not built by default), the sparse decode step ("sparse": the portable kernel's, every arch,
    and on sm_90a the SM90 one, the keys-on-M one (8, 16, 32 columns) and, over the 16-bit
    cache and the 656-byte rows, the split kernel that the dispatch takes in the SM90 one's
    place at 64-128 heads; "keysm": the keys-on-M step on sm_90a for 8, 16 and 32 columns,
    both cache formats, what the dispatch picks by default; "keysm64": its 64-column variants,
    which TORCH_MLA_KEYSM=1 adds, not built by default; "keysm_rs": its ping-pong variant over
    an e4m3 cache, which the dispatch picks in exact mode from a batch of 8 (32 at 32 columns;
    its 64-column steps with "keysm64" too: TORCH_MLA_KEYSM=1 and TORCH_MLA_KEYSM_RS=1);
    "keysm_fast" that variant's fast mode, which the dispatch picks for fast mode where s_q *
    h_q <= 32 (from a batch of 4 above 16)), the schedule kernel, append_kv for each cache dtype
    of ``dtypes`` (from SM89 up also float8_e4m3fn) from bf16/fp16/fp32 sources with int32/int64
    slots; "decode" and "combine" alone serve benchmarks."""
    out = []
    native = "sm90" if arch == SM90_ARCH else "sm80"
    steps = [native] if "step" in kernels else []
    if "portable" in kernels and "sm80" not in steps:
        steps.append("sm80")
    if "schedule" in kernels:
        out.append(ScheduleConfig())
    for dt in dtypes:
        for backend in steps:
            out += [DecodeStepConfig(backend, dt, c) for c in causal]
        if "fp8_step" in kernels and native == "sm90":  # the only float8_e4m3fn-cache kernel
            out += [DecodeStepConfig("sm90", dt, c, kv_fp8=True) for c in causal]
        for group, dither in (("fp8_fast", False), ("fp8_dither", True)):
            if group not in kernels or native != "sm90":
                continue
            for q8 in (False, True) if dt == "bf16" else (False,):
                out += [DecodeStepConfig("sm90", dt, c, kv_fp8=True, compute="fp8", q_fp8=q8,
                                         p_dither=dither)
                        for c in causal]
        if native == "sm90":
            cols = [n for n in KEYSM_COLUMNS if ("keysm" in kernels and n <= KEYSM_DEFAULT_ROWS)
                    or ("keysm64" in kernels and n > KEYSM_DEFAULT_ROWS)]
            out += [DecodeStepConfig("sm90_keysm", dt, c, kv_fp8=f8, columns=n)
                    for n in cols for f8 in (False, True) for c in causal]
            if "keysm_rs" in kernels:  # (64 columns with keysm64: opt-in, as the 64-row steps)
                out += [DecodeStepConfig("sm90_keysm_rs", dt, c, kv_fp8=True, columns=n)
                        for n in KEYSM_RS_COLUMNS for c in causal
                        if n <= KEYSM_DEFAULT_ROWS or "keysm64" in kernels]
            if "keysm_fast" in kernels:
                out += [DecodeStepConfig("sm90_keysm_fast", dt, c, kv_fp8=True, compute="fp8",
                                         columns=n) for n in KEYSM_FAST_COLUMNS for c in causal]
        if "sparse" in kernels:
            out += [SparseStepConfig("sm80", dt, c) for c in sparse_caches(dt)]
            if native == "sm90":  # (the dispatch's choice by shape: ops.sparse.sparse_backend;
                # over the 16-bit cache and the 656-byte rows the split kernel in the SM90
                # one's place at 64-128 heads)
                out += [SparseStepConfig("sm90", dt, c) for c in sparse_caches(dt)]
                if "sparse_split" not in kernels:
                    out += [SparseStepConfig("sm90_split", dt, c, n, short)
                            for c in sparse_caches(dt)
                            for n in ((0, SPARSE_SPLIT_PAIR) if c == "fp8_ds_mla" else (0,))
                            for short in ((False, True) if c == "fp8_ds_mla" else (False,))
                            if c != "e4m3"]
                out += [SparseStepConfig("sm90_keysm", dt, c, n)
                        for c in sparse_caches(dt) for n in SPARSE_KEYSM_COLUMNS]
        for group, backend in (("sparse_producer", "sm90_producer"),  # (opt-in:
                               ("sparse_split", "sm90_split")):  # TORCH_MLA_SPARSE_PRODUCER)
            if group in kernels and native == "sm90":
                shorts = (False, True) if backend == "sm90_split" else (False,)
                out += [SparseStepConfig(backend, dt, c, 0, short) for c in sparse_caches(dt)
                        for short in (shorts if c == "fp8_ds_mla" else (False,))
                        if c != "e4m3"]
                if backend == "sm90_split" and "fp8_ds_mla" in sparse_caches(dt):
                    out += [SparseStepConfig(backend, dt, "fp8_ds_mla", SPARSE_SPLIT_PAIR, short)
                            for short in shorts]
        if "sparse_rs" in kernels and native == "sm90":  # (opt-in: TORCH_MLA_SPARSE_KEYSM_RS=1)
            out += [SparseStepConfig("sm90_keysm_rs", dt, c, n)
                    for c in sparse_caches(dt) if c != "plain" for n in SPARSE_KEYSM_RS_COLUMNS]
        if "decode" in kernels:
            out += [DecodeConfig(native, dt, c) for c in causal]
        if "combine" in kernels:
            out += [CombineKernelConfig(dt, w, u) for w, u in COMBINE_VARIANTS]
        if "append_kv" in kernels:
            out += _append_variants(dt)
    if "append_kv" in kernels and arch in FP8_APPEND_ARCHS:
        out += _append_variants("e4m3")
    return [Variant(c, arch) for c in out]


def _append_variants(cache: str) -> list[AppendKVConfig]:
    return [AppendKVConfig(cache, src, slot) for src in APPEND_SOURCES for slot in APPEND_SLOTS]
