"""The swapped model's decode step under torch.compile: one graph, no recompiles, eager's values.

On the CPU with inductor (each test compiles once, ~20 s on 2 cores, less with a warm cache); on
a GPU also under mode="reduce-overhead" (CUDA graphs), where no graph may be skipped.
"""

import copy

import pytest
import torch

pytest.importorskip("transformers")

from test_modules import assert_greedy_matches, poison  # noqa: E402
from transformers import AutoModelForCausalLM, DeepseekV3Config  # noqa: E402

from torch_mla.modules import MLACache, generate_kwargs, swap_mla_attention  # noqa: E402

VOCAB = 256
CONFIG = dict(
    vocab_size=VOCAB, hidden_size=96, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=6, num_key_value_heads=6, q_lora_rank=40, kv_lora_rank=48,
    qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=24, max_position_embeddings=256,
    # Dense MLPs only: transformers' MoE loop has data-dependent shapes (not fullgraph-able).
    first_k_dense_replace=2, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
    pad_token_id=0, bos_token_id=1, eos_token_id=VOCAB + 1, initializer_range=0.15,
)


def models(dtype=torch.float32, device="cpu", **overrides):
    hf = AutoModelForCausalLM.from_config(DeepseekV3Config(**dict(CONFIG, **overrides)))
    hf = hf.to(device=device, dtype=dtype).eval()
    return hf, swap_mla_attention(copy.deepcopy(hf))


def kernel_sized_models():
    """bf16 (transformers', swapped) tiny models on the GPU with DeepSeek's latent width
    (512 + 64), so that their decode runs the GPU kernel."""
    return models(torch.bfloat16, "cuda", hidden_size=256, num_attention_heads=16,
                  num_key_value_heads=16, q_lora_rank=128, kv_lora_rank=512,
                  qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32)


def decode_step(model, cache, ids):
    """One decode step of the swapped model: positions from the cache, logits out."""
    pos = cache.position_ids(ids.shape[0], ids.shape[1])
    out = model(input_ids=ids, position_ids=pos, use_cache=True, **generate_kwargs(model, cache))
    return out.logits


def prefilled(model, ids, mask, max_len):
    """The cache after the prompt's prefill; its slots NaN until written (nothing unwritten may
    be read)."""
    cache = poison(MLACache.for_model(model, ids.shape[0], max_len))
    with torch.no_grad():
        model(ids, attention_mask=mask, use_cache=True, **generate_kwargs(model, cache))
    return cache


def recording_inductor(graphs: list):
    """A torch.compile backend: inductor, keeping each graph it compiles in ``graphs``."""
    from torch._inductor.compile_fx import compile_fx

    def backend(gm, example_inputs):
        graphs.append(gm)
        return compile_fx(gm, example_inputs)

    return backend


def test_compiled_decode_step_is_one_graph_and_matches_eager():
    torch._dynamo.reset()
    hf, ours = models()
    b, s = 3, 11
    ids = torch.randint(2, VOCAB, (b, s))
    mask = torch.ones(b, s, dtype=torch.long)
    mask[2, :4] = 0  # requests of different lengths
    eager_cache = prefilled(ours, ids, mask, 64)
    # The compiled steps start from a cache filled directly (as the benchmark fills it), so that
    # the very first compiled call starts from a state no eager forward has touched.
    compiled_cache = MLACache.for_model(ours, b, 64)
    for dst, src in zip(compiled_cache.kv_caches, eager_cache.kv_caches):
        dst.copy_(src)
    compiled_cache.set_seqlens(eager_cache.cache_seqlens.clone())
    graphs = []
    compiled = torch.compile(decode_step, backend=recording_inductor(graphs),
                             fullgraph=True)  # no graph breaks
    with torch.no_grad():
        hf_out = hf(ids, attention_mask=mask, use_cache=True)
        hf_cache = hf_out.cache if hasattr(hf_out, "cache") else hf_out.past_key_values
        for _ in range(3):  # new lengths every step, same shapes
            new = torch.randint(2, VOCAB, (b, 1))
            pos = eager_cache.position_ids(b, 1)
            mask = torch.cat([mask, torch.ones(b, 1, dtype=torch.long)], 1)
            ref = hf(new, attention_mask=mask, position_ids=pos, use_cache=True,
                     **generate_kwargs(hf, hf_cache)).logits
            eager = decode_step(ours, eager_cache, new)
            out = compiled(ours, compiled_cache, new)
            torch.testing.assert_close(out, eager, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    assert torch.equal(compiled_cache.cache_seqlens, eager_cache.cache_seqlens)
    assert compiled_cache.cache_seqlens.tolist() == [14, 14, 10]
    assert len(graphs) == 1, f"recompiled: {len(graphs)} graphs"
    # An eager step after compiled ones counts the positions those added (14 of 64 now).
    with pytest.raises(ValueError, match="65 positions .* max_cache_len=64"), torch.no_grad():
        decode_step(ours, compiled_cache, torch.randint(2, VOCAB, (b, 51)))
    assert compiled_cache.cache_seqlens.tolist() == [14, 14, 10]
    ops = [str(n.target) for n in graphs[0].graph.nodes
           if n.op == "call_function" and "torch_mla" in str(n.target)]
    # The schedule is computed once per step and shared by the layers.
    assert ops == ["torch_mla.get_decode_schedule"] + ["torch_mla.append_kv",
                                                       "torch_mla._head_matmul",
                                                       "torch_mla.mla_decode",
                                                       "torch_mla._head_matmul"] * 2


def test_compiled_generate_matches_transformers_and_stops_at_the_same_limit_as_eager():
    from torch._dynamo.utils import counters
    from transformers.generation import CompileConfig

    torch._dynamo.reset()
    counters.clear()
    hf, ours = models()
    ids = torch.randint(2, VOCAB, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    cache = MLACache.for_model(ours, 2, 9 + 16)
    config = CompileConfig(fullgraph=True, mode="default", dynamic=False)
    config._compile_all_devices = True  # generate compiles only on accelerators by default
    assert_greedy_matches(hf, ours, ids, cache, attention_mask=mask, max_new_tokens=16,
                          compile_config=config)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])

    # 9 + 16 positions fit (the 17th token is not fed back), one more does not: the eager step
    # raises before writing, the compiled one fails its device-side check; neither drops tokens.
    full = "MLACache is full: .* max_cache_len=25; build a larger cache"
    with torch.no_grad():
        for mode, error in ((dict(disable_compile=True), ValueError),
                            (dict(compile_config=config), RuntimeError)):
            kw = dict(attention_mask=mask, do_sample=False, **mode, **generate_kwargs(ours, cache))
            assert ours.generate(ids, max_new_tokens=17, **kw).shape == (2, 9 + 17)
            with pytest.raises(error, match=full):
                ours.generate(ids, max_new_tokens=18, **kw)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def check_reduce_overhead_steps(hf, ours, ids, mask, max_len, ref_tol=5e-2, hf_factor=None):
    """Six decode steps of the swapped bf16 model under mode="reduce-overhead" (warm-up,
    recording, then replays) against its eager steps and an fp32 copy of transformers' model,
    within a fraction of the logits' scale (eager 5e-2; fp32 ``ref_tol``); one graph, no CUDA
    graph skipped. With ``hf_factor``, for models whose bf16 rounding alone moves the logits
    further (a sparse model's selection parting from fp32's at near-ties), the fp32 bound is
    instead transformers' own bf16 model's: each step's error (compiled and eager, which may
    select differently too) within the larger of ``ref_tol`` and 2 * hf_factor times its error
    that step, the mean over steps within hf_factor times its mean."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    b = ids.shape[0]
    eager_cache, compiled_cache = (prefilled(ours, ids, mask, max_len) for _ in range(2))
    compiled = torch.compile(decode_step, mode="reduce-overhead", fullgraph=True)
    with torch.no_grad():
        hf32 = copy.deepcopy(hf).float()
        hf_out = hf32(ids, attention_mask=mask, use_cache=True)
        hf_cache = hf_out.cache if hasattr(hf_out, "cache") else hf_out.past_key_values
        if hf_factor is not None:
            hf16_out = hf(ids, attention_mask=mask, use_cache=True)
            hf16_cache = hf16_out.cache if hasattr(hf16_out, "cache") else hf16_out.past_key_values
        errors = []  # (compiled, eager, transformers bf16) against fp32 a step, over the scale
        for _ in range(6):  # warm-up, recording, then replays
            new = torch.randint(2, VOCAB, (b, 1), device="cuda")
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            pos = eager_cache.position_ids(b, 1)
            ref = hf32(new, attention_mask=mask, position_ids=pos, use_cache=True,
                       **generate_kwargs(hf32, hf_cache)).logits
            eager = decode_step(ours, eager_cache, new)
            out = compiled(ours, compiled_cache, new).clone()
            scale = ref.abs().max().item()
            # bf16 through 2 layers: inductor's fusions round differently from eager (seen on
            # the H200: 2.2e-2 * scale at worst), so both are held to the fp32 reference's bound.
            if hf_factor is None:
                torch.testing.assert_close(out.float(), eager.float(), atol=5e-2 * scale, rtol=0)
                torch.testing.assert_close(out.float(), ref, atol=ref_tol * scale, rtol=0)
                continue
            hf16 = hf(new, attention_mask=mask, position_ids=pos, use_cache=True,
                      **generate_kwargs(hf, hf16_cache)).logits
            errors.append([(x.float() - ref).abs().max().item() / scale
                           for x in (out, eager, hf16)])
            assert max(errors[-1][:2]) <= max(ref_tol, 2 * hf_factor * errors[-1][2]), errors
        if hf_factor is not None:
            compiled_err, eager_err, hf_err = (sum(e) / len(errors) for e in zip(*errors))
            assert max(compiled_err, eager_err) <= hf_factor * hf_err, errors
    assert torch.equal(compiled_cache.cache_seqlens, eager_cache.cache_seqlens)
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


@pytest.mark.cuda
def test_reduce_overhead_decode_step_replays_cuda_graphs():
    hf, ours = kernel_sized_models()
    b, s = 4, 100
    ids = torch.randint(2, VOCAB, (b, s), device="cuda")
    mask = torch.ones(b, s, dtype=torch.long, device="cuda")
    mask[1, :37] = 0
    check_reduce_overhead_steps(hf, ours, ids, mask, 256)


@pytest.mark.cuda
def test_generate_on_gpu_compiles_with_cuda_graphs():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    hf, ours = models(torch.bfloat16, "cuda", hidden_size=256, num_attention_heads=16,
                      num_key_value_heads=16, q_lora_rank=128, kv_lora_rank=512,
                      qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32)
    ids = torch.randint(2, VOCAB, (2, 30), device="cuda")
    cache = MLACache.for_model(ours, 2, 30 + 16)
    kw = dict(max_new_tokens=16, do_sample=False, output_scores=True,
              return_dict_in_generate=True)
    with torch.no_grad():
        # generate compiles the decode step itself (mode="reduce-overhead") for a static cache.
        out = ours.generate(ids, **kw, **generate_kwargs(ours, cache))
        cache.reset()
        eager = ours.generate(ids, disable_compile=True, **kw, **generate_kwargs(ours, cache))
    assert counters["stats"]["unique_graphs"] >= 1, "generate did not compile"
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    # bf16: compiled and eager round differently (2e-2 of the logits' scale seen on the H200), so
    # greedy tokens may part at a near-tie. While a row's tokens agree, its logits must agree,
    # and where the tokens part, eager must rate both tokens within that rounding.
    same = torch.ones(ids.shape[0], dtype=torch.bool, device="cuda")
    for step, (sc, se) in enumerate(zip(out.scores, eager.scores)):
        tol = 5e-2 * se.abs().max().item()
        if same.any():
            torch.testing.assert_close(sc[same].float(), se[same].float(), atol=tol, rtol=0)
        tc, te = out.sequences[:, 30 + step], eager.sequences[:, 30 + step]
        gap = (se.gather(1, te[:, None]) - se.gather(1, tc[:, None])).squeeze(1).abs()
        assert bool((gap[same & (tc != te)] <= tol).all()), (step, gap.tolist())
        same &= tc == te


def load_bench_e2e():
    """benchmarks/bench_e2e.py as a module (the benchmarks are scripts, not a package)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_e2e.py"
    spec = importlib.util.spec_from_file_location("bench_e2e", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_e2e_benchmark_runs_on_cpu_and_agrees_with_transformers(capsys):
    bench = load_bench_e2e()
    torch._dynamo.reset()
    bench.main(["--tiny", "--device", "cpu", "--layers", "2", "--batches", "2", "--context",
                "70", "--steps", "2", "--systems", "hf,torch_mla,torch_mla_fp8"])
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines()
            if line.startswith("| 2 |")]
    assert [r[1] for r in rows] == ["transformers as shipped (eager, DynamicCache)",
                                    "torch_mla, compiled (CPU: no CUDA graphs)",
                                    "torch_mla, fp8 latent cache, compiled (CPU: no CUDA graphs)"]
    mla, fp8 = rows[1], rows[2]
    assert float(mla[9]) < 1e-5  # first-step logits vs transformers, same cache contents
    assert mla[10].strip(" |") == fp8[10].strip(" |") == "1 graph"
    assert mla[5] == rows[0][5] == f"{2 * (32 + 16) * 4:,}"  # KV bytes per token, 2 layers fp32
    assert rows[0][4] == "1.00x" and mla[4].endswith("x")
    # The fp8 cache: 1 byte a value (a quarter of fp32 here, half of bf16 on a GPU); its logits
    # off transformers' by the e4m3 storage error (3.6e-3 of the largest logit measured: the
    # latents are randn, e_store ~2e-2 in the attention, less after o_proj), not by 0.
    assert fp8[5] == f"{2 * (32 + 16):,}"
    assert 1e-4 < float(fp8[9]) < 5e-2
    # Its floor reads 1 byte a cached value instead of 4: 2 layers x b 2 x 70 tokens x 48 values
    # x 3 bytes fewer, at 4246 GB/s (the tiny attention is memory-bound), in ms, to the table's
    # 3 digits.
    saved = 2 * 2 * 70 * 48 * 3 / 4246e9 * 1e3
    assert abs(float(mla[6]) - float(fp8[6]) - saved) < 2e-7


def test_e2e_benchmark_tensor_parallel_on_two_cpu_ranks():
    # torchrun, 2 CPU ranks (gloo): the sharded model's table, its logits against transformers'
    # tensor-parallel model (same shards, same cache contents).
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         "benchmarks/bench_e2e.py", "--tiny", "--device", "cpu", "--tp", "2", "--layers", "2",
         "--batches", "2", "--context", "70", "--steps", "2", "--systems", "hf,torch_mla"],
        cwd=root, capture_output=True, text=True, timeout=900,
        env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-5000:]
    out = proc.stdout
    assert "attention heads 4 = 2 x 2" in out and "2 x CPU, tensor parallel" in out
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| 2 |")]
    assert [r[1] for r in rows] == ["transformers as shipped (eager, DynamicCache)",
                                    "torch_mla, compiled (CPU: no CUDA graphs)"]
    for r in rows:  # tokens/s of the job, per GPU: half of it
        assert abs(float(r[3].replace(",", "")) / 2 - float(r[4].replace(",", ""))) <= 1
    mla = rows[1]
    assert float(mla[10]) < 1e-5  # first-step logits vs transformers' tensor-parallel model
    assert mla[11].strip(" |") == "1 graph"
    assert mla[6] == rows[0][6] == f"{2 * (32 + 16) * 4:,}"  # whole latent on every rank
