"""Fast mode's error (compute="fp8") against the e4m3 storage error, and where it comes from.

    python -m tools.fast_mode_error                 # H200: the kernel by part count, emulations
    python -m tools.fast_mode_error --device cpu --lengths 300      # plumbing check on a CPU

For each (h_q, data, length): one request of random latents (randn / 10; "outliers": 4 latent
channels 30x the rest), q randn / 10, the cache in e4m3 at kv_scale = amax / 448. Printed, each
as |out - ref| / |ref| over e_store (ref: the reference over the dequantized cache; e_store:
ref against the reference over the original latents; tests/test_fp8.py's check_fast_mode
allows 2.5):
  - the kernel mla_decode(compute="fp8") picks, under schedules of 1, 8 and 132 parts (shorter
    segments: fewer steps accumulated in one wgmma accumulator);
  - emulations in float64 with Q in e4m3 per row (448 / its largest |q|, as both fast kernels
    quantize it) and one softmax max over the request: P as e4m3(2^8 p) rounded to nearest (the
    heads-on-M fast mode's P), the same after a dither of one e4m3 step, random or taken from
    bits 8-15 of p in fp32 (free of a random source: what a kernel could use), and P in f16
    (the keys-on-M fast kernel's numerics).
On a CPU mla_decode is the reference (its columns read 0). docs/kernels/keysm.md, "Fast mode's
error", has the H200's numbers and their reading.
"""

from __future__ import annotations

import argparse

import torch

import torch_mla
from torch_mla.reference import dequantize_fp8, mla_decode_reference, quantize_fp8
from torch_mla.testing import make_decode_inputs

SCALE = 576**-0.5


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def e4m3(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float8_e4m3fn).double()


def emulate(q: torch.Tensor, k: torch.Tensor, g: torch.Generator) -> dict:
    """Fast mode's output for q [h, 576] over the dequantized keys k [L, 576] (V = k[:, :512]),
    float64, one max over the request: P in e4m3 rounded to nearest, dithered (random; by p's
    own low bits in fp32), and in f16."""
    qa = q.abs().amax(-1, keepdim=True).clamp(min=1e-30)
    s = (e4m3(q * 448 / qa) * qa / 448) @ k.T * SCALE
    # 2^P_SHIFT p (sm90_decode.P_SHIFT), in fp32 as a kernel holds it
    p = (torch.exp(s - s.amax(-1, keepdim=True)) * 256).float()
    low = (((p.view(torch.int32) >> 8) & 0xFF) ^ 0x80).double()  # (ptx.e4m3_dither's bits)
    p = p.double()
    step = torch.exp2(torch.floor(torch.log2(p.clamp(min=2**-6))) - 3)  # e4m3's step at p
    u = torch.rand(p.shape, generator=g, dtype=torch.float64, device=p.device) - 0.5
    forms = {"e4m3": e4m3(p), "dither": e4m3(p + u * step),
             "low bits": e4m3(p + ((low + 0.5) / 256 - 0.5) * step), "f16": p.half().double()}
    return {name: (P @ k[:, :512]) / p.sum(-1, keepdim=True) for name, P in forms.items()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--lengths", default="4096,16384,60000")
    ap.add_argument("--heads", default="64,128")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    g = torch.Generator(device=device)
    g.manual_seed(0)
    print("| h_q | data | length | e_store | kernel, 1 / 8 / 132 parts | emulated P e4m3 | "
          "dithered | dithered by low bits | f16 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for h_q in (int(x) for x in args.heads.split(",")):
        for outliers in (False, True):
            for L in (int(x) for x in args.lengths.split(",")):
                inp = make_decode_inputs([L], 1, h_q, device=device, generator=g)
                if outliers:
                    inp.kv_cache[..., :4] *= 30
                cache = inp.kv_cache.float()
                kv_scale = (cache.nan_to_num(0).abs().amax() / 448).reshape(1)
                c8 = quantize_fp8(cache, kv_scale)
                tail = (inp.block_table, inp.cache_seqlens)
                ref, _ = mla_decode_reference(inp.q, c8, *tail, SCALE, False, 512,
                                              kv_scale=kv_scale)
                orig, _ = mla_decode_reference(inp.q, inp.kv_cache, *tail, SCALE, False, 512)
                e_store = rel(ref, orig)
                kernel = []
                for parts in (1, 8, 132):
                    sched = torch_mla.get_decode_schedule(inp.cache_seqlens, 1, h_q,
                                                          num_sms=parts)
                    out, _ = torch_mla.mla_decode(inp.q, c8, *tail, sched, softmax_scale=SCALE,
                                                  kv_scale=kv_scale, compute="fp8")
                    kernel.append(f"{rel(out, ref) / e_store:.2f}")
                pages = inp.block_table[0, :(L + 63) // 64].long()
                k = dequantize_fp8(c8, kv_scale)[pages].reshape(-1, 576)[:L].double()
                emu = emulate(inp.q[0, 0].double(), k, g)
                r0 = ref[0, 0]
                print(f"| {h_q} | {'4 channels x 30' if outliers else 'plain'} | {L} | "
                      f"{e_store:.2e} | {' / '.join(kernel)} | "
                      + " | ".join(f"{rel(emu[n], r0) / e_store:.2f}"
                                   for n in ("e4m3", "dither", "low bits", "f16")) + " |",
                      flush=True)


if __name__ == "__main__":
    main()
