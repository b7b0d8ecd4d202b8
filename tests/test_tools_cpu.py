"""The maintained tools' CPU parts: tools/record_outputs.py (the bit-identity recorder) on the
reference path, and the shared helpers of torch_mla.testing that the tools use."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import torch_mla
from torch_mla.reference import mla_decode_reference
from torch_mla.scheduling import CombineConfig, DecodeSplitConfig
from torch_mla.testing import (
    DECODE_TOL,
    decode_errors,
    make_decode_inputs,
    mla_decode_fp64,
    parse_config,
    quantize_per_tensor,
)

ROOT = Path(__file__).resolve().parents[1]
# By path: the repository root need not be on sys.path (plain `pytest`).
_spec = importlib.util.spec_from_file_location("record_outputs",
                                               ROOT / "tools" / "record_outputs.py")
rec = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rec)


@pytest.fixture(scope="module")
def recording(tmp_path_factory):
    path = tmp_path_factory.mktemp("rec") / "a.pt"
    assert rec.main(["record", str(path), "--cpu"]) == 0
    return path


def test_record_saves_every_small_case_with_values(recording):
    data = torch.load(recording, weights_only=True)
    keys = [k for k, _ in rec.all_cases(True, torch.device("cpu"))]
    assert list(data["cases"]) == keys and len(set(keys)) == len(keys)
    assert data["header"]["torch_mla"] == os.path.dirname(torch_mla.__file__)
    for key, case in data["cases"].items():
        assert "error" not in case, key
        if key.startswith("decode"):
            # Query rows that see keys have finite outputs; the others out 0, lse +inf.
            assert case["backend"] == "reference"
            lse = case["lse"]
            assert torch.isfinite(lse).any() and not lse.isnan().any(), key
            assert not case["out"].isnan().any(), key
    edges = data["cases"]["decode kv=bf16 q=bf16 causal=0 edges"]
    assert torch.isposinf(edges["lse"][0]).all()  # the request of length 0
    fp8 = data["cases"]["append_kv cache=e4m3 src=bf16 slots=int64"]["cache"]
    assert fp8.dtype == torch.float8_e4m3fn


def test_decode_case_is_the_reference_on_its_inputs():
    """A recorded decode is mla_decode's result on the inputs the key's seed draws."""
    key = "decode kv=fp16 q=fp16 causal=1 edges"
    spec = dict(kv="fp16", q="fp16", causal=True, compute=None, portable=False)
    shape = rec.SMALL_SHAPES["edges"]
    got = rec.decode_case(key, spec, shape, "given", torch.device("cpu"))
    g = rec.generator(key)
    cache, table, lens = rec.paged(g, shape[0], shape[3])
    q = (torch.randn(len(shape[0]), shape[1], shape[2], 576, generator=g) / 10).half()
    ref, ref_lse = mla_decode_reference(q, cache.half(), table, lens, 576**-0.5, True, 512)
    assert torch.equal(got["out"], ref) and torch.equal(got["lse"], ref_lse)


def test_compare_same_file_is_identical(recording, capsys):
    assert rec.main(["compare", str(recording), str(recording)]) == 0
    out = capsys.readouterr().out
    assert "DIFFERS" not in out and "IDENTICAL" in out and "NOT IDENTICAL" not in out


def test_compare_finds_one_flipped_bit_a_nan_pattern_and_a_missing_case(recording, tmp_path,
                                                                        capsys):
    data = torch.load(recording, weights_only=True)
    cases = data["cases"]
    out = cases["decode kv=bf16 q=bf16 causal=0 edges"]["out"]
    bits = out.view(torch.int16)
    bits.view(-1)[100] ^= 1  # the last mantissa bit of one element
    lse = cases["decode kv=fp16 q=fp16 causal=0 hkv2"]["lse"]
    lse.view(-1)[0] = float("nan")
    nan = cases["append_kv cache=bf16 src=bf16 strided"]["cache"]
    flat = nan.view(-1)
    i = int(flat.isnan().nonzero()[0])
    flat.view(torch.int16)[i] ^= 1  # another NaN: same value class, other bits
    del cases["schedule varlen"]
    cases["decode kv=bf16 q=bf16 causal=0 hkv2"]["backend"] = "?"  # unknown: not a difference
    cases["decode kv=fp16 q=fp16 causal=0 edges"]["backend"] = "sm90"
    path = tmp_path / "b.pt"
    torch.save(data, path)
    assert rec.main(["compare", str(recording), str(path)]) == 1
    lines = {ln.split(": ", 1)[0]: ln for ln in capsys.readouterr().out.splitlines()}
    line = lines["decode kv=bf16 q=bf16 causal=0 edges"]
    assert f"out: 1 of {out.numel()} elements differ" in line and "lse" not in line
    assert "max |diff| 0" not in line  # a one-ulp change is a nonzero difference
    assert "lse: 1 of" in lines["decode kv=fp16 q=fp16 causal=0 hkv2"]
    assert "1 NaN positions differ" in lines["decode kv=fp16 q=fp16 causal=0 hkv2"]
    assert "cache: 1 of" in lines["append_kv cache=bf16 src=bf16 strided"]
    assert lines["schedule varlen"].endswith("MISSING in B")
    assert lines["decode kv=bf16 q=bf16 causal=0 hkv2"].endswith("same")
    assert lines["decode kv=fp16 q=fp16 causal=0 edges"].endswith("DIFFERS: backend reference vs sm90")
    assert "4 differ, 1 missing: NOT IDENTICAL" in lines["summary"]


def test_full_case_set_covers_the_issue_grid():
    """The GPU set (not run here): every decode variant, the lengths, heads, query tokens and
    the three warps-per-row choices of the combine, keys unique."""
    cases = list(rec.decode_cases(False))
    keys = [c[0] for c in cases]
    assert len(set(keys)) == len(keys)
    names = {name for name, _ in rec.decode_variants()}
    assert len(names) == 20  # (bf16, fp16, 6 fp8 q/compute, 2 portable) x causal
    assert all(any(k.startswith(f"decode {n} ") for k in keys) for n in names)
    shapes = [c[2] for c in cases]
    lens = {L for s in shapes for L in s[0]}
    assert {0, 1, 63, 64, 65} <= lens and max(lens) >= 4096
    assert {s[1] for s in shapes} == {1, 2, 3, 4} and {1, 16, 64, 128} <= {s[2] for s in shapes}
    assert {len(s[0]) for s in shapes} >= {1, 8, 32}
    warps = set()
    for lens, s_q, h_q, h_kv in shapes:
        parts = DecodeSplitConfig.from_heuristic(s_q, h_q, 132, h_kv).num_parts
        warps.add(CombineConfig.from_heuristic(len(lens), parts, s_q * h_q // h_kv).warps_per_row)
    assert warps == {1, 4, 16}
    appends = [k for k, *_ in rec.append_cases(False)]
    assert len(appends) == 3 * (3 * 2 + 2)
    assert len(list(rec.SCHEDULES)) >= 5


def test_record_by_path_imports_the_torch_mla_on_pythonpath(tmp_path):
    """How the old tree is recorded: the file run by path, that tree first on PYTHONPATH (here
    this checkout, from another directory). Also: neither it nor torch_mla.testing imports
    triton or the DSL."""
    path, script = tmp_path / "s.pt", ROOT / "tools" / "record_outputs.py"
    code = ("import runpy, sys, torch_mla.testing\n"
            f"sys.argv = [{str(script)!r}, 'record', {str(path)!r}, '--cpu', '--only', 'schedule']\n"
            "try:\n"
            f"    runpy.run_path({str(script)!r}, run_name='__main__')\n"
            "except SystemExit as e:\n"
            "    print('exit', e.code, 'triton' in sys.modules, 'cutlass' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True,
                          text=True, timeout=300)
    assert proc.stdout.splitlines()[-1] == "exit 0 False False", proc.stdout + proc.stderr
    header = torch.load(path, weights_only=True)["header"]
    assert header["torch_mla"] == str(ROOT / "torch_mla")
    assert f"torch_mla from {ROOT / 'torch_mla'}" in proc.stdout


def test_decode_errors_in_tolerance_units():
    inp = make_decode_inputs([70, 0], 2, 16)
    ref, ref_lse = mla_decode_reference(inp.q, inp.kv_cache, inp.block_table, inp.cache_seqlens,
                                        576**-0.5, True, 512)
    assert decode_errors(ref, ref_lse, ref, ref_lse, torch.bfloat16) == (0.0, 0.0, False)
    atol, rtol = DECODE_TOL[torch.bfloat16]
    off = ref.float().clone()
    off[0, 0, 0, 0] += 2 * (atol + rtol * off[0, 0, 0, 0].abs())
    ratio, lse_ratio, nan = decode_errors(off, ref_lse, ref, ref_lse, torch.bfloat16)
    assert ratio == pytest.approx(2.0, rel=1e-3) and lse_ratio == 0.0 and not nan
    lse = ref_lse.clone()
    lse[1, 0, 0] = 0.0  # a row that sees no key must keep +inf
    assert decode_errors(ref, lse, ref, ref_lse, torch.bfloat16)[1] == float("inf")


def test_fp64_oracle_agrees_with_the_reference():
    inp = make_decode_inputs([1, 65, 130], 3, 8, h_kv=2, dtype=torch.float32)
    for causal in (False, True):
        ref, ref_lse = mla_decode_reference(inp.q, inp.kv_cache, inp.block_table,
                                            inp.cache_seqlens, 0.05, causal, 512)
        out, lse = mla_decode_fp64(inp.q, inp.kv_cache, inp.block_table, inp.cache_seqlens,
                                   0.05, causal)
        assert torch.allclose(out.float(), ref, atol=1e-5)
        assert torch.allclose(lse.float(), ref_lse, atol=1e-5)


def test_quantize_per_tensor_and_parse_config():
    x = torch.tensor([[1.0, -3.0], [float("nan"), 0.5]])
    codes, scale = quantize_per_tensor(x)
    assert scale.shape == (1,) and float(scale) == pytest.approx(3 / 448)
    assert codes.dtype == torch.float8_e4m3fn and codes[1, 0].float().isnan()
    assert float(codes[0, 1].float() * scale) == pytest.approx(-3.0)
    assert parse_config("128,2,8192,64") == (128, 2, 8192, 64)
    with pytest.raises(ValueError, match="B,S_Q,S_K,H_Q"):
        parse_config("1,2,3")
