"""``swap_mla_attention``: puts MultiheadLatentAttention into a loaded transformers model.

Which attentions it swaps is decided by what they compute, not by their class names: many
transformers families (DeepSeek-V2/V3, GLM-4.7-Flash, Youtu, A.X K1, MiniCPM3, Sarvam, Kimi K2.5's
text model) copy DeepSeek's attention under their own name, and others change it (a gate, a
sparse indexer, scaled LoRA latents, position-dependent query scaling, no RoPE). An attention is
DeepSeek-V2/V3's, and swapped, when

- its submodules are exactly ``q_proj`` or ``q_a_proj, q_a_layernorm, q_b_proj``, and
  ``kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj`` (another one, a gate or an indexer,
  takes part in the forward);
- its other attributes are those of DeepSeek's attention (an extra one, such as LongCat's LoRA
  scales, may change the forward);
- its forward takes the model's ``position_embeddings`` (Kimi-Linear's NoPE attention does not);
- its config fields ``kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim, v_head_dim, q_lora_rank``
  and the projections' shapes agree, and the config asks for nothing the module does not compute
  (``rope_parameters["llama_4_scaling_beta"]``: Mistral 4's query scaling).

The RoPE convention follows what the model passes and its config: complex angles (DeepSeek-V2),
``rope_interleave`` (DeepSeek-V3's field), else halves (transformers' rotate_half, MiniCPM3).
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from .attention import MultiheadLatentAttention

SUPPORTED_ATTN_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2", "flash_attention_3")
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_Q_FULL = ("q_proj",)
_Q_LORA = ("q_a_proj", "q_a_layernorm", "q_b_proj")
_KV_OUT = ("kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj")
CONFIG_FIELDS = ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
                 "q_lora_rank")
# The plain attributes of transformers' DeepseekV2Attention / DeepseekV3Attention.
_KNOWN_ATTRIBUTES = frozenset((
    "config", "layer_idx", "attention_dropout", "hidden_size", "num_heads", "q_lora_rank",
    "qk_rope_head_dim", "kv_lora_rank", "v_head_dim", "qk_nope_head_dim", "qk_head_dim",
    "num_key_value_groups", "is_causal", "scaling", *_Q_FULL, *_Q_LORA, "training"))


def is_mla_attention(module: nn.Module) -> bool:
    """Whether ``module`` looks like an MLA attention (a latent down- and up-projection), the
    modules swap_mla_attention examines."""
    names = dict(module.named_children())
    return "kv_a_proj_with_mqa" in names or "kv_b_proj" in names


def mla_difference(attn: nn.Module) -> str | None:
    """What makes ``attn``, an MLA attention (:func:`is_mla_attention`), compute something other
    than DeepSeek-V2/V3's attention; None when it computes exactly that."""
    children = set(dict(attn.named_children()))
    q_names = _Q_FULL if "q_proj" in children else _Q_LORA
    expected = set(q_names + _KV_OUT)
    if extra := sorted(children - expected):
        return (f"it has submodules DeepSeek-V2/V3's attention does not have ({', '.join(extra)}): "
                "they take part in its forward")
    if missing := sorted(expected - children):
        return f"it has no {', '.join(missing)}"
    attributes = {k for k in vars(attn) if not k.startswith("_")}
    if extra := sorted(attributes - _KNOWN_ATTRIBUTES):
        return (f"it has attributes DeepSeek-V2/V3's attention does not have ({', '.join(extra)}), "
                "which may change its forward")
    if "position_embeddings" not in inspect.signature(attn.forward).parameters:
        return "its forward takes no position_embeddings: it applies no RoPE from the model"
    config = getattr(attn, "config", None)
    for field in CONFIG_FIELDS:
        ours, theirs = getattr(attn, field, "missing"), getattr(config, field, "missing")
        if ours != theirs:
            return f"its {field} is {ours} but its config's is {theirs}"
    beta = dict(getattr(config, "rope_parameters", None) or {}).get("llama_4_scaling_beta")
    if beta:
        return (f"it scales its queries by position (rope_parameters['llama_4_scaling_beta'] = "
                f"{beta}, Mistral 4's Llama-4 scaling)")
    H, dn, dr, dv, R = (attn.num_heads, attn.qk_nope_head_dim, attn.qk_rope_head_dim,
                        attn.v_head_dim, attn.kv_lora_rank)
    q_out = attn.q_proj if "q_proj" in children else attn.q_b_proj
    shapes = [("kv_a_proj_with_mqa", attn.kv_a_proj_with_mqa, "out_features", R + dr),
              ("kv_b_proj", attn.kv_b_proj, "in_features", R),
              ("kv_b_proj", attn.kv_b_proj, "out_features", H * (dn + dv)),
              (q_names[-1], q_out, "out_features", H * (dn + dr)),
              ("o_proj", attn.o_proj, "in_features", H * dv)]
    if "q_a_proj" in children:
        shapes.append(("q_a_proj", attn.q_a_proj, "out_features", attn.q_lora_rank))
    for name, lin, dim, want in shapes:
        got = getattr(lin, dim, None)
        if got != want:
            return f"its {name}.{dim} is {got}, not the {want} its config's dimensions give"
    return None


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
    """Replaces every DeepSeek-V2/V3-style attention of ``model`` by
    :class:`MultiheadLatentAttention`, in place, sharing the weights (nothing is copied; the state
    dict keeps its keys). Which attentions qualify is decided by what they compute (see the
    module docstring), whatever the model family calls them.

    Decode then runs on torch_mla's ops when the model is given an :class:`MLACache`
    (``MLACache.for_model(model, max_batch_size, max_cache_len)``).

    Raises:
        ValueError: the model has no MLA attention, or one whose forward differs from
            DeepSeek-V2/V3's (the message names the module and what differs); nothing is swapped.
        NotImplementedError: what the module cannot reproduce: quantized projections, a bias in
            kv_b_proj, an attention implementation other than eager, sdpa or flash attention
            (flex attention's block masks).

    Returns:
        ``model``, for chaining.
    """
    targets = []
    for name, module in model.named_modules():
        if isinstance(module, MultiheadLatentAttention) or not is_mla_attention(module):
            continue
        why = mla_difference(module)
        if why is not None:
            raise ValueError(
                f"{name} ({type(module).__name__}) is not DeepSeek-V2/V3's attention: {why}. "
                "MultiheadLatentAttention would compute something else, so nothing was swapped"
            )
        _check(name, module)
        targets.append((name, module))
    if not targets:
        if any(isinstance(m, MultiheadLatentAttention) for m in model.modules()):
            return model  # already swapped
        raise ValueError(
            f"{type(model).__name__} has no MLA attention to swap (a module with "
            "kv_a_proj_with_mqa and kv_b_proj, as DeepSeek-V2/V3's)"
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
