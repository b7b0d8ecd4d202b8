"""nn.Modules on top of the torch_mla ops, and their cache.

    MultiheadLatentAttention   DeepSeek-V2/V3 attention (transformers' parameter names): prefill
                               unabsorbed, decode absorbed over the paged latent cache
    SparseMultiheadLatentAttention
                               DeepSeek-V3.2's attention (MLA with a lightning indexer): decode
                               over the cache slots the indexer picks (DeepSeek Sparse Attention)
    MLACache                   the paged latent cache: static buffers, device-side lengths, a
                               transformers Cache that ``generate`` accepts
    swap_mla_attention         replaces every DeepSeek-V2/V3/V3.2-style attention of a loaded model
                               (decided by structure and config), in place
    generate_kwargs            the keyword under which this transformers version takes a cache
    mla_tp_plan                transformers tp_plan rules that shard MLA attention by head
    shard_model                transformers' tensor parallelism for a model loaded on every rank
                               (what from_pretrained(tp_plan=...) does, without accelerate)

transformers is optional (extra ``hf``): without it the module and the cache still work, the cache
is just not a transformers ``Cache``.
"""

from .attention import MultiheadLatentAttention, RMSNorm
from .cache import MLACache
from .sparse_attention import SparseMultiheadLatentAttention
from .swap import swap_mla_attention
from .tensor_parallel import mla_tp_plan, shard_model


def generate_kwargs(model, cache) -> dict:
    """``{"cache": cache}`` or ``{"past_key_values": cache}``, whichever this transformers'
    ``generate`` takes (``cache`` from 5.24 on; the old name is deprecated there)."""
    import inspect

    params = inspect.signature(model.forward).parameters
    return {"cache": cache} if "cache" in params else {"past_key_values": cache}


__all__ = ["MLACache", "MultiheadLatentAttention", "RMSNorm", "SparseMultiheadLatentAttention",
           "generate_kwargs", "mla_tp_plan", "shard_model", "swap_mla_attention"]
