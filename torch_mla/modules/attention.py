"""``MultiheadLatentAttention``: DeepSeek-V2/V3's attention on torch_mla's paged latent cache.

Parameters and names are transformers' ``DeepseekV3Attention`` / ``DeepseekV2Attention`` ones, so
a state dict loads unchanged, and the forward takes and returns what theirs does.

Per head h, with the normalised latent c (kv_lora_rank wide) and the up-projection
``kv_b_proj.weight`` viewed as [H, qk_nope + v, kv_lora_rank] = [W_UK_h; W_UV_h]:

    k_nope_h = W_UK_h c,   v_h = W_UV_h c
    q_h . k_h = (W_UK_h^T q_nope_h) . c + q_pe_h . k_pe      (absorb W_UK into the query)
    sum_j p_j v_h,j = W_UV_h (sum_j p_j c_j)                  (absorb W_UV into the output)

so a decode step attends every query head directly to the cached ``[c | k_pe]`` rows
(:func:`torch_mla.mla_decode` with ``d_v = kv_lora_rank``) and never materialises per-head keys or
values. The prefill (the first forward on an empty :class:`MLACache`, or any forward without one)
expands the latents of its own tokens instead, exactly as transformers does, and writes the
latents into the cache. The softmax scale is the model's (with YaRN's mscale ** 2).

Under transformers' tensor parallelism (heads split over ranks, see ``tensor_parallel.py``) each
rank's module computes its own heads (``num_heads`` is the rank's count) over the whole latent,
and o_proj's partial outputs are summed over the ranks.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..ops import mla_decode
from ..ops.absorb import head_matmul
from .cache import LatentStep, MLACache
from .rope import (
    MLARotaryEmbedding,
    apply_rope,
    apply_rope_complex,
    half_angles,
    rope_parameters,
    softmax_scale,
)
from .tensor_parallel import all_reduce_sum, head_shard, local

_warned_foreign_cache = False


class RMSNorm(nn.Module):
    """DeepSeek's RMSNorm (normalises in float32, scales in the input dtype); [..., d] -> same."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * xf.to(dtype)


def _attention_mask(attention_mask: Any, q_len: int, k_len: int, device: torch.device,
                    dtype: torch.dtype) -> torch.Tensor | None:
    """The mask for SDPA over ``k_len`` keys whose last ``q_len`` are the queries: transformers'
    4D mask sliced to the keys, a 2D padding mask combined with causality, or plain causality
    (bottom-right aligned) when there is none."""
    if attention_mask is not None and attention_mask.dim() == 4:
        m = attention_mask[..., :k_len]
        return m if m.dtype == torch.bool else m.to(dtype)
    if q_len == 1 and attention_mask is None:
        return None
    qi = torch.arange(q_len, device=device)[:, None]
    kj = torch.arange(k_len, device=device)[None, :]
    causal = kj <= qi + (k_len - q_len)  # (q_len, k_len)
    if attention_mask is None:
        return causal
    return causal[None, None] & attention_mask[:, None, None, -k_len:].bool()


class _Step(NamedTuple):
    """One forward's projected inputs, as the attention paths take them."""

    hidden_states: torch.Tensor  # [b, s, hidden_size]
    q_resid: torch.Tensor | None  # [b, s, q_lora_rank], q_a_layernorm's output (None: q_proj)
    q_nope: torch.Tensor  # [b, H, s, qk_nope_head_dim]
    q_pe: torch.Tensor  # [b, H, s, qk_rope_head_dim], rotated
    kv_c: torch.Tensor  # [b, s, kv_lora_rank], normalised
    k_pe: torch.Tensor  # [b, s, qk_rope_head_dim], rotated
    cache: Any  # an MLACache, None or another transformers Cache
    prefill: bool  # (on an MLACache)
    attention_mask: Any
    position_embeddings: Any
    position_ids: torch.Tensor | None


class MultiheadLatentAttention(nn.Module):
    """DeepSeek-V2/V3 multi-head latent attention on torch_mla's ops.

    Args:
        config: a DeepseekV3Config / DeepseekV2Config (or any object with the same fields:
            hidden_size, num_attention_heads, q_lora_rank (None: one q_proj), kv_lora_rank,
            qk_nope_head_dim, qk_rope_head_dim, v_head_dim, attention_bias, rope_parameters,
            rope_interleave (absent: RoPE in halves; DeepSeek-V2's model_type: complex angles),
            max_position_embeddings, attention_dropout).
        layer_idx: the layer's index in the model (its slot in the cache).

    Shapes: ``hidden_states`` [b, s, hidden_size] -> ``(out [b, s, hidden_size], None)``.
    """

    def __init__(self, config: Any, layer_idx: int | None = None):
        super().__init__()
        self._setup(config, layer_idx)
        H, dqk, R = self.num_heads, self.qk_head_dim, self.kv_lora_rank
        bias = bool(getattr(config, "attention_bias", False))
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(self.hidden_size, H * dqk, bias=False)
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        else:
            self.q_proj = None
            self.q_a_proj = nn.Linear(self.hidden_size, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank)
            self.q_b_proj = nn.Linear(self.q_lora_rank, H * dqk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(self.hidden_size, R + self.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(R)
        self.kv_b_proj = nn.Linear(R, H * (self.qk_nope_head_dim + self.v_head_dim), bias=False)
        self.o_proj = nn.Linear(H * self.v_head_dim, self.hidden_size, bias=bias)

    def _setup(self, config: Any, layer_idx: int | None) -> None:
        self.config = config
        self.layer_idx = layer_idx
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.q_lora_rank = config.q_lora_rank
        self.kv_lora_rank = config.kv_lora_rank
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        self.qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        self.attention_dropout = float(getattr(config, "attention_dropout", 0.0) or 0.0)
        self.tp_group = None  # the ranks holding the other heads, under tensor parallelism
        self.is_causal = True
        # How the model rotates (see rope.py): DeepSeek-V2 multiplies by complex angles; the others
        # pass (cos, sin) and pair dimensions interleaved where the config says rope_interleave
        # (DeepSeek-V3's field), else in halves, transformers' rotate_half (MiniCPM3).
        self.rope_complex = getattr(config, "model_type", "") == "deepseek_v2"
        self.rope_interleave = self.rope_complex or bool(getattr(config, "rope_interleave", False))
        self.scaling = softmax_scale(config)
        try:
            self.rotary = MLARotaryEmbedding(self.qk_rope_head_dim, rope_parameters(config),
                                             config.max_position_embeddings)
        except NotImplementedError:
            self.rotary = None  # fine inside a transformers model, which passes the angles in

    @classmethod
    def from_hf(cls, attn: nn.Module) -> MultiheadLatentAttention:
        """The module for a transformers attention that computes DeepSeek-V2/V3's (see
        :func:`torch_mla.modules.swap.mla_difference`), sharing (not copying) its projections and
        norms."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._setup(attn.config, attn.layer_idx)
        self.scaling = float(attn.scaling)
        shard = head_shard(attn, f"layer {attn.layer_idx}'s attention")
        if shard is not None:  # transformers' tensor parallelism: this rank's heads
            self.num_heads, self.tp_group = shard
        for name in ("q_proj", "q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa",
                     "kv_a_layernorm", "kv_b_proj", "o_proj"):
            setattr(self, name, getattr(attn, name, None))
        self.train(attn.training)
        return self

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, q_lora_rank={self.q_lora_rank}, "
                f"kv_lora_rank={self.kv_lora_rank}, qk_nope={self.qk_nope_head_dim}, "
                f"qk_rope={self.qk_rope_head_dim}, v={self.v_head_dim}, "
                f"interleave={self.rope_interleave}, scale={self.scaling:.6g}")

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: Any = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: Any = None,
        cache: Any = None,
        position_ids: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        """Attention of ``hidden_states`` [b, s, hidden_size] over the cache and themselves.

        Args:
            hidden_states: [b, s, hidden_size].
            position_embeddings: what the transformers model passes: ``(cos, sin)`` [b, s, d_rope]
                (V3) or complex ``freqs_cis`` [b, s, d_rope / 2] (V2). If None, the angles are
                computed from ``position_ids`` (int [b, s]) with the config's RoPE.
            attention_mask: transformers' mask (4D bool or additive, 2D padding, or None for
                causal). On an :class:`MLACache`, a decode step reads only which of its tokens
                are padding: it attends to every cached token of the request, and to its new
                tokens causally.
            past_key_values / cache: an :class:`MLACache` (the torch_mla path), None (attention
                over these tokens alone) or another transformers Cache (latents stored there,
                attention computed unabsorbed, as transformers does).

        Returns:
            ``(out [b, s, hidden_size], None)``: no attention weights.
        """
        if kwargs.get("output_attentions"):
            raise NotImplementedError(
                "output_attentions=True: MultiheadLatentAttention returns no attention weights (a "
                "decode step attends over the latent cache in torch_mla.mla_decode, which never "
                "forms them); run the model without swap_mla_attention to see them")
        cache = cache if cache is not None else past_key_values
        b, s, _ = hidden_states.shape
        prefill = False
        if isinstance(cache, MLACache):
            prefill = cache.begin_layer(self.layer_idx, b, s, attention_mask)
        H, dn, dr, R = self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim, \
            self.kv_lora_rank
        q_resid = None  # the normalised query latent (DeepSeek-V3.2's indexer reads it too)
        if self.q_proj is not None:
            q = self._linear(self.q_proj, hidden_states)
        else:
            q_resid = self.q_a_layernorm(self._linear(self.q_a_proj, hidden_states))
            q = self._linear(self.q_b_proj, q_resid)
        # Heads first, as transformers lays the query out: the same tensors go into the same ops.
        q_nope, q_pe = q.view(b, s, H, dn + dr).transpose(1, 2).split([dn, dr], dim=-1)
        kv_c, k_pe = self._linear(self.kv_a_proj_with_mqa, hidden_states).split([R, dr], dim=-1)
        kv_c = self.kv_a_layernorm(kv_c)  # [b, s, R]
        q_pe, k_pe = self._rotate(q_pe, k_pe, position_embeddings, position_ids)
        step = _Step(hidden_states, q_resid, q_nope, q_pe, kv_c, k_pe, cache, prefill,
                     attention_mask, position_embeddings, position_ids)
        out, extra = self._attend(step, **kwargs)
        out = self._out(out.reshape(b, s, H * self.v_head_dim))
        return (out, None) if extra is None else (out, None, extra)

    def _attend(self, x: _Step, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        """The attention of this step's queries over the cache and themselves: [b, s, H,
        v_head_dim], and what else the forward returns (None here; DeepSeek-V3.2-style
        subclasses return their top-k selection)."""
        b, s = x.kv_c.shape[:2]
        R, dr, cache = self.kv_lora_rank, self.qk_rope_head_dim, x.cache
        if isinstance(cache, MLACache):
            step = cache.append_latents(self.layer_idx, x.kv_c, x.k_pe, self.num_heads)
            if x.prefill:
                return self._attend_expanded(x.q_nope, x.q_pe, x.kv_c, x.k_pe,
                                             x.attention_mask), None
            return self._attend_absorbed(x.q_nope, x.q_pe, step), None
        if cache is None:
            return self._attend_expanded(x.q_nope, x.q_pe, x.kv_c, x.k_pe,
                                         x.attention_mask), None
        _warn_foreign_cache(cache)
        kv_all, pe_all = cache.update(x.kv_c.view(b, 1, s, R), x.k_pe.view(b, 1, s, dr),
                                      self.layer_idx)
        return self._attend_expanded(x.q_nope, x.q_pe, kv_all[:, 0], pe_all[:, 0],
                                     x.attention_mask), None

    def _linear(self, lin: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """``lin(x)``; under tensor parallelism on this rank's shard of the weight (its heads'
        rows, or the whole of a replicated one), as transformers' wrapped forward computes it."""
        if self.tp_group is None:
            return lin(x)
        return F.linear(x, local(lin.weight), local(lin.bias))

    def _out(self, out: torch.Tensor) -> torch.Tensor:
        """o_proj of [b, s, num_heads * v_head_dim]; under tensor parallelism this rank's heads'
        columns, summed over the ranks, then the bias (once), as transformers' rowwise layer."""
        if self.tp_group is None:
            return self.o_proj(out)
        y = all_reduce_sum(F.linear(out, local(self.o_proj.weight)), self.tp_group)
        bias = local(self.o_proj.bias)
        return y if bias is None else y + bias

    def _rotate(self, q_pe, k_pe, position_embeddings, position_ids):
        """RoPE on ``q_pe`` [b, H, s, dr] and ``k_pe`` [b, s, dr], as the model computes it."""
        if position_embeddings is None:
            if position_ids is None:
                raise ValueError("MultiheadLatentAttention needs position_embeddings (as "
                                 "transformers models pass them) or position_ids [b, s]")
            if self.rotary is None:
                raise NotImplementedError(
                    f"rope_type {rope_parameters(self.config)['rope_type']!r} is computed only by "
                    "transformers: pass the model's position_embeddings")
            cos, sin = self.rotary(position_ids)  # float32 [b, s, dr / 2]
            if not self.rope_complex:
                return (apply_rope(q_pe, cos[:, None], sin[:, None], self.rope_interleave),
                        apply_rope(k_pe, cos, sin, self.rope_interleave))
            position_embeddings = torch.complex(cos, sin)
        if isinstance(position_embeddings, torch.Tensor) and position_embeddings.is_complex():
            return (apply_rope_complex(q_pe, position_embeddings[:, None]),
                    apply_rope_complex(k_pe, position_embeddings))
        cos, sin = half_angles(position_embeddings, self.qk_rope_head_dim)  # [b, s, dr / 2]
        return (apply_rope(q_pe, cos[:, None], sin[:, None], self.rope_interleave),
                apply_rope(k_pe, cos, sin, self.rope_interleave))

    def _attend_expanded(self, q_nope, q_pe, kv_c, k_pe, attention_mask,
                         mask: torch.Tensor | None = None) -> torch.Tensor:
        """Unabsorbed attention of [b, H, s, *] queries over ``kv_c`` [b, S, R] / ``k_pe``
        [b, S, dr] (the last s of which are the queries' own tokens) -> [b, s, H, v_head_dim].

        transformers' computation, op for op and in its layouts (``expand_kv``, then its eager or
        SDPA attention), so that a bf16 model rounds exactly as the original does. ``mask``, if
        given, is the 4D mask to use as it is (a sparse attention's, built by the caller)."""
        b, H, s, _ = q_nope.shape
        S = kv_c.shape[1]
        dn, dv = self.qk_nope_head_dim, self.v_head_dim
        kv = self._linear(self.kv_b_proj, kv_c.to(self.kv_b_proj.weight.dtype).view(b, 1, S, -1))
        k_nope, v = kv.view(b, S, H, dn + dv).transpose(1, 2).split([dn, dv], dim=-1)
        k = torch.cat([k_nope, k_pe[:, None].to(k_nope.dtype).expand(b, H, S, -1)], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1)  # [b, H, s, dqk]
        dropout = self.attention_dropout if self.training else 0.0
        # A prompt without padding: SDPA's own causal masking (its fused kernels need no mask).
        plain_causal = attention_mask is None and s == S and s > 1 and mask is None
        eager = getattr(self.config, "_attn_implementation", None) == "eager"
        if mask is None and not (plain_causal and not eager):
            mask = _attention_mask(attention_mask, s, S, q.device, q.dtype)
        if eager:
            scores = torch.matmul(q, k.transpose(2, 3)) * self.scaling
            if mask is not None:
                if mask.dtype == torch.bool:
                    mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(
                        ~mask, torch.finfo(q.dtype).min)
                scores = scores + mask
            p = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            out = torch.matmul(F.dropout(p, p=dropout, training=self.training), v)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                                 is_causal=plain_causal, scale=self.scaling)
        return out.transpose(1, 2)

    def _absorbed_query(self, q_nope, q_pe) -> tuple[torch.Tensor, torch.Tensor]:
        """``([q_nope W_UK | q_pe] per head, token-major: [b, s, H, R + dr], W_UV (H, dv, R))``
        from [b, H, s, *] queries: the decode's query over the latent cache, and what its output
        is multiplied by."""
        H, dn, dv, R = self.num_heads, self.qk_nope_head_dim, self.v_head_dim, self.kv_lora_rank
        w = local(self.kv_b_proj.weight).view(H, dn + dv, R)
        w_uk, w_uv = w[:, :dn], w[:, dn:]  # (H, dn, R), (H, dv, R)
        return head_matmul(q_nope.transpose(1, 2), w_uk, q_pe.transpose(1, 2)), w_uv

    def _attend_absorbed(self, q_nope, q_pe, step: LatentStep) -> torch.Tensor:
        """Decode: W_UK into the query, torch_mla.mla_decode over the latent cache, W_UV into the
        output. [b, H, s, *] -> [b, s, H, v_head_dim]."""
        R = self.kv_lora_rank
        q, w_uv = self._absorbed_query(q_nope, q_pe)
        if step.kv_scale is None:
            out_lat, _ = mla_decode(q.to(step.kv_cache.dtype), step.kv_cache, step.block_table,
                                    step.cache_seqlens, step.schedule, softmax_scale=self.scaling,
                                    causal=True, d_v=R)
        else:  # an FP8 cache: q stays in the model's dtype (bf16/fp16 run the SM90 kernel)
            out_lat, _ = mla_decode(q, step.kv_cache, step.block_table, step.cache_seqlens,
                                    step.schedule, softmax_scale=self.scaling, causal=True, d_v=R,
                                    kv_scale=step.kv_scale, compute=step.compute)
        return self._absorbed_output(out_lat, w_uv)

    @staticmethod
    def _absorbed_output(out_lat: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
        """``o W_UV^T`` per head: the decode's latent output [b, s, H, R] -> [b, s, H, dv]."""
        return head_matmul(out_lat.to(w_uv.dtype), w_uv.transpose(1, 2))


def _warn_foreign_cache(cache) -> None:
    global _warned_foreign_cache
    if not _warned_foreign_cache and not torch.compiler.is_compiling():
        _warned_foreign_cache = True
        import warnings

        warnings.warn(
            f"MultiheadLatentAttention got a {type(cache).__name__}: attention runs unabsorbed, "
            "as in transformers. Pass a torch_mla.modules.MLACache for the torch_mla decode path",
            stacklevel=3,
        )
