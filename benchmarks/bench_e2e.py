"""End-to-end decode step of a DeepSeek-V3-shaped model: transformers vs torch_mla.

    python benchmarks/bench_e2e.py --out docs/e2e-h200.md     # one H200, ~4 min
    python benchmarks/bench_e2e.py --tiny --device cpu       # plumbing check on a CPU
    python benchmarks/bench_e2e.py --systems torch_mla,torch_mla_fp8
                                                             # bf16 vs fp8 latent cache
    torchrun --nproc-per-node 2 benchmarks/bench_e2e.py --tp 2 --systems torch_mla
                                                             # tensor parallel over 2 GPUs
    python benchmarks/bench_e2e.py --systems torch_mla --profile --timeline out/
                                                             # where each step's time goes
    python benchmarks/bench_e2e.py --model v32 --out docs/e2e-v32-h200.md
                                                             # DeepSeek-V3.2: the indexer and
                                                             # sparse decode, contexts 4k-128k

Tensor parallel (``--tp N``, under ``torchrun --nproc-per-node N``, one GPU per rank): the same
model, sharded with transformers' tensor parallelism (its plan for the MLPs, torch_mla's
``mla_tp_plan`` for the attention: heads split over the ranks, the latent replicated); every rank
keeps the whole latent cache and runs its heads. The table (rank 0's) gives the step time, which
every rank shares (the all-reduces synchronise them), tokens/s of the whole job and per GPU; the
floor counts one rank's bytes (its weight shards, the whole latent cache). The one-GPU numbers
come from a separate run without ``--tp`` (same flags); the table says which.

Model: transformers' DeepseekV3ForCausalLM with DeepSeek-V3's attention shape (hidden 7168, 128
heads, q_lora_rank 1536, kv_lora_rank 512, rope 64, nope 128, v 128, YaRN), 4 layers with dense
MLPs (intermediate 18432), vocab 129280, random bf16 weights. Each request's cache is filled with
``--context`` (4096) random latents, the same values for every system, without a prefill.

``--model v32``: DeepSeek-V3.2's shape instead (transformers' DeepseekV32ForCausalLM: the same
attention plus its lightning indexer, 64 heads x 128, index_topk 2048), at contexts 4096, 32768
and 131072 (``--context`` takes a list), batches 1 and 32. Each request's cache also holds a
random index key per token (in the fp8 systems rotated and quantized as the module stores them).
torch_mla's step runs the indexer (torch_mla.indexer_topk: the logits over every cached index key,
then the top-k) and the sparse decode over the 2048 selected tokens; transformers scores every
cached token with its indexer in plain torch, masks all but the top 2048 and attends over the
whole expanded cache.

Systems, each timed over ``--steps`` decode steps of one token per request after 3 warm-up steps
(CUDA-synchronised wall clock; the context grows by one token a step):
    transformers as shipped   eager, sdpa, DynamicCache (the reference run's 'as shipped' numbers
                              are printed next to it)
    transformers static       StaticCache (max_cache_len = context + 64) and the forward under
                              torch.compile(mode="reduce-overhead"), transformers' own recipe
    torch_mla                 swap_mla_attention + MLACache, the forward under
                              torch.compile(mode="reduce-overhead", fullgraph=True): CUDA graphs
    torch_mla_fp8             the same with the FP8 latent cache (MLACache in float8_e4m3fn, 576
                              bytes a token and layer); each layer's kv_scale is amax / 448 of its
                              random latents (what the prefill would measure), written quantized.
                              On H100/H200 its decode runs the SM90 kernel's exact mode (fp8 pages
                              expanded to bf16 on chip, bf16 MMAs)
    torch_mla_fp8_fast        the same in fast mode (MLACache(compute="fp8"): Q, quantized per
                              row, and P in e4m3 on the fp8 tensor cores)

Roofline floor of a step (floor_ms): per op the larger of its bytes over the H200's 4246 GB/s
copy ceiling and its FLOP over the 679 TFLOP/s bf16 matmul ceiling, summed over every linear
layer (weights + activations), the embedding rows and the absorbed attention over the latent
cache (b * context * (kv_lora_rank + rope) values a layer, 2 bytes each in bf16, 1 in the fp8
cache); % of floor = floor / step time.
DeepSeek-V3.2 (``--model v32``): per layer, instead of the dense attention, the indexer (its index
keys read, b * context * index_head_dim values, 2 bytes each in bf16 or 1 + a 4-byte scale per
token in fp8; 2 b context index_n_heads index_head_dim FLOP for the products and 2 b context
index_n_heads for the weighted relu sum; the float32 logits written and read once by the top-k,
8 b context bytes) and the sparse attention over min(context, topk) gathered latent rows (b k
(kv_lora_rank + rope) values read; 2 b k heads (2 kv_lora_rank + rope) FLOP). Its projections
(wq_b, wk, weights_proj) are linear layers, counted with the others.
KV cache bytes per token: the cache object's bytes over the tokens it has room for (all layers).
The first step's logits of each system are compared with transformers as shipped (same inputs,
same cache contents): the relative error is printed.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import sys
import time
import traceback

import torch

from torch_mla.demo import V3_SHAPE, V32_INDEXER, build_model, deepseek_config, deepseek_v32_config

COPY_GBPS = 4246.0
MATMUL_TFLOPS = 679.0  # the H200's bf16 dense matmul ceiling (shared/anchors/README.md)
# transformers as shipped (eager, sdpa, DynamicCache filled to 4096), batch -> ms per step,
# measured on the H200 (torch 2.11, transformers 5.17) before this benchmark existed.
HF_REFERENCE_MS = {1: 5.86, 32: 75.7, 128: 302.0}
TINY = dict(hidden=64, heads=4, q_lora_rank=32, kv_lora_rank=32, rope_dim=16, nope_dim=16,
            v_dim=16, intermediate=64, vocab=128)
TINY_INDEXER = dict(index_n_heads=4, index_head_dim=32, index_topk=32)
# --model v32's defaults: DeepSeek-V3.2's serving contexts, the batches whose caches fit.
V32_DEFAULTS = dict(context="4096,32768,131072", batches="1,32")
WARMUP = 3  # reduce-overhead: a warm-up run, the CUDA-graph recording, then replays


def log(msg: str) -> None:
    if os.environ.get("RANK", "0") != "0":  # under torchrun, rank 0 speaks for all
        return
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_latents(layer: int, b: int, ctx: int, d_latent: int, d_rope: int, dtype, device):
    """The context's cached latents of one layer, the same for every system: [b, ctx, d] each."""
    g = torch.Generator(device=device).manual_seed(1000 + layer)
    kv = torch.randn(b, ctx, d_latent, generator=g, device=device).to(dtype)
    pe = torch.randn(b, ctx, d_rope, generator=g, device=device).to(dtype)
    return kv, pe


def random_index_keys(layer: int, b: int, ctx: int, dim: int, dtype, device):
    """The context's index keys of one layer, the same for every system: [b, ctx, dim] (randn:
    the indexer's keys come out of a LayerNorm)."""
    g = torch.Generator(device=device).manual_seed(2000 + layer)
    return torch.randn(b, ctx, dim, generator=g, device=device).to(dtype)


def index_dim(model) -> int | None:
    """index_head_dim of a DeepSeek-V3.2 model, None for DeepSeek-V3."""
    return getattr(model.config, "index_head_dim", None) if hasattr(
        model.config, "index_topk") else None


def forward_fn(model, cache):
    """One decode step: ids int64 [b, 1] -> logits [b, 1, vocab]; positions come from the cache."""
    from torch_mla.modules import generate_kwargs

    kw = generate_kwargs(model, cache)

    def step(ids):
        return model(input_ids=ids, use_cache=True, **kw).logits

    return step


def hf_caches_expanded(model) -> bool:
    """Whether transformers' attention caches the expanded K/V rather than the latents: its
    forward updates the cache with ``key_states`` after ``expand_kv`` (DeepSeek-V3.2 in
    transformers 5.17; 5.24 caches the latents)."""
    import inspect

    attn = model.model.layers[0].self_attn
    return hasattr(attn, "expand_kv") and "update(key_states" in inspect.getsource(
        type(attn).forward)


def hf_layer_kv(model, layer: int, b, ctx, dims, dtype, device):
    """What transformers' cache holds for the context's random latents of one layer, as (keys,
    values) [b, heads, ctx, d]: the latents themselves (heads 1), or, where the attention caches
    the expanded K/V (hf_caches_expanded), its ``expand_kv`` of them."""
    kv, pe = random_latents(layer, b, ctx, *dims, dtype, device)
    attn = model.model.layers[layer].self_attn
    if hf_caches_expanded(model):
        with torch.no_grad():
            return attn.expand_kv(kv[:, None], pe[:, None])
    return kv[:, None], pe[:, None]


def hf_dynamic_cache(model, b, ctx, dims, dtype, device):
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    for layer in range(model.config.num_hidden_layers):
        cache.update(*hf_layer_kv(model, layer, b, ctx, dims, dtype, device), layer)
        if index_dim(model):
            cache.update_indexer(random_index_keys(layer, b, ctx, index_dim(model), dtype,
                                                   device), layer)
    return cache


def hf_static_cache(model, b, ctx, max_len, dims, dtype, device):
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=max_len)
    for layer_idx, layer in enumerate(cache.layers):
        keys, values = hf_layer_kv(model, layer_idx, b, ctx, dims, dtype, device)
        layer.lazy_initialization(keys[:, :, :0], values[:, :, :0])
        layer.keys[:, :, :ctx] = keys
        layer.values[:, :, :ctx] = values
        layer.cumulative_length.fill_(ctx)
        if index_dim(model):
            keys = random_index_keys(layer_idx, b, ctx, index_dim(model), dtype, device)
            layer.lazy_initialization_indexer(keys[:, :0])
            layer.indexer_keys[:, :ctx] = keys
            layer.indexer_cumulative_length.fill_(ctx)
    return cache


def mla_cache(model, b, ctx, max_len, dims, dtype, device, fp8: bool = False,
              compute: str = "exact"):
    """The MLACache holding the context's random latents; ``fp8``: in float8_e4m3fn, each layer's
    scale amax / 448 of its latents (what a prefill of them would measure), decoded in
    ``compute`` mode."""
    from torch_mla.modules import MLACache
    from torch_mla.reference import quantize_fp8
    from torch_mla.reference_indexer import quantize_index_keys

    latents = [torch.cat(random_latents(layer, b, ctx, *dims, dtype, device), dim=-1)
               for layer in range(model.config.num_hidden_layers)]
    if fp8:
        scales = [(x.abs().amax().float() / 448).reshape(1) for x in latents]
        cache = MLACache.for_model(model, b, max_len, dtype=torch.float8_e4m3fn, kv_scale=scales,
                                   compute=compute)
    else:
        cache = MLACache.for_model(model, b, max_len)
    for layer, (kv_cache, x) in enumerate(zip(cache.kv_caches, latents)):
        rows = kv_cache.view(b, cache.max_blocks * 64, -1)  # default table: request r's pages
        rows[:, :ctx] = quantize_fp8(x, cache.kv_scales[layer]) if fp8 else x
    for layer, index_cache in enumerate(cache.index_caches or ()):
        if index_cache is None:
            continue
        keys = random_index_keys(layer, b, ctx, index_dim(model), dtype, device)
        rows = index_cache.view(b, cache.max_blocks * 64, -1)
        if fp8:  # as the module stores them: rotated, then e4m3 with a scale per token
            attn = next(m for m in model.modules() if getattr(m, "indexer", None) is not None)
            keys, scales = quantize_index_keys(attn.indexer.rotate_for_fp8(keys))
            cache.index_scales[layer].view(b, -1)[:, :ctx] = scales
        rows[:, :ctx] = keys
    cache.set_seqlens(torch.full((b,), ctx, dtype=torch.int32, device=device))
    return cache


def cache_bytes_per_token(cache) -> float:
    """The cache's bytes (all layers; DeepSeek-V3.2's index keys included) over the token slots
    it holds (a static cache's full length, a dynamic cache's current one)."""
    if hasattr(cache, "kv_bytes_per_token"):
        return cache.kv_bytes_per_token
    total, slots = 0, 0
    for layer in cache.layers:
        tensors = (layer.keys, layer.values, getattr(layer, "indexer_keys", None))
        total += sum(t.numel() * t.element_size() for t in tensors if t is not None)
        slots = layer.keys.shape[0] * layer.keys.shape[-2]
    return total / slots


def time_steps(step, token_ids, steps, device):
    """Runs WARMUP + steps decode steps; returns (ms per timed step, first step's logits)."""
    first = step(token_ids[0]).float().clone()
    for i in range(1, WARMUP):
        step(token_ids[i])
    sync(device)
    t0 = time.perf_counter()
    for i in range(WARMUP, WARMUP + steps):
        step(token_ids[i])
    sync(device)
    return (time.perf_counter() - t0) / steps * 1e3, first


def profile_steps(step, ids, b: int, steps: int = 5, top: int = 25,
                  timeline: str | None = None) -> None:
    """Prints (stderr) where the GPU time of `steps` replayed steps goes, kernel by kernel. With
    ``timeline`` (a file path), also writes the last step's kernels in launch order: start (us
    from the step's first kernel), duration (us) and name, one a line, then the step's span."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step(ids)
        torch.cuda.synchronize()
    kernels = [] if not timeline else sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
        key=lambda e: e.time_range.start)
    if len(kernels) >= steps:
        last = kernels[len(kernels) - len(kernels) // steps:]
        t0 = last[0].time_range.start
        with open(timeline, "w") as f:
            for e in last:
                f.write(f"{e.time_range.start - t0:9.1f} {e.time_range.elapsed_us():8.2f}  "
                        f"{e.name}\n")
            f.write(f"# span {last[-1].time_range.end - t0:.1f} us, {len(last)} kernels\n")
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    events.sort(key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in events)
    log(f"batch {b}: GPU time per step {total / steps / 1e3:.3f} ms in "
        f"{sum(e.count for e in events) // steps} kernels; the largest:")
    for e in events[:top]:
        log(f"  {e.device_time_total / steps:9.1f} us/step  {e.count // steps:4d} x  "
            f"{e.key[:110]}")


def free(device) -> None:
    torch._dynamo.reset()  # drops compiled graphs and their CUDA-graph memory pools
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def run_system(system, model, b, ctx, args, dims, dtype, device):
    """Times one system at batch b and context ctx. Returns dict(ms, logits, kv_bpt, peak_gib,
    note)."""
    max_len = ctx + 64
    token_ids = [torch.randint(2, args.vocab, (b, 1), device=device,
                               generator=torch.Generator(device=device).manual_seed(i))
                 for i in range(WARMUP + args.steps)]
    from torch._dynamo.utils import counters

    counters.clear()
    mode = "reduce-overhead" if device.type == "cuda" else "default"
    note = ""
    if system == "hf":
        cache = hf_dynamic_cache(model, b, ctx, dims, dtype, device)
        step = forward_fn(model, cache)
    elif system == "hf_static":
        cache = hf_static_cache(model, b, ctx, max_len, dims, dtype, device)
        # transformers' own recipe (and generate's default compile config): not fullgraph.
        step = torch.compile(forward_fn(model, cache), mode=mode, dynamic=False)
    else:
        cache = mla_cache(model, b, ctx, max_len, dims, dtype, device,
                          fp8=system.startswith("torch_mla_fp8"),
                          compute="fp8" if system == "torch_mla_fp8_fast" else "exact")
        step = torch.compile(forward_fn(model, cache), mode=mode, fullgraph=True, dynamic=False)
    with torch.no_grad():
        ms, logits = time_steps(step, token_ids, args.steps, device)
        if args.profile and system.startswith("torch_mla") and device.type == "cuda":
            timeline = None
            if args.timeline:
                os.makedirs(args.timeline, exist_ok=True)
                rank = f"_rank{os.environ['RANK']}" if args.tp > 1 else ""
                timeline = os.path.join(args.timeline, f"{system}_b{b}{rank}.txt")
            profile_steps(step, token_ids[-1], b, timeline=timeline)
    if system != "hf":
        graphs = counters["stats"]["unique_graphs"]
        note = f"{graphs} graph{'s' if graphs != 1 else ''}"
        skips = counters["inductor"]["cudagraph_skips"]
        if skips and device.type == "cuda":
            note += f", {skips} CUDA graph(s) skipped"
            log(f"warning: CUDA graphs skipped: {dict(counters['inductor'])}")
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    bpt = cache_bytes_per_token(cache)
    del cache, step
    return dict(ms=ms, logits=logits, kv_bpt=bpt, peak_gib=peak, note=note)


def floor_ms(model, b, ctx, config, tp: int = 1, cache_el: int | None = None) -> float:
    """The step's roofline floor on one rank: per op the larger of its bytes / 4246 GB/s and
    its FLOP / 679 TFLOP/s (bf16 dense), summed over the ops that move or compute nearly
    everything: every nn.Linear (this rank's weight shard + b rows in and out; 2 b in out FLOP),
    the embedding rows, and per layer the absorbed MLA attention over the latent cache (b ctx
    (kv_lora_rank + rope) cached values read; 2 b ctx heads (2 kv_lora_rank + rope) FLOP, this
    rank's heads: scores over 576 columns, output over 512). Norms, RoPE and the residual adds
    are a few b x hidden vectors: left out. ``cache_el``: bytes per cached value (default: the
    model's; 1 for the fp8 cache, whose FLOP still run at the bf16 rate: exact mode)."""
    from torch_mla.modules.tensor_parallel import local

    el = next(model.parameters()).element_size()
    total = 0.0

    def op(nbytes: float, flop: float) -> None:
        nonlocal total
        total += max(nbytes / (COPY_GBPS * 1e9), flop / (MATMUL_TFLOPS * 1e12))

    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            n_out, n_in = local(m.weight).shape
            op(n_out * n_in * el + b * (n_in + n_out) * el, 2 * b * n_in * n_out)
    op(b * model.get_input_embeddings().weight.shape[1] * el, 0)
    latent = config.kv_lora_rank + config.qk_rope_head_dim
    heads = config.num_attention_heads // tp
    topk = getattr(config, "index_topk", None)
    kinds = getattr(config, "indexer_types", None) or ["full"] * config.num_hidden_layers
    for layer in range(config.num_hidden_layers):
        if not topk:
            op(b * ctx * latent * (cache_el or el), 2 * b * ctx * heads * (latent +
                                                                           config.kv_lora_rank))
            continue
        if kinds[layer] != "shared":  # the indexer: its keys, the logits read by the top-k
            H, D = config.index_n_heads, config.index_head_dim
            key_bytes = D * el if cache_el is None else D * cache_el + 4
            op(b * ctx * key_bytes + 8 * b * ctx, 2 * b * ctx * H * D + 2 * b * ctx * H)
        k = min(ctx, topk)  # the sparse attention over the selected rows
        op(b * k * latent * (cache_el or el), 2 * b * k * heads * (latent + config.kv_lora_rank))
    return total * 1e3


def indexer_kernel_found(device, dtype, config) -> bool:
    """Whether torch_mla.indexer_topk runs a logits kernel for config's indexer over a cache in
    dtype here."""
    from torch_mla.ops.indexer import find_indexer_kernel

    if device.type != "cuda":
        return False
    q = torch.empty(1, 1, config.index_n_heads, config.index_head_dim, dtype=dtype,
                    device=device)
    return find_indexer_kernel(q, q.new_empty(1, 64, q.shape[3])) is not None


NAMES = {"hf": "transformers as shipped (eager, DynamicCache)",
         "hf_static": "transformers, StaticCache + torch.compile",
         "torch_mla": "torch_mla, compiled + CUDA graphs",
         "torch_mla_fp8": "torch_mla, fp8 latent cache, compiled + CUDA graphs",
         "torch_mla_fp8_fast": "torch_mla, fp8 latent cache (fast mode), compiled + CUDA graphs"}
CPU_NAMES = dict(NAMES, hf_static="transformers, StaticCache + torch.compile (CPU)",
                 torch_mla="torch_mla, compiled (CPU: no CUDA graphs)",
                 torch_mla_fp8="torch_mla, fp8 latent cache, compiled (CPU: no CUDA graphs)",
                 torch_mla_fp8_fast="torch_mla, fp8 latent cache (fast mode), compiled (CPU: no "
                                    "CUDA graphs)")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default=None,
                    help="default: bf16 on a GPU, fp32 on a CPU")
    ap.add_argument("--tiny", action="store_true", help="tiny layer shape (a CPU check)")
    ap.add_argument("--model", choices=["v3", "v32"], default="v3",
                    help="v3: DeepSeek-V3's shape; v32: DeepSeek-V3.2's (its indexer, 64 heads x "
                         "128, topk 2048; sparse decode) (default: %(default)s)")
    for k, v in V3_SHAPE.items():
        ap.add_argument(f"--{k.replace('_', '-')}", type=int, default=None, help=f"default {v}")
    ap.add_argument("--index-topk", type=int, default=None,
                    help=f"--model v32: default {V32_INDEXER['index_topk']}")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batches", default=None,
                    help=f"default 1,32,128; {V32_DEFAULTS['batches']} with --model v32")
    ap.add_argument("--context", default=None,
                    help="cached tokens per request, or a comma-separated list (default 4096; "
                         f"{V32_DEFAULTS['context']} with --model v32)")
    ap.add_argument("--steps", type=int, default=10, help="timed decode steps per system")
    ap.add_argument("--systems", default="hf,hf_static,torch_mla",
                    help="comma-separated, of hf, hf_static, torch_mla, torch_mla_fp8 (the fp8 "
                         "latent cache), torch_mla_fp8_fast (it in fast mode) "
                         "(default: %(default)s)")
    ap.add_argument("--out", default=None, help="also write the table (markdown) to this file")
    ap.add_argument("--profile", action="store_true",
                    help="print where torch_mla's step spends its GPU time, kernel by kernel")
    ap.add_argument("--timeline", default=None, metavar="DIR",
                    help="with --profile: also write one step's kernels in launch order (start, "
                         "duration, name) to DIR/<system>_b<batch>.txt (_rank<r> added with --tp)")
    ap.add_argument("--tp", type=int, default=1,
                    help="tensor-parallel ranks; run under torchrun --nproc-per-node TP")
    args = ap.parse_args(argv)
    rank = 0
    if args.tp > 1:
        world = int(os.environ.get("WORLD_SIZE", 1))
        if world != args.tp:
            sys.exit(f"--tp {args.tp}: run under torchrun --nproc-per-node {args.tp} (WORLD_SIZE "
                     f"is {world})")
        rank = int(os.environ["RANK"])
        if args.device == "cuda":
            args.device = f"cuda:{os.environ['LOCAL_RANK']}"
            torch.cuda.set_device(torch.device(args.device))
    shape = dict(TINY if args.tiny else V3_SHAPE)
    for k in V3_SHAPE:
        if getattr(args, k) is not None:
            shape[k] = getattr(args, k)
        setattr(args, k, shape[k])
    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[
        args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    v32 = args.model == "v32"
    batches = [int(x) for x in (args.batches or (V32_DEFAULTS["batches"] if v32 else
                                                 "1,32,128")).split(",")]
    contexts = [int(x) for x in str(args.context or (V32_DEFAULTS["context"] if v32 else
                                                      "4096")).split(",")]
    systems = args.systems.split(",")
    names = NAMES if device.type == "cuda" else CPU_NAMES
    if not set(systems) <= set(NAMES):
        sys.exit(f"--systems: choose from {', '.join(NAMES)}")

    import transformers

    from torch_mla.modules import swap_mla_attention

    t_start = time.perf_counter()
    if v32:
        index = dict(TINY_INDEXER if args.tiny else V32_INDEXER)
        if args.index_topk:
            index["index_topk"] = args.index_topk
        config = deepseek_v32_config(**index, **shape, layers=args.layers)
    else:
        config = deepseek_config(**shape, layers=args.layers)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = build_model(config, dtype, device)
    if args.tp > 1:  # every rank built the same weights (same seed); each keeps its shards
        from torch_mla.modules import mla_tp_plan, shard_model

        model = shard_model(model, mla_tp_plan(config))
    dims = (config.kv_lora_rank, config.qk_rope_head_dim)
    hf_expands = hf_caches_expanded(model)
    log(f"built the model: {sum(p.numel() for p in model.parameters()) / 1e6:,.1f} M parameters")

    results: dict[tuple[int, int, str], dict] = {}
    failed = False
    # torch_mla first (swapped, then the original attention put back), the riskiest last:
    # transformers' static cache expands the whole static length at every step.
    for system in ("torch_mla", "torch_mla_fp8", "torch_mla_fp8_fast", "hf", "hf_static"):
        if system not in systems:
            continue
        originals = None
        if system.startswith("torch_mla"):
            originals = {n: m for n, m in model.named_modules()
                         if type(m).__name__ in ("DeepseekV3Attention", "DeepseekV32Attention")}
            swap_mla_attention(model)
        for ctx in contexts:
            for b in batches:
                log(f"{names[system]}, batch {b}, context {ctx} ...")
                t0 = time.perf_counter()
                try:
                    r = results[ctx, b, system] = run_system(system, model, b, ctx, args, dims,
                                                              dtype, device)
                    log(f"  {r['ms']:.2f} ms per step "
                        f"({time.perf_counter() - t0:.0f} s with compile and warm-up)")
                except Exception as e:  # report it and go on with the other systems
                    oom = isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e)
                    note = "out of memory" if oom else f"failed: {type(e).__name__}"
                    failed |= system.startswith("torch_mla") or not oom
                    log(f"  {note}: {e}")
                    if not oom:
                        traceback.print_exc()
                    results[ctx, b, system] = dict(ms=None, logits=None, kv_bpt=None,
                                                   peak_gib=None, note=note)
                free(device)
        if originals:
            for n, m in originals.items():
                parent, _, child = n.rpartition(".")
                setattr(model.get_submodule(parent), child, m)

    if rank != 0:  # every rank ran every step; rank 0 reports
        if failed:
            sys.exit(1)
        return
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    tp = args.tp
    where = f"{tp} x {name}, tensor parallel" if tp > 1 else name
    lines = [
        f"# End-to-end decode step: {where}",
        "",
        f"`python benchmarks/bench_e2e.py {' '.join(argv if argv is not None else sys.argv[1:])}`"
        f" ({datetime.date.today()}; torch {torch.__version__}, transformers "
        f"{transformers.__version__}; {str(dtype).replace('torch.', '')}).",
        "",
        f"Model: {type(model).__name__}, {args.layers} layers with dense MLPs "
        f"(intermediate {shape['intermediate']}), hidden {shape['hidden']}, {shape['heads']} "
        f"heads, q_lora_rank {shape['q_lora_rank']}, kv_lora_rank {shape['kv_lora_rank']} + "
        f"rope {shape['rope_dim']}, nope {shape['nope_dim']}, v {shape['v_dim']}, vocab "
        f"{shape['vocab']}"
        + (f", indexer {config.index_n_heads} heads x {config.index_head_dim}, index_topk "
           f"{config.index_topk}" if v32 else "")
        + f", random weights. Context {', '.join(map(str, contexts))} cached tokens per request; "
        f"one new token per request per step; mean of {args.steps} steps after {WARMUP} "
        "warm-up steps. Floor: per op the larger of bytes / 4246 GB/s and FLOP / 679 TFLOP/s, "
        "summed (every linear layer, the embedding rows, the absorbed attention over the latent "
        "cache; benchmarks/bench_e2e.py floor_ms)."
        + (" DeepSeek-V3.2's floor counts, per layer, the indexer (its index keys read, its "
           "products, its float32 logits written and read once) and the attention over the "
           "min(context, index_topk) selected latent rows." if v32 else "")
        + (" The fp8 latent cache's floor reads 1 byte a cached value; its kv_scale per layer is "
           "amax / 448 of the cached latents, and its logits differ from transformers' by the "
           "e4m3 storage error." if any(s.startswith("torch_mla_fp8") for s in systems)
           else ""),
        "",
        "| batch | system | step (ms) | tokens/s | vs shipped | KV cache (bytes/token) "
        "| floor (ms) | % of floor | peak memory (GiB) | logits rel. err | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    by_context = len(contexts) > 1  # a context column
    if by_context:
        lines[-2] = lines[-2].replace("| batch |", "| batch | context |")
        lines[-1] += "---|"
    if tp > 1:
        one = " ".join(a for a in (argv if argv is not None else sys.argv[1:]))
        one = " ".join(one.replace(f"--tp {tp}", "").replace(f"--tp={tp}", "").split())
        lines[3:3] = [
            "",
            f"Tensor parallel over {tp} ranks (one process and device each): attention heads "
            f"{shape['heads']} = {tp} x {shape['heads'] // tp} (torch_mla's mla_tp_plan), MLPs "
            "sharded by transformers' plan, each rank holding the whole latent cache. The step "
            "time is every rank's; tokens/s is the job's, per GPU the job's over "
            f"{tp}; floor and peak memory are one rank's. One GPU: `python benchmarks/"
            f"bench_e2e.py {one}` (a separate run).",
        ]
        lines[-2] = lines[-2].replace("| tokens/s |", "| tokens/s | per GPU |")
        lines[-1] += "---|"
    for ctx, b in ((ctx, b) for ctx in contexts for b in batches):
        ref = results.get((ctx, b, "hf"), {}).get("logits")
        ref_ms = results.get((ctx, b, "hf"), {}).get("ms")
        head = f"| {b} | {ctx} |" if by_context else f"| {b} |"
        for system in systems:
            fl = floor_ms(model, b, ctx, config, args.tp,
                          cache_el=1 if system.startswith("torch_mla_fp8") else None)
            r = results[ctx, b, system]
            if r["ms"] is None:
                dash = "- | " if tp > 1 else ""
                lines.append(f"{head} {names[system]} | - | - | {dash}- | - | {fl:.3g} | - | - "
                             f"| - | {r['note']} |")
                continue
            err = "-"
            if ref is not None and system != "hf":
                err = f"{((r['logits'] - ref).abs().max() / ref.abs().max()).item():.1e}"
            note = r["note"]
            if (system == "hf" and b in HF_REFERENCE_MS and ctx == 4096 and not args.tiny
                    and not v32):
                note = f"reference run: {HF_REFERENCE_MS[b]} ms"
            peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "-"
            ratio = f"{ref_ms / r['ms']:.2f}x" if ref_ms else "-"
            tps = f"{b / r['ms'] * 1e3:,.0f}" + (
                f" | {b / r['ms'] * 1e3 / tp:,.0f}" if tp > 1 else "")
            lines.append(
                f"{head} {names[system]} | {r['ms']:.2f} | {tps} | {ratio} | "
                f"{r['kv_bpt']:,.0f} | {fl:.3g} | {100 * fl / r['ms']:.3g}% | {peak} | {err} | "
                f"{note} |")
    d = config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim
    el = torch.empty((), dtype=dtype).element_size()
    expanded = (f"{config.num_attention_heads} heads x {d} values of K and V "
                f"({config.num_attention_heads * d * el * args.layers:,} bytes per token over all "
                "layers)")
    latent = (f"one latent row per token and layer ({config.kv_lora_rank} + "
              f"{config.qk_rope_head_dim} values)")
    import transformers

    lines += ["", (
        f"transformers {transformers.__version__} caches each token expanded into {expanded}, "
        f"torch_mla {latent}" if hf_expands else
        f"Both caches hold {latent}; at every step transformers expands each cached token into "
        f"{expanded}") + "; torch_mla attends to the latent directly (absorbed kv_b_proj)."]
    if v32:
        lines[-1] += (f" Both also hold an index key per token ({config.index_head_dim} values). "
                      "transformers' indexer scores every cached key in plain torch and masks the "
                      "attention over all of them; torch_mla's runs torch_mla.indexer_topk over "
                      "the paged index keys (logits kernel: "
                      + ("yes" if indexer_kernel_found(device, dtype, config) else "none yet, the "
                         "reference") + f"; top-k: torch.topk) and attends to the "
                      f"{config.index_topk} selected rows with torch_mla.mla_decode_sparse.")
    table = "\n".join(lines)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")
    log(f"done in {time.perf_counter() - t_start:.0f} s")
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
