"""The disk cache of compiled kernels (torch_mla/ops/kernel_cache.py) and the precompile CLI.

Most tests stand a tiny C function in for a compiled kernel: it is exported, linked, stored and
loaded through the cache exactly as a kernel is, and called through TVM-FFI (x -> 2 x + tag, the
tag telling builds apart), so the cache's logic is tested in seconds. One test compiles a real
kernel (the combine, the fastest to compile) for sm_90a and loads it in a fresh process."""

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from importlib import metadata
from pathlib import Path

import pytest
from expecttest import assert_expected_inline

from torch_mla import precompile
from torch_mla.constants import COMBINE_VARIANTS
from torch_mla.ops import kernel_cache, registry

ROOT = Path(__file__).resolve().parents[1]
needs_cc = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")

C_SOURCE = r"""
#include <stdint.h>
typedef struct { int32_t type_index; uint32_t zero_padding; int64_t v_int64; } Any; /* TVMFFIAny */
int __tvm_ffi_%(name)s(void* self, const Any* args, int32_t num_args, Any* result) {
  result->type_index = 1; /* kTVMFFIInt */
  result->zero_padding = 0;
  result->v_int64 = 2 * args[0].v_int64 + %(tag)d;
  return 0;
}
"""


class FakeCompiled:
    """Stands in for a cute.compile result: export_to_c writes an object file whose TVM-FFI
    function computes 2 x + tag."""

    def __init__(self, tag: int, export_delay: float = 0.0):
        self.tag, self.export_delay = tag, export_delay

    def export_to_c(self, object_file_path, function_name, export_only_tvm_ffi_symbols=False):
        time.sleep(self.export_delay)
        src = Path(object_file_path).with_suffix(".c")
        src.write_text(C_SOURCE % {"name": function_name, "tag": self.tag})
        subprocess.run(["cc", "-c", "-fPIC", "-o", object_file_path, str(src)], check=True)


CONFIG = {"dtype": "bf16", "n": 3}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache directory and a process with nothing loaded."""
    monkeypatch.setenv("TORCH_MLA_CACHE_DIR", str(tmp_path / "cache"))
    kernel_cache._loaded.clear()
    kernel_cache._warned.clear()
    yield kernel_cache.cache_dir("sm_90a")
    kernel_cache._loaded.clear()
    kernel_cache._warned.clear()


def _replace(path: Path, data: bytes) -> None:
    # A new inode: the test process may have the old file mapped (dlopen); writing it in place
    # would change code under the loaded library.
    tmp = path.with_name(path.name + ".new")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def test_cache_dir(monkeypatch, tmp_path):
    tm, dsl = kernel_cache.versions()["torch_mla"], metadata.version("nvidia-cutlass-dsl")
    monkeypatch.delenv("TORCH_MLA_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert kernel_cache.cache_dir("sm_90a") == tmp_path / "xdg" / "torch_mla" / tm / dsl / "sm_90a"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert kernel_cache.cache_dir("sm_90a") == (tmp_path / "home" / ".cache" / "torch_mla" / tm
                                                / dsl / "sm_90a")
    monkeypatch.setenv("TORCH_MLA_CACHE_DIR", str(tmp_path / "mine"))
    assert kernel_cache.cache_dir("sm_100a") == tmp_path / "mine" / tm / dsl / "sm_100a"
    monkeypatch.setenv("TORCH_MLA_CACHE_DIR", "off")
    assert kernel_cache.cache_dir("sm_90a") is None


def test_entry_key(monkeypatch):
    for name in [k for k in os.environ if k.startswith("TORCH_MLA_DEV_")]:
        monkeypatch.delenv(name)
    key = kernel_cache.entry_key("combine", {"dtype": "bf16", "warps_per_row": 4}, "sm_90a")
    assert key == {"kernel": "combine", "config": {"dtype": "bf16", "warps_per_row": 4},
                   "arch": "sm_90a", "torch_mla": kernel_cache.versions()["torch_mla"],
                   "nvidia-cutlass-dsl": metadata.version("nvidia-cutlass-dsl"),
                   "apache-tvm-ffi": metadata.version("apache-tvm-ffi"),
                   "sources": kernel_cache.sources_hash()}
    assert re.fullmatch("[0-9a-f]{64}", key["sources"])
    _, stem, function = kernel_cache._names("combine", {"dtype": "bf16", "warps_per_row": 4},
                                            "sm_90a")
    assert re.fullmatch("combine-dtype=bf16-warps_per_row=4-[0-9a-f]{16}", stem), stem
    assert function == "torch_mla_combine_" + stem[-16:]
    # every part of the key changes the entry
    stems = {kernel_cache._names(k, c, a)[1][-16:] for k, c, a in [
        ("combine", {"dtype": "bf16", "warps_per_row": 4}, "sm_90a"),
        ("combine", {"dtype": "bf16", "warps_per_row": 16}, "sm_90a"),
        ("combine", {"dtype": "fp16", "warps_per_row": 4}, "sm_90a"),
        ("combine", {"dtype": "bf16", "warps_per_row": 4}, "sm_100a"),
        ("decode_sm90", {"dtype": "bf16", "warps_per_row": 4}, "sm_90a")]}
    monkeypatch.setattr(kernel_cache, "sources_hash", lambda: "0" * 64)
    stems.add(kernel_cache._names("combine", {"dtype": "bf16", "warps_per_row": 4}, "sm_90a")[1])
    monkeypatch.setattr(kernel_cache, "versions", lambda: {
        "torch_mla": "0", "nvidia-cutlass-dsl": "0", "apache-tvm-ffi": "0"})
    stems.add(kernel_cache._names("combine", {"dtype": "bf16", "warps_per_row": 4}, "sm_90a")[1])
    # a kernel's developer knob set (any TORCH_MLA_DEV_* value) is part of the key
    monkeypatch.setenv("TORCH_MLA_DEV_SPLIT_SCOPE", "cluster")
    stems.add(kernel_cache._names("combine", {"dtype": "bf16", "warps_per_row": 4}, "sm_90a")[1])
    assert kernel_cache.entry_key("combine", {}, "sm_90a")["dev"] == {
        "TORCH_MLA_DEV_SPLIT_SCOPE": "cluster"}
    assert len(stems) == 8
    # the dispatch's knobs change no build: not in the key
    for name in kernel_cache.HOST_KNOBS:
        monkeypatch.setenv(name, "1")
    assert kernel_cache.entry_key("combine", {}, "sm_90a")["dev"] == {
        "TORCH_MLA_DEV_SPLIT_SCOPE": "cluster"}


def test_host_knobs_are_the_dispatchs():
    """kernel_cache.HOST_KNOBS (out of the cache key) are the TORCH_MLA_DEV_* names that
    torch_mla/ops reads, and no kernel module reads one."""
    import torch_mla

    root = Path(torch_mla.__file__).parent
    names = lambda files: {m for f in files  # noqa: E731
                           for m in re.findall(r"TORCH_MLA_DEV_[A-Z0-9_]*[A-Z0-9]",
                                               f.read_text())}
    ops = names(f for f in (root / "ops").glob("*.py") if f.name != "kernel_cache.py")
    kernels = names((root / "cute_kernels").glob("*.py"))
    assert ops == set(kernel_cache.HOST_KNOBS), ops
    assert not ops & kernels, ops & kernels


@needs_cc
def test_round_trip_threads_compile_once(cache):
    builds = []

    def build():
        builds.append(1)
        time.sleep(0.5)  # the other threads arrive while this one compiles
        return FakeCompiled(tag=7)

    results = [None] * 4

    def worker(i):
        results[i] = kernel_cache.load_or_build("fake", CONFIG, "sm_90a", build)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(builds) == 1
    assert all(r is results[0] for r in results)
    assert results[0](21) == 49  # what runs is the library loaded back from disk
    files = sorted((p.name for p in cache.iterdir()), key=lambda name: Path(name).suffix)
    assert [Path(f).suffix for f in files] == [".json", ".so"], files
    meta = json.loads((cache / files[0]).read_text())
    data = (cache / files[1]).read_bytes()
    assert meta["artefact"] == files[1] and meta["size"] == len(data)
    assert meta["key"] == kernel_cache.entry_key("fake", CONFIG, "sm_90a")
    # a fresh process's view: nothing in memory, the entry loads without building
    kernel_cache._loaded.clear()
    fn = kernel_cache.load_or_build("fake", CONFIG, "sm_90a", lambda: pytest.fail("rebuilt"))
    assert type(fn).__name__ == "Function" and fn(5) == 17
    assert kernel_cache.artefact("fake", CONFIG, "sm_90a") == cache / files[1]


def _corrupt(cache: Path, how: str) -> None:
    sidecar = next(cache.glob("*.json"))
    meta = json.loads(sidecar.read_text())
    art = cache / meta["artefact"]
    if how == "truncated artefact":
        _replace(art, art.read_bytes()[: len(art.read_bytes()) // 2])
    elif how == "garbage artefact":
        _replace(art, os.urandom(meta["size"]))
    elif how == "missing artefact":
        art.unlink()
    elif how == "garbage sidecar":
        _replace(sidecar, b"\x00{garbage")
    elif how == "stale sidecar":  # written by another DSL version under this name
        meta["key"]["nvidia-cutlass-dsl"] = "4.0.0"
        _replace(sidecar, json.dumps(meta).encode())
    elif how == "sidecar pointing elsewhere":
        meta["artefact"] = "../" + meta["artefact"]
        _replace(sidecar, json.dumps(meta).encode())


@needs_cc
@pytest.mark.parametrize("how", ["truncated artefact", "garbage artefact", "missing artefact",
                                 "garbage sidecar", "stale sidecar",
                                 "sidecar pointing elsewhere"])
def test_corrupt_or_stale_entry_is_rebuilt(cache, how):
    assert kernel_cache.load_or_build("fake", CONFIG, "sm_90a", lambda: FakeCompiled(1))(0) == 1
    _corrupt(cache, how)
    kernel_cache._loaded.clear()
    with pytest.warns(UserWarning, match="ignoring the kernel cache entry .*compiling the kernel"):
        assert kernel_cache.load("fake", CONFIG, "sm_90a") is None
    kernel_cache._warned.clear()
    with pytest.warns(UserWarning, match="ignoring the kernel cache entry"):
        assert kernel_cache.load_or_build("fake", CONFIG, "sm_90a",
                                          lambda: FakeCompiled(2))(0) == 2
    kernel_cache._loaded.clear()
    assert kernel_cache.load("fake", CONFIG, "sm_90a")(0) == 2  # the rewritten entry is valid


CHILD = r"""
import os, sys, time
from pathlib import Path
sys.path.insert(0, {tests!r})
from test_kernel_cache import CONFIG, FakeCompiled
from torch_mla.ops import kernel_cache
i, n, meet = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])

def build():
    (meet / str(i)).touch()  # every process misses the cache, then all store at once
    deadline = time.time() + 120
    while len(list(meet.iterdir())) < n and time.time() < deadline:
        time.sleep(0.01)
    return FakeCompiled(tag=i, export_delay=0.1)

print(kernel_cache.load_or_build("fake", CONFIG, "sm_90a", build)(0))
"""


@needs_cc
def test_processes_storing_one_entry_at_once(cache, tmp_path):
    n, meet = 2, tmp_path / "meet"
    meet.mkdir()
    script = CHILD.format(tests=str(ROOT / "tests"))
    procs = [subprocess.Popen([sys.executable, "-c", script, str(i), str(n), str(meet)],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(n)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    assert sorted(os.listdir(meet)) == [str(i) for i in range(n)]  # all of them built
    # each process runs a complete entry (its own or one stored a moment later)
    assert all(int(o[0].split()[-1]) in range(n) for o in outs), outs
    assert not [p for p in cache.iterdir() if p.name.startswith(".tmp-")]
    assert len(list(cache.glob("*.json"))) == 1 and len(list(cache.glob("*.so"))) == n
    kernel_cache._loaded.clear()
    assert kernel_cache.load("fake", CONFIG, "sm_90a")(0) in range(n)


@needs_cc
def test_without_c_compiler_the_object_file_is_the_artefact(cache, monkeypatch):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    assert kernel_cache.load_or_build("fake", CONFIG, "sm_90a", lambda: FakeCompiled(3))(4) == 11
    assert sorted(p.suffix for p in cache.iterdir()) == [".json", ".o"]
    kernel_cache._loaded.clear()
    assert kernel_cache.load("fake", CONFIG, "sm_90a")(4) == 11  # cute.runtime.load_module


def test_unwritable_cache_warns_and_runs_the_compiled_kernel(cache):
    cache.parent.mkdir(parents=True)
    cache.write_text("a file where the directory should be")
    built = FakeCompiled(0)
    with pytest.warns(UserWarning) as w:
        assert kernel_cache.load_or_build("fake", CONFIG, "sm_90a", lambda: built) is built
    assert_expected_inline(re.sub(r"\(.*\)", "(...)", str(w[0].message)).replace(str(cache), "DIR"), """torch_mla: could not store the compiled fake kernel in DIR (...); every process compiles it again""")  # noqa: E501


def test_off_stores_nothing(cache, monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_MLA_CACHE_DIR", "off")
    built = FakeCompiled(0)
    assert kernel_cache.load_or_build("fake", CONFIG, "sm_90a", lambda: built) is built
    assert kernel_cache.load_or_build("fake", CONFIG, "sm_90a", lambda: pytest.fail()) is built
    assert list(tmp_path.iterdir()) == []
    assert precompile.main(["--kernels", "combine"]) == 2


def test_precompile_variants_cover_the_dispatch():
    got = [(v.name, v.key()) for v in registry.variants(["bf16", "fp16"], (False, True),
                                                        ["step", "fp8_step", "fp8_fast",
                                                         "decode", "combine"])]
    assert_expected_inline("\n".join(f"{k} {c}" for k, c in got), """\
step_sm90 {'dtype': 'bf16', 'causal': False}
step_sm90 {'dtype': 'bf16', 'causal': True}
step_sm90 {'dtype': 'bf16', 'causal': False, 'kv': 'e4m3'}
step_sm90 {'dtype': 'bf16', 'causal': True, 'kv': 'e4m3'}
step_sm90 {'dtype': 'bf16', 'causal': False, 'kv': 'e4m3', 'compute': 'fp8'}
step_sm90 {'dtype': 'bf16', 'causal': True, 'kv': 'e4m3', 'compute': 'fp8'}
step_sm90 {'dtype': 'bf16', 'causal': False, 'kv': 'e4m3', 'compute': 'fp8', 'q': 'e4m3'}
step_sm90 {'dtype': 'bf16', 'causal': True, 'kv': 'e4m3', 'compute': 'fp8', 'q': 'e4m3'}
decode_sm90 {'dtype': 'bf16', 'causal': False}
decode_sm90 {'dtype': 'bf16', 'causal': True}
combine {'dtype': 'bf16', 'warps_per_row': 1}
combine {'dtype': 'bf16', 'warps_per_row': 4}
combine {'dtype': 'bf16', 'warps_per_row': 16}
combine {'dtype': 'bf16', 'warps_per_row': 16, 'unroll': 2}
step_sm90 {'dtype': 'fp16', 'causal': False}
step_sm90 {'dtype': 'fp16', 'causal': True}
step_sm90 {'dtype': 'fp16', 'causal': False, 'kv': 'e4m3'}
step_sm90 {'dtype': 'fp16', 'causal': True, 'kv': 'e4m3'}
step_sm90 {'dtype': 'fp16', 'causal': False, 'kv': 'e4m3', 'compute': 'fp8'}
step_sm90 {'dtype': 'fp16', 'causal': True, 'kv': 'e4m3', 'compute': 'fp8'}
decode_sm90 {'dtype': 'fp16', 'causal': False}
decode_sm90 {'dtype': 'fp16', 'causal': True}
combine {'dtype': 'fp16', 'warps_per_row': 1}
combine {'dtype': 'fp16', 'warps_per_row': 4}
combine {'dtype': 'fp16', 'warps_per_row': 16}
combine {'dtype': 'fp16', 'warps_per_row': 16, 'unroll': 2}""")
    got = [(v.name, v.key()) for v in registry.variants(["bf16"], (True,),
                                                        ["decode", "combine", "portable"],
                                                        "sm_90a")]
    got += [(v.name, v.key()) for v in registry.variants(["fp16"], (False,),
                                                         ["decode", "portable"], "sm_86")]
    assert_expected_inline("\n".join(f"{k} {c}" for k, c in got), """\
step_sm80 {'dtype': 'bf16', 'causal': True}
decode_sm90 {'dtype': 'bf16', 'causal': True}
combine {'dtype': 'bf16', 'warps_per_row': 1}
combine {'dtype': 'bf16', 'warps_per_row': 4}
combine {'dtype': 'bf16', 'warps_per_row': 16}
combine {'dtype': 'bf16', 'warps_per_row': 16, 'unroll': 2}
step_sm80 {'dtype': 'fp16', 'causal': False}
decode_sm80 {'dtype': 'fp16', 'causal': False}""")
    from torch_mla.scheduling import CombineConfig

    picked = {COMBINE_VARIANTS[CombineConfig.from_heuristic(b, parts, rows).variant]
              for b in (1, 2, 8, 32, 128) for parts in (1, 16, 132, 264, 1000)
              for rows in (1, 16, 128, 512)}
    assert picked == set(COMBINE_VARIANTS)


def test_precompile_variants_of_the_small_kernels():
    """schedule and append_kv for any arch (the decode kernels only for sm_90a); append_kv in
    every combination its dispatch compiles (dispatch.find_append_kernel): over a
    float8_e4m3fn cache from sm_89 up."""
    got = [(v.name, v.key()) for v in registry.variants(["bf16"], (False,),
                                                        list(registry.KERNELS), "sm_80")]
    assert_expected_inline("\n".join(f"{k} {c}" for k, c in got), """\
schedule {}
step_sm80 {'dtype': 'bf16', 'causal': False}
sparse_step_sm80 {'dtype': 'bf16'}
sparse_step_sm80 {'dtype': 'bf16', 'kv': 'e4m3'}
sparse_step_sm80 {'dtype': 'bf16', 'kv': 'fp8_ds_mla'}
decode_sm80 {'dtype': 'bf16', 'causal': False}
combine {'dtype': 'bf16', 'warps_per_row': 1}
combine {'dtype': 'bf16', 'warps_per_row': 4}
combine {'dtype': 'bf16', 'warps_per_row': 16}
combine {'dtype': 'bf16', 'warps_per_row': 16, 'unroll': 2}
append_kv {'cache': 'bf16', 'source': 'bf16', 'slot': 'int32'}
append_kv {'cache': 'bf16', 'source': 'bf16', 'slot': 'int64'}
append_kv {'cache': 'bf16', 'source': 'fp16', 'slot': 'int32'}
append_kv {'cache': 'bf16', 'source': 'fp16', 'slot': 'int64'}
append_kv {'cache': 'bf16', 'source': 'fp32', 'slot': 'int32'}
append_kv {'cache': 'bf16', 'source': 'fp32', 'slot': 'int64'}""")
    assert len(registry.variants(["bf16", "fp16"], (False, True), list(registry.KERNELS))) \
        == 1 + 2 * (2 * 2 + 2 + 15 + 2 + 4 + 6 + 16 + 8 + 6 + 4) + 2 + 2 + 2 + 6 - 5 + 4 + 6 \
        + 3 + 3 + 1 + 2  # schedule;
    # per dtype: sm90 + portable steps, fp8 steps, the sparse steps (portable, SM90 and keys-on-M
    # (3 column counts) over the three cache formats, the 656-byte one bf16 only: - 5),
    # decode, combine (4 variants), append_kv, the
    # keys-on-M steps (4 column counts x 2 cache formats x causal or not), its ping-pong steps
    # over e4m3 (4 column counts x causal or not) and their fast mode (3), the sparse
    # ping-pong steps ("sparse_rs", opt-in: e4m3, 4 column counts; + 4: the 656-byte rows,
    # bf16 only); fast-mode fp8
    # steps
    # (q in dtype: 2 per dtype; q e4m3: 2, bf16 only); append_kv over an e4m3 cache; the
    # fast-mode steps again with P dithered ("fp8_dither", opt-in: 2 per dtype + 2: + 6); the
    # SM90 sparse steps with a producer warpgroup ("sparse_producer", opt-in: the 16-bit cache
    # and, bf16 only, the 656-byte rows: + 3), and with its warpgroup split ("sparse_split":
    # the same, + 3, and its cluster pair over the 656-byte rows, bf16 only: + 1; its short
    # build beside each of its two builds over the 656-byte rows: + 2)
    # The SM90 sparse steps only for sm_90a (run where ops.sparse.sm90_sparse_pays; its split
    # variant over the 16-bit cache at 64-128 heads).
    assert [(v.name, v.key()) for v in registry.variants(["fp16"], (False,), ["sparse"])] == [
        ("sparse_step_sm80", {"dtype": "fp16"}),
        ("sparse_step_sm80", {"dtype": "fp16", "kv": "e4m3"}),
        ("sparse_step_sm90", {"dtype": "fp16"}),
        ("sparse_step_sm90", {"dtype": "fp16", "kv": "e4m3"}),
        ("sparse_step_sm90_split", {"dtype": "fp16"})] + [
        ("sparse_step_sm90_keysm", dict(dtype="fp16", **kv, columns=n))
        for kv in ({}, {"kv": "e4m3"}) for n in (8, 16, 32)]
    for bad in [("sm90", "fp16", "fp8_ds_mla"), ("sm80", "fp16", "fp8_ds_mla"),
                ("sm80", "bf16", "fp8"), ("sm90_keysm", "fp16", "fp8_ds_mla", 16),
                ("sm90_keysm", "bf16", "plain", 64), ("sm90", "bf16", "plain", 16)]:
        with pytest.raises(ValueError, match="no sparse decode kernel"):
            registry.SparseStepConfig(*bad)
    assert registry.SparseStepConfig("sm90", "bf16").entry == \
        "sm90_sparse_decode:compile_sparse_step"
    fp8_append = {arch: sorted((v.config.source, v.config.slot) for v in registry.variants(
        ["bf16"], (False,), ["append_kv"], arch) if v.config.cache == "e4m3")
        for arch in ("sm_80", "sm_86", "sm_89", "sm_90a", "sm_100a", "sm_120a")}
    assert {a: len(v) for a, v in fp8_append.items()} == {
        "sm_80": 0, "sm_86": 0, "sm_89": 6, "sm_90a": 6, "sm_100a": 6, "sm_120a": 6}
    assert "sm_80" in registry.ARCHS and registry.ARCHS[0] == "sm_90a"


@needs_cc
def test_precompile_cli(cache, monkeypatch, capsys):
    def fake_build(config, arch):
        assert config.name == "combine", config  # (a real compile: not in this test)
        return FakeCompiled(config.warps_per_row)

    monkeypatch.setattr(registry, "build", fake_build)

    def run(*argv):
        # --jobs 1: in this process, where the stand-in compile is patched in
        assert precompile.main(["--arch", "sm_90a", "--jobs", "1", *argv]) == 0
        out = capsys.readouterr().out.replace(str(cache), "DIR")
        out = re.sub(r"-[0-9a-f]{16}\.[0-9a-f]{16}\.so", "-KEY.SHA.so", out)
        out = re.sub(r"variants in \d+\.\d s", "variants in T s", out)
        return re.sub(r"\d+\.\d(?= s)", lambda m: "T".rjust(len(m[0])), out)

    assert_expected_inline(run("--kernels", "combine", "--dtypes", "bf16"), """\
built      combine      dtype=bf16 warps_per_row=1        T s  DIR/combine-dtype=bf16-warps_per_row=1-KEY.SHA.so
built      combine      dtype=bf16 warps_per_row=4        T s  DIR/combine-dtype=bf16-warps_per_row=4-KEY.SHA.so
built      combine      dtype=bf16 warps_per_row=16       T s  DIR/combine-dtype=bf16-warps_per_row=16-KEY.SHA.so
built      combine      dtype=bf16 warps_per_row=16 unroll=2      T s  DIR/combine-dtype=bf16-warps_per_row=16-unroll=2-KEY.SHA.so
4 variants in T s, 1 process: 4 built, 0 cached, 0 not stored
cache: DIR
""")  # noqa: E501
    kernel_cache._loaded.clear()  # a second run, in another process
    assert_expected_inline(run("--kernels", "combine", "--dtypes", "bf16,fp16"), """\
cached     combine      dtype=bf16 warps_per_row=1        T s  DIR/combine-dtype=bf16-warps_per_row=1-KEY.SHA.so
cached     combine      dtype=bf16 warps_per_row=4        T s  DIR/combine-dtype=bf16-warps_per_row=4-KEY.SHA.so
cached     combine      dtype=bf16 warps_per_row=16       T s  DIR/combine-dtype=bf16-warps_per_row=16-KEY.SHA.so
cached     combine      dtype=bf16 warps_per_row=16 unroll=2      T s  DIR/combine-dtype=bf16-warps_per_row=16-unroll=2-KEY.SHA.so
built      combine      dtype=fp16 warps_per_row=1        T s  DIR/combine-dtype=fp16-warps_per_row=1-KEY.SHA.so
built      combine      dtype=fp16 warps_per_row=4        T s  DIR/combine-dtype=fp16-warps_per_row=4-KEY.SHA.so
built      combine      dtype=fp16 warps_per_row=16       T s  DIR/combine-dtype=fp16-warps_per_row=16-KEY.SHA.so
built      combine      dtype=fp16 warps_per_row=16 unroll=2      T s  DIR/combine-dtype=fp16-warps_per_row=16-unroll=2-KEY.SHA.so
8 variants in T s, 1 process: 4 built, 4 cached, 0 not stored
cache: DIR
""")  # noqa: E501
    assert kernel_cache.load("combine", {"dtype": "fp16", "warps_per_row": 16}, "sm_90a")(1) == 18


PARALLEL_SCRIPT = r"""
import json, sys
from torch_mla import precompile
rc = precompile.main(sys.argv[1:])
print(json.dumps({"rc": rc, "dsl": sorted(m for m in sys.modules if m.split(".")[0] == "cutlass"
                                          or "cute_kernels" in m)}))
"""


def test_precompile_worker_start_never_raises(monkeypatch):
    # A worker initializer that raises makes multiprocessing.Pool start new workers forever
    # (session 44: a machine without the DSL hung a precompile until its call's limit); the
    # warm-up import's failure is left to the build, which reports it.
    import builtins

    from torch_mla import precompile

    real_import = builtins.__import__

    tried = []

    def no_dsl(name, *args, **kwargs):
        if name.startswith("cutlass"):
            tried.append(name)
            raise ModuleNotFoundError("No module named 'cutlass'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_dsl)
    precompile._worker_start()  # (returns: the failed import is swallowed)
    assert tried == ["cutlass.cute"]  # (the warm-up import was attempted)


@needs_cc
def test_precompile_in_parallel_processes(tmp_path):
    """--jobs 2 compiles real kernels (the cheapest: the schedule and the combine, for sm_80) in
    two worker processes, each storing its entries; the parent imports no DSL, prints a line
    per variant and the total, and every variant it lists is in the cache."""
    env = {k: v for k, v in os.environ.items() if k != "CUTE_DSL_ARCH"}
    env["TORCH_MLA_CACHE_DIR"] = str(tmp_path)
    argv = ["--arch", "sm_80", "--kernels", "schedule,combine", "--dtypes", "bf16", "--jobs", "2"]
    res = subprocess.run([sys.executable, "-c", PARALLEL_SCRIPT, *argv], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    *lines, total, where, result = res.stdout.strip().splitlines()
    assert json.loads(result) == {"rc": 0, "dsl": []}
    todo = registry.variants(["bf16"], (False, True), ["schedule", "combine"], "sm_80")
    assert len(todo) == 5 and len(lines) == 5, res.stdout
    assert re.fullmatch(r"5 variants in \d+\.\d s, 2 processes: 5 built, 0 cached, 0 not stored",
                        total), total
    got = {}
    for line in lines:
        what, name, *cfg, seconds, unit, path = line.split()
        assert what == "built" and unit == "s" and float(seconds) > 0, line
        got[(name, " ".join(cfg))] = Path(path)
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setenv("TORCH_MLA_CACHE_DIR", str(tmp_path))
    try:
        assert where == f"cache: {kernel_cache.cache_dir('sm_80')}"
        for v in todo:
            path = got[(v.name, " ".join(f"{k}={x}" for k, x in v.key().items()))]
            assert path == kernel_cache.artefact(v.name, v.key(), "sm_80") and path.exists(), v
    finally:
        monkeypatch.undo()


DSL_SCRIPT = r"""
import json, os, sys
import torch
from torch_mla.ops import kernel_cache, registry
fn = registry.compiled(registry.CombineKernelConfig("bf16", 4), "sm_90a")
imported = sorted(m for m in sys.modules if m.split(".")[0] == "cutlass" or "cute_kernels" in m)
try:  # CPU tensors: the compiled launcher checks its arguments before touching a GPU
    fn(torch.zeros(3, dtype=torch.int32), torch.randn(5, 16, 512), torch.randn(5, 16),
       torch.empty(2, 16, 512, dtype=torch.bfloat16), torch.empty(2, 16, 1),
       torch.zeros(2, 3, dtype=torch.int32), torch.zeros(2, dtype=torch.int32), 4)
    err = None
except Exception as e:
    err = f"{type(e).__name__}: {e}"
print(json.dumps({"type": type(fn).__name__, "imported": len(imported),
                  "CUTE_DSL_ARCH": os.environ.get("CUTE_DSL_ARCH"), "error": err}))
"""


@needs_cc
def test_dsl_kernel_round_trip(tmp_path):
    """A real kernel compiled for sm_90a here (no GPU, no CUTE_DSL_ARCH), stored, and loaded by a
    fresh process without importing the DSL or the kernel classes; both are the same TVM-FFI
    function, which takes torch tensors (it rejects CPU ones with the compiled signature)."""
    env = {k: v for k, v in os.environ.items() if k != "CUTE_DSL_ARCH"}
    env["TORCH_MLA_CACHE_DIR"] = str(tmp_path)

    def child():
        res = subprocess.run([sys.executable, "-c", DSL_SCRIPT], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stderr[-4000:]
        return json.loads(res.stdout.strip().splitlines()[-1])

    cold, warm = child(), child()
    assert cold["type"] == warm["type"] == "Function"
    assert cold["imported"] > 0 and warm["imported"] == 0  # warm: no DSL, no kernel class
    assert cold["CUTE_DSL_ARCH"] is None  # compiling for sm_90a changed no environment
    assert cold["error"] == warm["error"]
    assert_expected_inline(warm["error"], """ValueError: Mismatched Tensor on argument #0 when calling: `__call__(mNumSplits: Tensor([n0], int32), mOacc: Tensor([n1, n2, 512], float32), mLSEacc: Tensor([n1, n2], float32), mO: Tensor([n3, n2, 512], bfloat16), mLSE: Tensor([n3, n4, n5], float32), mBlockTable: Tensor([n3, n6], int32), mSeqlens: Tensor([n3], int32), num_pages: int32)`, expected device_type=cuda""")  # noqa: E501
    (sidecar,) = (tmp_path / kernel_cache.versions()["torch_mla"]).rglob("*.json")
    key = json.loads(sidecar.read_text())["key"]
    assert {k: key[k] for k in ("kernel", "config", "arch")} == {
        "kernel": "combine", "config": {"dtype": "bf16", "warps_per_row": 4}, "arch": "sm_90a"}
    assert sidecar.parent.relative_to(tmp_path).parts[1:] == (
        metadata.version("nvidia-cutlass-dsl"), "sm_90a")


def test_p_dither_is_the_sm90_fast_modes_own():
    """DecodeStepConfig.p_dither (TORCH_MLA_FAST_DITHER=1's steps): the SM90 kernel's fast mode
    only, a cache entry of its own."""
    fast = dict(kv_fp8=True, compute="fp8")
    key = registry.DecodeStepConfig("sm90", "bf16", False, p_dither=True, **fast).key()
    assert key == {"dtype": "bf16", "causal": False, "kv": "e4m3", "compute": "fp8",
                   "p": "dither"}
    assert "p" not in registry.DecodeStepConfig("sm90", "bf16", False, **fast).key()
    for bad in (dict(backend="sm90", kv_fp8=True),
                dict(backend="sm90_keysm_fast", columns=16, **fast)):
        with pytest.raises(ValueError, match="p_dither"):
            registry.DecodeStepConfig(dtype="bf16", causal=False, p_dither=True, **bad)
