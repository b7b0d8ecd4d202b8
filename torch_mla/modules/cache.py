"""``MLACache``: a paged latent KV cache with static buffers, usable as a transformers ``Cache``.

What it holds (all preallocated at construction, on one device, never reallocated):

    kv_caches[l]   [num_blocks, 64, 1, kv_lora_rank + qk_rope_head_dim], one per layer: token t of
                   request r lives in page ``block_table[r, t // 64]``, row ``t % 64``; each row is
                   ``[kv_c | k_pe]``, the normalised latent and the rotated RoPE key (FlashMLA's
                   layout, 576 values = 1152 bytes in bf16 for DeepSeek-V2/V3).
    block_table    int32 [max_batch_size, ceil(max_cache_len / 64)], shared by all layers
                   (default: request r owns pages ``r * max_blocks ...``, in order).
    cache_seqlens  int32 [max_batch_size], tokens cached per request, shared by all layers.

A forward of the model is one *step*: its layer 0 starts it (computes this step's slots, advances
the lengths on the device and computes the decode schedule, which all layers then share), every
layer appends its latents. The first step after construction or
:meth:`MLACache.reset` is the *prefill*: the attention runs over the prompt itself and its latents
are written; a padding token (found from the attention mask) is not written, so each request's
cache holds only its real tokens and requests of different lengths sit side by side. Every later
step is a *decode* step of ``s_q >= 1`` new tokens per request, appended at each request's own
length and attended causally through :func:`torch_mla.mla_decode`.

Nothing in a decode step reads a value on the host, so it compiles to one graph whose shapes do
not change from step to step, and replays in a CUDA graph: the buffers are marked as static
addresses for cudagraph trees.

Positions: a decode step needs each request's own positions when the lengths differ;
``generate`` passes them, a hand-written loop passes ``position_ids=cache.position_ids(b, s)``.

Limits: one device; tokens past ``max_cache_len`` cannot be stored. In eager mode that raises
before anything is written; under torch.compile (no host read is possible) such tokens are
dropped: size the cache for prompt + new tokens. Beam search, cropping (assisted decoding) and
batch re-indexing are not supported and raise.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from ..ops import DecodeSchedule, append_kv, get_decode_schedule

try:  # transformers is optional: without it MLACache is a plain object with the same methods.
    from transformers.cache_utils import Cache as _CacheBase
    from transformers.cache_utils import CacheLayerMixin as _LayerBase

    HAS_TRANSFORMERS = True
except ImportError:  # pragma: no cover - exercised only where transformers is absent
    _CacheBase = object
    _LayerBase = object
    HAS_TRANSFORMERS = False

PAGE_SIZE = 64


class LatentStep(NamedTuple):
    """What one layer needs to attend in the current step.

    prefill: True for the first step (attend over this forward's tokens, not the cache).
    kv_cache: this layer's [num_blocks, 64, 1, d_latent + d_rope] buffer (this step's latents in).
    block_table: int32 [b, max_blocks]; cache_seqlens: int32 [b], lengths including this step.
    schedule: the decode schedule for these lengths (None at prefill).
    """

    prefill: bool
    kv_cache: torch.Tensor
    block_table: torch.Tensor
    cache_seqlens: torch.Tensor
    schedule: DecodeSchedule | None


def _unsupported(what: str):
    raise NotImplementedError(
        f"MLACache does not support {what}: it holds one growing sequence per batch row "
        "(greedy or sampled generation, speculative decoding with s_q > 1)"
    )


class _RefusesReshaping:
    """Cache and cache-layer methods for beam search and assisted decoding: refused clearly."""

    def reorder_cache(self, beam_idx):
        _unsupported("beam search (reorder_cache)")

    def crop(self, *args):
        _unsupported("cropping (assisted decoding)")

    def batch_repeat_interleave(self, repeats):
        _unsupported("batch_repeat_interleave")

    def batch_select_indices(self, indices):
        _unsupported("batch_select_indices")


class MLACacheLayer(_RefusesReshaping, _LayerBase):
    """One layer's entry in ``MLACache.layers`` (what transformers' generic code iterates over);
    the buffers and the step logic live on the cache."""

    is_compileable = True
    is_sliding = False
    is_croppable = False
    supports_early_init = True

    def __init__(self, cache: MLACache, layer_idx: int):
        if HAS_TRANSFORMERS:
            super().__init__()
        self.cache = cache
        self.layer_idx = layer_idx
        self.is_initialized = True  # preallocated
        self.batch_size = cache.max_batch_size
        self.device = cache.device

    def lazy_initialization(self, key_states, value_states) -> None:  # already allocated
        return None

    def update(self, key_states, value_states, *args, **kwargs):
        raise TypeError(
            "MLACache stores latents for torch_mla.modules.MultiheadLatentAttention; this model "
            "still has transformers' attention. Call torch_mla.modules.swap_mla_attention(model) "
            "first"
        )

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cache._mask_sizes(query_length)

    def get_seq_length(self):
        return self.cache.get_seq_length()

    def get_max_length(self) -> int:
        return self.cache.max_cache_len

    def reset(self) -> None:
        return None  # MLACache.reset resets the shared state once

    def offload(self):
        _unsupported("offloading")

    def prefetch(self):
        _unsupported("offloading")



class MLACache(_RefusesReshaping, _CacheBase):
    """Paged latent cache for MLA models (DeepSeek-V2/V3), a transformers ``Cache`` that
    ``generate`` accepts (pass it as ``past_key_values=`` or, from transformers 5.24, ``cache=``).

    Args:
        config: the model config (duck-typed: ``num_hidden_layers``, ``kv_lora_rank``,
            ``qk_rope_head_dim``).
        max_batch_size: most requests in one forward.
        max_cache_len: most tokens per request (prompt, with its padding, plus generated).
        device, dtype: of the buffers (the model's; bf16/fp16 use the GPU kernel, fp32 the
            reference). ``MLACache.for_model`` reads them from a model.
        block_table: optional int32 [max_batch_size, ceil(max_cache_len / 64)], a custom page
            assignment (pages must be distinct); default: request r owns its own run of pages.
        num_blocks: pages to allocate per layer (default: enough for the block table).
    """

    def __init__(
        self,
        config: Any,
        max_batch_size: int,
        max_cache_len: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        block_table: torch.Tensor | None = None,
        num_blocks: int | None = None,
    ):
        if max_batch_size < 1 or max_cache_len < 1:
            raise ValueError(f"max_batch_size and max_cache_len must be >= 1, got "
                             f"{max_batch_size} and {max_cache_len}")
        device = torch.device(device if device is not None else "cpu")
        dtype = dtype or torch.float32
        self.num_layers = config.num_hidden_layers
        self.kv_lora_rank = config.kv_lora_rank
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.device, self.dtype = device, dtype
        self._max_batch, self._max_len = max_batch_size, max_cache_len
        self.max_blocks = math.ceil(max_cache_len / PAGE_SIZE)
        if block_table is None:
            block_table = torch.arange(max_batch_size * self.max_blocks, dtype=torch.int32)
            block_table = block_table.view(max_batch_size, self.max_blocks)
        if tuple(block_table.shape) != (max_batch_size, self.max_blocks):
            raise ValueError(f"block_table must be [max_batch_size, ceil(max_cache_len / 64)] = "
                             f"[{max_batch_size}, {self.max_blocks}], "
                             f"got {list(block_table.shape)}")
        if num_blocks is None:
            num_blocks = int(block_table.max()) + 1
        d = self.kv_lora_rank + self.qk_rope_head_dim
        self.kv_caches = [torch.zeros(num_blocks, PAGE_SIZE, 1, d, dtype=dtype, device=device)
                          for _ in range(self.num_layers)]
        self.block_table = block_table.to(device=device, dtype=torch.int32).contiguous()
        self.cache_seqlens = torch.zeros(max_batch_size, dtype=torch.int32, device=device)
        # Positions processed, padding included (transformers' notion of the sequence length).
        self._seen = torch.zeros((), dtype=torch.int64, device=device)
        if not torch.compiler.is_compiling():
            # In-place updates of these inside a compiled step need fixed addresses for CUDA graphs.
            for t in (*self.kv_caches, self.block_table, self.cache_seqlens, self._seen):
                torch._dynamo.mark_static_address(t)
        self._reset_python_state()
        layers = [MLACacheLayer(self, i) for i in range(self.num_layers)]
        if HAS_TRANSFORMERS:
            super().__init__(layers=layers)
        else:  # pragma: no cover
            self.layers = layers

    @classmethod
    def for_model(cls, model: torch.nn.Module, max_batch_size: int, max_cache_len: int,
                  **kwargs) -> MLACache:
        """A cache sized for ``model`` (a transformers DeepSeek model), on its device and in the
        dtype of its attention weights."""
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") \
            else model.config
        w = next(m.kv_b_proj.weight for m in model.modules() if hasattr(m, "kv_b_proj"))
        kwargs.setdefault("device", w.device)
        kwargs.setdefault("dtype", w.dtype)
        return cls(config, max_batch_size, max_cache_len, **kwargs)

    # --- sizes ---------------------------------------------------------------------------------

    @property
    def max_batch_size(self) -> int:
        return self._max_batch

    @property
    def max_cache_len(self) -> int:
        return self._max_len

    @property
    def batch_size(self) -> int:
        return self._max_batch

    @property
    def kv_bytes_per_token_per_layer(self) -> int:
        """Bytes one cached token takes in one layer: (kv_lora_rank + qk_rope_head_dim) values."""
        return (self.kv_lora_rank + self.qk_rope_head_dim) * self.kv_caches[0].element_size()

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes one cached token takes over all layers."""
        return self.kv_bytes_per_token_per_layer * self.num_layers

    @property
    def nbytes(self) -> int:
        """Bytes allocated for the latents, all layers."""
        return sum(t.numel() * t.element_size() for t in self.kv_caches)

    # --- transformers' Cache API ---------------------------------------------------------------

    def get_seq_length(self, layer_idx: int = 0):
        """Positions processed so far, padding included: 0 before the prefill, then a 0-d int64
        device tensor (a tensor, so that a compiled step does not specialise on it)."""
        return self._seen if self._prefilled else 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self._max_len

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self._mask_sizes(query_length)

    def _mask_sizes(self, query_length: int) -> tuple[int, int]:
        # Prefill attends over the prompt alone. Decode steps ignore the mask (padding never
        # reaches the cache), so transformers may build it at a fixed size that never recompiles.
        if not self._prefilled:
            return query_length, 0
        return self._max_len + query_length, 0

    def reset(self) -> None:
        """Empties the cache (lengths to 0); the next forward is a prefill again."""
        self.cache_seqlens.zero_()
        self._seen.zero_()
        self._reset_python_state()

    def _reset_python_state(self) -> None:
        self._prefilled = False
        # (prefill, batch, tokens, slots, schedule) of the step under way; None between steps.
        self._step: tuple | None = None
        self._host_bound = 0  # an upper bound of the longest request, tracked in eager mode

    # --- the step -----------------------------------------------------------------------------

    def position_ids(self, batch_size: int, num_tokens: int = 1) -> torch.Tensor:
        """int64 [batch_size, num_tokens]: the positions of the next tokens of each request
        (its cached length onwards), what a decode step passes as ``position_ids``."""
        offs = torch.arange(num_tokens, device=self.device)
        return self.cache_seqlens[:batch_size, None].to(torch.int64) + offs

    def set_seqlens(self, cache_seqlens: torch.Tensor) -> None:
        """Declares that request r holds ``cache_seqlens[r]`` tokens (int [b]), written into
        ``kv_caches`` directly rather than by a prefill (benchmarks fill the cache this way). The
        next forward is a decode step. Reads the lengths on the host once."""
        b = cache_seqlens.shape[0]
        longest = int(cache_seqlens.max()) if b else 0
        if b > self._max_batch or longest > self.max_blocks * PAGE_SIZE:
            raise ValueError(f"{b} requests of up to {longest} tokens do not fit a cache of "
                             f"{self._max_batch} x {self._max_len}")
        self.cache_seqlens.zero_()
        self.cache_seqlens[:b].copy_(cache_seqlens)
        self._seen.fill_(longest)
        self._reset_python_state()
        self._prefilled = True
        self._host_bound = longest

    def begin_layer(self, layer_idx: int, batch_size: int, num_tokens: int) -> bool:
        """Called by each attention layer before :meth:`append_latents`; returns whether this
        forward is the prefill. Layer 0 starts a new step; the layers of a forward must run in
        order (0 .. num_layers - 1), as in every transformers model.

        The start of a step reads no Python state that a step changes (only ``_prefilled``, which
        stays True after the prefill), so a compiled decode step never recompiles."""
        if layer_idx == 0:
            if batch_size > self._max_batch:
                raise ValueError(f"batch of {batch_size} requests, but the cache was built for "
                                 f"max_batch_size={self._max_batch}")
            prefill = not self._prefilled
            if not torch.compiler.is_compiling():
                bound = (0 if prefill else self._host_bound) + num_tokens
                if bound > self._max_len:
                    raise ValueError(
                        f"MLACache is full: {bound} positions (padding included) would exceed "
                        f"max_cache_len={self._max_len}; build a larger cache"
                    )
                self._host_bound = bound
            self._prefilled = True
            self._step = (prefill, batch_size, num_tokens, None, None)
        elif self._step is None:
            raise RuntimeError(f"layer {layer_idx} attends before layer 0 in this forward: "
                               "MLACache expects layers 0 .. num_layers - 1 in order")
        prefill, b, s, _, _ = self._step
        if (b, s) != (batch_size, num_tokens):
            raise ValueError(f"layer {layer_idx} sees [{batch_size}, {num_tokens}] tokens but this "
                             f"step started with [{b}, {s}]")
        return prefill

    def append_latents(self, layer_idx: int, kv_c: torch.Tensor, k_pe: torch.Tensor,
                       num_heads: int, key_valid: torch.Tensor | None = None) -> LatentStep:
        """Writes one layer's latents for this step and returns what it attends with.

        Args:
            kv_c: [b, s, kv_lora_rank], normalised latents of this step's tokens.
            k_pe: [b, s, qk_rope_head_dim], their rotated RoPE keys.
            num_heads: query heads (sizes the decode schedule).
            key_valid: bool [b, s], False for padding tokens; read at prefill only.
        """
        prefill, b, s, slots, sched = self._step
        if slots is None:  # the first layer of the step computes what every layer shares
            if prefill:
                slots = self._prefill_slots(b, s, key_valid, kv_c.device)
            else:
                slots = self._decode_slots(b, s)
                sched = get_decode_schedule(self.cache_seqlens[:b], s, num_heads)
            self._step = (prefill, b, s, slots, sched)
        kv = self.kv_caches[layer_idx]
        append_kv(kv, kv_c.reshape(b * s, -1), k_pe.reshape(b * s, -1), slots)
        if layer_idx == self.num_layers - 1:
            self._step = None  # the step is over; hold no tensor past it
        return LatentStep(prefill, kv, self.block_table[:b], self.cache_seqlens[:b], sched)

    def _slots(self, b: int, pos: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        # pos: int64 [b, s] cache positions; keep: bool [b, s]. Out-of-range pages are clamped
        # for the gather and the slot dropped (-1), so nothing is ever read or written out of
        # bounds even when the eager capacity check cannot run.
        cap = self.max_blocks * PAGE_SIZE
        page = torch.gather(self.block_table[:b].to(torch.int64), 1,
                            (pos // PAGE_SIZE).clamp(0, self.max_blocks - 1))
        slot = page * PAGE_SIZE + pos % PAGE_SIZE
        return torch.where(keep & (pos < cap), slot, -1).reshape(-1)

    def _prefill_slots(self, b: int, s: int, key_valid: torch.Tensor | None,
                       device: torch.device) -> torch.Tensor:
        if key_valid is None:
            key_valid = torch.ones(b, s, dtype=torch.bool, device=device)
        key_valid = key_valid.to(self.device).expand(b, s)
        pos = torch.cumsum(key_valid.to(torch.int64), dim=1) - 1  # padding is skipped
        lens = key_valid.sum(dim=1).clamp(max=self.max_blocks * PAGE_SIZE)
        self.cache_seqlens.zero_()
        self.cache_seqlens[:b].copy_(lens)
        self._seen.fill_(s)
        return self._slots(b, pos, key_valid)

    def _decode_slots(self, b: int, s: int) -> torch.Tensor:
        lens = self.cache_seqlens[:b]
        pos = lens[:, None].to(torch.int64) + torch.arange(s, device=self.device)
        slots = self._slots(b, pos, torch.ones_like(pos, dtype=torch.bool))
        lens.add_(s).clamp_(max=self.max_blocks * PAGE_SIZE)
        self._seen.add_(s)
        return slots

    def __repr__(self) -> str:
        return (f"MLACache(layers={self.num_layers}, max_batch_size={self._max_batch}, "
                f"max_cache_len={self._max_len}, latent={self.kv_lora_rank}+"
                f"{self.qk_rope_head_dim}, dtype={self.dtype}, "
                f"{self.kv_bytes_per_token} bytes/token)")
