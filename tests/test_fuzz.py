"""tools/fuzz_decode.py on the CPU: tiny cases pass, a broken decode is caught, a case replays."""

import os
import sys

import pytest
import torch

import torch_mla.ops.decode as decode

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
import fuzz_decode  # noqa: E402


def fuzz(tmp_path, *argv):
    log = tmp_path / "fuzz.log"
    rc = fuzz_decode.main(["--device", "cpu", "--log", str(log), *argv])
    return rc, log.read_text().splitlines()


def without_time(line):
    return line.rsplit(" ms=", 1)[0]


def test_tiny_cases_pass_and_replay(tmp_path):
    rc, lines = fuzz(tmp_path, "--cases", "20", "--seed", "7")
    assert rc == 0
    assert lines[-1].startswith("summary: cases=20 passed=20 failed=0 ")
    assert [line.split()[:3] for line in lines[:-1]] == [["case", str(k), "PASS"] for k in range(20)]
    # --only draws the same configuration and the same data
    rc, again = fuzz(tmp_path, "--seed", "7", "--only", "13", "4")
    assert rc == 0
    assert [without_time(line) for line in again[:-1]] == [without_time(lines[13]), without_time(lines[4])]


def test_fp8_cases_pass_and_replay(tmp_path):
    """--fp8: the cache quantized to e4m3 (kv_scale), the fp64 computation over the same
    dequantized values; the repro carries the flag."""
    rc, lines = fuzz(tmp_path, "--cases", "6", "--seed", "3", "--fp8")
    assert rc == 0 and lines[-1].startswith("summary: cases=6 passed=6 failed=0 ")
    rc, again = fuzz(tmp_path, "--seed", "3", "--fp8", "--only", "5")
    assert rc == 0 and without_time(again[0]) == without_time(lines[5])
    args = fuzz_decode.parse_args(["--device", "cpu", "--fp8"])
    assert "--fp8" in fuzz_decode.repro(args, 5)


def wrong_scale(real, args):
    q, kv, table, lens, scale, causal, d_v = args
    return real(q, kv, table, lens, scale * 1.25, causal, d_v)


def one_key_too_many(real, args):
    q, kv, table, lens, scale, causal, d_v = args
    return real(q, kv, table, lens + (lens > 0).int(), scale, causal, d_v)


def nonzero_empty_rows(real, args):
    out, lse = real(*args)
    empty = torch.isposinf(lse).transpose(1, 2)[..., None]
    return torch.where(empty, 1e-5, out.float()).to(out.dtype), lse  # 1e-5 is inside atol


@pytest.mark.parametrize("breakage,symptoms,at_least", [
    (wrong_scale, ["lse_tol="], 4),
    (one_key_too_many, [" nan ", "error=IndexError: index 1073741824"], 4),  # NaN slot, poisoned page
    (nonzero_empty_rows, ["empty_nonzero"], 1),  # of these 8 cases, one has a query row that sees no key
])
def test_broken_decode_is_caught(tmp_path, monkeypatch, capsys, breakage, symptoms, at_least):
    real = decode.mla_decode_reference
    monkeypatch.setattr(decode, "mla_decode_reference", lambda *args: breakage(real, args))
    rc, lines = fuzz(tmp_path, "--cases", "8", "--seed", "7")
    assert rc == 1
    failed = [line for line in lines[:-1] if line.split()[2] == "FAIL"]
    assert len(failed) >= at_least and all(any(s in line for s in symptoms) for line in failed)
    assert lines[-1].startswith(f"summary: cases=8 passed={8 - len(failed)} failed={len(failed)} ")
    # each failure is printed with the command that replays it
    printed = capsys.readouterr().out.splitlines()
    k = failed[0].split()[1]
    assert printed[0] == failed[0]
    assert printed[1] == (f"  repro: python -m tools.fuzz_decode --device cpu --seed 7 --max-b 4 --max-len 320 "
                          f"--max-tokens 1024 --max-h-kv 1 --schedule random --only {k}")


def one_key_short(real, args, kwargs):
    q, kv, table, lens, *rest = args
    return real(q, kv, table, (lens - 1).clamp(min=0), *rest, **kwargs)


def test_fast_cases_pass_and_a_missed_key_is_caught(tmp_path, monkeypatch):
    """--fast: fast mode's bounds (2.5 x e_store, lse within Q's rounding); on the CPU the decode
    is the reference, so the cases pass, and a decode that misses each request's last key
    fails them (a softmax scale 1.25x too large would not: the bounds are that loose); the
    repro carries the flag."""
    rc, lines = fuzz(tmp_path, "--cases", "6", "--seed", "3", "--fast")
    assert rc == 0 and lines[-1].startswith("summary: cases=6 passed=6 failed=0 ")
    assert "--fast" in fuzz_decode.repro(fuzz_decode.parse_args(["--device", "cpu", "--fast"]), 5)
    real = decode.mla_decode_reference
    monkeypatch.setattr(decode, "mla_decode_reference",
                        lambda *args, **kwargs: one_key_short(real, args, kwargs))
    rc, lines = fuzz(tmp_path, "--cases", "8", "--seed", "7", "--fast")
    failed = [line for line in lines[:-1] if line.split()[2] == "FAIL"]
    assert rc == 1 and len(failed) == 8, lines
    assert all("error=" not in line for line in failed), failed  # failed on the bounds
