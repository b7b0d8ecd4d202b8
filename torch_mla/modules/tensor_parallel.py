"""Tensor parallelism for MLA attention: transformers' sharding, read by the swapped module.

transformers shards a model's weights over ranks when it is loaded with a ``tp_plan`` under
``torchrun`` (``from_pretrained(..., distributed_config=DistributedConfig(tp_plan="auto"))``).
The parameters become DTensors: each rank holds one shard (``to_local()``), and each projection's
``forward`` is wrapped to move activations between layouts. DeepSeek-V2's plan shards attention by
head, the Megatron way:

    q_proj / q_b_proj   colwise (Shard(0) of the weight): rank r's rows are its heads' queries
    kv_b_proj           colwise: the same heads' W_UK and W_UV
    o_proj              rowwise (Shard(1)): the same heads' columns; the ranks' partial outputs
                        are summed (all-reduce), the bias added once after the sum
    kv_a_proj_with_mqa  replicated ("mla_kv_a_proj" only changes its gradient): every rank
                        computes the whole latent ``[c | k_pe]`` of every token

So each rank attends with ``num_attention_heads / world_size`` heads over the full latent: every
rank keeps a full latent cache (an :class:`MLACache` of its own, the same on every rank) and runs
:func:`torch_mla.mla_decode` with its own heads. transformers 5.24 leaves DeepSeek-V3's attention
unsharded (its plan has only the MLPs); :func:`mla_tp_plan` gives the same rules for any MLA model
(pass them as ``tp_plan``: they are merged into the model's own plan).

:class:`MultiheadLatentAttention` reads the sharding from the parameters (:func:`head_shard`):
it runs its projections on the local shards itself and sums o_proj's output with a functional
all-reduce, which ``torch.compile(fullgraph=True)`` traces and a CUDA graph captures (NCCL).

Loading with ``tp_plan`` needs ``accelerate`` in transformers 5.24; :func:`shard_model` applies the
same plan to a model already loaded whole on every rank, without it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn


class HeadShard(NamedTuple):
    """This rank's part of a head-sharded attention.

    heads: the query heads this rank computes (``num_attention_heads // world_size``).
    group: the process group whose ranks hold the other heads (o_proj's sum runs over it).
    """

    heads: int
    group: Any


def _dtensor_type():
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor

    return DTensor


def local(t: torch.Tensor | None) -> torch.Tensor | None:
    """A DTensor's shard on this rank (the tensor itself, no copy); any other tensor as it is."""
    DTensor = _dtensor_type()
    return t.to_local() if DTensor is not None and isinstance(t, DTensor) else t


def head_shard(attn: nn.Module, name: str = "attention") -> HeadShard | None:
    """How ``attn`` (a DeepSeek-V2/V3 attention, transformers' or ours) is sharded over ranks:
    None when its weights are whole; a :class:`HeadShard` when transformers' tensor parallelism
    split it by head (q and kv_b_proj colwise, o_proj rowwise, the latent projections replicated).

    Raises:
        NotImplementedError: any other sharding (the message names the projection and its
            placement), or heads that do not divide evenly over the ranks.
    """
    DTensor = _dtensor_type()
    q = "q_proj" if getattr(attn, "q_proj", None) is not None else "q_b_proj"
    names = (q, "q_a_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "q_a_layernorm",
             "kv_a_layernorm")
    params = {f"{n}.{p}": t for n in names if getattr(attn, n, None) is not None
              for p, t in getattr(attn, n).named_parameters(recurse=False)}
    if DTensor is None or not any(isinstance(t, DTensor) for t in params.values()):
        return None
    from torch.distributed.tensor import Replicate, Shard

    # The head-sharded layout; every other parameter must be whole (or a replicated DTensor).
    want = {f"{q}.weight": Shard(0), "kv_b_proj.weight": Shard(0), "o_proj.weight": Shard(1),
            "o_proj.bias": Replicate()}
    mesh = None
    for pname, t in params.items():
        got = tuple(t.placements) if isinstance(t, DTensor) else (Replicate(),)
        expected = (want.get(pname, Replicate()),)
        if got != expected:
            raise NotImplementedError(
                f"{name}.{pname} is sharded as {got}, not {expected}: MultiheadLatentAttention "
                "runs tensor-parallel only with the heads split as DeepSeek-V2's tp_plan splits "
                "them (torch_mla.modules.mla_tp_plan(config))")
        if isinstance(t, DTensor):
            if t.device_mesh.ndim != 1:
                raise NotImplementedError(
                    f"{name}.{pname} lies on a {t.device_mesh.ndim}-D mesh; "
                    "MultiheadLatentAttention takes a 1-D tensor-parallel one")
            mesh = t.device_mesh if mesh is None else mesh
    world = mesh.size()
    if attn.num_heads % world:
        raise NotImplementedError(
            f"{name}: {attn.num_heads} heads do not split evenly over {world} ranks")
    return HeadShard(attn.num_heads // world, mesh.get_group())


def all_reduce_sum(x: torch.Tensor, group: Any) -> torch.Tensor:
    """The sum of ``x`` over the ranks of ``group``: a functional all-reduce (a new tensor), which
    torch.compile traces and a CUDA graph captures."""
    from torch.distributed import _functional_collectives as funcol

    return funcol.all_reduce(x, "sum", group)


def mla_tp_plan(config: Any, prefix: str = "model.layers.*.self_attn") -> dict[str, str]:
    """transformers ``tp_plan`` rules that shard every MLA attention by head (DeepSeek-V2's rules,
    for models whose own plan leaves attention whole, as DeepSeek-V3's in transformers 5.24).

    Args:
        config: the model config (``q_lora_rank`` None: one ``q_proj``, else ``q_b_proj``).
        prefix: the attention modules' names in the model, ``*`` for the layer number.

    Returns:
        ``{module name: style}``; pass it as ``DistributedConfig(tp_plan=...)`` (merged into the
        model's own plan) or to :func:`shard_model`.
    """
    q = "q_proj" if getattr(config, "q_lora_rank", None) is None else "q_b_proj"
    return {f"{prefix}.{q}": "colwise", f"{prefix}.kv_a_proj_with_mqa": "mla_kv_a_proj",
            f"{prefix}.kv_b_proj": "colwise", f"{prefix}.o_proj": "rowwise"}


def shard_model(model: nn.Module, tp_plan: dict[str, str] | str = "auto") -> nn.Module:
    """Shards a transformers model that every rank of the running ``torchrun`` job has loaded
    whole (same weights, on its own device), with transformers' own tensor-parallel code, as
    ``from_pretrained(..., distributed_config=DistributedConfig(tp_plan=tp_plan))`` would (which
    needs ``accelerate``). Initialises ``torch.distributed`` (NCCL on GPUs, gloo on CPUs) unless
    it is already; uses all ``WORLD_SIZE`` ranks.

    Args:
        model: a transformers ``PreTrainedModel`` on this rank's device (``cuda:LOCAL_RANK``).
        tp_plan: "auto" (the model's plan) or rules merged into it (e.g. :func:`mla_tp_plan`).

    Returns:
        ``model``, its sharded parameters now DTensors.
    """
    from transformers.distributed import DistributedConfig
    from transformers.distributed.utils import initialize_distributed_mesh

    config = DistributedConfig(tp_plan=tp_plan)
    _, meshes = initialize_distributed_mesh(config)
    # transformers' loading path: the plan's styles wrap the parameters (distribute_tensor without
    # a source rank keeps each rank's own slice, no communication) and the forwards.
    return type(model).maybe_distribute_model(model, config, meshes)
