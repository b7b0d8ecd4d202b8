"""One sparse decode under compute-sanitizer (memcheck): entries -1, repeated, past
topk_length (garbage there), split over parts; run as
``compute-sanitizer --tool memcheck python -m tools.sparse_memcheck [--cache e4m3|fp8_ds_mla]
[--heads H]`` (over a float8_e4m3fn cache or the 656-byte FP8 rows: NaN bytes in every slot no
entry names; H query heads, default 16)."""

import argparse

import torch

import torch_mla
from torch_mla.reference_sparse import quantize_fp8_ds_mla


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", choices=["bf16", "e4m3", "fp8_ds_mla"], default="bf16")
    ap.add_argument("--heads", type=int, default=16)
    args = ap.parse_args()
    torch.manual_seed(0)
    cache = torch.randn(40, 64, 1, 576, device="cuda").bfloat16()
    b, s_q, h_q, topk = 2, 2, args.heads, 1024
    idx = torch.randint(0, 40 * 64, (b, s_q, topk), dtype=torch.int32, device="cuda")
    idx[..., ::5] = -1
    lens = torch.tensor([topk, 300], dtype=torch.int32, device="cuda")
    kv_scale = None
    if args.cache != "bf16":
        named = torch.zeros(40 * 64, dtype=torch.bool, device="cuda")
        named[idx[0][idx[0] >= 0].long()] = True
        named[idx[1, :, :300][idx[1, :, :300] >= 0].long()] = True
        if args.cache == "fp8_ds_mla":
            cache = quantize_fp8_ds_mla(cache[..., :512], cache[..., 512:])
        else:
            kv_scale = (cache.float().abs().amax() / 448).reshape(1)
            cache = (cache.float() / kv_scale).to(torch.float8_e4m3fn)
        cache.view(torch.uint8).view(40 * 64, -1)[~named] = 0xFF
    idx[1, :, 300:] = 2**31 - 1  # past topk_length: never read
    q = torch.randn(b, s_q, h_q, 576, device="cuda").bfloat16()
    out, lse = torch_mla.mla_decode_sparse(q, cache, idx, topk_length=lens, kv_scale=kv_scale)
    torch.cuda.synchronize()
    print("ok", args.cache, out.float().abs().sum().item(), out.isfinite().all().item(),
          lse.isfinite().all().item())


if __name__ == "__main__":
    main()
