"""One keys-on-M kernel choice timed over rows (development tool, needs an SM90 GPU).

    python -m tools.keysm_rows MODE B,S_Q,S_K,H_Q [...]     (causal where S_Q > 1)

MODE picks the kernel through the dispatch's environment flags (TORCH_MLA_KEYSM=128 throughout:
up to 128 rows, a CTA for each 64 above 64):
    bf16    a bf16 cache (the keys-on-M kernel where it takes the rows)
    exact   an e4m3 cache in exact mode, TORCH_MLA_KEYSM_RS=0: the keys-on-M fp8 kernel
    rs      the same with TORCH_MLA_KEYSM_RS=1: the ping-pong variant at every batch
    fast    fast mode (compute="fp8"), TORCH_MLA_KEYSM_FAST=1: the keys-on-M fast variant
    fast0   fast mode, TORCH_MLA_KEYSM_FAST=0: the heads-on-M fast mode
    dither  the same with P dithered (TORCH_MLA_FAST_DITHER=1)
Each row: one decode call (schedule included) captured in a CUDA graph on FlashMLA's test data
(benchmarks/bench_decode.run_config, no reference check), us, GB/s and % of the copy ceiling.
Run two modes in separate processes and compare rows of one machine start: docs/kernels/keysm.md
("Session 23") has the kernel-choice tables it made. TAG (environment) prefixes each line.
"""

from __future__ import annotations

import os
import sys

MODES = {
    "bf16": ({"TORCH_MLA_KEYSM_RS": "0"}, False, "exact"),
    "exact": ({"TORCH_MLA_KEYSM_RS": "0"}, True, "exact"),
    "rs": ({"TORCH_MLA_KEYSM_RS": "1"}, True, "exact"),
    "fast": ({"TORCH_MLA_KEYSM_FAST": "1"}, True, "fp8"),
    "fast0": ({"TORCH_MLA_KEYSM_FAST": "0", "TORCH_MLA_FAST_DITHER": "0"}, True, "fp8"),
    "dither": ({"TORCH_MLA_KEYSM_FAST": "0", "TORCH_MLA_FAST_DITHER": "1"}, True, "fp8"),
}


def parse_row(spec: str) -> tuple[int, int, int, int, bool]:
    """'b,s_q,s_k,h_q' -> run_config's (b, s_q, s_k, h_q, causal), causal where s_q > 1."""
    b, s_q, s_k, h_q = (int(x) for x in spec.split(","))
    return b, s_q, s_k, h_q, s_q > 1


def main(argv: list[str]) -> None:
    if len(argv) < 2 or argv[0] not in MODES:
        raise SystemExit(f"usage: python -m tools.keysm_rows {{{','.join(MODES)}}} "
                         "B,S_Q,S_K,H_Q [...]")
    env, fp8, compute = MODES[argv[0]]
    rows = [parse_row(spec) for spec in argv[1:]]
    os.environ["TORCH_MLA_KEYSM"] = "128"
    os.environ.update(env)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
    import bench_decode as bd

    for spec, cfg in zip(argv[1:], rows):
        us, _, gbps, _, _ = bd.run_config(*cfg, check=False, fp8=fp8, compute=compute)
        print(f"{os.environ.get('TAG', '')} {argv[0]} {spec}: {us:.1f} us, {gbps:.0f} GB/s "
              f"({100 * gbps / bd.COPY_GBPS:.0f}% of the H200 copy)", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
