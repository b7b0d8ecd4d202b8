"""Checks torch_mla's Hugging Face module on several GPUs; prints each check, exits 1 on a failure.

    python -m tools.check_multi_gpu                       # a machine with 2 (or more) GPUs
    python -m tools.check_multi_gpu --device cpu --only tp    # the tensor-parallel part on CPU
                                                          # ranks (gloo), as tests/ runs it

One command, one process: it runs the checks that need one process itself and launches the
tensor-parallel ranks with ``python -m torch.distributed.run`` (torchrun) as a child. Full output
goes to ``$OUT/check_multi_gpu.log`` when ``$OUT`` is set (or ``--log``).

split   a tiny DeepSeek-V3 model (YaRN, dense MLPs) split over cuda:0 / cuda:1, layer 0 on the
        first, layer 1, the norm and lm_head on the second: with ``device_map`` when accelerate is
        installed, else placed by hand (forward pre-hooks move the activations). MLACache holds
        each layer's latents, block table, lengths on that layer's GPU. fp32: greedy tokens equal
        the unswapped split model's up to a near-tie (top-2 margin < 1e-3), and teacher-forced on
        its tokens every step's logits within 1e-4. bf16: the swapped split model's tokens equal
        the swapped model's on one GPU, logits within 1e-2 (same kernels, same GPU type).
tp      transformers' tensor parallelism over ``--world`` ranks (default 2; NCCL on GPUs), tiny
        DeepSeek-V2 (transformers' plan, q_lora_rank None, MoE) and DeepSeek-V3 (q_lora,
        ``mla_tp_plan`` for its attention, YaRN) with 3 heads per rank, fp32 and bf16 (GPUs; the
        CPU runs fp32): swapped vs unswapped, both tensor-parallel. Eager and compiled
        (``fullgraph=True``; on GPUs mode="reduce-overhead": CUDA graphs, a skipped one fails the
        check): greedy tokens equal up to a near-tie (top-2 margin < 1e-3 in fp32, < 0.3 in bf16)
        and teacher-forced logits within 1e-4 (fp32) / 0.15 (bf16; |logits| reach about 6).
tests   pytest -m multigpu (the tests that need 2 GPUs).
"""

from __future__ import annotations

import argparse
import copy
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

VOCAB = 256
COMMON = dict(
    vocab_size=VOCAB, hidden_size=96, intermediate_size=128, moe_intermediate_size=32,
    num_hidden_layers=2, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
    kv_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=24, pad_token_id=0,
    bos_token_id=1, eos_token_id=None, max_position_embeddings=256, initializer_range=0.15)
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=8.0, original_max_position_embeddings=32,
            beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0)
# (logit atol, near-tie margin) per dtype: fp32 differs only by summation order; bf16 rounds
# differently in the absorbed decode (README: up to 0.09 at these logits).
TOL = {torch.float32: (1e-4, 1e-3), torch.bfloat16: (0.15, 0.3)}


def tiny_config(kind: str, heads: int):
    """Tiny DeepSeek-V2 (q_proj, MoE in layer 1) or -V3 (q_lora, YaRN, dense MLPs) config."""
    from transformers import DeepseekV2Config, DeepseekV3Config

    common = dict(COMMON, num_attention_heads=heads, num_key_value_heads=heads)
    if kind == "v2":
        return DeepseekV2Config(**common, q_lora_rank=None, first_k_dense_replace=1)
    return DeepseekV3Config(**common, q_lora_rank=40, n_group=2, topk_group=1,
                            first_k_dense_replace=2, rope_parameters=YARN)


def left_padded_prompts(b: int, s: int, pads, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (b, s), generator=g)
    mask = torch.ones(b, s, dtype=torch.long)
    for r, p in enumerate(pads):
        mask[r, :p] = 0
    return ids.masked_fill(mask == 0, 0), mask


def poison(cache):
    for kv in cache.kv_caches:
        kv.fill_(float("nan"))
    return cache


def compare(ref, ours_free, ours_forced, prompt_len: int, dtype) -> tuple[bool, str]:
    """transformers' greedy run against ours: tokens equal up to each request's first near-tie,
    teacher-forced logits within the dtype's tolerance. Returns (ok, one line of numbers)."""
    atol, tie_margin = TOL[dtype]
    s = prompt_len
    tokens, logits = ref.sequences[:, s:], torch.stack(ref.logits, 1).float()
    top2 = logits.topk(2, dim=-1).values
    tie = top2[..., 0] - top2[..., 1] < tie_margin
    same = 0
    ok = torch.equal(ours_forced.sequences.cpu(), ref.sequences.cpu())
    for r in range(tokens.shape[0]):
        n = int(tie[r].nonzero()[0, 0]) if tie[r].any() else tokens.shape[1]
        ok &= torch.equal(ours_free.sequences[r, s:s + n].cpu(), tokens[r, :n].cpu())
        same += torch.equal(ours_free.sequences[r].cpu(), ref.sequences[r].cpu())
    err = float((torch.stack(ours_forced.logits, 1).float() - logits).abs().max())
    ok &= err <= atol
    return ok, (f"tokens identical {same}/{tokens.shape[0]} requests, teacher-forced logits max "
                f"|diff| {err:.2e} (bound {atol:g}, |logits| up to {logits.abs().max():.3g})")


def greedy_runs(hf, ours, ids, mask, cache, new_tokens, compile_config=None):
    """transformers' greedy run, ours free-running and ours teacher-forced on its tokens."""
    from transformers import LogitsProcessorList

    from torch_mla.demo import _force_tokens
    from torch_mla.modules import generate_kwargs

    gen = dict(attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
               output_logits=True, return_dict_in_generate=True)
    kw = dict(generate_kwargs(ours, cache))
    if compile_config is not None:
        kw["compile_config"] = compile_config
    else:
        kw["disable_compile"] = True
    with torch.no_grad():
        ref = hf.generate(ids, **gen)
        poison(cache)
        free = ours.generate(ids, **gen, **kw)
        force = _force_tokens(ref.sequences[:, ids.shape[1]:], ids.shape[1])
        poison(cache)
        forced = ours.generate(ids, logits_processor=LogitsProcessorList([force]), **gen, **kw)
    return ref, free, forced


def compile_config(device):
    from transformers import CompileConfig

    cc = CompileConfig(fullgraph=True, dynamic=False,
                       mode="reduce-overhead" if device.type == "cuda" else "default")
    cc._compile_all_devices = True  # transformers compiles only on accelerators by default
    return cc


# --- split over two GPUs -------------------------------------------------------------------------


def _move(x, device):
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, (tuple, list)):
        return type(x)(_move(v, device) for v in x)
    return x


def place_by_hand(model, layer_devices, last_device):
    """``model.model.layers[i]`` on ``layer_devices[i]``, the embedding and RoPE on the first,
    the final norm and lm_head on ``last_device``, with forward pre-hooks that bring each
    module's tensor inputs to its device (what accelerate's hooks do for a device_map) and the
    logits back to the first device, where generate keeps the tokens."""
    first = layer_devices[0]
    model.model.embed_tokens.to(first)
    model.model.rotary_emb.to(first)
    for layer, dev in zip(model.model.layers, layer_devices):
        layer.to(dev)
    for m in (model.model.norm, model.lm_head):
        m.to(last_device)

    def pre_hook(module, args, kwargs):
        dev = next(module.parameters()).device
        return _move(args, dev), {k: _move(v, dev) for k, v in kwargs.items()}

    for m in (*model.model.layers, model.model.norm, model.lm_head):
        m.register_forward_pre_hook(pre_hook, with_kwargs=True)
    model.lm_head.register_forward_hook(lambda m, i, out: out.to(first))
    return model


def check_split(say) -> bool:
    from transformers import AutoModelForCausalLM

    from torch_mla.modules import MLACache, swap_mla_attention

    try:
        import accelerate  # noqa: F401

        how = "device_map (accelerate)"
    except ImportError:
        how = "placed by hand (no accelerate)"
    gpu0, gpu1 = torch.device("cuda", 0), torch.device("cuda", 1)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(tiny_config("v3", 6)).eval()
    tmp = tempfile.mkdtemp()
    base.save_pretrained(tmp)
    ok_all = True
    for dtype in (torch.float32, torch.bfloat16):
        name = f"split over cuda:0 + cuda:1, {how}, {str(dtype)[6:]}"
        try:
            def load(split=True, dtype=dtype):
                if how.startswith("device_map"):
                    device_map = {"model.embed_tokens": 0, "model.rotary_emb": 0,
                                  "model.layers.0": 0, "model.layers.1": 1, "model.norm": 1,
                                  "lm_head": 1} if split else {"": 0}
                    return AutoModelForCausalLM.from_pretrained(
                        tmp, device_map=device_map, dtype=dtype).eval()
                m = copy.deepcopy(base).to(dtype)
                return place_by_hand(m, [gpu0, gpu1], gpu1) if split else m.to(gpu0)

            hf, ours = load(), swap_mla_attention(load())
            ids, mask = (t.to(gpu0) for t in left_padded_prompts(3, 12, (0, 3, 8)))
            cache = MLACache.for_model(ours, 3, 12 + 16)
            where = ([str(kv.device) for kv in cache.kv_caches], [str(t.device) for t in
                     (*cache._tables, *cache._seqlens)])
            ok = where == (["cuda:0", "cuda:1"], ["cuda:0", "cuda:1"] * 2)
            if dtype == torch.float32:
                ref, free, forced = greedy_runs(hf, ours, ids, mask, cache, 16)
                good, line = compare(ref, free, forced, ids.shape[1], dtype)
            else:  # against the swapped model on one GPU: same kernels, same GPU type
                one = swap_mla_attention(load(split=False))
                single = greedy_runs(one, one, ids, mask, MLACache.for_model(one, 3, 28), 16)[1]
                free = greedy_runs(one, ours, ids, mask, cache, 16)[1]
                err = float((torch.stack(free.logits, 1) - torch.stack(single.logits, 1)).abs()
                            .max())
                same = torch.equal(free.sequences.cpu(), single.sequences.cpu())
                good = same and err <= 1e-2
                line = (f"tokens identical to the model on one GPU: {same}, logits max |diff| "
                        f"{err:.2e} (bound 1e-2)")
            ok &= good
            say(f"[{'ok' if ok else 'FAIL'}] {name}: cache on {where[0]}, tables/lengths on "
                f"{sorted(set(where[1]))}; {line}")
        except Exception:
            ok = False
            say(f"[FAIL] {name}:\n{traceback.format_exc()}")
        ok_all &= ok
    return ok_all


# --- tensor parallel (one process per rank) ------------------------------------------------------


def load_whole(path, dtype, device):
    """The unsharded model, swapped: every rank's own copy."""
    from transformers import AutoModelForCausalLM

    from torch_mla.modules import swap_mla_attention

    return swap_mla_attention(AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
                              .to(device).eval())


def check_tp_fp8(ours, whole, ids, mask, tokens) -> tuple[bool, str]:
    """The FP8 latent cache under tensor parallelism (eager): every rank measures the same
    scales (the latent projection is replicated), and the sharded model's logits, teacher-forced
    on ``tokens``, are the unsharded model's on its own fp8 cache. The bound is 1e-2 of the
    largest logit: the ranks' latents differ from the unsharded ones by the summation order of
    the all-reduce, which can move an e4m3 rounding (a whole step of 1/16 on one value); e4m3
    storage itself moves these logits by 5e-2 and more."""
    import torch.distributed as dist
    from transformers import LogitsProcessorList

    from torch_mla.demo import _force_tokens
    from torch_mla.modules import MLACache, generate_kwargs

    b, s = ids.shape
    logits = []
    for model in (ours, whole):
        cache = MLACache.for_model(model, b, s + tokens.shape[1], dtype=torch.float8_e4m3fn)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=tokens.shape[1],
                                 do_sample=False, output_logits=True,
                                 return_dict_in_generate=True, disable_compile=True,
                                 logits_processor=LogitsProcessorList([_force_tokens(tokens, s)]),
                                 **generate_kwargs(model, cache))
        logits.append(torch.stack(out.logits, 1).float())
        if model is ours:
            scales = torch.cat(cache.kv_scales)
    gathered = [torch.empty_like(scales) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, scales)
    same = all(torch.equal(g, scales) for g in gathered)
    err = float((logits[0] - logits[1]).abs().max())
    bound = 1e-2 * float(logits[1].abs().max())
    return same and err <= bound, (f"fp8 cache: scales equal on every rank: {same}, "
                                   f"teacher-forced logits vs the unsharded model's max |diff| "
                                   f"{err:.2e} (bound {bound:.3g})")


def tp_worker(args) -> int:
    """Runs on every rank under torchrun; rank 0 prints. Returns the exit code."""
    import torch.distributed as dist
    from torch._dynamo.utils import counters
    from transformers import AutoModelForCausalLM

    from torch_mla.modules import MLACache, MultiheadLatentAttention, swap_mla_attention
    from torch_mla.modules.tensor_parallel import mla_tp_plan, shard_model

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    try:
        import accelerate  # noqa: F401

        loader = "from_pretrained(distributed_config=DistributedConfig(tp_plan=...))"
    except ImportError:
        loader = "from_pretrained, then shard_model (no accelerate)"

    def say(msg):
        if rank == 0:
            print(msg, flush=True)

    say(f"tensor parallel over {world} ranks on {args.device} "
        f"({dist.get_backend()}); loading: {loader}")
    dtypes = [torch.float32] + ([torch.bfloat16] if device.type == "cuda" else [])
    failures = 0
    for kind in ("v2", "v3"):
        heads = 3 * world
        tmp = [tempfile.mkdtemp() if rank == 0 else None]
        dist.broadcast_object_list(tmp, src=0)
        if rank == 0:
            torch.manual_seed(0)
            AutoModelForCausalLM.from_config(tiny_config(kind, heads)).save_pretrained(tmp[0])
        dist.barrier()
        config = tiny_config(kind, heads)
        plan = "auto" if kind == "v2" else mla_tp_plan(config)
        for dtype in dtypes:
            name = (f"{'DeepSeek-V2, its own plan' if kind == 'v2' else 'DeepSeek-V3, mla_tp_plan'}"
                    f", {heads} heads = {world} x 3, {str(dtype)[6:]}")
            lines, ok = [], True
            try:
                def load(path=tmp[0], dtype=dtype, plan=plan):
                    if loader.startswith("from_pretrained(distributed"):
                        from transformers.distributed import DistributedConfig

                        return AutoModelForCausalLM.from_pretrained(
                            path, dtype=dtype,
                            distributed_config=DistributedConfig(tp_plan=plan)).eval()
                    m = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
                    return shard_model(m, plan).eval()

                hf, ours = load(), swap_mla_attention(load())
                attn = [m for m in ours.modules() if isinstance(m, MultiheadLatentAttention)]
                ok &= all(a.num_heads == 3 and a.tp_group is not None for a in attn)
                lines.append(f"heads per rank {sorted({a.num_heads for a in attn})}")
                ids, mask = (t.to(device) for t in left_padded_prompts(3, 12, (0, 3, 8)))
                for label, cc in (("eager", None), ("compiled", compile_config(device))):
                    counters.clear()
                    cache = MLACache.for_model(ours, 3, 12 + 10)
                    ref, free, forced = greedy_runs(hf, ours, ids, mask, cache, 10, cc)
                    good, line = compare(ref, free, forced, ids.shape[1], dtype)
                    if cc is not None:  # fullgraph: a graph break would have raised
                        graphs = counters["stats"]["unique_graphs"]
                        skips = counters["inductor"]["cudagraph_skips"]
                        good &= graphs >= 1 and not skips
                        label += f" ({graphs} graph(s), fullgraph" + (
                            f", {skips} CUDA graph(s) SKIPPED)" if skips else ")")
                    ok &= good
                    lines.append(f"{label}: {line}")
                good, line = check_tp_fp8(ours, load_whole(tmp[0], dtype, device), ids, mask,
                                          ref.sequences[:, ids.shape[1]:])
                ok &= good
                lines.append(line)
            except Exception:
                ok = False
                lines.append(f"rank {rank}:\n{traceback.format_exc()}")
                print(lines[-1], file=sys.stderr, flush=True)
            flag = torch.tensor([0 if ok else 1], device=device)
            dist.all_reduce(flag)  # a failure on any rank fails the check
            ok = int(flag) == 0
            failures += not ok
            say(f"[{'ok' if ok else 'FAIL'}] TP {name}: " + "; ".join(lines))
            torch._dynamo.reset()
    dist.destroy_process_group()
    return 1 if failures else 0


def run_tp(args, say) -> bool:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={args.world}", "-m", "tools.check_multi_gpu", "--tp-worker",
           "--device", args.device]
    say(f"$ {' '.join(cmd)}")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    for line in proc.stdout.splitlines():
        say("  " + line)
    if proc.returncode:
        say(f"[FAIL] torchrun exited with {proc.returncode}; its stderr:\n{proc.stderr[-20000:]}")
    else:
        log_only(proc.stderr)
    return proc.returncode == 0


def run_tests(say) -> bool:
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-m", "multigpu", "tests"]
    say(f"$ {' '.join(cmd)}")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    for line in proc.stdout.splitlines()[-30:]:
        say("  " + line)
    # 5: no test selected (no test is marked), not a failure of one.
    return proc.returncode in (0, 5)


_LOG = None


def log_only(text: str) -> None:
    if _LOG is not None and text:
        _LOG.write(text + "\n")
        _LOG.flush()


def main(argv=None) -> int:
    global _LOG
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cuda", "cpu"],
                    default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--only", action="append", choices=["split", "tp", "tests"],
                    help="run only these checks (repeatable); default: all")
    ap.add_argument("--world", type=int, default=2, help="tensor-parallel ranks (default 2)")
    ap.add_argument("--log", default=None, help="full log file (default $OUT/check_multi_gpu.log)")
    ap.add_argument("--tp-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.tp_worker:
        return tp_worker(args)
    log = args.log or (os.path.join(os.environ["OUT"], "check_multi_gpu.log")
                       if os.environ.get("OUT") else None)
    _LOG = open(log, "w") if log else None

    def say(msg):
        print(msg, flush=True)
        log_only(msg)

    import transformers

    say(f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"{torch.cuda.device_count()} GPU(s): "
        f"{[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}")
    parts = args.only or ["split", "tp", "tests"]
    if args.device == "cuda" and torch.cuda.device_count() < max(2, args.world):
        say(f"[FAIL] needs {max(2, args.world)} GPUs, found {torch.cuda.device_count()}")
        return 1
    if args.device == "cpu" and "split" in parts:
        say("[FAIL] the split check needs two GPUs (run with --only tp on a CPU)")
        return 1
    t0 = time.perf_counter()
    results = {}
    if "split" in parts:
        results["split"] = check_split(say)
    if "tp" in parts:
        results["tp"] = run_tp(args, say)
    if "tests" in parts:
        results["tests"] = run_tests(say)
    bad = [k for k, v in results.items() if not v]
    say(f"{'FAILED: ' + ', '.join(bad) if bad else 'all checks passed'} "
        f"({time.perf_counter() - t0:.0f} s)" + (f"; full log {log}" if log else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
