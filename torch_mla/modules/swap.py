"""``swap_mla_attention``: puts MultiheadLatentAttention into a loaded transformers model."""

from __future__ import annotations

import torch
from torch import nn

from .attention import MultiheadLatentAttention

# transformers' MLA attentions whose forward MultiheadLatentAttention reproduces.
SUPPORTED_ATTENTIONS = ("DeepseekV3Attention", "DeepseekV2Attention")
SUPPORTED_ATTN_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2", "flash_attention_3")
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _is_mla_like(module: nn.Module) -> bool:
    return hasattr(module, "kv_a_proj_with_mqa") and hasattr(module, "kv_b_proj")


def _check(name: str, attn: nn.Module) -> None:
    for proj in ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"):
        lin = getattr(attn, proj, None)
        if lin is None:
            continue
        if not isinstance(lin, nn.Linear) or lin.weight.dtype not in _FLOAT_DTYPES:
            raise NotImplementedError(
                f"{name}.{proj} is a {type(lin).__name__} with {lin.weight.dtype} weights; "
                "swap_mla_attention needs plain nn.Linear layers in fp32/bf16/fp16 (the decode "
                "path multiplies kv_b_proj.weight into the query and the output). Load or "
                "dequantize the model in bf16 first"
            )
    if attn.kv_b_proj.bias is not None:
        raise NotImplementedError(f"{name}.kv_b_proj has a bias, which cannot be absorbed")
    if attn.qk_rope_head_dim % 2:
        raise NotImplementedError(f"{name}: qk_rope_head_dim must be even, got "
                                  f"{attn.qk_rope_head_dim}")
    if attn.layer_idx is None:
        raise ValueError(f"{name} has no layer_idx: the cache cannot tell its layers apart")


def swap_mla_attention(model: nn.Module) -> nn.Module:
    """Replaces every DeepSeek-V2/V3 attention of ``model`` by :class:`MultiheadLatentAttention`,
    in place, sharing the weights (nothing is copied; the state dict keeps its keys).

    Decode then runs on torch_mla's ops when the model is given an :class:`MLACache`
    (``MLACache.for_model(model, max_batch_size, max_cache_len)``).

    Raises:
        ValueError: the model has no DeepSeek-V2/V3 attention.
        NotImplementedError: what the module cannot reproduce: another MLA variant, quantized
            projections, a bias in kv_b_proj, an attention implementation other than eager,
            sdpa or flash attention (flex attention's block masks).

    Returns:
        ``model``, for chaining.
    """
    targets = []
    for name, module in model.named_modules():
        if isinstance(module, MultiheadLatentAttention):
            continue
        if type(module).__name__ in SUPPORTED_ATTENTIONS:
            _check(name, module)
            targets.append((name, module))
        elif _is_mla_like(module):
            raise NotImplementedError(
                f"{name} is a {type(module).__name__}, an MLA attention swap_mla_attention does "
                f"not know (supported: {', '.join(SUPPORTED_ATTENTIONS)}); its forward may "
                "differ, so it is left alone and nothing was swapped"
            )
    if not targets:
        if any(isinstance(m, MultiheadLatentAttention) for m in model.modules()):
            return model  # already swapped
        raise ValueError(
            f"{type(model).__name__} has no {' or '.join(SUPPORTED_ATTENTIONS)} module to swap; "
            "swap_mla_attention is for transformers' DeepSeek-V2/V3 models"
        )
    impl = getattr(targets[0][1].config, "_attn_implementation", None) or "eager"
    if impl not in SUPPORTED_ATTN_IMPLEMENTATIONS:
        raise NotImplementedError(
            f"the model uses attn_implementation={impl!r}, whose masks MultiheadLatentAttention "
            f"cannot read; load it with attn_implementation='sdpa' or 'eager'"
        )
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, MultiheadLatentAttention.from_hf(module))
    return model
