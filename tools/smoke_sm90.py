"""Quick GPU smoke test of the SM90 decode kernel: a few configurations, errors printed."""

import sys
import time

import torch

import torch_mla
from torch_mla.reference import mla_decode_reference
from torch_mla.testing import make_decode_inputs

CASES = [
    ([100, 700], 1, 16, False),
    ([4096, 0, 65], 2, 128, True),
    ([64, 1, 2000, 130], 1, 128, False),
    ([20, 140, 4096, 0], 4, 9, True),
    ([1], 1, 128, False),  # most parts lie inside the request's overhead units: no block
    ([3000], 1, 64, False),  # one request cut into ~50 pieces: 4-warp combine
]


def main():
    ok = True
    for lens, s_q, h_q, causal in CASES:
        inp = make_decode_inputs(lens, s_q, h_q, device="cuda")
        sched = torch_mla.get_decode_schedule(inp.cache_seqlens, s_q, h_q)
        t = time.time()
        out, lse = torch_mla.mla_decode(inp.q, inp.kv_cache, inp.block_table, inp.cache_seqlens,
                                        sched, causal=causal)
        torch.cuda.synchronize()
        dt = time.time() - t
        ref, ref_lse = mla_decode_reference(inp.q, inp.kv_cache, inp.block_table,
                                            inp.cache_seqlens, 576**-0.5, causal, 512)
        err = (out.float() - ref.float()).abs().max().item()
        rel = ((out.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-30)).item()
        fin = torch.isfinite(ref_lse)
        lse_err = (lse[fin] - ref_lse[fin]).abs().max().item() if fin.any() else 0.0
        inf_ok = torch.equal(torch.isposinf(lse), torch.isposinf(ref_lse))
        nan = out.isnan().any().item() or lse.isnan().any().item()
        good = (not nan) and inf_ok and err < 2e-2 and lse_err < 1e-3
        ok &= good
        print(f"lens={lens} s_q={s_q} h_q={h_q} causal={causal}: first call {dt:.1f}s "
              f"max|err|={err:.2e} rel={rel:.2e} lse_err={lse_err:.2e} inf_ok={inf_ok} "
              f"nan={nan} {'OK' if good else 'FAIL'}", flush=True)
        if not good:
            bad = (out.float() - ref.float()).abs().amax(dim=-1)  # (b, s_q, h_q)
            print("  per (b, s_q) max err:", bad.amax(-1).tolist(), flush=True)
            print("  lse:", lse[:, :4, 0].tolist(), "ref:", ref_lse[:, :4, 0].tolist())
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
