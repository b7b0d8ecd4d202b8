"""FlashMLA's own sparse-decode correctness cases, run through torch_mla.compat.flash_mla.

    python -m tools.flashmla_sparse_tests FLASHMLA_TESTS_DIR [--limit N] [--every K]

FLASHMLA_TESTS_DIR is the tests/ folder of a deepseek-ai/FlashMLA checkout (9241ae3 was used):
test_flash_mla_sparse_decoding.py, lib.py, ref.py, quant.py and kernelkit/. It stays out of this
repository (on the GPU machine: an ignored folder such as .peers/flashmla-tests, carried along).

The module ``flash_mla`` that FlashMLA's test imports is torch_mla.compat.flash_mla here, so
every call the test makes (get_mla_metadata(), flash_mla_with_kvcache(..., indices,
attn_sink, topk_length) over the 656-byte FP8 cache) goes through torch_mla unchanged. Its
case list is FlashMLA's gen_testcase(); this runs the cases our op covers (d_qk 576, the V3.2
layout; d_qk 512 is DeepSeek's MODEL1 layout with extra_* caches, which compat refuses) with
FlashMLA's own comparison (kernelkit.check_is_allclose, its tolerances) and no timing
(num_runs 0: the kineto timing reads FlashMLA's kernel names). Prints one line a case and the
count passed; exit status 1 if any failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys
import time

import torch

import torch_mla.compat.flash_mla as compat


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tests_dir")
    ap.add_argument("--limit", type=int, default=0, help="run at most N cases (0: all)")
    ap.add_argument("--every", type=int, default=1, help="run every K-th case")
    args = ap.parse_args()

    # FlashMLA's test imports `flash_mla`, `lib`, `ref`, `quant` and `kernelkit` as top-level
    # modules from its own folder.
    sys.modules["flash_mla"] = compat
    sys.path.insert(0, args.tests_dir)
    test = importlib.import_module("test_flash_mla_sparse_decoding")

    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    torch.set_default_dtype(torch.bfloat16)  # as FlashMLA's main()
    torch.set_default_device(device)
    torch.set_float32_matmul_precision("high")

    cases = [dataclasses.replace(c, num_runs=0) for c in test.gen_testcase()
             if c.d_qk == 576 and c.check_correctness]
    cases = cases[::args.every]
    if args.limit:
        cases = cases[:args.limit]
    print(f"{len(cases)} FlashMLA sparse-decode cases (d_qk 576) on {device}", flush=True)
    failed = []
    t0 = time.time()
    for i, raw in enumerate(cases):
        p = raw.to_test_param()
        ok = test.test_flash_mla(p).is_correct
        print(f"[{i + 1}/{len(cases)}] {'ok' if ok else 'FAILED'} {raw}", flush=True)
        if not ok:
            failed.append(raw)
    print(f"{len(cases) - len(failed)} passed, {len(failed)} failed "
          f"({time.time() - t0:.0f} s)")
    for raw in failed:
        print("failed:", raw)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
