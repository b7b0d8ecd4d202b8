"""Time the first decode call of a fresh process (GPU): the kernels come from the disk cache
when it holds them (TORCH_MLA_CACHE_DIR, torch_mla/ops/kernel_cache.py), else they compile.

    TORCH_MLA_CACHE_DIR=/tmp/tmc python -m tools.first_call     # cold: compiles and stores
    TORCH_MLA_CACHE_DIR=/tmp/tmc python -m tools.first_call     # warm: loads

Prints the import times, the first call (schedule + decode + combine, synchronised), a second
call, the error against the fp32 reference, and whether the DSL was imported at all.
"""

import sys
import time

t0 = time.perf_counter()
import torch  # noqa: E402

t1 = time.perf_counter()
import torch_mla  # noqa: E402
from torch_mla.testing import make_decode_inputs  # noqa: E402

t2 = time.perf_counter()


def main():
    s_q, h_q = 1, 128
    inp = make_decode_inputs([1000, 3000, 65, 4096], s_q, h_q, device="cuda")
    torch.cuda.synchronize()

    def step():
        sched = torch_mla.get_decode_schedule(inp.cache_seqlens, s_q, h_q)
        out = torch_mla.mla_decode(inp.q, inp.kv_cache, inp.block_table, inp.cache_seqlens,
                                   sched, causal=True)
        torch.cuda.synchronize()
        return out

    t3 = time.perf_counter()
    out, _ = step()
    t4 = time.perf_counter()
    step()
    t5 = time.perf_counter()
    from torch_mla.reference import mla_decode_reference

    ref, _ = mla_decode_reference(inp.q, inp.kv_cache, inp.block_table, inp.cache_seqlens,
                                  576**-0.5, True, 512)
    err = (out.float() - ref.float()).abs().max().item()
    print(f"import torch {t1 - t0:.2f} s | import torch_mla {t2 - t1:.2f} s | first call "
          f"{t4 - t3:.3f} s | second call {1e3 * (t5 - t4):.2f} ms | max |err| {err:.1e} | "
          f"DSL imported: {'cutlass' in sys.modules}")


if __name__ == "__main__":
    main()
