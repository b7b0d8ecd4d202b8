"""Compiled kernels on disk: a fresh process launches them without tracing or compiling.

How: a kernel compiled by ``cute.compile(..., options="--enable-tvm-ffi ...")`` is exported with
``export_to_c`` (an ELF object: the host launcher, named ``__tvm_ffi_<name>``, and the cubin),
linked by the system C compiler (``$CC``, default ``cc``) into a shared library against the DSL's
``libcute_dsl_runtime`` and ``libtvm_ffi`` (the route nvidia-cutlass-dsl's ``aot_config``
documents), and loaded back with ``tvm_ffi.load_module``: one dlopen, milliseconds, and neither
the DSL nor the kernel classes are imported. The loaded object is the ``tvm_ffi.Function`` that
the in-memory compile wraps, so it takes torch tensors and the current stream as before; the
cubin goes to the GPU on the first call, as with a fresh compile. Without a C compiler the object
file is the artefact, loaded by ``cutlass.cute.runtime.load_module`` (which imports the DSL).

Where: ``$TORCH_MLA_CACHE_DIR``, else ``$XDG_CACHE_HOME/torch_mla``, else
``~/.cache/torch_mla``; then ``<torch_mla version>/<nvidia-cutlass-dsl version>/<arch>/``.
``TORCH_MLA_CACHE_DIR=off`` turns the disk cache off (every process compiles). Entries are
never deleted; removing the directory clears the cache. ``python -m torch_mla.precompile``
fills it ahead of time.

An entry is a sidecar ``<kernel>-<config>-<key hash>.json`` that names its artefact
``<same stem>.<sha256 prefix>.so`` and holds the artefact's size and sha256 and the full key:
the versions of torch_mla, nvidia-cutlass-dsl and apache-tvm-ffi, the arch, the kernel's
configuration and a hash of the kernel sources (``cute_kernels/``, ``constants.py``,
``contract.py`` and ``ops/registry.py``: a development checkout keeps its version number while
the kernels change), and the kernels' developer knobs where any is set (the TORCH_MLA_DEV_*
variables the kernel modules read at import; HOST_KNOBS, read by the dispatch, are not part
of it). The knobs are read from the environment when the key is made, so a process must not
change them after importing the kernels. Anything that does not
match (an unreadable sidecar, another key, a wrong size or checksum, a library that does not
load) is a miss: the kernel is compiled again and the entry rewritten, never trusted.

Writing is atomic: the artefact is written under a temporary name in the cache directory and
renamed to its content-addressed name, then the sidecar likewise, so a reader never sees a
sidecar without its artefact, and processes building one entry at once each leave a complete
entry (the last sidecar wins). No fsync: a file cut short by a crash fails its checksum. Within
a process one lock serialises loading and compiling, so threads asking for one kernel compile it
once (the DSL is not thread-safe either).
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
import os
import shlex
import shutil
import subprocess
import tempfile
import threading
import warnings
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

_PKG = Path(__file__).resolve().parents[1]
_lock = threading.Lock()
_loaded: dict[tuple, Any] = {}
_warned: set[str] = set()


@functools.lru_cache(maxsize=None)
def _version(dist: str, module: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:  # on sys.path without its metadata (a bare copy)
        try:
            return str(importlib.import_module(module).__version__)
        except Exception:
            return "unknown"


def versions() -> dict[str, str]:
    """The package versions an artefact depends on (read from metadata: no DSL import, unless
    a package's metadata is missing)."""
    from .. import __version__

    return {"torch_mla": __version__,
            "nvidia-cutlass-dsl": _version("nvidia-cutlass-dsl", "cutlass"),
            "apache-tvm-ffi": _version("apache-tvm-ffi", "tvm_ffi")}


@functools.lru_cache(maxsize=None)
def sources_hash() -> str:
    """sha256 over what a compiled kernel is made from: the kernel sources (cute_kernels/, with
    each kernel's compile entry), the constants they use, the compile signatures (contract.py)
    and the variants' configs (ops/registry.py)."""
    h = hashlib.sha256()
    files = sorted((_PKG / "cute_kernels").rglob("*.py")) + [
        _PKG / "constants.py", _PKG / "contract.py", _PKG / "ops" / "registry.py"]
    for f in files:
        data = f.read_bytes()
        h.update(f"{f.relative_to(_PKG).as_posix()}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()


def cache_dir(arch: str) -> Path | None:
    """The directory holding this arch's entries, or None when TORCH_MLA_CACHE_DIR=off."""
    root = os.environ.get("TORCH_MLA_CACHE_DIR", "")
    if root.strip().lower() == "off":
        return None
    if not root:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "torch_mla"
    v = versions()
    return Path(root).expanduser() / v["torch_mla"] / v["nvidia-cutlass-dsl"] / arch


# Developer knobs the dispatch reads (ops/), not the kernels: they change no build, so they stay
# out of the key (tests/test_kernel_cache.py checks this list against ops/).
HOST_KNOBS = ("TORCH_MLA_DEV_COMBINE_WPR", "TORCH_MLA_DEV_SPLIT_PAIR_MIN_TOKENS",
              "TORCH_MLA_DEV_SPLIT_SHORT_BLOCKS")


def entry_key(kernel: str, config: dict, arch: str) -> dict:
    """Everything the compiled artefact depends on; config values are str, int or bool. The
    kernels' developer knobs (TORCH_MLA_DEV_* variables but HOST_KNOBS, read when a kernel
    module is imported) are part of it where any is set, so a build under other knob values
    never loads the defaults' entry, nor the defaults another's."""
    dev = {k: v for k, v in sorted(os.environ.items())
           if k.startswith("TORCH_MLA_DEV_") and v and k not in HOST_KNOBS}
    return {"kernel": kernel, "config": dict(config), "arch": arch, **versions(),
            "sources": sources_hash(), **({"dev": dev} if dev else {})}


def _names(kernel: str, config: dict, arch: str) -> tuple[dict, str, str]:
    """(key, file stem, exported function name: unique, so symbols never clash in a process)."""
    key = entry_key(kernel, config, arch)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    stem = "-".join([kernel, *(f"{k}={v}" for k, v in config.items()), digest])
    return key, stem, f"torch_mla_{kernel}_{digest}"


def _open(path: Path, function: str) -> Any:
    if path.suffix == ".so":
        import tvm_ffi

        return tvm_ffi.load_module(str(path))[function]
    import cutlass.cute as cute

    return getattr(cute.runtime.load_module(str(path), enable_tvm_ffi=True), function)


def _warn_once(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        warnings.warn(msg, stacklevel=4)


def _load_unlocked(directory: Path, kernel: str, config: dict, arch: str) -> Any | None:
    key, stem, function = _names(kernel, config, arch)
    sidecar = directory / f"{stem}.json"
    if not sidecar.exists():
        return None
    try:
        meta = json.loads(sidecar.read_bytes())
        name = meta["artefact"]
        if meta["key"] != key or meta["function"] != function or Path(name).name != name:
            raise ValueError("the entry's key differs from this kernel's")
        data = (directory / name).read_bytes()
        if len(data) != meta["size"] or hashlib.sha256(data).hexdigest() != meta["sha256"]:
            raise ValueError(f"{name} does not match its recorded size and sha256")
        return _open(directory / name, function)
    except Exception as e:  # any doubt is a miss: the kernel is compiled again
        _warn_once(f"torch_mla: ignoring the kernel cache entry {sidecar} ({e}); compiling "
                   "the kernel again")
        return None


def _link(obj: Path) -> Path:
    """obj linked into a shared library next to it, or obj itself without a C compiler."""
    cc = shlex.split(os.environ.get("CC") or "cc")
    if not cc or shutil.which(cc[0]) is None:
        return obj
    import cutlass.cute as cute

    libs = cute.runtime.find_runtime_libraries(enable_tvm_ffi=True)
    # rpath: the runtime libraries are found even before the DSL or tvm_ffi has loaded them.
    rpath = ":".join(sorted({str(Path(p).parent) for p in libs}))
    so = obj.with_suffix(".so")
    subprocess.run([*cc, "-shared", "-o", str(so), str(obj), *libs, f"-Wl,-rpath,{rpath}"],
                   check=True, capture_output=True, text=True)
    return so


def _store(directory: Path, kernel: str, config: dict, arch: str, fn: Any) -> None:
    key, stem, function = _names(kernel, config, arch)
    directory.mkdir(parents=True, exist_ok=True)
    # Temporary files in the cache directory itself: os.replace is atomic on one filesystem.
    with tempfile.TemporaryDirectory(dir=directory, prefix=".tmp-") as tmp:
        obj = Path(tmp) / "kernel.o"
        # Only __tvm_ffi_<function> stays global: libraries loaded into one process never
        # resolve each other's internal symbols.
        fn.export_to_c(str(obj), function_name=function, export_only_tvm_ffi_symbols=True)
        artefact = _link(obj)
        data = artefact.read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        name = f"{stem}.{digest[:16]}{artefact.suffix}"
        os.replace(artefact, directory / name)
        meta = {"key": key, "artefact": name, "function": function, "size": len(data),
                "sha256": digest}
        (Path(tmp) / "entry.json").write_text(json.dumps(meta, indent=1, sort_keys=True))
        os.replace(Path(tmp) / "entry.json", directory / f"{stem}.json")


def load(kernel: str, config: dict, arch: str) -> Any | None:
    """The kernel from this process's memory or a valid disk entry, else None (no compile)."""
    with _lock:
        mkey = (kernel, tuple(config.items()), arch)
        if mkey not in _loaded:
            directory = cache_dir(arch)
            fn = _load_unlocked(directory, kernel, config, arch) if directory else None
            if fn is None:
                return None
            _loaded[mkey] = fn
        return _loaded[mkey]


def load_or_build(kernel: str, config: dict, arch: str, build: Callable[[], Any]) -> Any:
    """The compiled kernel: from memory, else from the disk cache, else ``build()`` (a
    ``cute.compile`` result with ``--enable-tvm-ffi``), stored and loaded back from disk so
    that a process runs what later processes will load.

    Args:
        kernel: a name (letters, digits, underscores); config: its static configuration
            (str/int/bool values); arch: the GPU arch it is compiled for, e.g. ``"sm_90a"``.

    Returns:
        A callable taking the kernel's arguments (torch tensors, scalars) through TVM-FFI.
    """
    with _lock:
        mkey = (kernel, tuple(config.items()), arch)
        if mkey in _loaded:
            return _loaded[mkey]
        directory = cache_dir(arch)
        fn = _load_unlocked(directory, kernel, config, arch) if directory else None
        if fn is None:
            fn = build()
            if directory is not None:
                try:
                    _store(directory, kernel, config, arch, fn)
                    fn = _load_unlocked(directory, kernel, config, arch) or fn
                except Exception as e:
                    _warn_once(f"torch_mla: could not store the compiled {kernel} kernel in "
                               f"{directory} ({e}); every process compiles it again")
        _loaded[mkey] = fn
        return fn


def artefact(kernel: str, config: dict, arch: str) -> Path | None:
    """Where the entry's artefact is (not checked: :func:`load` checks), or None."""
    directory = cache_dir(arch)
    if directory is None:
        return None
    sidecar = directory / f"{_names(kernel, config, arch)[1]}.json"
    try:
        return directory / json.loads(sidecar.read_bytes())["artefact"]
    except (OSError, ValueError, KeyError):
        return None
