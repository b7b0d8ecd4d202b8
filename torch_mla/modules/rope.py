"""Rotary position embedding as DeepSeek-V2/V3 configure it, without a dependency on transformers.

MLA applies RoPE to a narrow slice of the query (``qk_rope_head_dim`` of each head) and to one
shared key (``k_pe``, cached next to the latent). Three conventions exist in transformers' MLA
models, and this module computes each with transformers' own operations, in its dtypes, so a
swapped model rounds as the original does:

    halves       pairs ``(x_i, x_{i + d/2})``, angles as ``(cos, sin)`` in the model's dtype and
                 rotated in it (``rotate_half``: MiniCPM3, DeepSeek-V3 with
                 ``rope_interleave=False``);
    interleaved  pairs ``(x_0, x_1), (x_2, x_3), ...``, same angles and dtype, written as
                 ``[a_0 .. a_{d/2-1}, b_0 .. b_{d/2-1}]`` for the rotated pairs (a, b)
                 (DeepSeek-V3 with ``rope_interleave``);
    complex      interleaved pairs multiplied by complex ``freqs_cis`` in float32 and kept
                 interleaved (DeepSeek-V2).

The order the dimensions come out in changes nothing in ``q_pe . k_pe`` as long as queries and
keys share it; each convention keeps transformers' order, so the cached ``k_pe`` is the same bits
as in transformers' cache.

Frequencies: the default ``base ** (-2i / d)`` or YaRN (NTK-by-parts interpolation with its
attention factor folded into cos/sin), as in transformers' ``_compute_yarn_parameters``. YaRN's
other half, the softmax scale ``mscale(factor, mscale_all_dim) ** 2``, is :func:`softmax_scale`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "yarn")


def rope_parameters(config: Any) -> dict:
    """The RoPE parameters of a DeepSeek config as one dict with at least ``rope_type`` and
    ``rope_theta`` (transformers 5 keeps them in ``config.rope_parameters``; older configs in
    ``rope_scaling`` plus ``rope_theta``)."""
    params = getattr(config, "rope_parameters", None)
    if params is None:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params = dict(params)
    params.setdefault("rope_type", params.pop("type", "default"))
    return params


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def softmax_scale(config: Any) -> float:
    """The scale of ``q . k`` before the softmax: ``qk_head_dim ** -0.5``, times
    ``mscale(factor, mscale_all_dim) ** 2`` for YaRN (DeepSeek's ``yarn_apply_mscale``)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = rope_parameters(config)
    if params["rope_type"] != "default" and params.get("mscale_all_dim"):
        m = _yarn_mscale(params["factor"], params["mscale_all_dim"])
        scale = scale * m * m
    return scale


def rope_frequencies(dim: int, params: dict, max_position_embeddings: int) -> tuple[torch.Tensor,
                                                                                   float]:
    """Inverse frequencies float32 [dim // 2] and the factor cos/sin are multiplied by.

    ``params`` as returned by :func:`rope_parameters`; ``rope_type`` "default" or "yarn".
    """
    base = params["rope_theta"]
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    kind = params["rope_type"]
    if kind == "default":
        return 1.0 / pos_freqs, 1.0
    if kind != "yarn":
        raise NotImplementedError(
            f"rope_type {kind!r} is not implemented by torch_mla.modules.rope (supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}); inside a transformers model the module uses the "
            "position_embeddings the model passes in, which covers every type transformers has"
        )
    orig_max = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_position_embeddings / orig_max
    attention_factor = params.get("attention_factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig_max / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: avoids a division by zero in the ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1 where the frequency is kept, 0 where it is interpolated
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
    return inv_freq, float(attention_factor)


class MLARotaryEmbedding(nn.Module):
    """cos/sin of the rotary angles for given positions (half width: one angle per pair).

    Args:
        dim: the rotary width (``qk_rope_head_dim``).
        params: from :func:`rope_parameters`.
        max_position_embeddings: the model's context length (YaRN derives ``factor`` from it when
            the config leaves it out).
    """

    def __init__(self, dim: int, params: dict, max_position_embeddings: int):
        super().__init__()
        inv_freq, self.attention_factor = rope_frequencies(dim, params, max_position_embeddings)
        # A plain attribute, not a buffer: model.to(torch.bfloat16) must not round it.
        self.inv_freq = inv_freq

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids: int [b, s] -> (cos, sin), float32 [b, s, dim // 2]."""
        if self.inv_freq.device != position_ids.device:
            self.inv_freq = self.inv_freq.to(position_ids.device)
        freqs = position_ids[..., None].float() * self.inv_freq
        return freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor


def half_angles(position_embeddings: Any, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalises what a transformers DeepSeek model passes as ``position_embeddings`` to
    (cos, sin) of shape [b, s, dim // 2].

    DeepSeek-V3 passes ``(cos, sin)`` [b, s, dim] (the half-width angles repeated twice);
    DeepSeek-V2 passes complex ``freqs_cis`` [b, s, dim // 2]. Both carry the YaRN attention factor.
    """
    if isinstance(position_embeddings, torch.Tensor) and position_embeddings.is_complex():
        return position_embeddings.real, position_embeddings.imag
    cos, sin = position_embeddings
    return cos[..., : dim // 2], sin[..., : dim // 2]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool
               ) -> torch.Tensor:
    """Rotates ``x`` [..., d] by angles given as cos/sin broadcastable to [..., d // 2], pairing
    dimensions interleaved or in halves; output layout ``[a | b]`` for the rotated pairs (a, b).

    The operations and their dtypes are transformers' (``apply_rotary_pos_emb`` and
    ``apply_rotary_pos_emb_interleave``): each product and sum in the promoted dtype of x and the
    angles (bf16 for a bf16 model, whose rotary embedding returns bf16 cos/sin), rounded to x's
    dtype at the end.
    """
    half = x.shape[-1] // 2
    if interleave:  # [x_0, x_2, ... | x_1, x_3, ...]: then as in halves
        x = x.unflatten(-1, (half, 2)).transpose(-1, -2).flatten(-2)
    x1, x2 = x[..., :half], x[..., half:]
    # transformers' x * [cos | cos] + rotate_half(x) * [sin | sin], rotate_half(x) = [-x2 | x1]:
    # [x1 cos - x2 sin | x2 cos + x1 sin] bit for bit (but a NaN's sign bit). Not written as the
    # concatenation of those two products: under torch.compile a concatenation evaluates both
    # halves' expressions for every element, with the angles' cos and sin, which inductor
    # recomputes inside the kernel (the query's RoPE kernel at batch 128 on the H200 went from
    # 9.3 to 7.1 us a layer; docs/kernel-notes.md, session 9).
    cos = cos.unsqueeze(-2).expand(*cos.shape[:-1], 2, half).flatten(-2)
    sin = sin.unsqueeze(-2).expand(*sin.shape[:-1], 2, half).flatten(-2)
    return (x * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)


def apply_rope_complex(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V2's rotation: ``x`` [..., d] as d // 2 interleaved complex pairs, times complex
    ``freqs_cis`` broadcastable to [..., d // 2], in float32; returns x's dtype, interleaved."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * freqs_cis).flatten(-2).type_as(x)
