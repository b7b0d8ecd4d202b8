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

An attention with a lightning indexer (``indexer``) is DeepSeek-V3.2's (DeepSeek Sparse
Attention: DeepSeek-V3.2, GLM-5's GLM-MoE-DSA), and swapped for
:class:`SparseMultiheadLatentAttention`, when it is DeepSeek-V3's as above with a query latent
(``q_a_proj``), and

- its indexer's submodules are exactly ``wq_b, wk, k_norm, weights_proj`` (a LayerNorm), its
  attributes those of transformers' ``DeepseekV32Indexer``, its forward takes the query latent
  (``q_resid``), and its dimensions agree with the config's ``index_n_heads, index_head_dim,
  index_topk`` and its projections' shapes;
- the attention has no parameter of its own (HunYuan-V4's attention sinks) and no other
  submodule (its output gate, AXK2's fused query gate, Mistral Large 4's query scaling);
- a layer without an indexer reuses the previous layer's selection only where the model says
  so (GLM-MoE-DSA's ``skip_topk`` layers, ``prev_topk_indices`` in the forward).

Their RoPE layouts are not in the config: DeepSeek-V3.2 interleaves the attention's pairs and not
the indexer's, GLM-MoE-DSA interleaves both. They are read from the rotary function each forward
calls (transformers' ``apply_rotary_pos_emb_interleave`` or ``apply_rotary_pos_emb``); a forward
calling neither or both (and no ``rope_interleave`` in the config to choose) is refused. Where
the indexer rotates its keys' last dimensions instead of the first (HunYuan-V4's) cannot be told
this way; that family is refused for its gate and sinks.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from .attention import MultiheadLatentAttention
from .sparse_attention import SparseMultiheadLatentAttention

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
# DeepSeek-V3.2's: GLM-MoE-DSA's layers also say whether they reuse the previous selection (and
# then hold indexer = None, a plain attribute).
_SPARSE_ATTRIBUTES = _KNOWN_ATTRIBUTES | {"skip_topk", "indexer"}
_INDEXER_CHILDREN = ("wq_b", "wk", "k_norm", "weights_proj")
# The plain attributes of transformers' DeepseekV32Indexer (and GlmMoeDsaIndexer).
_INDEXER_ATTRIBUTES = frozenset((
    "config", "layer_idx", "hidden_size", "n_heads", "head_dim", "qk_rope_head_dim",
    "index_topk", "q_lora_rank", "softmax_scale", "training"))
# indexer attribute <- config field
_INDEXER_FIELDS = (("n_heads", "index_n_heads"), ("head_dim", "index_head_dim"),
                   ("index_topk", "index_topk"), ("qk_rope_head_dim", "qk_rope_head_dim"),
                   ("q_lora_rank", "q_lora_rank"))
_ROPE_INTERLEAVED, _ROPE_HALVES = "apply_rotary_pos_emb_interleave", "apply_rotary_pos_emb"


def is_mla_attention(module: nn.Module) -> bool:
    """Whether ``module`` looks like an MLA attention (a latent down- and up-projection), the
    modules swap_mla_attention examines."""
    names = dict(module.named_children())
    return "kv_a_proj_with_mqa" in names or "kv_b_proj" in names


def is_sparse_attention(module: nn.Module) -> bool:
    """Whether an MLA attention has DeepSeek-V3.2's lightning indexer (or, on a layer that
    reuses the previous layer's selection, says so: GLM-MoE-DSA's ``skip_topk``)."""
    return "indexer" in dict(module.named_children()) or "skip_topk" in vars(module)


def _rope_calls(forward) -> str | None:
    """"interleaved" or "halves": the RoPE a forward applies, by the transformers rotary function
    it calls; None if it calls neither or both (then its config must say)."""
    names = set(inspect.unwrap(forward).__code__.co_names)
    calls = (_ROPE_INTERLEAVED in names, _ROPE_HALVES in names)
    return {(True, False): "interleaved", (False, True): "halves"}.get(calls)


def mla_difference(attn: nn.Module) -> str | None:
    """What makes ``attn``, an MLA attention (:func:`is_mla_attention`), compute something other
    than DeepSeek-V2/V3's attention, or with an indexer (:func:`is_sparse_attention`)
    DeepSeek-V3.2's; None when it computes exactly that."""
    children = set(dict(attn.named_children()))
    sparse = is_sparse_attention(attn)
    whose = "DeepSeek-V3.2's" if sparse else "DeepSeek-V2/V3's"
    q_names = _Q_FULL if "q_proj" in children else _Q_LORA
    expected = set(q_names + _KV_OUT) | ({"indexer"} & children)
    if extra := sorted(children - expected):
        return (f"it has submodules {whose} attention does not have ({', '.join(extra)}): "
                "they take part in its forward")
    if missing := sorted(expected - children):
        return f"it has no {', '.join(missing)}"
    attributes = {k for k in vars(attn) if not k.startswith("_")}
    if extra := sorted(attributes - (_SPARSE_ATTRIBUTES if sparse else _KNOWN_ATTRIBUTES)):
        return (f"it has attributes {whose} attention does not have ({', '.join(extra)}), "
                "which may change its forward")
    if own := sorted(name for name, p in attn._parameters.items() if p is not None):
        return (f"it has parameters of its own ({', '.join(own)}; HunYuan-V4's attention sinks, "
                f"for one), which take part in its forward")
    params = inspect.signature(attn.forward).parameters
    if "position_embeddings" not in params:
        return "its forward takes no position_embeddings: it applies no RoPE from the model"
    if sparse and (why := _sparse_difference(attn, children, params)):
        return why
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


def _sparse_difference(attn: nn.Module, children: set, params) -> str | None:
    """mla_difference's part for an attention with an indexer (or reusing one's selection)."""
    config = getattr(attn, "config", None)
    if "q_proj" in children:
        return "it has no query latent (q_a_proj) for its indexer to read"
    if _rope_calls(type(attn).forward) is None and \
            getattr(config, "rope_interleave", None) is None:
        return ("which RoPE its forward applies cannot be told (it calls both or neither of "
                f"transformers' {_ROPE_INTERLEAVED} and {_ROPE_HALVES}, and its config has no "
                "rope_interleave)")
    if "indexer" not in children:
        if not getattr(attn, "skip_topk", False) or "prev_topk_indices" not in params:
            return ("it has no indexer and does not take the previous layer's selection "
                    "(prev_topk_indices)")
        return None
    return indexer_difference(attn.indexer, config)


def indexer_difference(indexer: nn.Module, config) -> str | None:
    """What makes an attention's ``indexer`` compute something other than DeepSeek-V3.2's
    lightning indexer (:class:`~torch_mla.modules.sparse_attention.LightningIndexer`); None when
    it computes exactly that."""
    children = set(dict(indexer.named_children()))
    if extra := sorted(children - set(_INDEXER_CHILDREN)):
        return (f"its indexer has submodules DeepSeek-V3.2's does not have ({', '.join(extra)}): "
                "they take part in its forward")
    if missing := sorted(set(_INDEXER_CHILDREN) - children):
        return f"its indexer has no {', '.join(missing)}"
    attributes = {k for k in vars(indexer) if not k.startswith("_")}
    if extra := sorted(attributes - _INDEXER_ATTRIBUTES):
        return (f"its indexer has attributes DeepSeek-V3.2's does not have ({', '.join(extra)}), "
                "which may change its forward")
    if "q_resid" not in inspect.signature(indexer.forward).parameters:
        return "its indexer's forward does not read the query latent (q_resid)"
    if not isinstance(indexer.k_norm, nn.LayerNorm):
        return f"its indexer's k_norm is a {type(indexer.k_norm).__name__}, not a LayerNorm"
    for attribute, field in _INDEXER_FIELDS:
        ours, theirs = getattr(indexer, attribute, "missing"), getattr(config, field, "missing")
        if ours != theirs:
            return f"its indexer's {attribute} is {ours} but its config's {field} is {theirs}"
    H, D = indexer.n_heads, indexer.head_dim
    if indexer.softmax_scale != D ** -0.5:
        return (f"its indexer's softmax_scale is {indexer.softmax_scale}, not index_head_dim ** "
                f"-0.5 = {D ** -0.5}")
    if not 0 < indexer.qk_rope_head_dim <= D or indexer.qk_rope_head_dim % 2:
        return (f"its indexer rotates {indexer.qk_rope_head_dim} of its {D} dimensions: an even "
                "number, at most index_head_dim, is needed")
    shapes = [("wq_b", "in_features", indexer.q_lora_rank), ("wq_b", "out_features", H * D),
              ("wk", "in_features", config.hidden_size), ("wk", "out_features", D),
              ("weights_proj", "in_features", config.hidden_size),
              ("weights_proj", "out_features", H)]
    for name, dim, want in shapes:
        got = getattr(getattr(indexer, name), dim, None)
        if got != want:
            return (f"its indexer's {name}.{dim} is {got}, not the {want} its config's "
                    "dimensions give")
    if _rope_calls(type(indexer).forward) is None:
        return (f"its indexer's RoPE is none torch_mla knows (its forward calls both or neither "
                f"of transformers' {_ROPE_INTERLEAVED} and {_ROPE_HALVES})")
    return None


def sparse_layout(attn: nn.Module) -> dict:
    """The keyword arguments :meth:`SparseMultiheadLatentAttention.from_hf` takes for a
    DeepSeek-V3.2-style attention: the attention's and the indexer's RoPE layouts, and whether
    its forward returns its selection for the next layer (GLM-MoE-DSA)."""
    rope = _rope_calls(type(attn).forward)
    interleave = rope == "interleaved" if rope else bool(attn.config.rope_interleave)
    indexer = getattr(attn, "indexer", None)
    index_rope = None if indexer is None else _rope_calls(type(indexer).forward)
    return dict(rope_interleave=interleave, index_rope_interleave=index_rope == "interleaved",
                returns_topk="prev_topk_indices" in inspect.signature(attn.forward).parameters)


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
    indexer = getattr(attn, "indexer", None)
    for proj in ("wq_b", "wk", "weights_proj") if indexer is not None else ():
        lin = getattr(indexer, proj)
        if not isinstance(lin, nn.Linear) or lin.weight.dtype not in _FLOAT_DTYPES:
            raise NotImplementedError(
                f"{name}.indexer.{proj} is a {type(lin).__name__} with {lin.weight.dtype} "
                "weights; swap_mla_attention needs plain nn.Linear layers in fp32/bf16/fp16. Load "
                "or dequantize the model in bf16 first")
    if attn.kv_b_proj.bias is not None:
        raise NotImplementedError(f"{name}.kv_b_proj has a bias, which cannot be absorbed")
    if attn.qk_rope_head_dim % 2:
        raise NotImplementedError(f"{name}: qk_rope_head_dim must be even, got "
                                  f"{attn.qk_rope_head_dim}")
    if attn.layer_idx is None:
        raise ValueError(f"{name} has no layer_idx: the cache cannot tell its layers apart")


def swap_mla_attention(model: nn.Module) -> nn.Module:
    """Replaces every DeepSeek-V2/V3-style attention of ``model`` by
    :class:`MultiheadLatentAttention`, and every DeepSeek-V3.2-style one (with a lightning
    indexer) by :class:`SparseMultiheadLatentAttention`, in place, sharing the weights (nothing
    is copied; the state dict keeps its keys). Which attentions qualify is decided by what they
    compute (see the module docstring), whatever the model family calls them.

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
            whose, ours = ("DeepSeek-V3.2's", "SparseMultiheadLatentAttention") \
                if is_sparse_attention(module) else ("DeepSeek-V2/V3's", "MultiheadLatentAttention")
            raise ValueError(
                f"{name} ({type(module).__name__}) is not {whose} attention: {why}. "
                f"{ours} would compute something else, so nothing was swapped"
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
        if is_sparse_attention(module):
            swapped = SparseMultiheadLatentAttention.from_hf(module, **sparse_layout(module))
        else:
            swapped = MultiheadLatentAttention.from_hf(module)
        setattr(parent, child, swapped)
    return model
