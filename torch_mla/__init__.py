"""torch_mla: Multi-head Latent Attention decode for PyTorch, with CuTe DSL kernels.

Public API:
    mla_decode            attention of every query head over the paged latent cache
    get_decode_schedule   the split-KV work schedule for one decode step (device-side)
    append_kv             write new tokens' latents into the paged cache (in place)
    slot_mapping          the cache slots of each request's next tokens, from its block table
    set_value_checks      turn the device-side value checks of CUDA inputs on or off
    mla_decode_sparse     attention of each query token over the cache slots it names (DSA)
    indexer_topk          DeepSeek-V3.2's lightning indexer: the slots each query token attends to
    indexer_logits        its scores; append_index_keys writes its paged index-key cache
    compat.flash_mla      FlashMLA's interface on top of these ops

The ops are forward-only (inference): a backward through them raises.
"""

from . import compat
from .ops import DecodeSchedule, append_kv, get_decode_schedule, mla_decode, set_value_checks
from .ops.cache import slot_mapping

__all__ = ["DecodeSchedule", "append_kv", "compat", "get_decode_schedule", "mla_decode",
           "set_value_checks", "slot_mapping"]
__version__ = "0.1.0"

from .ops.sparse import get_sparse_decode_schedule, mla_decode_sparse  # noqa: E402

__all__ += ["get_sparse_decode_schedule", "mla_decode_sparse"]
from .ops.indexer import append_index_keys, indexer_logits, indexer_topk  # noqa: E402

__all__ += ["append_index_keys", "indexer_logits", "indexer_topk"]
