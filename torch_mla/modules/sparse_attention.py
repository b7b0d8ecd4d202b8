"""DeepSeek-V3.2's attention (DeepSeek Sparse Attention) on torch_mla's ops: MLA whose every query
token attends only to the ``index_topk`` cached tokens a lightning indexer picks for it.

The indexer (transformers' ``DeepseekV32Indexer``, the same parameters and names) scores each
query token against one index key per token, ``D = index_head_dim`` wide, with ``H =
index_n_heads`` small query heads::

    q_h   = RoPE(wq_b(q_resid))_h             (q_resid: the attention's q_a_layernorm output)
    k     = RoPE(k_norm(wk(x)))               (a LayerNorm; RoPE on the first qk_rope_head_dim)
    w_h   = weights_proj(x)_h * H ** -0.5
    score = sum_h w_h * relu(q_h . k * D ** -0.5)

and keeps the ``index_topk`` best keys among those the token sees (all of them while fewer).

Prefill (the first forward on an empty :class:`MLACache`, or any forward without one) is
transformers' computation: the scores over the prompt in its arithmetic, its top-k turned into a
mask on top of the causal one, the unabsorbed attention. Decode is torch_mla's: this step's index
keys go into the cache's paged index-key cache beside the latents, :func:`torch_mla.indexer_topk`
selects each token's cache slots over it on the device, and :func:`torch_mla.mla_decode_sparse`
attends to exactly those slots over the latent cache (absorbed, as the dense module's decode).
In fp32 both give transformers' tokens and logits (the indexer's float32 sums go in another order:
its selection can differ only at ties).

An FP8 index cache (``MLACache(index_dtype=torch.float8_e4m3fn)``) stores keys as DeepSeek's
serving code does: rotated by a Hadamard transform (orthogonal, so every ``q . k`` is unchanged,
while outliers spread over the whole key before quantizing; index_head_dim a power of two) and
quantized per token with a power-of-two scale; the queries are rotated and quantized per
(token, head) the same way, their scale folded into the head weights.

Layers that reuse an earlier layer's selection (GLM-5's ``indexer_types[l] == "shared"``: no
indexer of their own) take it from the layer before (``prev_topk_indices``) and return theirs, as
transformers' GLM-MoE-DSA layers do: positions at the prefill, cache slots at decode (every layer's
latent cache has the same pages, so a slot names the same token in each).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..ops import mla_decode_sparse
from ..ops.indexer import indexer_topk
from ..reference_indexer import quantize_index_keys
from .attention import MultiheadLatentAttention, _attention_mask, _Step, _warn_foreign_cache
from .cache import LatentStep, MLACache
from .rope import apply_rope, half_angles

FP8 = torch.float8_e4m3fn


def hadamard_signs(n: int, device: torch.device | str | None = None) -> torch.Tensor | None:
    """float32 [n, n] of +-1: Sylvester's Hadamard matrix (symmetric, H H = n I), n a power of two;
    None otherwise. ``x @ H / sqrt(n)`` is DeepSeek's ``rotate_activation``. Its entries are exact
    in every float dtype (a model cast to bf16 casts the buffer holding it without changing it)."""
    if n < 1 or n & (n - 1):
        return None
    h = torch.ones(1, 1, device=device)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


class LightningIndexer(nn.Module):
    """DeepSeek-V3.2's lightning indexer: transformers' ``DeepseekV32Indexer`` parameters
    (``wq_b, wk, k_norm, weights_proj``), its arithmetic, and the selection over torch_mla's
    paged index-key cache.

    Args:
        config: with hidden_size, q_lora_rank, qk_rope_head_dim, index_n_heads, index_head_dim,
            index_topk.
        rope_interleave: pair the RoPE dimensions interleaved (GLM-MoE-DSA) or in halves
            (DeepSeek-V3.2, whose indexer does not interleave where its attention does).
    """

    def __init__(self, config: Any, rope_interleave: bool = False):
        super().__init__()
        self._setup(config, rope_interleave, None)
        D, H = self.head_dim, self.n_heads
        self.wq_b = nn.Linear(config.q_lora_rank, H * D, bias=False)
        self.wk = nn.Linear(config.hidden_size, D, bias=False)
        self.k_norm = nn.LayerNorm(D, eps=1e-6)
        self.weights_proj = nn.Linear(config.hidden_size, H, bias=False)

    def _setup(self, config: Any, rope_interleave: bool, device) -> None:
        self.n_heads = config.index_n_heads
        self.head_dim = config.index_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.index_topk = config.index_topk
        self.softmax_scale = self.head_dim ** -0.5
        self.rope_interleave = rope_interleave
        # The FP8 index cache's rotation: a buffer (it follows the model's .to(device)), not in
        # the state dict.
        self.register_buffer("hadamard", hadamard_signs(self.head_dim, device), persistent=False)

    @classmethod
    def from_hf(cls, indexer: nn.Module, rope_interleave: bool) -> LightningIndexer:
        """The indexer for a transformers one (see swap.indexer_difference), sharing its
        projections and norm."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._setup(indexer.config, rope_interleave, indexer.wq_b.weight.device)
        for name in ("wq_b", "wk", "k_norm", "weights_proj"):
            setattr(self, name, getattr(indexer, name))
        self.train(indexer.training)
        return self

    def extra_repr(self) -> str:
        return (f"heads={self.n_heads}, head_dim={self.head_dim}, topk={self.index_topk}, "
                f"interleave={self.rope_interleave}")

    def project(self, x: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The indexer's queries [b, s, H, D], keys [b, s, D] (RoPE applied) and head weights
        float32 [b, s, H] (times H ** -0.5, without the softmax scale), from x [b, s, hidden],
        q_resid [b, s, q_lora_rank] and the half-width angles cos, sin [b, s, rope_dim / 2];
        transformers' operations in its dtypes."""
        b, s, _ = x.shape
        H, D, dr = self.n_heads, self.head_dim, self.rope_dim
        q_rot, q_pass = self.wq_b(q_resid).view(b, s, H, D).split([dr, D - dr], dim=-1)
        k_rot, k_pass = self.k_norm(self.wk(x)).split([dr, D - dr], dim=-1)
        q_rot = apply_rope(q_rot, cos[:, :, None], sin[:, :, None], self.rope_interleave)
        k_rot = apply_rope(k_rot, cos, sin, self.rope_interleave)
        weights = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float() * H ** -0.5
        return torch.cat([q_rot, q_pass], dim=-1), torch.cat([k_rot, k_pass], dim=-1), weights

    def dense_topk(self, q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor,
                   mask: torch.Tensor) -> torch.Tensor:
        """transformers' selection over keys held in full: q [b, s, H, D], k [b, T, D], weights
        [b, s, H], mask [b, s, T] (bool, True = seen; or additive float) -> int32 positions
        [b, s, min(index_topk, T)]."""
        scores = torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1))
        scores = F.relu(scores * self.softmax_scale)  # [b, s, H, T]
        index_scores = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)  # [b, s, T]
        if mask.dtype == torch.bool:
            index_scores = index_scores.masked_fill(~mask, float("-inf"))
        else:
            index_scores = index_scores + mask
        topk = min(self.index_topk, index_scores.shape[-1])
        return index_scores.topk(topk, dim=-1).indices.to(torch.int32)

    def rotate_for_fp8(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., D] in float32, rotated by the Hadamard transform where D is a power of two
        (as DeepSeek does before quantizing to e4m3), else as it is."""
        if self.hadamard is None:
            return x.float()
        return (x.float() @ self.hadamard.float()) * self.head_dim ** -0.5

    def cache_keys(self, k: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
        """What goes into an index cache of this dtype: the keys [b, s, D], rotated for an FP8
        one (the cache quantizes them)."""
        return self.rotate_for_fp8(k) if cache_dtype == FP8 else k

    def cached_topk(self, q: torch.Tensor, weights: torch.Tensor, step: LatentStep
                    ) -> torch.Tensor:
        """The selection over the paged index-key cache: int32 cache slots [b, s, index_topk]
        (-1 past the positions a token sees), by :func:`torch_mla.indexer_topk`."""
        w = weights * self.softmax_scale  # (relu(a x) = a relu(x) for a > 0)
        if step.index_cache.dtype == FP8:
            q, q_scale = quantize_index_keys(self.rotate_for_fp8(q))
            w = w * q_scale
        else:
            q = q.to(step.index_cache.dtype)
        return indexer_topk(q, w, step.index_cache, step.block_table, step.cache_seqlens,
                            self.index_topk, index_scale=step.index_scale)


class SparseMultiheadLatentAttention(MultiheadLatentAttention):
    """DeepSeek-V3.2's attention (MLA with a lightning indexer) on torch_mla's ops: transformers'
    ``DeepseekV32Attention`` / ``GlmMoeDsaAttention`` parameters (``indexer.*`` included) and
    forward.

    Args:
        config: a DeepseekV32Config / GlmMoeDsaConfig (the MLA fields of
            :class:`MultiheadLatentAttention`, q_lora_rank required, and index_n_heads,
            index_head_dim, index_topk; ``indexer_types`` for cross-layer sharing).
        layer_idx: the layer's index in the model.
        rope_interleave: the attention's RoPE (DeepSeek-V3.2 and GLM-MoE-DSA: interleaved);
            index_rope_interleave: the indexer's (DeepSeek-V3.2: halves; GLM-MoE-DSA:
            interleaved).

    Shapes: ``hidden_states`` [b, s, hidden_size] -> ``(out [b, s, hidden_size], None)``, or
    ``(out, None, topk_indices)`` for a model that shares selections across layers
    (``returns_topk``, GLM-MoE-DSA).
    """

    def __init__(self, config: Any, layer_idx: int | None = None, rope_interleave: bool = True,
                 index_rope_interleave: bool = False):
        super().__init__(config, layer_idx)
        if self.q_lora_rank is None:
            raise ValueError("DeepSeek-V3.2's indexer reads the query latent: q_lora_rank must "
                             "be set")
        self.rope_interleave = rope_interleave
        kinds = getattr(config, "indexer_types", None)
        self.returns_topk = kinds is not None
        shared = kinds is not None and layer_idx is not None and kinds[layer_idx] == "shared"
        self.indexer = None if shared else LightningIndexer(config, index_rope_interleave)

    @classmethod
    def from_hf(cls, attn: nn.Module, rope_interleave: bool = True,
                index_rope_interleave: bool = False, returns_topk: bool = False
                ) -> SparseMultiheadLatentAttention:
        """The module for a transformers attention that computes DeepSeek-V3.2's (see
        :func:`torch_mla.modules.swap.mla_difference`), sharing its projections, norms and
        indexer (none on a layer that reuses the previous one's selection)."""
        self = super().from_hf(attn)
        self.rope_interleave = rope_interleave
        self.returns_topk = returns_topk
        hf = getattr(attn, "indexer", None)
        self.indexer = None if hf is None else LightningIndexer.from_hf(hf, index_rope_interleave)
        return self

    def extra_repr(self) -> str:
        shared = ", indexer shared with the layer before" if self.indexer is None else ""
        return super().extra_repr() + shared

    def forward(self, hidden_states: torch.Tensor, position_embeddings: Any = None,
                attention_mask: torch.Tensor | None = None, past_key_values: Any = None,
                cache: Any = None, position_ids: torch.Tensor | None = None,
                prev_topk_indices: torch.Tensor | None = None, **kwargs: Any):
        """As :meth:`MultiheadLatentAttention.forward`; ``prev_topk_indices``: the selection of
        the layer before, which a layer without an indexer uses (GLM-MoE-DSA's sharing)."""
        out = super().forward(hidden_states, position_embeddings, attention_mask,
                              past_key_values, cache, position_ids,
                              prev_topk_indices=prev_topk_indices, **kwargs)
        return out if self.returns_topk else out[:2]

    def _angles(self, x: _Step) -> tuple[torch.Tensor, torch.Tensor]:
        """Half-width cos, sin [b, s, rope / 2], as the model passes them or from positions."""
        if x.position_embeddings is not None:
            return half_angles(x.position_embeddings, self.qk_rope_head_dim)
        if x.position_ids is None or self.rotary is None:
            raise ValueError("SparseMultiheadLatentAttention needs position_embeddings (as "
                             "transformers models pass them) or position_ids [b, s]")
        return self.rotary(x.position_ids)

    def _attend(self, x: _Step, prev_topk_indices: torch.Tensor | None = None,
                **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        b, s = x.kv_c.shape[:2]
        R, dr, cache = self.kv_lora_rank, self.qk_rope_head_dim, x.cache
        if self.indexer is None:
            if prev_topk_indices is None:
                raise ValueError(f"layer {self.layer_idx} reuses the previous layer's top-k "
                                 "selection (no indexer of its own): pass prev_topk_indices")
            q_idx = k_idx = w_idx = None
            # (the layer before may sit on another device of a device_map split)
            prev_topk_indices = prev_topk_indices.to(x.kv_c.device)
        else:
            q_idx, k_idx, w_idx = self.indexer.project(x.hidden_states, x.q_resid, *self._angles(x))
        if isinstance(cache, MLACache):
            index_k = None
            if k_idx is not None and cache.index_caches is not None:
                index_k = self.indexer.cache_keys(k_idx, cache.index_dtype)
            step = cache.append_latents(self.layer_idx, x.kv_c, x.k_pe, self.num_heads, index_k)
            if x.prefill:
                return self._attend_dense(x, x.kv_c, x.k_pe, q_idx, k_idx, w_idx,
                                          prev_topk_indices)
            if self.indexer is not None and step.index_cache is None:
                raise ValueError(f"layer {self.layer_idx} has an indexer but its MLACache holds "
                                 "no index keys: build the cache from this model's config "
                                 "(MLACache.for_model)")
            topk = prev_topk_indices if self.indexer is None else \
                self.indexer.cached_topk(q_idx, w_idx, step)
            return self._attend_sparse(x.q_nope, x.q_pe, step, topk), topk
        if cache is None:
            return self._attend_dense(x, x.kv_c, x.k_pe, q_idx, k_idx, w_idx, prev_topk_indices)
        _warn_foreign_cache(cache)
        kv_all, pe_all = cache.update(x.kv_c.view(b, 1, s, R), x.k_pe.view(b, 1, s, dr),
                                      self.layer_idx)
        if k_idx is not None:
            if not hasattr(cache, "update_indexer"):
                raise TypeError(f"a {type(cache).__name__} holds no index keys: pass an MLACache "
                                "or transformers' DynamicCache(config=model.config)")
            k_idx = cache.update_indexer(k_idx, self.layer_idx)
        return self._attend_dense(x, kv_all[:, 0], pe_all[:, 0], q_idx, k_idx, w_idx,
                                  prev_topk_indices)

    def _attend_dense(self, x: _Step, kv_c, k_pe, q_idx, k_idx, w_idx, prev_topk_indices):
        """transformers' sparse attention over keys held in full (the prefill's prompt, or a
        transformers cache): the indexer's top-k positions as a mask on top of the causal one,
        then the unabsorbed attention. Returns ([b, s, H, dv], the positions [b, s, k])."""
        b, s = x.q_nope.shape[0], x.q_nope.shape[2]
        S = kv_c.shape[1]
        dtype = x.hidden_states.dtype
        mask = _attention_mask(x.attention_mask, s, S, kv_c.device, dtype)
        if mask is None:  # one token, no mask: it sees every key
            mask = torch.ones(b, 1, s, S, dtype=torch.bool, device=kv_c.device)
        mask = mask.expand(b, 1, s, S)
        topk = prev_topk_indices if self.indexer is None else \
            self.indexer.dense_topk(q_idx, k_idx, w_idx, mask[:, 0])
        unselected = torch.ones(b, s, S, dtype=torch.bool, device=kv_c.device).scatter(
            -1, topk.long(), False).unsqueeze(1)  # [b, 1, s, S], True: not selected
        if mask.dtype == torch.bool:
            mask = mask & ~unselected
        else:
            mask = mask.masked_fill(unselected, torch.finfo(dtype).min)
        return self._attend_expanded(x.q_nope, x.q_pe, kv_c, k_pe, x.attention_mask,
                                     mask=mask), topk

    def _attend_sparse(self, q_nope, q_pe, step: LatentStep, indices: torch.Tensor
                       ) -> torch.Tensor:
        """Decode: W_UK into the query, torch_mla.mla_decode_sparse over the latent-cache slots
        ``indices`` (int32 [b, s, topk], -1 for none), W_UV into the output. [b, H, s, *] ->
        [b, s, H, v_head_dim]."""
        q, w_uv = self._absorbed_query(q_nope, q_pe)
        if step.kv_scale is None:
            q = q.to(step.kv_cache.dtype)
        out_lat, _ = mla_decode_sparse(q, step.kv_cache, indices, softmax_scale=self.scaling,
                                       d_v=self.kv_lora_rank, kv_scale=step.kv_scale,
                                       schedule=step.schedule)
        return self._absorbed_output(out_lat, w_uv)

