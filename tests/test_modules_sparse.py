"""SparseMultiheadLatentAttention (DeepSeek-V3.2's attention: MLA with a lightning indexer) and the
MLACache's index-key cache against transformers' DeepSeek-V3.2 and GLM-MoE-DSA, in fp32 on the
CPU.

Tiny random-weight models (an index_topk below the contexts, so that the indexer decides what
each decode step attends to). Prefill runs transformers' own computation, decode runs
torch_mla.indexer_topk over the paged index-key cache and mla_decode_sparse over the latent cache;
greedy tokens must be transformers', logits within 1e-4, with requests of different lengths (left
padding), a shuffled block table, decode steps of several tokens (causal within the step) and,
for GLM-MoE-DSA, layers that reuse the previous layer's selection. Unwritten slots are NaN.
"""

import copy
import types
import warnings

import expecttest
import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from test_modules import (  # noqa: E402
    COMMON,
    VOCAB,
    assert_greedy_matches,
    left_padded_prompts,
    poisoned_cache,
    returned_cache,
)
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from torch_mla.modules import (  # noqa: E402
    MLACache,
    MultiheadLatentAttention,
    SparseMultiheadLatentAttention,
    generate_kwargs,
    swap_mla_attention,
)
from torch_mla.reference_indexer import dequantize_index_keys  # noqa: E402

# The brief's bound for the swapped model's logits (fp32; absorbed vs expanded attention and the
# indexer's float32 sums differ only in summation order: ~1e-5 seen).
ATOL = 1e-4
# DeepSeek-V3.2's 64 index heads, index_topk 12 of contexts up to ~45. A key every head's relu
# zeroes scores exactly 0, tied with every other such key, and transformers' top-k and torch_mla's
# (over another layout: no padding, the table's width) may break such a tie differently: the
# models below give the padding token (id 0, which greedy decoding may pick) a random embedding,
# as the real models have, instead of nn.Embedding's zero row (whose index key is 0: all such
# tokens tied at 0, which parted the greedy tokens).
INDEXER = dict(index_n_heads=64, index_head_dim=32, index_topk=12)
FAMILIES = {
    "deepseek_v32": {},
    # Layer 1 reuses layer 0's selection (GLM-5's cross-layer sharing).
    "glm_moe_dsa": dict(index_topk_pattern="FS"),
}


def family_model(family, **overrides):
    fields = {**COMMON, "q_lora_rank": 40, "n_group": 1, "topk_group": 1, **INDEXER,
              **FAMILIES[family], **overrides}
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **fields)).eval()
    with torch.no_grad():
        hf.model.embed_tokens.weight[COMMON["pad_token_id"]].normal_(std=COMMON["initializer_range"])
    return hf


def swapped(hf):
    return swap_mla_attention(copy.deepcopy(hf))


def poison_index(cache):
    for t in (*(cache.index_caches or ()), *(cache.index_scales or ())):
        if t is not None:
            t.view(torch.uint8).fill_(0xFF)  # NaN in every format (float32, bf16, e4m3)
    return cache


@pytest.mark.parametrize("family", FAMILIES)
def test_swap_builds_the_sparse_module_with_each_familys_rope(family):
    hf = family_model(family)
    ours = swapped(hf)
    attns = [m for m in ours.modules() if isinstance(m, MultiheadLatentAttention)]
    assert len(attns) == 2 and all(isinstance(m, SparseMultiheadLatentAttention) for m in attns)
    assert all(a.rope_interleave for a in attns)  # both interleave the attention's RoPE
    # DeepSeek-V3.2's indexer rotates in halves, GLM-MoE-DSA's interleaved; GLM's layer 1 has no
    # indexer and returns its selection for the next layer.
    assert attns[0].indexer.rope_interleave == (family == "glm_moe_dsa")
    assert (attns[1].indexer is None) == (family == "glm_moe_dsa")
    assert all(a.returns_topk == (family == "glm_moe_dsa") for a in attns)
    # Weights shared, state dict keys kept (the indexer's included).
    assert ours.state_dict().keys() == hf.state_dict().keys()
    mine = swap_mla_attention(hf)
    assert mine.model.layers[0].self_attn.indexer.wq_b is hf.model.layers[0].self_attn.indexer.wq_b


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers_prefill_and_every_decode_step(family):
    hf = family_model(family)
    ours = swapped(hf)
    b, s = 3, 21
    ids, mask = left_padded_prompts(b, s, pads=(0, 5, 13))
    cache = poison_index(poisoned_cache(ours, max_batch=4, max_len=s + 40))
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask, use_cache=True)
        out = ours(ids, attention_mask=mask, use_cache=True, **generate_kwargs(ours, cache))
        real = mask.bool()
        torch.testing.assert_close(out.logits[real], ref.logits[real], atol=ATOL, rtol=0)
        assert cache.cache_seqlens.tolist() == [21, 16, 8, 0]
        hf_cache = returned_cache(ref)
        lens = mask.sum(1)
        # Decode steps of 1 token, then 3 at once (causal among themselves), 1, 2.
        for n_new in (1, 3, 1, 2):
            new = torch.randint(2, VOCAB, (b, n_new))
            mask = torch.cat([mask, torch.ones(b, n_new, dtype=torch.long)], 1)
            pos = lens[:, None] + torch.arange(n_new)
            r = hf(new, attention_mask=mask, position_ids=pos, use_cache=True,
                   **generate_kwargs(hf, hf_cache))
            o = ours(new, attention_mask=mask, position_ids=pos, use_cache=True,
                     **generate_kwargs(ours, cache))
            torch.testing.assert_close(o.logits, r.logits, atol=ATOL, rtol=0)
            lens = lens + n_new
        # The comparison has teeth: with every token selected (a dense indexer) the logits are
        # far from transformers' sparse ones.
        dense = copy.deepcopy(ours)
        for m in dense.modules():
            if isinstance(m, SparseMultiheadLatentAttention) and m.indexer is not None:
                m.indexer.index_topk = 1000
        new = torch.randint(2, VOCAB, (b, 1))
        mask = torch.cat([mask, torch.ones(b, 1, dtype=torch.long)], 1)
        r = hf(new, attention_mask=mask, position_ids=lens[:, None], use_cache=True,
               **generate_kwargs(hf, hf_cache))
        for model, close in ((ours, True), (dense, False)):
            c = copy.deepcopy(cache)
            c.index_topk = model.model.layers[0].self_attn.indexer.index_topk
            o = model(new, attention_mask=mask, position_ids=lens[:, None], use_cache=True,
                      **generate_kwargs(model, c))
            assert ((o.logits - r.logits).abs().max() < ATOL) == close


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generate_matches_transformers(family):
    hf = family_model(family)
    ours = swapped(hf)
    ids, mask = left_padded_prompts(3, 12, pads=(0, 3, 8))
    cache = poison_index(poisoned_cache(ours, max_batch=3, max_len=12 + 24))
    gen = dict(attention_mask=mask, max_new_tokens=24, do_sample=False, output_logits=True,
               return_dict_in_generate=True)
    with torch.no_grad():
        ref = hf.generate(ids, **gen)
        out = ours.generate(ids, **gen, **generate_kwargs(ours, cache))
    assert torch.equal(out.sequences, ref.sequences)
    torch.testing.assert_close(torch.stack(out.logits, 1), torch.stack(ref.logits, 1),
                               atol=ATOL, rtol=0)
    assert len(set(ref.sequences[:, 12:].flatten().tolist())) > 12  # not a degenerate loop
    # 23 decode steps after prompts of 12, 9 and 4 real tokens: every later step of each request
    # sees more tokens than it keeps (index_topk 12).
    assert cache.cache_seqlens.tolist() == [12 + 23, 9 + 23, 4 + 23]


def test_chunked_prefill_and_teacher_forcing():
    # Chunks of 4 (later chunks are decode steps of 4 tokens through the indexer op), and the
    # strict checks of tests/test_modules.py: teacher-forced logits at every step.
    hf = family_model("deepseek_v32")
    ours = swapped(hf)
    ids, mask = left_padded_prompts(3, 21, pads=(0, 9, 17))
    cache = poison_index(poisoned_cache(ours, max_batch=3, max_len=21 + 10))
    assert_greedy_matches(hf, ours, ids, cache, attention_mask=mask, max_new_tokens=10,
                          prefill_chunk_size=4)


def test_bf16_without_mla_cache_is_transformers_bit_for_bit():
    # Without an MLACache the module runs transformers' own operations (the indexer's included)
    # in its dtypes, on its DynamicCache: the bound is zero.
    hf = family_model("deepseek_v32").to(torch.bfloat16)
    ours = swapped(hf)
    ids, mask = left_padded_prompts(3, 12, pads=(0, 3, 8))
    gen = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, output_logits=True,
               return_dict_in_generate=True)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the swapped model on transformers' DynamicCache
        ref, out = hf.generate(ids, **gen), ours.generate(ids, **gen)
    assert torch.equal(out.sequences, ref.sequences)
    assert torch.equal(torch.stack(out.logits), torch.stack(ref.logits))


def test_fp8_index_cache_stores_rotated_keys_and_selects_nearly_the_same():
    # DeepSeek's serving format: keys rotated by a Hadamard transform, e4m3 with a power-of-two
    # scale per token. The products are unchanged by the rotation, so the selection differs from
    # the fp32 cache's only where quantization reorders close scores.
    hf = family_model("deepseek_v32", index_topk=16)
    ours = swapped(hf)
    ids, mask = left_padded_prompts(2, 40, pads=(0, 7))
    caches = [MLACache.for_model(ours, 2, 64), MLACache.for_model(
        ours, 2, 64, index_dtype=torch.float8_e4m3fn)]
    assert caches[1].index_bytes_per_token_per_layer == 32 + 4
    picks = []
    attn = ours.model.layers[0].self_attn
    x, kv_c, k_pe = torch.randn(2, 1, 96), torch.randn(2, 1, 48), torch.randn(2, 1, 16)
    with torch.no_grad():
        for cache in caches:
            ours(ids, attention_mask=mask, use_cache=True, **generate_kwargs(ours, cache))
            q_resid = attn.q_a_layernorm(attn.q_a_proj(x))
            cos, sin = attn.rotary(cache.position_ids(2, 1))
            q, k, w = attn.indexer.project(x, q_resid, cos, sin)
            # Layer 0 of a decode step by hand: its latents and index keys in, its selection.
            assert not cache.begin_layer(0, 2, 1)
            step = cache.append_latents(0, kv_c, k_pe, 6,
                                        attn.indexer.cache_keys(k, cache.index_dtype))
            picks.append(attn.indexer.cached_topk(q, w, step))
    # Stored keys: e4m3 times a power of two, the rotated fp32 keys within e4m3's rounding.
    fp32, fp8 = caches[0].index_caches[0].view(-1, 32), caches[1].index_caches[0].view(-1, 32)
    scale = caches[1].index_scales[0].view(-1)
    held = caches[0].block_table[:, :1].flatten()  # the first page of each request
    rows = (held[:, None] * 64 + torch.arange(33)).flatten()
    rotated = attn.indexer.rotate_for_fp8(fp32[rows])
    err = (dequantize_index_keys(fp8[rows], scale[rows]) - rotated).abs()
    # e4m3: 3 mantissa bits (2^-4 relative), subnormals in steps of 2^-9 of the scale.
    assert (err <= rotated.abs() * 2**-4 + scale[rows, None] * 2**-10).all()
    assert torch.equal(scale[rows], torch.exp2(torch.log2(scale[rows]).round()))
    same = sum(len(set(a.tolist()) & set(b.tolist()))
               for a, b in zip(picks[0].flatten(0, 1), picks[1].flatten(0, 1)))
    assert same >= 0.85 * picks[0].numel(), same


def test_cache_holds_index_keys_only_where_a_layer_has_an_indexer():
    glm = swapped(family_model("glm_moe_dsa"))
    cache = MLACache.for_model(glm, 2, 100)
    assert cache.index_topk == 12
    assert cache.index_caches[0].shape == (4, 64, 32) and cache.index_caches[1] is None
    # Per token: 2 layers of latents (48 + 16 fp32 values), one layer of index keys (32 fp32).
    assert cache.kv_bytes_per_token == 2 * (48 + 16) * 4 + 32 * 4
    assert cache.nbytes == 4 * 64 * (2 * (48 + 16) + 32) * 4
    v32 = MLACache.for_model(swapped(family_model("deepseek_v32")), 2, 100,
                             index_dtype=torch.float8_e4m3fn)
    assert v32.index_scales[1].shape == (4, 64) and v32.kv_bytes_per_token == 2 * (64 * 4 + 36)


class TestSparseRefusals(expecttest.TestCase):
    def changed(self, change, family="deepseek_v32"):
        hf = family_model(family)
        change(hf.model.layers[1].self_attn)
        with self.assertRaises(ValueError) as e:
            swap_mla_attention(hf)
        assert not any(isinstance(m, MultiheadLatentAttention) for m in hf.modules())
        return str(e.exception)

    def test_indexers_that_differ(self):
        c = self.changed
        self.assertExpectedInline(c(lambda a: setattr(a.indexer, "q_input_norm", nn.LayerNorm(96))), """model.layers.1.self_attn (DeepseekV32Attention) is not DeepSeek-V3.2's attention: its indexer has submodules DeepSeek-V3.2's does not have (q_input_norm): they take part in its forward. SparseMultiheadLatentAttention would compute something else, so nothing was swapped""")
        self.assertExpectedInline(c(lambda a: setattr(a.indexer, "use_rope", False)), """model.layers.1.self_attn (DeepseekV32Attention) is not DeepSeek-V3.2's attention: its indexer has attributes DeepSeek-V3.2's does not have (use_rope), which may change its forward. SparseMultiheadLatentAttention would compute something else, so nothing was swapped""")
        self.assertExpectedInline(c(lambda a: setattr(a.indexer, "index_topk", 7)), """model.layers.1.self_attn (DeepseekV32Attention) is not DeepSeek-V3.2's attention: its indexer's index_topk is 7 but its config's index_topk is 12. SparseMultiheadLatentAttention would compute something else, so nothing was swapped""")
        self.assertExpectedInline(c(lambda a: setattr(a.indexer, "k_norm", nn.RMSNorm(32))), """model.layers.1.self_attn (DeepseekV32Attention) is not DeepSeek-V3.2's attention: its indexer's k_norm is a RMSNorm, not a LayerNorm. SparseMultiheadLatentAttention would compute something else, so nothing was swapped""")
        self.assertExpectedInline(c(lambda a: setattr(a.indexer, "softmax_scale", 1.0)), """model.layers.1.self_attn (DeepseekV32Attention) is not DeepSeek-V3.2's attention: its indexer's softmax_scale is 1.0, not index_head_dim ** -0.5 = 0.1767766952966369. SparseMultiheadLatentAttention would compute something else, so nothing was swapped""")
        self.assertExpectedInline(c(lambda a: setattr(a.indexer, "wk", nn.Linear(96, 16))), """model.layers.1.self_attn (DeepseekV32Attention) is not DeepSeek-V3.2's attention: its indexer's wk.out_features is 16, not the 32 its config's dimensions give. SparseMultiheadLatentAttention would compute something else, so nothing was swapped""")

    def test_attentions_that_differ(self):
        c = self.changed
        self.assertExpectedInline(c(lambda a: setattr(a, "sinks", nn.Parameter(torch.zeros(6)))), """model.layers.1.self_attn (DeepseekV32Attention) is not DeepSeek-V3.2's attention: it has parameters of its own (sinks; HunYuan-V4's attention sinks, for one), which take part in its forward. SparseMultiheadLatentAttention would compute something else, so nothing was swapped""")
        self.assertExpectedInline(c(lambda a: setattr(a, "gate_proj", nn.Linear(96, 144))), """model.layers.1.self_attn (DeepseekV32Attention) is not DeepSeek-V3.2's attention: it has submodules DeepSeek-V3.2's attention does not have (gate_proj): they take part in its forward. SparseMultiheadLatentAttention would compute something else, so nothing was swapped""")
        self.assertExpectedInline(c(lambda a: setattr(a, "skip_topk", False), "glm_moe_dsa"), """model.layers.1.self_attn (GlmMoeDsaAttention) is not DeepSeek-V3.2's attention: it has no indexer and does not take the previous layer's selection (prev_topk_indices). SparseMultiheadLatentAttention would compute something else, so nothing was swapped""")

    def test_cache_without_index_keys(self):
        ours = swapped(family_model("deepseek_v32"))
        # A cache built from a config without the indexer's fields (as for DeepSeek-V3).
        config = types.SimpleNamespace(num_hidden_layers=2, kv_lora_rank=48, qk_rope_head_dim=16)
        cache = MLACache(config, 1, 64)
        with self.assertRaises(ValueError) as e, torch.no_grad():
            ours(torch.randint(2, VOCAB, (1, 4)), **generate_kwargs(ours, cache))
            ours(torch.randint(2, VOCAB, (1, 1)), **generate_kwargs(ours, cache))
        self.assertExpectedInline(str(e.exception), """layer 0 has an indexer but its MLACache holds no index keys: build the cache from this model's config (MLACache.for_model)""")



# ---- torch.compile and CUDA graphs -----------------------------------------------------------------

def compile_models(dtype=torch.float32, device="cpu", **overrides):
    """(transformers', swapped) DeepSeek-V3.2 models with dense MLPs only (transformers' MoE loop
    has data-dependent shapes: not fullgraph-able)."""
    hf = family_model("deepseek_v32", first_k_dense_replace=2, **overrides)
    hf = hf.to(device=device, dtype=dtype)
    return hf, swapped(hf)


def test_compiled_decode_step_is_one_graph_and_matches_eager():
    from test_modules_compile import decode_step, prefilled, recording_inductor

    torch._dynamo.reset()
    hf, ours = compile_models()
    b, s = 3, 20
    ids, mask = left_padded_prompts(b, s, pads=(0, 3, 9))
    eager_cache, compiled_cache = (prefilled(ours, ids, mask, 64) for _ in range(2))
    graphs = []
    compiled = torch.compile(decode_step, backend=recording_inductor(graphs),
                             fullgraph=True)  # no graph breaks
    with torch.no_grad():
        hf_cache = returned_cache(hf(ids, attention_mask=mask, use_cache=True))
        for n_new in (1, 1, 1, 2):  # new lengths every step; s_q 2 is a second graph
            new = torch.randint(2, VOCAB, (b, n_new))
            pos = eager_cache.position_ids(b, n_new)
            mask = torch.cat([mask, torch.ones(b, n_new, dtype=torch.long)], 1)
            ref = hf(new, attention_mask=mask, position_ids=pos, use_cache=True,
                     **generate_kwargs(hf, hf_cache)).logits
            eager = decode_step(ours, eager_cache, new)
            out = compiled(ours, compiled_cache, new)
            torch.testing.assert_close(out, eager, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    assert torch.equal(compiled_cache.cache_seqlens, eager_cache.cache_seqlens)
    for a, c in zip(eager_cache.index_caches, compiled_cache.index_caches):
        # (the same keys up to inductor's fusions of the projection and the LayerNorm)
        torch.testing.assert_close(a, c, atol=1e-5, rtol=1e-5)
    assert len(graphs) == 2, f"{len(graphs)} graphs"
    ops = [str(n.target) for n in graphs[0].graph.nodes
           if n.op == "call_function" and "torch_mla" in str(n.target)]
    # The sparse schedule once per step, shared by the layers; per layer the latent and index-key
    # appends (each one op, writing its cache in place), the indexer, the sparse decode between
    # the absorbed projections.
    assert ops == ["torch_mla.get_decode_schedule"] + [
        "torch_mla.append_kv", "torch_mla.append_index_keys", "torch_mla.indexer_topk",
        "torch_mla._head_matmul",
        "torch_mla.mla_decode_sparse", "torch_mla._head_matmul"] * 2


def test_fp8_index_cache_decode_step_compiles_as_one_graph():
    # The FP8 path adds the Hadamard rotation and the per-row quantization of queries and keys
    # (frexp) to the traced step. (aot_eager: dynamo's graph and functionalization, without
    # inductor's compile time)
    from test_modules_compile import decode_step

    torch._dynamo.reset()
    hf, ours = compile_models()
    ids, mask = left_padded_prompts(2, 20, pads=(0, 3))
    eager = MLACache.for_model(ours, 2, 64, index_dtype=torch.float8_e4m3fn)
    with torch.no_grad():
        ours(ids, attention_mask=mask, use_cache=True, **generate_kwargs(ours, eager))
        compiled_cache = copy.deepcopy(eager)
        compiled = torch.compile(decode_step, backend="aot_eager", fullgraph=True)
        for _ in range(2):
            new = torch.randint(2, VOCAB, (2, 1))
            torch.testing.assert_close(compiled(ours, compiled_cache, new),
                                       decode_step(ours, eager, new), atol=1e-5, rtol=1e-5)
    for a, b in zip(eager.index_scales, compiled_cache.index_scales):
        assert torch.equal(a, b)


@pytest.mark.cuda
def test_gpu_compiled_generate_with_cuda_graphs_gives_transformers_tokens_in_fp32():
    # The H200 check: a tiny V3.2 model, generate compiling the decode step with CUDA
    # graphs (mode="reduce-overhead"), fp32 (every op's reference path: the indexer, the sparse
    # decode), the tokens transformers gives.
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    hf, ours = compile_models(device="cuda")
    ids, mask = left_padded_prompts(3, 30, pads=(0, 5, 17))
    ids, mask = ids.cuda(), mask.cuda()
    cache = MLACache.for_model(ours, 3, 30 + 24)
    gen = dict(attention_mask=mask, max_new_tokens=24, do_sample=False, output_logits=True,
               return_dict_in_generate=True)
    with torch.no_grad():
        ref = hf.generate(ids, **gen)
        out = ours.generate(ids, **gen, **generate_kwargs(ours, cache))  # compiles itself
    assert counters["stats"]["unique_graphs"] >= 1, "generate did not compile"
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    assert torch.equal(out.sequences, ref.sequences)
    torch.testing.assert_close(torch.stack(out.logits, 1), torch.stack(ref.logits, 1),
                               atol=ATOL, rtol=0)


@pytest.mark.cuda
def test_gpu_reduce_overhead_decode_step_on_the_sparse_kernel():
    # bf16 with DeepSeek's latent (512 + 64): the sparse decode runs the portable sparse kernel
    # inside CUDA graphs, the indexer its logits kernel where there is one (else the reference),
    # both held to an fp32 copy of the model: the dense model's check (test_modules_compile.py),
    # its bound against fp32 set by transformers' own bf16 model (hf_factor): bf16 selections
    # part from fp32's at near-ties (index_topk 64 of ~150 tokens), and transformers' bf16 model
    # is itself up to 0.83 of the logits' scale off at a step (seen on the H200, where ours'
    # largest error each step was within 6% of transformers').
    from test_modules_compile import check_reduce_overhead_steps

    hf, ours = compile_models(torch.bfloat16, "cuda", hidden_size=256, num_attention_heads=16,
                              num_key_value_heads=16, q_lora_rank=128, kv_lora_rank=512,
                              qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
                              index_head_dim=128, index_topk=64)
    ids, mask = left_padded_prompts(4, 150, pads=(0, 37, 90, 3))
    check_reduce_overhead_steps(hf, ours, ids.cuda(), mask.cuda(), 256, hf_factor=1.5)


def test_e2e_benchmark_v32_runs_on_cpu_and_agrees_with_transformers(capsys):
    from test_modules_compile import load_bench_e2e

    bench = load_bench_e2e()
    torch._dynamo.reset()
    # A context of 130 against an index_topk of 32: the sparse step (one compile).
    bench.main(["--model", "v32", "--tiny", "--device", "cpu", "--layers", "2", "--batches",
                "2", "--context", "130", "--steps", "2", "--systems", "hf,torch_mla"])
    out = capsys.readouterr().out
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| 2 |")]
    assert [r[1] for r in rows] == ["transformers as shipped (eager, DynamicCache)",
                                    "torch_mla, compiled (CPU: no CUDA graphs)"]
    hf, mla = rows
    assert float(mla[9]) < 1e-5  # first-step logits vs transformers, same cache contents
    assert mla[10].strip(" |") == "1 graph"
    # Bytes per token, 2 layers in fp32: the latent (32 + 16) and the index key (32), both.
    assert hf[5] == mla[5] == f"{2 * (32 + 16 + 32) * 4:,}"
    assert "indexer 4 heads x 32, index_topk 32" in out
    # The floor: per layer the indexer reads every index key (and its logits once each way),
    # the attention only the 32 selected rows; 130 tokens cost the indexer's bytes for 130 -
    # 70 more tokens than 70 do, and the attention nothing more (memory-bound at this size).
    config = bench.deepseek_v32_config(**bench.TINY_INDEXER, **bench.TINY, layers=2)
    model = bench.build_model(config, torch.float32, "cpu")
    more = bench.floor_ms(model, 2, 130, config) - bench.floor_ms(model, 2, 70, config)
    assert more == pytest.approx(2 * 2 * 60 * (32 * 4 + 8) / 4246e9 * 1e3, rel=1e-9)
    fp8 = bench.floor_ms(model, 2, 130, config, cache_el=1)
    saved = 2 * 2 * (130 * (32 * 3 - 4) + 32 * 48 * 3) / 4246e9 * 1e3
    assert bench.floor_ms(model, 2, 130, config) - fp8 == pytest.approx(saved, rel=1e-9)
