"""A DeepSeek-shaped model with random weights, before and after swapping in torch_mla's attention.

    python -m torch_mla.demo                    # small on a CPU, DeepSeek-V3's layer shape on a GPU
    python -m torch_mla.demo --layers 2 --batch 8 --new-tokens 64 --hidden 1024 ...
    python -m torch_mla.demo --model v32        # DeepSeek-V3.2: sparse attention, its indexer

Steps: build a transformers DeepseekV3ForCausalLM from a config (dense MLPs, random weights),
generate greedily with it as shipped (eager attention, DynamicCache), swap every attention for
:class:`torch_mla.modules.MultiheadLatentAttention` in place (same weights), compile the decode
step (CUDA graphs on a GPU: mode="reduce-overhead"), generate again on an :class:`MLACache`, and
print decode tokens/s, the KV cache's bytes per token and peak memory, side by side, and whether
the greedy tokens agree. Then an fp32 copy of the same weights re-scores each run's tokens, so
each run's logits are measured against the exact result at every step (error, and whether its
pick is fp32's): where two bf16 runs part, the numbers say which one is closer to fp32.

``--kv-cache fp8`` adds two runs on an FP8 latent cache (``MLACache(dtype=torch.float8_e4m3fn)``,
its scales measured at the prefill), one per ``compute`` mode, each teacher-forced on the tokens of
the run on the model-dtype cache so that all see the same prefix at every step, and reports how
often each one's top-1 token agrees with that run's and how far its logits are, per step and
overall. On H100/H200 their decode runs the SM90 kernel: exact mode (fp8 pages expanded to 16 bits
on chip, 16-bit MMAs over the dequantized cache) and fast mode (Q, quantized per row, and P in
e4m3 on the fp8 tensor cores); elsewhere the reference, for both.

``--model v32`` builds DeepSeek-V3.2 instead (transformers' DeepseekV32ForCausalLM: the same
attention shape plus its lightning indexer, 64 heads of 128 on a GPU, each query token attending to
the ``--index-topk`` cached tokens it scores highest). The swap puts in
:class:`torch_mla.modules.SparseMultiheadLatentAttention`: decode selects each token's tokens with
``torch_mla.indexer_topk`` over the cache's index keys and attends to them with
``torch_mla.mla_decode_sparse``. Its GPU defaults (4 requests, 3072-token prompts, topk 2048) make
every decode step sparse (about two thirds of the context) while transformers' own prefill, whose
indexer holds [b, s, 64, s] float32 scores, still fits.

Needs transformers (``pip install -e ".[hf]"``).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

# DeepSeek-V3's attention and MLP shape (config.json of deepseek-ai/DeepSeek-V3), its YaRN RoPE.
V3_SHAPE = dict(hidden=7168, heads=128, q_lora_rank=1536, kv_lora_rank=512, rope_dim=64,
                nope_dim=128, v_dim=128, intermediate=18432, vocab=129280)
V3_YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=40.0,
               original_max_position_embeddings=4096, beta_fast=32, beta_slow=1, mscale=1.0,
               mscale_all_dim=1.0)
CPU_SHAPE = dict(hidden=256, heads=8, q_lora_rank=128, kv_lora_rank=64, rope_dim=16,
                 nope_dim=32, v_dim=32, intermediate=512, vocab=1000)
# DeepSeek-V3.2's lightning indexer (config.json of deepseek-ai/DeepSeek-V3.2-Exp): 64 heads of 128,
# top 2048; on a CPU the same heads, narrower.
V32_INDEXER = dict(index_n_heads=64, index_head_dim=128, index_topk=2048)
CPU_INDEXER = dict(index_n_heads=64, index_head_dim=32, index_topk=32)
# Workload defaults that differ for --model v32 (gpu, cpu): contexts past topk.
V32_WORKLOAD = {True: dict(batch=4, prompt_len=3072), False: dict(batch=4, prompt_len=48)}


def deepseek_config(hidden: int, heads: int, q_lora_rank: int | None, kv_lora_rank: int,
                    rope_dim: int, nope_dim: int, v_dim: int, intermediate: int, vocab: int,
                    layers: int, yarn: bool = True, initializer_range: float = 0.02):
    """A transformers DeepseekV3Config with these attention dims and dense MLPs in every layer
    (``first_k_dense_replace = layers``: no MoE), DeepSeek-V3's YaRN RoPE unless ``yarn=False``."""
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
        q_lora_rank=q_lora_rank, kv_lora_rank=kv_lora_rank, qk_rope_head_dim=rope_dim,
        qk_nope_head_dim=nope_dim, v_head_dim=v_dim, first_k_dense_replace=layers,
        n_routed_experts=8, moe_intermediate_size=64, num_experts_per_tok=2, n_group=1,
        topk_group=1, max_position_embeddings=163840 if yarn else 4096,
        rope_parameters=V3_YARN if yarn else None, initializer_range=initializer_range,
        pad_token_id=0, bos_token_id=1, eos_token_id=None,  # never stops early
    )


def deepseek_v32_config(index_n_heads: int, index_head_dim: int, index_topk: int, **shape):
    """A transformers DeepseekV32Config: :func:`deepseek_config`'s attention and MLP dims (its
    keyword arguments) plus the lightning indexer's heads, head width and top-k."""
    from transformers import DeepseekV32Config

    fields = deepseek_config(**shape).to_dict()
    keep = set(DeepseekV32Config.__dataclass_fields__) - {"layer_types", "mlp_layer_types"}
    fields = {k: v for k, v in fields.items() if k in keep}
    return DeepseekV32Config(**fields, index_n_heads=index_n_heads, index_head_dim=index_head_dim,
                             index_topk=index_topk)


def build_model(config, dtype: torch.dtype, device: str | torch.device):
    """The config's ``ForCausalLM`` (DeepSeek-V3 or V3.2) with random weights, built directly on
    ``device``; eval mode. The padding token's embedding is random too (nn.Embedding zeroes it):
    a token whose hidden state is 0 has an index key of 0, which ties every other such token in
    DeepSeek-V3.2's indexer, and trained models have no such row."""
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if getattr(config, "index_topk", None) and config.pad_token_id is not None:
        with torch.no_grad():
            model.get_input_embeddings().weight[config.pad_token_id].normal_(
                std=config.initializer_range)
    return model.eval()


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _progress_streamer(label: str, total: int, device):
    """A transformers streamer that shows progress and records when each token arrives: a bar
    redrawn in place on a terminal, else (a pipe, a log file, CI) a plain line at every quarter."""
    from transformers.generation.streamers import BaseStreamer

    tty = sys.stderr.isatty()

    class Progress(BaseStreamer):
        def __init__(self):
            self.times: list[float] = []
            self.prompt_seen = False

        def put(self, value):
            if not self.prompt_seen:  # generate first sends the prompt
                self.prompt_seen = True
                return
            _sync(device)
            self.times.append(time.perf_counter())
            n = len(self.times)
            if tty or n == total or 4 * n // total > 4 * (n - 1) // total:
                self.draw()

        def draw(self):
            n = len(self.times)
            rate = ""
            if n > 1:
                rate = f", {(n - 1) / (self.times[-1] - self.times[0]):.1f} steps/s"
            if not tty:
                sys.stderr.write(f"  {label:<12} generating: {n}/{total} tokens{rate}\n")
                return
            done = int(30 * n / total)
            end = "\n" if n == total else ""
            sys.stderr.write(f"\r  {label:<12} [{'#' * done}{'.' * (30 - done)}] {n}/{total}"
                             f"{rate}{end}")
            sys.stderr.flush()

        def end(self):
            pass

    return Progress()


def _logits_recorder(dtype: torch.dtype):
    """A logits processor that keeps each step's scores [b, vocab] and changes nothing: enough to
    tell afterwards how far each step was from an fp32 run, and whether two greedy runs parted at
    a near-tie. Kept in the model's dtype, that of its lm_head's output (generate hands them over
    as fp32 copies), so nothing is lost and half the memory is held."""
    from transformers import LogitsProcessor

    class Recorder(LogitsProcessor):
        def __init__(self):
            self.steps: list[torch.Tensor] = []

        def __call__(self, input_ids, scores):
            self.steps.append(scores.to(dtype))
            return scores

    return Recorder()


def nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _force_tokens(tokens: torch.Tensor, prompt_len: int):
    """A logits processor for teacher forcing: step t picks ``tokens[:, t]`` ([b, new])."""
    from transformers import LogitsProcessor

    class Force(LogitsProcessor):
        def __call__(self, input_ids, scores):
            t = input_ids.shape[1] - prompt_len
            forced = torch.full_like(scores, float("-inf"))
            return forced.scatter_(1, tokens[:, t:t + 1].to(scores.device), 0.0)

    return Force()


def timed_generate(model, ids, new_tokens, label, device, force=None, **kwargs):
    """Greedy generate with a progress bar, or teacher-forced on ``force`` (new tokens [b, new]:
    the scores are still the model's). Returns (tokens [b, s + new], decode tokens/s over the
    steps after the first token, the generate output, each step's scores [b, vocab])."""
    from transformers import LogitsProcessorList

    streamer = _progress_streamer(label, new_tokens, device)
    top = _logits_recorder(model.dtype)
    procs = [top] + ([_force_tokens(force, ids.shape[1])] if force is not None else [])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, streamer=streamer, return_dict_in_generate=True,
                             logits_processor=LogitsProcessorList(procs), **kwargs)
    t = streamer.times
    steps_per_s = (len(t) - 1) / (t[-1] - t[0]) if len(t) > 1 else float("nan")
    return out.sequences, steps_per_s * ids.shape[0], out, top.steps


def compare_greedy(ref_tokens, ref_top, tokens, top) -> dict:
    """Compares two greedy runs over the same prompts (new tokens [b, n] and per-step top scores).

    While a request's tokens agree, both runs saw the same inputs, so their top scores measure
    the numerical difference between them (``score_diff``). At the step where a request's tokens
    part, the reference's own scores of its token and of the other run's token (``tie_gap``)
    tell a near-tie (gap within the score difference: rounding picked the other one) from a real
    disagreement; ``outside_top`` counts partings at a token the reference did not even rank in
    its top k."""
    b, n = ref_tokens.shape
    same = (ref_tokens == tokens).cpu()
    first = torch.where(same.all(dim=1), n, (~same).int().argmax(dim=1))
    score_diff, tie_gap, outside = 0.0, 0.0, 0
    for t in range(n):
        rv, ri = (x.cpu() for x in ref_top[t])
        ov = top[t][0].cpu()
        agree = first > t
        if agree.any():
            score_diff = max(score_diff, float((rv[agree, 0] - ov[agree, 0]).abs().max()))
        for i in torch.nonzero(first == t).flatten().tolist():
            hit = ri[i] == tokens[i, t].cpu()
            if hit.any():
                tie_gap = max(tie_gap, float(rv[i, 0] - rv[i][hit][0]))
            else:
                outside += 1
    top1 = max(float(ref_top[t][0][:, 0].abs().max()) for t in range(n))
    return dict(identical=int(same.all(dim=1).sum()), first_diff=int(first.min()),
                score_diff=score_diff, tie_gap=tie_gap, outside_top=outside, top_score=top1)


def top_scores(steps: list[torch.Tensor], k: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each step's top-k (values, token ids) from its scores [b, vocab], as compare_greedy takes
    them."""
    return [tuple(x.float().topk(k, dim=-1)) for x in steps]


def against_fp32(ref_model, sequences: torch.Tensor, steps: list[torch.Tensor]) -> dict:
    """How far one greedy run is from the exact result: ``ref_model`` (an fp32 copy of the same
    weights) re-scores the run's own ``sequences`` [b, s + n] in one forward, and each of the n
    steps' scores [b, vocab] is compared with fp32's for the same prefix.

    Returns per-step lists ``max_err`` (largest |logit - fp32 logit| over the batch and the
    vocabulary), ``mean_err`` (its mean) and ``top1`` (requests whose pick is fp32's argmax), and
    their totals ``max``, ``mean``, ``agree`` (of ``picks`` = b * n)."""
    n = len(steps)
    with torch.no_grad():
        ref = ref_model(sequences[:, :-1], logits_to_keep=n).logits.float()  # [b, n, vocab]
    max_err, mean_err, top1 = [], [], []
    for t, scores in enumerate(steps):
        err = (scores.float() - ref[:, t]).abs()
        max_err.append(float(err.max()))
        mean_err.append(float(err.mean()))
        top1.append(int((scores.float().argmax(-1) == ref[:, t].argmax(-1)).sum()))
    return dict(max_err=max_err, mean_err=mean_err, top1=top1, max=max(max_err),
                mean=sum(mean_err) / n, agree=sum(top1), picks=sequences.shape[0] * n)


def against_run(ref_steps: list[torch.Tensor], steps: list[torch.Tensor]) -> dict:
    """How far a teacher-forced run's scores are from another run's over the same tokens: each
    step's scores [b, vocab] against the other's. Per-step lists ``max_err`` (largest |logit
    difference|), ``rel_err`` (norm of the difference over the norm of ``ref_steps``, the whole
    batch) and ``top1`` (requests whose argmax is the reference's); totals ``max``, ``rel``
    (over all steps), ``agree`` of ``picks``."""
    max_err, rel_err, top1 = [], [], []
    num, den = 0.0, 0.0
    for ref, ours in zip(ref_steps, steps):
        ref, ours = ref.float(), ours.float()
        diff = ours - ref
        max_err.append(float(diff.abs().max()))
        rel_err.append(float(diff.norm() / ref.norm()))
        num, den = num + float(diff.norm()) ** 2, den + float(ref.norm()) ** 2
        top1.append(int((ours.argmax(-1) == ref.argmax(-1)).sum()))
    return dict(max_err=max_err, rel_err=rel_err, top1=top1, max=max(max_err),
                rel=(num / den) ** 0.5, agree=sum(top1), picks=steps[0].shape[0] * len(steps))


def fp32_verdict(ours: dict, theirs: dict) -> str:
    """Whether a run is "closer", "as close" or "further" from fp32 than another, by their mean
    logit errors over every step (within 10% of each other: as close)."""
    if ours["mean"] < 0.9 * theirs["mean"]:
        return "closer"
    if ours["mean"] > 1.1 * theirs["mean"]:
        return "further"
    return "as close"


def hf_cache_bytes_per_token(cache, batch: int) -> float:
    """Bytes of a transformers cache (all layers: latents, and DeepSeek-V3.2's index keys)
    divided by the tokens it holds."""
    total, tokens = 0, 0
    for layer in cache.layers:
        for t in (layer.keys, layer.values, getattr(layer, "indexer_keys", None)):
            if t is not None:
                total += t.numel() * t.element_size()
        if layer.keys is not None:
            tokens = max(tokens, layer.keys.shape[-2])
    return total / max(1, batch * tokens)


# Help for the model-shape options, named as in transformers' DeepseekV3Config.
SHAPE_HELP = dict(
    hidden="model width (hidden_size)",
    heads="attention heads (num_attention_heads): the decode's query heads",
    q_lora_rank="rank of the query's low-rank projection (q_lora_rank)",
    kv_lora_rank="width of the cached latent (kv_lora_rank); the kernel needs 512",
    rope_dim="width of the RoPE key cached next to the latent (qk_rope_head_dim); the kernel "
             "needs 64",
    nope_dim="per-head query/key width without RoPE (qk_nope_head_dim)",
    v_dim="per-head value width (v_head_dim)",
    intermediate="width of the dense MLP in every layer (intermediate_size)",
    vocab="vocabulary size",
)


def build_parser(cuda: bool) -> argparse.ArgumentParser:
    """The demo's options; defaults are DeepSeek-V3's layer shape with a GPU, a tiny one without."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if cuda else "cpu",
                    help="where to run: cuda or cpu (default: %(default)s)")
    ap.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None,
                    help="weights and activations (default: bf16 on a GPU, fp32 on a CPU)")
    shape = V3_SHAPE if cuda else CPU_SHAPE
    for k, v in shape.items():
        ap.add_argument(f"--{k.replace('_', '-')}", type=int, default=v,
                        help=f"{SHAPE_HELP[k]} (default: %(default)s)")
    ap.add_argument("--model", choices=["v3", "v32"], default="v3",
                    help="v3: DeepSeek-V3 (dense MLA); v32: DeepSeek-V3.2 (MLA with its lightning "
                         "indexer: sparse attention) (default: %(default)s)")
    index = V32_INDEXER if cuda else CPU_INDEXER
    ap.add_argument("--index-topk", type=int, default=index["index_topk"],
                    help=f"--model v32: cached tokens each query token attends to (index_topk; "
                         f"{index['index_n_heads']} indexer heads of {index['index_head_dim']}) "
                         "(default: %(default)s)")
    ap.add_argument("--layers", type=int, default=4,
                    help="decoder layers, each with a dense MLP (default: %(default)s)")
    v32 = V32_WORKLOAD[cuda]
    ap.add_argument("--batch", type=int, default=None,
                    help=f"requests generated together (default: {32 if cuda else 4}; "
                         f"{v32['batch']} with --model v32)")
    ap.add_argument("--prompt-len", type=int, default=None,
                    help=f"random prompt tokens per request (default: {512 if cuda else 48}; "
                         f"{v32['prompt_len']} with --model v32)")
    ap.add_argument("--new-tokens", type=int, default=128 if cuda else 32,
                    help="tokens generated per request (default: %(default)s)")
    ap.add_argument("--kv-cache", choices=["model", "fp8"], default="model",
                    help="model: the latent cache in the model's dtype; fp8: also run on a "
                         "float8_e4m3fn latent cache (half the bytes), in exact and in fast mode, "
                         "and compare them with the model-dtype run (default: %(default)s)")
    ap.add_argument("--no-compile", action="store_true",
                    help="run the swapped model eagerly (no torch.compile, no CUDA graphs)")
    ap.add_argument("--seed", type=int, default=0,
                    help="seed of the random weights and prompts (default: %(default)s)")
    return ap


def main(argv=None) -> None:
    cuda = torch.cuda.is_available()
    args = build_parser(cuda).parse_args(argv)
    workload = V32_WORKLOAD[cuda] if args.model == "v32" else dict(
        batch=32 if cuda else 4, prompt_len=512 if cuda else 48)
    args.batch = args.batch or workload["batch"]
    args.prompt_len = args.prompt_len or workload["prompt_len"]
    if hasattr(sys.stdout, "reconfigure"):  # piped (tee, a log): each line as it is printed
        sys.stdout.reconfigure(line_buffering=True)

    try:
        import transformers
    except ImportError:
        sys.exit("the demo needs transformers: pip install -e '.[hf]'")
    from transformers.generation import CompileConfig

    from torch_mla.modules import MLACache, generate_kwargs, swap_mla_attention
    from torch_mla.ops.dispatch import decode_backend

    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[
        args.dtype or ("bf16" if on_gpu else "fp32")]
    torch.manual_seed(args.seed)
    name = torch.cuda.get_device_name(device) if on_gpu else "CPU"
    print(f"# torch_mla demo on {name}: torch {torch.__version__}, transformers "
          f"{transformers.__version__}, {str(dtype).replace('torch.', '')}")
    shape = dict(hidden=args.hidden, heads=args.heads, q_lora_rank=args.q_lora_rank,
                 kv_lora_rank=args.kv_lora_rank, rope_dim=args.rope_dim, nope_dim=args.nope_dim,
                 v_dim=args.v_dim, intermediate=args.intermediate, vocab=args.vocab,
                 layers=args.layers)
    indexer = ""
    if args.model == "v32":
        index = dict(V32_INDEXER if cuda else CPU_INDEXER, index_topk=args.index_topk)
        config = deepseek_v32_config(**index, **shape)
        indexer = (f", indexer {index['index_n_heads']} heads x {index['index_head_dim']} "
                   f"selecting {index['index_topk']} tokens")
    else:
        config = deepseek_config(**shape)
    t0 = time.perf_counter()
    model = build_model(config, dtype, device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {type(model).__name__}, {args.layers} layers, hidden {args.hidden}, "
          f"{args.heads} heads, q_lora_rank {args.q_lora_rank}, kv_lora_rank "
          f"{args.kv_lora_rank} + rope {args.rope_dim}{indexer}, dense MLP {args.intermediate}, "
          f"vocab {args.vocab}: {n_params / 1e6:,.1f} M random parameters "
          f"(built in {time.perf_counter() - t0:.1f} s)")
    b, s, n = args.batch, args.prompt_len, args.new_tokens
    ids = torch.randint(2, args.vocab, (b, s), device=device)
    print(f"workload: {b} requests x {s} prompt tokens, {n} new tokens each, greedy\n")

    weights = sum(p.numel() * p.element_size() for p in model.parameters())

    def peak_over_weights(recorded: list[torch.Tensor]) -> str:
        # Less the logits kept for the fp32 comparison: they grow step by step as the caches do,
        # so the peak comes at the end, when all of them are held.
        if not on_gpu:
            return "-"
        peak = torch.cuda.max_memory_allocated(device) - weights - nbytes(recorded)
        return f"{peak / 2**30:.2f} GiB"

    # 1. transformers as shipped.
    fp8 = args.kv_cache == "fp8"
    total = 6 if fp8 else 4
    print(f"1/{total} transformers as shipped (eager attention, DynamicCache)")
    with torch.no_grad():
        model.generate(ids[:, :8], max_new_tokens=2, do_sample=False)  # warm-up
    if on_gpu:
        torch.cuda.reset_peak_memory_stats(device)
    ref, hf_tps, out, ref_steps = timed_generate(model, ids, n, "transformers", device)
    hf_cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
    hf_bpt = hf_cache_bytes_per_token(hf_cache, b)
    hf_peak = peak_over_weights(ref_steps)
    del out, hf_cache

    # 2. the swap, in place: same parameters.
    swap_mla_attention(model)
    backend, why = decode_backend(device, dtype, args.kv_lora_rank + args.rope_dim,
                                  args.kv_lora_rank)
    if args.model == "v32":
        backend, why = sparse_description(device, dtype, args.kv_lora_rank, args.rope_dim,
                                           model.config, args.batch)
    print(f"swapped in torch_mla's attention; its decode runs {backend}: {why}")
    label = "eager" if args.no_compile else (
        "compiled, CUDA graphs" if on_gpu else "compiled")
    cc = None
    if not args.no_compile:
        cc = CompileConfig(fullgraph=True, dynamic=False,
                           mode="reduce-overhead" if on_gpu else "default")
        cc._compile_all_devices = True  # transformers compiles only on accelerators by default

    def generate_options(cache, what: str, backend: str) -> dict:
        """generate's keyword arguments for this cache; compiles the decode step first (a cache
        of another dtype is another graph)."""
        kwargs = generate_kwargs(model, cache)
        if cc is None:
            kwargs["disable_compile"] = True
            return kwargs
        kwargs["compile_config"] = cc
        print(f"{what}: compiling the decode step (mode={cc.mode!r}, fullgraph; once, "
              f"{'~1 min' if on_gpu else '~30 s'}"
              f"{', the decode kernel included' if backend != 'reference' else ''})...")
        t0 = time.perf_counter()
        with torch.no_grad():  # same batch and cache shape as the timed run: no recompiles
            model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False, **kwargs)
        cache.reset()
        print(f"  compiled in {time.perf_counter() - t0:.1f} s")
        return kwargs

    cache = MLACache.for_model(model, b, s + n)
    kwargs = generate_options(cache, f"2/{total} swapped attention", backend)
    print(f"3/{total} torch_mla ({label}, MLACache)")
    if backend != "reference" and args.no_compile:
        print("  compiling the decode kernel (first call, ~20-60 s)...")
    if on_gpu:
        torch.cuda.reset_peak_memory_stats(device)
    tok, ours_tps, _, steps = timed_generate(model, ids, n, "torch_mla", device, **kwargs)
    ours_peak = peak_over_weights(ref_steps + steps)
    fp8_runs = {}  # compute mode -> (tokens/s, per-step logits, peak memory, cache)
    for k, mode in enumerate(("exact", "fp8") if fp8 else ()):
        fp8_backend, fp8_why = decode_backend(device, dtype, args.kv_lora_rank + args.rope_dim,
                                              args.kv_lora_rank,
                                              cache_dtype=torch.float8_e4m3fn, compute=mode)
        print(f"{4 + k}/{total} torch_mla ({label}, MLACache in float8_e4m3fn, scales measured "
              f"at the prefill, compute={mode!r}), teacher-forced on run 3's tokens; its decode "
              f"runs {fp8_backend}: {fp8_why}")
        cache8 = MLACache.for_model(model, b, s + n, dtype=torch.float8_e4m3fn, compute=mode)
        kwargs8 = generate_options(cache8, f"  fp8 cache ({mode})", fp8_backend)
        if on_gpu:
            torch.cuda.reset_peak_memory_stats(device)
        _, fp8_tps, _, fp8_steps = timed_generate(model, ids, n, f"torch_mla fp8 {mode}",
                                                  device, force=tok[:, s:], **kwargs8)
        fp8_runs[mode] = (fp8_tps, fp8_steps, peak_over_weights(ref_steps + steps + fp8_steps),
                          cache8)

    # 4. The exact result: the same weights in fp32 re-score each run's own tokens.
    print(f"{total}/{total} fp32 copy of the same weights, re-scoring both runs' tokens (the "
          "exact result)")
    exact = build_model(config, torch.float32, device)
    exact.load_state_dict(model.state_dict())  # the swap kept the parameter names
    dtype_name = str(dtype).replace("torch.", "")
    acc = {"transformers": against_fp32(exact, ref, ref_steps),
           "torch_mla": against_fp32(exact, tok, steps)}
    for mode, run in fp8_runs.items():
        acc[f"fp8 {mode}"] = against_fp32(exact, tok, run[1])  # (its tokens are run 3's)
    del exact

    cmp = compare_greedy(ref[:, s:], top_scores(ref_steps), tok[:, s:], top_scores(steps))
    print()
    print("| | decode tokens/s | KV cache bytes/token (all layers) | peak memory over weights |")
    print("|---|---|---|---|")
    print(f"| transformers (eager, DynamicCache) | {hf_tps:,.0f} | {hf_bpt:,.0f} | {hf_peak} |")
    print(f"| torch_mla ({label}) | {ours_tps:,.0f} | {cache.kv_bytes_per_token:,} | "
          f"{ours_peak} |")
    for mode, (fp8_tps, _, fp8_peak, cache8) in fp8_runs.items():
        print(f"| torch_mla ({label}, fp8 cache, compute={mode!r}) | {fp8_tps:,.0f} | "
              f"{cache8.kv_bytes_per_token:,} | {fp8_peak} |")
    el = torch.empty((), dtype=dtype).element_size()
    expanded = args.heads * (args.nope_dim + args.rope_dim + args.v_dim) * el * args.layers
    index_keys = ""
    if args.model == "v32":
        index_keys = (f" and one index key ({config.index_head_dim} values), and torch_mla "
                      f"attends to the {config.index_topk} its indexer selects out of each "
                      "context")
    print(f"\nspeed-up: {ours_tps / hf_tps:.2f}x. Both caches hold one latent per token and layer "
          f"({args.kv_lora_rank} + {args.rope_dim} values){index_keys}; at every step "
          f"transformers expands each cached token to {args.heads} heads x (qk "
          f"{args.nope_dim + args.rope_dim} + v {args.v_dim}) = {expanded:,} bytes over all "
          "layers, torch_mla reads the latent as it is.")

    print(f"\nAgainst fp32 (each run's {dtype_name} logits minus fp32's for the same tokens so "
          f"far; top-1: requests whose pick is fp32's, of {b}):\n")
    print("| step | transformers max / mean error | top-1 | torch_mla max / mean error | top-1 |")
    print("|---|---|---|---|---|")
    hf_acc, our_acc = acc["transformers"], acc["torch_mla"]
    shown = sorted({t for t in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024) if t <= n} | {n})
    for t in shown:
        print(f"| {t} | {hf_acc['max_err'][t - 1]:.3g} / {hf_acc['mean_err'][t - 1]:.2g} | "
              f"{hf_acc['top1'][t - 1]} | {our_acc['max_err'][t - 1]:.3g} / "
              f"{our_acc['mean_err'][t - 1]:.2g} | {our_acc['top1'][t - 1]} |")
    print(f"| all {n} | {hf_acc['max']:.3g} / {hf_acc['mean']:.2g} | "
          f"{hf_acc['agree']}/{hf_acc['picks']} | {our_acc['max']:.3g} / {our_acc['mean']:.2g} | "
          f"{our_acc['agree']}/{our_acc['picks']} |")
    verdict = fp32_verdict(our_acc, hf_acc)
    phrase = {"closer": "closer to the fp32 result than", "further": "further from the fp32 "
              "result than", "as close": "as close to the fp32 result as"}[verdict]
    print(f"\nverdict: torch_mla ({dtype_name}) is {phrase} transformers ({dtype_name}): mean "
          f"logit error {our_acc['mean']:.3g} vs {hf_acc['mean']:.3g}, picks "
          f"equal to fp32's {our_acc['agree']}/{our_acc['picks']} vs "
          f"{hf_acc['agree']}/{hf_acc['picks']}.")
    where = ("all tokens" if cmp["identical"] == b else
             f"first difference after {cmp['first_diff']} tokens at worst")
    print(f"greedy tokens identical to transformers: {cmp['identical']}/{b} requests ({where}).")
    if cmp["identical"] < b:
        why = ("torch_mla's logits are further from fp32 than transformers': check the numbers "
               "above" if verdict == "further" else
               f"two {dtype_name} roundings of the same computation, each as close to fp32 as "
               "the other or closer (the table above), part at tokens whose top scores are "
               "close; with random weights many are")
        print(f"  while tokens agree, the two runs' top scores differ by at most "
              f"{cmp['score_diff']:.3g} (top scores up to {cmp['top_score']:.3g}); where a "
              f"request's tokens part, transformers rates its own token and torch_mla's within "
              f"{cmp['tie_gap']:.3g} of each other ({cmp['outside_top']} partings outside its "
              f"top 8): {why}.")
    for mode, run in fp8_runs.items():
        report_fp8(steps, run[1], acc, dtype_name, label, b, n, shown, mode)
    if not on_gpu:
        print("on a CPU both paths are plain PyTorch on a tiny model: the numbers show the "
              "plumbing, not the kernel; run it on an H100/H200 for the real comparison")



def sparse_description(device: torch.device, dtype: torch.dtype, kv_lora_rank: int,
                       rope_dim: int, config, batch: int = 1) -> tuple[str, str]:
    """(name, reason) for a DeepSeek-V3.2 decode step of `batch` requests of one token: which
    implementation torch_mla.mla_decode_sparse runs, and the indexer's logits (config: the
    model's, for its attention heads and its indexer's heads and width)."""
    from torch_mla.constants import PAGE_SIZE
    from torch_mla.ops.indexer import find_indexer_kernel
    from torch_mla.ops.sparse import sparse_backend

    if device.type != "cuda":
        return "reference", ("cpu tensors: the kernels run on NVIDIA GPUs (the lightning "
                             "indexer and the sparse decode: plain PyTorch)")
    q = torch.empty(batch, 1, config.num_attention_heads, kv_lora_rank + rope_dim, dtype=dtype,
                    device=device)
    cache = torch.empty(1, PAGE_SIZE, 1, kv_lora_rank + rope_dim, dtype=dtype, device=device)
    name, why = sparse_backend(q, cache, kv_lora_rank)
    iq = torch.empty(1, 1, config.index_n_heads, config.index_head_dim, dtype=dtype, device=device)
    logits = ("a kernel" if find_indexer_kernel(iq, iq.new_empty(1, 64, iq.shape[3])) is not None
              else "the reference")
    what = {"sm80": "the portable sparse kernel", "sm90": "the SM90 sparse kernel",
            "sm90_keysm": "the keys-on-M sparse kernel"}.get(name, f"the reference ({why})")
    return f"sparse decode {name}", (f"mla_decode_sparse on {what}; the indexer's logits on "
                                     f"{logits}, its top-k by torch.topk")


def report_fp8(steps, fp8_steps, acc, dtype_name: str, label: str, b: int, n: int,
               shown: list[int], mode: str) -> None:
    """An fp8-cache run (compute=mode) against the model-dtype-cache run (same tokens:
    teacher-forced)."""
    vs = against_run(steps, fp8_steps)
    print(f"\nFP8 latent cache, compute={mode!r}, against the {dtype_name} cache (torch_mla "
          f"{label}, the same "
          f"tokens: each step's logits of the fp8 run minus the {dtype_name}-cache run's; top-1: "
          f"requests whose pick is the {dtype_name}-cache run's, of {b}):\n")
    print("| step | max error | relative error | top-1 agreement |")
    print("|---|---|---|---|")
    for t in shown:
        print(f"| {t} | {vs['max_err'][t - 1]:.3g} | {vs['rel_err'][t - 1]:.2g} | "
              f"{vs['top1'][t - 1]} |")
    print(f"| all {n} | {vs['max']:.3g} | {vs['rel']:.2g} | {vs['agree']}/{vs['picks']} |")
    ours, f8 = acc["torch_mla"], acc[f"fp8 {mode}"]
    print(f"\nfp8 cache (compute={mode!r}): top-1 agreement with the {dtype_name} cache "
          f"{vs['agree']}/{vs['picks']} ({100 * vs['agree'] / vs['picks']:.1f}%), relative "
          f"logit error {vs['rel']:.2g} (step 1 is the prefill, which attends over the "
          f"prompt's unquantized latents); against fp32, mean logit error {f8['mean']:.3g} vs "
          f"{ours['mean']:.3g} for the {dtype_name} cache, picks equal to fp32's "
          f"{f8['agree']}/{f8['picks']} vs {ours['agree']}/{ours['picks']}. Storing the "
          "latents in e4m3 alone moves attention by about 2-7e-2 (relative; "
          "tests/test_fp8.py).")


if __name__ == "__main__":
    main()
