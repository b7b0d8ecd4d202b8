"""``MLACache``: a paged latent KV cache with static buffers, usable as a transformers ``Cache``.

What it holds (all preallocated at construction, never reallocated):

    kv_caches[l]   [num_blocks, 64, 1, kv_lora_rank + qk_rope_head_dim], one per layer, on that
                   layer's device: token t of request r lives in page ``block_table[r, t // 64]``,
                   row ``t % 64``; each row is ``[kv_c | k_pe]``, the normalised latent and the
                   rotated RoPE key (FlashMLA's layout, 576 values = 1152 bytes in bf16 for
                   DeepSeek-V2/V3).
    block_table    int32 [max_batch_size, ceil(max_cache_len / 64)], shared by all layers
                   (default: request r owns pages ``r * max_blocks ...``, in order).
    cache_seqlens  int32 [max_batch_size], tokens cached per request, shared by all layers.

For a model with DeepSeek Sparse Attention (DeepSeek-V3.2: a config with ``index_topk`` and
``index_head_dim``) each layer that runs an indexer also holds

    index_caches[l]  [num_blocks, 64, index_head_dim]: one index key a token, on the same pages
                     and slots as the latents (``torch_mla.indexer_topk``'s cache); in the
                     model's dtype, or float8_e4m3fn with
    index_scales[l]  float32 [num_blocks, 64], one power-of-two scale a token (DeepSeek's
                     per-token quantization, ``torch_mla.append_index_keys``).

Layers that reuse an earlier layer's selection (``config.indexer_types[l] == "shared"``, GLM-5)
have none. A decode step of such a model attends through ``torch_mla.mla_decode_sparse`` and
shares its schedule (the same for every step of the same shape: each query token has ``topk``
entries) across the layers.

A model split over devices (``device_map``) gets each layer's buffers on the device of that
layer's attention (``MLACache.for_model`` reads them; ``layer_devices``); the block table and the
lengths are kept on layer 0's device and mirrored, once a step, on every other device.

A forward of the model is one *step*: its layer 0 starts it (computes this step's slots, advances
the lengths on the device and computes the decode schedule, which all layers then share), every
layer appends its latents; the first layer on another device copies the lengths and the slots
there and computes the schedule there, for the layers on that device. The first step after
construction or :meth:`MLACache.reset` is the *prefill*: the attention runs over the prompt
itself and its latents are written; a padding token (found from the attention mask) is not
written, so each request's cache holds only its real tokens and requests of different lengths sit
side by side. Every later step is a *decode* step of ``s_q >= 1`` new tokens per request,
appended at each request's own length and attended causally through :func:`torch_mla.mla_decode`.

Nothing in a decode step reads a value on the host, so it compiles to one graph whose shapes do
not change from step to step, and replays in a CUDA graph: the buffers are marked as static
addresses for cudagraph trees.

The FP8 latent cache (``dtype=torch.float8_e4m3fn``): the latent buffers hold e4m3 values (576
bytes a token and layer for DeepSeek, half of bf16) and each layer has one float32 [1] scale,
``kv_scales[l]`` on that layer's device: a row stands for ``row.float() * kv_scales[l]``. The
scale is given (``kv_scale=``) or, by default, measured: at the prefill each layer takes the
largest magnitude of the latents it stores (``[kv_c | k_pe]`` of the real tokens, what
``append_kv`` writes) over 448, on the device (no host sync), and keeps it until the next prefill.
A later latent past ``448 * scale`` is saturated to +-448 (clipped, not NaN), so tokens after
the prompt that grow larger than every prompt token lose that excess.

Positions: a decode step needs each request's own positions when the lengths differ;
``generate`` passes them, a hand-written loop passes ``position_ids=cache.position_ids(b, s)``.

A decode step may also carry padding (a chunked prefill, ``generate(prefill_chunk_size=k)``, whose
left padding runs past the first chunk): its padding tokens are not written and each request's
real tokens go to its own next slots, so with the causal decode every real token sees exactly
the real tokens before it. That needs the padding of a step to come before its real tokens
(left padding); a real token followed by padding in the same step raises.

``generate`` starts from an empty cache on every call (it resets the cache it is given), so a
cache serves one generate call after another; to continue a sequence, pass the whole of it again
(it is prefilled again, and the tokens are transformers' own).

Limits: at most ``max_cache_len`` positions per request, counted as transformers
counts them (padding included). In eager mode a step past that raises ValueError before anything
is written; a compiled step (no host read is possible) fails a device-side assert instead
(RuntimeError; on a GPU the CUDA context is lost, as with any device-side assert), unless
``torch_mla.set_value_checks(False)``: then such tokens are dropped. Size the cache for prompt
plus new tokens. Beam search, cropping (assisted decoding) and batch re-indexing are not
supported and raise.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from ..ops import DecodeSchedule, append_kv, checks, get_decode_schedule
from ..ops.checks import FP8, FP8_MAX
from ..ops.indexer import append_index_keys, index_cache_bytes_per_token

try:  # transformers is optional: without it MLACache is a plain object with the same methods.
    from transformers.cache_utils import Cache as _CacheBase
    from transformers.cache_utils import CacheLayerMixin as _LayerBase

    HAS_TRANSFORMERS = True
except ImportError:  # pragma: no cover - exercised only where transformers is absent
    _CacheBase = object
    _LayerBase = object
    HAS_TRANSFORMERS = False

PAGE_SIZE = 64
_warned_fp32_on_gpu = False


def key_padding(attention_mask: Any, num_tokens: int,
                offset: torch.Tensor | int = 0) -> torch.Tensor | None:
    """bool [b, num_tokens], False for this step's padding tokens (which are not stored), from a
    transformers attention mask; None when there is no mask (no padding).

    Accepts a 2D padding mask [b, >= num_tokens] (1 = token; its last columns are this step's), or
    a 4D bool mask [b, 1, num_tokens, kv] (True = attend) or additive float one (0 = attend, very
    negative = masked) whose columns are positions, this step's tokens at ``offset`` onwards
    (``cache.get_seq_length()``, as transformers builds them): a real token sees itself, padding
    is seen by no one.
    """
    if attention_mask is None:
        return None
    if attention_mask.dim() == 2:
        return attention_mask[:, -num_tokens:].bool()
    m = attention_mask[:, 0]  # [b, num_tokens, kv]
    if m.dtype != torch.bool:
        m = m > torch.finfo(m.dtype).min / 2
    own = torch.arange(num_tokens, device=m.device) + offset
    # Clamped so that a mask narrower than the cache can never index out of bounds.
    own = own.clamp(max=m.shape[-1] - 1).expand(m.shape[0], num_tokens)
    return torch.gather(m, 2, own[:, :, None]).squeeze(2)


def _per_layer(device: Any, num_layers: int) -> list[torch.device]:
    if isinstance(device, (list, tuple)):
        if len(device) != num_layers:
            raise ValueError(f"device: one per layer, {num_layers} layers, got {len(device)} "
                             "devices")
        return [torch.device(d) for d in device]
    return [torch.device(device if device is not None else "cpu")] * num_layers


def attention_devices(model: torch.nn.Module) -> dict[int, torch.device]:
    """``{layer_idx: device}`` for each MLA attention of ``model`` (a module with ``kv_b_proj``
    and a ``layer_idx``): where its weights are, or, for a layer that accelerate offloads (weights
    on the meta device or the CPU, moved in at each call), the device its hook runs it on."""
    hooks = {}  # accelerate's hooks sit on the modules device_map names: the layers' ancestors
    for name, m in model.named_modules():
        if getattr(getattr(m, "_hf_hook", None), "execution_device", None) is not None:
            hooks[name] = torch.device(m._hf_hook.execution_device)
    devices = {}
    for name, m in model.named_modules():
        if not hasattr(m, "kv_b_proj") or getattr(m, "layer_idx", None) is None:
            continue
        device = m.kv_b_proj.weight.device
        parts = name.split(".")
        scopes = (".".join(parts[:i]) for i in range(len(parts), -1, -1))  # itself, parents
        hooked = next((hooks[p] for p in scopes if p in hooks), None)
        devices[m.layer_idx] = hooked if hooked is not None else device
    return devices


def measure_scale(kv_c: torch.Tensor, k_pe: torch.Tensor, stored: torch.Tensor) -> torch.Tensor:
    """float32 [1]: ``amax(|[kv_c | k_pe]|) / 448`` over the rows that ``stored`` (bool [T])
    marks, the scale that maps the largest stored latent to e4m3's largest finite value.
    kv_c [T, R], k_pe [T, d_rope], any float dtype. On the device, no host sync. Never 0 (all
    rows zero or unstored: the smallest normal float32), so quantizing never divides by 0."""
    amax = torch.maximum(kv_c.abs().amax(dim=1), k_pe.abs().amax(dim=1)).float()  # [T]
    amax = torch.where(stored, amax, 0.0).amax(dim=0, keepdim=True) if amax.numel() else \
        amax.new_zeros(1)
    return (amax / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)


class LatentStep(NamedTuple):
    """What one layer needs to attend in the current step.

    prefill: True for the first step (attend over this forward's tokens, not the cache).
    kv_cache: this layer's [num_blocks, 64, 1, d_latent + d_rope] buffer (this step's latents in).
    block_table: int32 [b, max_blocks]; cache_seqlens: int32 [b], lengths including this step.
    schedule: the decode schedule for these lengths (None at prefill).
    kv_scale: float32 [1], the dequantization scale of a float8_e4m3fn kv_cache; None otherwise.
    compute: mla_decode's ``compute`` over a float8_e4m3fn kv_cache ("exact" or "fp8").
    index_cache: this layer's index-key cache [num_blocks, 64, index_head_dim] (this step's keys
        in), None for a layer without an indexer; index_scale: its float32 [num_blocks, 64]
        scales when it is float8_e4m3fn. In a cache with index keys, ``schedule`` is the sparse
        decode's (``torch_mla.mla_decode_sparse``, ``topk`` entries a query token).
    """

    prefill: bool
    kv_cache: torch.Tensor
    block_table: torch.Tensor
    cache_seqlens: torch.Tensor
    schedule: DecodeSchedule | None
    kv_scale: torch.Tensor | None = None
    compute: str = "exact"
    index_cache: torch.Tensor | None = None
    index_scale: torch.Tensor | None = None


def _warn_fp32_on_gpu(device: torch.device, dtype: torch.dtype) -> None:
    global _warned_fp32_on_gpu
    if device.type == "cuda" and dtype == torch.float32 and not _warned_fp32_on_gpu:
        _warned_fp32_on_gpu = True
        import warnings

        warnings.warn(
            "MLACache in float32 on a CUDA device: torch_mla's GPU kernel takes bfloat16 or "
            "float16, so every decode step runs the slow reference path. Build the cache in the "
            "model's dtype (MLACache.for_model(model, ...) reads it, or pass dtype=)",
            stacklevel=3,
        )


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
        self.device = cache.layer_devices[layer_idx]

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
        device: of the buffers, the model's (default: the CPU); or one device per layer, for a
            model split over devices (the step's state lives on layer 0's).
        dtype: of the buffers, the model's: bf16/fp16 run the GPU kernel, fp32 the reference
            (warned about once on a GPU). Default: ``torch.get_default_dtype()``.
            ``MLACache.for_model`` reads both from the model. ``torch.float8_e4m3fn``: the FP8
            latent cache (half the bytes of bf16; the decode runs the SM90 kernel's exact mode
            on H100/H200 with a bf16/fp16 model, the reference elsewhere), with a scale per
            layer (``kv_scale``).
        kv_scale: only with a float8_e4m3fn cache: ``"auto"`` (the default) measures each
            layer's scale at each prefill, ``amax([kv_c | k_pe]) / 448`` over the real tokens'
            latents, on the device, and keeps it until the next prefill (NaN before the first:
            a cache filled by :meth:`set_seqlens` instead needs its ``kv_scales`` filled too);
            or a given scale used as is: a float or a tensor of one element for every layer, or
            a list of them, one per layer. Latents past ``448 * scale`` are saturated to +-448.
        compute: only with a float8_e4m3fn cache: :func:`torch_mla.mla_decode`'s ``compute``,
            ``"exact"`` (default: 16-bit MMAs over the dequantized pages) or ``"fp8"`` (fast
            mode: Q, quantized per row, and P in e4m3 on the fp8 tensor cores).
        block_table: optional int32 [max_batch_size, ceil(max_cache_len / 64)], a custom page
            assignment (pages must be distinct); default: request r owns its own run of pages.
        num_blocks: pages to allocate per layer (default: enough for the block table).
        index_dtype: the index-key caches' dtype, for a config with an indexer (DeepSeek-V3.2):
            default ``dtype``; ``torch.float8_e4m3fn`` stores each key in e4m3 with a float32
            scale per token (``index_head_dim + 4`` bytes a token and layer).
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
        kv_scale: str | float | torch.Tensor | Sequence[float | torch.Tensor] | None = None,
        compute: str = "exact",
        index_dtype: torch.dtype | None = None,
    ):
        if max_batch_size < 1 or max_cache_len < 1:
            raise ValueError(f"max_batch_size and max_cache_len must be >= 1, got "
                             f"{max_batch_size} and {max_cache_len}")
        self.num_layers = config.num_hidden_layers
        self.layer_devices = _per_layer(device, self.num_layers)
        dtype = dtype if dtype is not None else torch.get_default_dtype()
        for d in dict.fromkeys(self.layer_devices):
            _warn_fp32_on_gpu(d, dtype)
        self.kv_lora_rank = config.kv_lora_rank
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.device, self.dtype = self.layer_devices[0], dtype
        # The distinct devices, layer 0's first; each layer's index among them.
        self._devices = list(dict.fromkeys(self.layer_devices))
        self._device_of = [self._devices.index(d) for d in self.layer_devices]
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
        self.kv_caches = [torch.zeros(num_blocks, PAGE_SIZE, 1, d, dtype=dtype, device=dev)
                          for dev in self.layer_devices]
        # float32 [1] per layer for a float8_e4m3fn cache, else None.
        self.kv_scales, self.auto_scale = self._scales(kv_scale, dtype)
        self._index_caches(config, num_blocks, index_dtype or dtype)
        if compute not in ("exact", "fp8"):
            raise ValueError(f"compute must be 'exact' or 'fp8', got {compute!r}")
        if compute == "fp8" and dtype != torch.float8_e4m3fn:
            raise ValueError(f"compute='fp8' is a float8_e4m3fn cache's fast mode; this cache is "
                             f"{dtype}: pass compute='exact'")
        self.compute = compute
        # Per device: the block table and the lengths ([0]: layer 0's, where a step starts).
        self._tables = [block_table.to(device=dev, dtype=torch.int32).contiguous()
                        for dev in self._devices]
        self._seqlens = [torch.zeros(max_batch_size, dtype=torch.int32, device=dev)
                         for dev in self._devices]
        self.block_table, self.cache_seqlens = self._tables[0], self._seqlens[0]
        # Positions processed, padding included (transformers' notion of the sequence length).
        self._seen = torch.zeros((), dtype=torch.int64, device=self.device)
        if not torch.compiler.is_compiling():
            # In-place updates of these inside a compiled step need fixed addresses for CUDA graphs.
            index = [t for t in (*(self.index_caches or ()), *(self.index_scales or ()))
                     if t is not None]
            for t in (*self.kv_caches, *(self.kv_scales or ()), *index, *self._tables,
                      *self._seqlens, self._seen):
                torch._dynamo.mark_static_address(t)
        self._reset_python_state()
        self._given_to_generate = False
        layers = [MLACacheLayer(self, i) for i in range(self.num_layers)]
        if HAS_TRANSFORMERS:
            super().__init__(layers=layers)
        else:  # pragma: no cover
            self.layers = layers

    def _index_caches(self, config: Any, num_blocks: int, dtype: torch.dtype) -> None:
        """The index-key caches of a config with an indexer (``index_topk``, ``index_head_dim``):
        one per layer that runs its own indexer, None for the others; ``index_caches`` None for
        a config without one."""
        self.index_topk = getattr(config, "index_topk", None)
        self.index_head_dim = getattr(config, "index_head_dim", None)
        self.index_caches = self.index_scales = None
        if not (self.index_topk and self.index_head_dim):
            self.index_topk = None
            return
        if dtype not in (*checks.DTYPES, FP8):
            raise ValueError(f"index_dtype must be bfloat16, float16, float32 or "
                             f"float8_e4m3fn, got {dtype}")
        kinds = getattr(config, "indexer_types", None) or ["full"] * self.num_layers
        own = [kinds[i] != "shared" for i in range(self.num_layers)]
        shape = (num_blocks, PAGE_SIZE)
        self.index_caches = [torch.zeros(*shape, self.index_head_dim, dtype=dtype, device=dev)
                             if mine else None for mine, dev in zip(own, self.layer_devices)]
        if dtype == FP8:
            self.index_scales = [torch.zeros(shape, dtype=torch.float32, device=dev)
                                 if mine else None for mine, dev in zip(own, self.layer_devices)]
        self.index_dtype = dtype

    def _scales(self, kv_scale, dtype: torch.dtype) -> tuple[list[torch.Tensor] | None, bool]:
        """(kv_scales, measured at the prefill) from the constructor's ``kv_scale``."""
        if dtype != FP8:
            if kv_scale is not None:
                raise ValueError(f"kv_scale is the scale of a float8_e4m3fn cache; this cache is "
                                 f"{dtype}: pass kv_scale=None")
            return None, False
        if kv_scale is None or (isinstance(kv_scale, str) and kv_scale == "auto"):
            # NaN until a prefill measures it: a decode over latents nobody scaled shows.
            return [torch.full((1,), math.nan, dtype=torch.float32, device=dev)
                    for dev in self.layer_devices], True
        if isinstance(kv_scale, str):
            raise ValueError(f'kv_scale must be "auto", a float, a tensor of one element or a '
                             f"list of them (one per layer), got {kv_scale!r}")
        given = list(kv_scale) if isinstance(kv_scale, (list, tuple)) else \
            [kv_scale] * self.num_layers
        if len(given) != self.num_layers:
            raise ValueError(f"kv_scale: one per layer, {self.num_layers} layers, got "
                             f"{len(given)} scales")
        scales = []
        for layer, (x, dev) in enumerate(zip(given, self.layer_devices)):
            if isinstance(x, torch.Tensor) and x.numel() != 1:
                raise ValueError(f"kv_scale of layer {layer}: one element, got shape "
                                 f"{list(x.shape)}")
            t = torch.as_tensor(x).to(device=dev, dtype=torch.float32).reshape(1).clone()
            if t.device.type == "cpu" and not (math.isfinite(t.item()) and t.item() > 0):
                raise ValueError(f"kv_scale of layer {layer} must be finite and > 0, got "
                                 f"{t.item()}")
            scales.append(t)
        return scales, False

    @classmethod
    def for_model(cls, model: torch.nn.Module, max_batch_size: int, max_cache_len: int,
                  **kwargs) -> MLACache:
        """A cache sized for ``model`` (a transformers DeepSeek model) in the dtype of its
        attention weights, each layer's buffers on the device of that layer's attention
        (:func:`attention_devices`: one device, or several for a model split by ``device_map``).
        ``dtype=torch.float8_e4m3fn`` (and ``kv_scale=``) make it an FP8 latent cache."""
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") \
            else model.config
        w = next(m.kv_b_proj.weight for m in model.modules() if hasattr(m, "kv_b_proj"))
        if "device" not in kwargs:
            devices = attention_devices(model)
            first = devices[min(devices)]
            per_layer = [devices.get(i, first) for i in range(config.num_hidden_layers)]
            kwargs["device"] = first if len(set(per_layer)) == 1 else per_layer
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
        """Bytes one cached token takes in one layer: (kv_lora_rank + qk_rope_head_dim) values
        (one byte each in a float8_e4m3fn cache; its one scale per layer is not per token)."""
        return (self.kv_lora_rank + self.qk_rope_head_dim) * self.kv_caches[0].element_size()

    @property
    def index_bytes_per_token_per_layer(self) -> int:
        """Bytes one token's index key takes in a layer with an indexer (index_head_dim values,
        plus a float32 scale in an FP8 index cache); 0 without indexer."""
        if self.index_caches is None:
            return 0
        return index_cache_bytes_per_token(self.index_head_dim, self.index_dtype)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes one cached token takes over all layers (its latents, and its index keys in the
        layers that have an indexer)."""
        index = sum(c is not None for c in self.index_caches or ())
        return (self.kv_bytes_per_token_per_layer * self.num_layers
                + self.index_bytes_per_token_per_layer * index)

    @property
    def nbytes(self) -> int:
        """Bytes allocated for the latents (and index keys), all layers."""
        tensors = [*self.kv_caches, *(self.index_caches or ()), *(self.index_scales or ())]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

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
        # Prefill attends over the prompt alone. Decode steps read only which of their tokens are
        # padding (the mask's columns at their positions), so transformers may build the mask at
        # a fixed size that never recompiles.
        if not self._prefilled:
            return query_length, 0
        return self._max_len + query_length, 0

    def reset(self) -> None:
        """Empties the cache (lengths to 0); the next forward is a prefill again. ``generate``
        calls it itself (see ``_is_user_defined``); a hand-written loop calls it between
        sequences."""
        for lens in self._seqlens:
            lens.zero_()
        self._seen.zero_()
        self._reset_python_state()

    def _reset_python_state(self) -> None:
        self._prefilled = False
        # (prefill, batch, tokens, key_valid, per device: (slots, schedule) or None) of the step
        # under way; None between steps.
        self._step: tuple | None = None
        # ``_seen`` as the host knows it: eager steps keep it, a compiled step sets None.
        self._host_seen: int | None = 0

    @property
    def _is_user_defined(self) -> bool:
        return self._given_to_generate

    @_is_user_defined.setter
    def _is_user_defined(self, value: bool) -> None:
        # transformers' generate sets this on the cache it is given, once, at its start, before it
        # reads the cache's length. A cache left as an earlier call filled it would make generate
        # skip that many tokens of the new prompt and continue the old sequence, so every call
        # starts from an empty cache; a continuation (the whole sequence passed again) is then
        # prefilled again, which gives transformers' tokens.
        if value:
            self.reset()
        self._given_to_generate = bool(value)

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
        if b > self._max_batch or longest > self._max_len:
            raise ValueError(f"{b} requests of up to {longest} tokens do not fit a cache of "
                             f"{self._max_batch} x {self._max_len}")
        for lens in self._seqlens:
            lens.zero_()
            lens[:b].copy_(cache_seqlens)
        self._seen.fill_(longest)
        self._reset_python_state()
        self._prefilled = True
        self._host_seen = longest

    def begin_layer(self, layer_idx: int, batch_size: int, num_tokens: int,
                    attention_mask: Any = None) -> bool:
        """Called by each attention layer before :meth:`append_latents`; returns whether this
        forward is the prefill. Layer 0 starts a new step: it checks that the step fits and reads
        which of its tokens are padding from ``attention_mask`` (transformers' mask: see
        :func:`key_padding`; ignored by the other layers). The layers of a forward must run in
        order (0 .. num_layers - 1), as in every transformers model.

        The start of a step reads no Python state that a step changes (only ``_prefilled``, which
        stays True after the prefill), so a compiled decode step never recompiles."""
        if layer_idx == 0:
            if batch_size > self._max_batch:
                raise ValueError(f"batch of {batch_size} requests, but the cache was built for "
                                 f"max_batch_size={self._max_batch}")
            if num_tokens == 0:
                raise ValueError(
                    "MLACache got a forward with 0 new tokens: the cache already holds this input "
                    "(generate passes only the tokens past cache.get_seq_length()); call "
                    "cache.reset() before starting a new sequence")
            prefill = not self._prefilled
            self._check_fits(prefill, num_tokens)
            key_valid = key_padding(attention_mask, num_tokens, 0 if prefill else self._seen)
            if not prefill and key_valid is not None and num_tokens > 1:
                self._check_padding_first(key_valid)
            self._prefilled = True
            self._step = (prefill, batch_size, num_tokens, key_valid, (None,) * len(self._devices))
        elif self._step is None:
            raise RuntimeError(f"layer {layer_idx} attends before layer 0 in this forward: "
                               "MLACache expects layers 0 .. num_layers - 1 in order")
        prefill, b, s = self._step[:3]
        if (b, s) != (batch_size, num_tokens):
            raise ValueError(f"layer {layer_idx} sees [{batch_size}, {num_tokens}] tokens but this "
                             f"step started with [{b}, {s}]")
        return prefill

    def _check_fits(self, prefill: bool, num_tokens: int) -> None:
        # The limit is on positions, padding included (``_seen``): what transformers counts, and
        # never less than any request's stored length, so a step that fits never leaves its pages.
        full = (f"MLACache is full: {{}} positions (padding included) would exceed "
                f"max_cache_len={self._max_len}; build a larger cache")
        if prefill:
            seen = 0
        elif torch.compiler.is_compiling():
            seen = None  # a compiled step reads nothing on the host (nor the host count)
        elif self._host_seen is not None:
            seen = self._host_seen
        elif self._seen.device.type == "cpu":
            seen = int(self._seen)  # the first eager step after compiled ones
        else:
            seen = None
        if seen is None:
            # The device checks: no sync, and CUDA graphs keep the check. The host count stays
            # unknown until the next prefill, reset() or set_seqlens().
            if checks._value_checks:
                torch._assert_async(self._seen + num_tokens <= self._max_len,
                                    full.format("this step's"))
            self._host_seen = None
        else:
            if seen + num_tokens > self._max_len:
                raise ValueError(full.format(seen + num_tokens))
            self._host_seen = seen + num_tokens

    def _check_padding_first(self, key_valid: torch.Tensor) -> None:
        # Real tokens are stored at the request's next slots and attend causally among this
        # step's tokens, which is right for each real token only if no padding follows it here.
        bad = (key_valid[:, :-1] & ~key_valid[:, 1:]).any(dim=1)  # [b]
        msg = ("a padding token follows a real token in the same step{}: MLACache stores a "
               "step's real tokens in order and attends causally, which needs the padding "
               "first (left padding: a tokenizer with padding_side='left')")
        if key_valid.device.type == "cpu" and not torch.compiler.is_compiling():
            if bool(bad.any()):
                raise ValueError(msg.format(f" of request {int(bad.nonzero()[0, 0])}"))
        elif checks._value_checks:
            torch._assert_async(~bad.any(), msg.format(""))

    def append_latents(self, layer_idx: int, kv_c: torch.Tensor, k_pe: torch.Tensor,
                       num_heads: int, index_k: torch.Tensor | None = None) -> LatentStep:
        """Writes one layer's latents for this step and returns what it attends with.

        Args:
            kv_c: [b, s, kv_lora_rank], normalised latents of this step's tokens.
            k_pe: [b, s, qk_rope_head_dim], their rotated RoPE keys.
            num_heads: query heads (sizes the decode schedule).
            index_k: [b, s, index_head_dim], their index keys, for a layer with an indexer
                (written to its index cache at the latents' slots; quantized per token in an
                FP8 one).
        """
        prefill, b, s, key_valid, per_device = self._step
        if per_device[0] is None:  # the step's first layer computes what every layer shares
            if key_valid is None:
                key_valid = torch.ones(b, s, dtype=torch.bool, device=self.device)
            key_valid = key_valid.to(self.device).expand(b, s)
            slots = self._store(b, s, key_valid, prefill)
            sched = None if prefill else self._schedule(self.cache_seqlens[:b], s, num_heads)
            per_device = ((slots, sched), *per_device[1:])
        k = self._device_of[layer_idx]
        if per_device[k] is None:  # the step's first layer on another device: mirror it there
            lens = self._seqlens[k]
            lens.copy_(self.cache_seqlens)
            slots = per_device[0][0].to(self._devices[k])
            sched = None if prefill else self._schedule(lens[:b], s, num_heads)
            per_device = (*per_device[:k], (slots, sched), *per_device[k + 1:])
        self._step = (prefill, b, s, None, per_device)
        slots, sched = per_device[k]
        kv = self.kv_caches[layer_idx]
        kv_c, k_pe = kv_c.reshape(b * s, -1), k_pe.reshape(b * s, -1)
        scale = None if self.kv_scales is None else self.kv_scales[layer_idx]
        if scale is not None and prefill and self.auto_scale:
            scale.copy_(measure_scale(kv_c, k_pe, slots >= 0))
        if scale is None:
            append_kv(kv, kv_c, k_pe, slots)
        else:
            append_kv(kv, kv_c, k_pe, slots, kv_scale=scale)
        index_cache = index_scale = None
        if self.index_caches is not None and self.index_caches[layer_idx] is not None:
            index_cache = self.index_caches[layer_idx]
            index_scale = None if self.index_scales is None else self.index_scales[layer_idx]
            if index_k is None:
                raise ValueError(f"layer {layer_idx} has an index-key cache: pass its index keys "
                                 "(index_k) with its latents")
            append_index_keys(index_cache, index_k.reshape(b * s, -1), slots, index_scale)
        if layer_idx == self.num_layers - 1:
            self._step = None  # the step is over; hold no tensor past it
        return LatentStep(prefill, kv, self._tables[k][:b], self._seqlens[k][:b], sched, scale,
                          self.compute, index_cache, index_scale)

    def _schedule(self, lengths: torch.Tensor, s: int, num_heads: int) -> DecodeSchedule:
        """This step's decode schedule for requests of these lengths (int32 [b], this step
        included): mla_decode's, or in a cache with index keys mla_decode_sparse's (each of the
        b * s query tokens a request of topk entries; it does not depend on the lengths)."""
        if self.index_caches is None:
            return get_decode_schedule(lengths, s, num_heads)
        entries = torch.full((lengths.shape[0] * s,), self.index_topk, dtype=torch.int32,
                             device=lengths.device)
        return get_decode_schedule(entries, 1, num_heads)

    def _store(self, b: int, s: int, key_valid: torch.Tensor, prefill: bool) -> torch.Tensor:
        """The slots of this step's tokens (-1 for padding, which is not stored); advances the
        lengths. Each request's real tokens go to its next slots, in order."""
        lens = self.cache_seqlens[:b]
        if prefill:
            self.cache_seqlens.zero_()
            self._seen.zero_()
        pos = lens[:, None].to(torch.int64) + torch.cumsum(key_valid.to(torch.int64), dim=1) - 1
        page = torch.gather(self.block_table[:b].to(torch.int64), 1,
                            (pos // PAGE_SIZE).clamp(0, self.max_blocks - 1))
        slot = page * PAGE_SIZE + pos % PAGE_SIZE
        # Past the pages only when the capacity check was off: such tokens are dropped, nothing
        # is ever written or read out of bounds.
        slots = torch.where(key_valid & (pos < self.max_blocks * PAGE_SIZE), slot, -1)
        lens.add_(key_valid.sum(dim=1, dtype=torch.int32)).clamp_(max=self.max_blocks * PAGE_SIZE)
        self._seen.add_(s)
        return slots.reshape(-1)

    def __repr__(self) -> str:
        where = "" if len(self._devices) == 1 else \
            f"devices={[str(d) for d in self._devices]}, "
        index = "" if self.index_caches is None else \
            f"index_keys={self.index_head_dim} ({self.index_dtype}), topk={self.index_topk}, "
        return (f"MLACache(layers={self.num_layers}, {where}max_batch_size={self._max_batch}, "
                f"max_cache_len={self._max_len}, latent={self.kv_lora_rank}+"
                f"{self.qk_rope_head_dim}, dtype={self.dtype}, {index}"
                f"{self.kv_bytes_per_token} bytes/token)")
