"""The keys-on-M fast kernel's load path alone (development tool, needs the H200).

    python -m tools.keysm_load_only MODE [B,S_Q,S_K,H_Q ...]     (causal where S_Q > 1)

MODE (run each in its own process and TORCH_MLA_CACHE_DIR: a load-only build would otherwise be
cached under the shipped kernel's key):
    real     the shipped fast kernel (cute_kernels/sm90_keysm_fast_decode.py)
    pages    load-only over the shipped ring (one TMA box of 144 rows x 256 bytes a page)
Everything else (schedule, producer, Q, the combine) is the shipped kernel's. Prints per row the
time of one decode call in a CUDA graph (fast mode, benchmarks/bench_decode.run_config; no
check: load-only outputs are garbage), GB/s and % of the copy ceiling. docs/kernels/keysm.md,
"What bounds it", has session 21's numbers (then also over the 64-byte swizzled ring the
ping-pong variant had before session 22) and session 22's from this tool.
"""

from __future__ import annotations

import os
import sys

import cutlass.cute as cute

from torch_mla.cute_kernels import sm90_keysm_fast_decode as fast
from torch_mla.cute_kernels.sm90_keysm_decode import ring_slot

ROWS = ["128,1,8192,16", "64,1,16384,16", "16,1,32768,16"]


class LoadOnly(fast.MLADecodeSm90KeysMFast):
    """The fast kernel whose consumers release each page's ring stage as soon as it lands."""

    @cute.jit
    def _block(self, blk, valid, L, col0, min_border, scale_log2, cnt, tidx, wg, wq, lane, ops,
               acc_S, acc_O, rP, m_run, l_run, sMax, bar_full, bar_empty):
        s, parity = ring_slot(cnt[0], self.stages)
        cute.arch.mbarrier_wait(bar_full + s, parity)
        cute.arch.sync_warp()
        if lane == 0:
            cute.arch.mbarrier_arrive(bar_empty + s)
        cnt[0] = cnt[0] + 1
        cnt[2] = cnt[2] + 1


def main(argv: list[str]) -> None:
    mode = argv[0] if argv else "real"
    classes = {"real": None, "pages": LoadOnly}
    if mode not in classes:
        raise SystemExit(f"MODE is one of {sorted(classes)}, got {mode!r}")
    if classes[mode] is not None:
        if "TORCH_MLA_CACHE_DIR" not in os.environ:
            raise SystemExit("set TORCH_MLA_CACHE_DIR to a directory of this mode's own")
        fast.MLADecodeSm90KeysMFast = classes[mode]  # (what decode_kernel builds)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
    import bench_decode

    os.environ["TORCH_MLA_KEYSM"] = "1"
    for spec in argv[1:] or ROWS:
        b, s_q, s_k, h_q = (int(x) for x in spec.split(","))
        us, _, gbps, _, _ = bench_decode.run_config(b, s_q, s_k, h_q, s_q > 1, check=False,
                                                    fp8=True, compute="fp8")
        print(f"{mode} b {b} s_q {s_q} s_k {s_k} h_q {h_q}: {us:.1f} us, {gbps:.0f} GB/s "
              f"({100 * gbps / bench_decode.COPY_GBPS:.0f}% of the H200 copy)", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
