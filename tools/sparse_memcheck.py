"""One sparse decode under compute-sanitizer (memcheck): entries -1, repeated, past
topk_length (garbage there), split over parts; run as
``compute-sanitizer --tool memcheck python -m tools.sparse_memcheck``."""

import torch

import torch_mla


def main() -> None:
    torch.manual_seed(0)
    cache = torch.randn(40, 64, 1, 576, device="cuda").bfloat16()
    b, s_q, h_q, topk = 2, 2, 16, 1024
    idx = torch.randint(0, 40 * 64, (b, s_q, topk), dtype=torch.int32, device="cuda")
    idx[..., ::5] = -1
    lens = torch.tensor([topk, 300], dtype=torch.int32, device="cuda")
    idx[1, :, 300:] = 2**31 - 1  # past topk_length: never read
    q = torch.randn(b, s_q, h_q, 576, device="cuda").bfloat16()
    out, lse = torch_mla.mla_decode_sparse(q, cache, idx, topk_length=lens)
    torch.cuda.synchronize()
    print("ok", out.float().abs().sum().item(), lse.isfinite().all().item())


if __name__ == "__main__":
    main()
