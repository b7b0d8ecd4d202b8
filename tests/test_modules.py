"""MultiheadLatentAttention and MLACache against transformers' DeepSeek-V2/V3, in fp32 on the CPU.

Small random-weight models built from configs: DeepSeek-V3 (interleaved RoPE, with and without
YaRN; one variant with half-split RoPE and eager attention), DeepSeek-V2 (q_lora_rank None). The
swapped model's logits must match the original's at the prefill and at every decode step, with
requests of different lengths (left padding) and a shuffled block table, and greedy generate
must give the same tokens (up to a near-tie) and, teacher-forced on transformers' tokens, the same
logits at every step. Unwritten cache slots are NaN, so reading one shows.
"""

import copy
import subprocess
import sys
import types
import warnings

import expecttest
import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    DeepseekV2Config,
    DeepseekV3Config,
    LogitsProcessor,
    LogitsProcessorList,
)

from torch_mla.modules import (  # noqa: E402
    MLACache,
    MultiheadLatentAttention,
    generate_kwargs,
    swap_mla_attention,
)
from torch_mla.modules.rope import (  # noqa: E402
    MLARotaryEmbedding,
    apply_rope,
    half_angles,
    rope_parameters,
    softmax_scale,
)

# fp32 end to end: absorbed vs expanded attention differ only by summation order.
ATOL, RTOL = 2e-5, 2e-5
# Two paths within that tolerance (under 5e-4 for the |logits| < 20 of these models) order any two
# tokens alike whose logits are further apart than twice it: a greedy pick with a smaller top-2
# margin may go either way.
TIE = 1e-3
VOCAB = 256

COMMON = dict(
    vocab_size=VOCAB, hidden_size=96, intermediate_size=128, moe_intermediate_size=32,
    num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=6, n_routed_experts=4,
    n_shared_experts=1, num_experts_per_tok=2, kv_lora_rank=48, qk_rope_head_dim=16,
    qk_nope_head_dim=32, v_head_dim=24, pad_token_id=0, bos_token_id=1, eos_token_id=VOCAB + 1,
    max_position_embeddings=256,
    # Larger than the default 0.02 so that attention is far from uniform and RoPE matters.
    initializer_range=0.15,
)
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=8.0, original_max_position_embeddings=32,
            beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0)
KINDS = ["v3", "v3_yarn", "v3_halves_eager", "v2"]


def make_config(kind):
    if kind == "v2":
        return DeepseekV2Config(**COMMON, q_lora_rank=None, first_k_dense_replace=2)
    cfg = dict(COMMON, q_lora_rank=40, n_group=2, topk_group=1, first_k_dense_replace=1)
    if kind == "v3_yarn":
        cfg.update(rope_parameters=YARN, first_k_dense_replace=2)
    if kind == "v3_halves_eager":
        cfg.update(rope_interleave=False, first_k_dense_replace=2)
    config = DeepseekV3Config(**cfg)
    if kind == "v3_halves_eager":
        config._attn_implementation = "eager"
    return config


def hf_model(kind):
    return AutoModelForCausalLM.from_config(make_config(kind)).eval()


def swapped(hf):
    return swap_mla_attention(copy.deepcopy(hf))


def poison(cache):
    for kv in cache.kv_caches:
        kv.fill_(float("nan"))
    return cache


def poisoned_cache(model, max_batch, max_len):
    """A cache over a shuffled page order whose every slot holds NaN until written."""
    max_blocks = -(-max_len // 64)
    table = torch.randperm(max_batch * max_blocks + 3)[: max_batch * max_blocks]
    cache = MLACache.for_model(model, max_batch, max_len,
                               block_table=table.view(max_batch, max_blocks).int(),
                               num_blocks=max_batch * max_blocks + 3)
    return poison(cache)


def returned_cache(out):
    return out.cache if hasattr(out, "cache") else out.past_key_values


class ForceTokens(LogitsProcessor):
    """Teacher forcing for generate: step t picks ``tokens[:, t]``, whatever the logits (which
    ``output_logits`` still returns as the model gave them)."""

    def __init__(self, tokens, prompt_len):
        self.tokens, self.prompt_len = tokens, prompt_len

    def __call__(self, input_ids, scores):
        t = input_ids.shape[1] - self.prompt_len
        forced = torch.full_like(scores, float("-inf"))
        return forced.scatter_(1, self.tokens[:, t:t + 1].to(scores.device), 0.0)


def assert_greedy_matches(hf, ours, ids, cache, hf_kwargs=(), **kwargs):
    """Greedy ``generate`` of the swapped model on ``cache`` against transformers', both with
    ``kwargs`` (attention_mask, max_new_tokens, ...; ``hf_kwargs`` for transformers only). Strict
    wherever the tokens are decided, blind only to near-ties:

    - free-running, each request's tokens equal transformers' up to its first step whose top-2
      logit margin (transformers' own) is below TIE;
    - teacher-forced on transformers' tokens, every step's logits match within ATOL / RTOL.

    The cache is NaN-poisoned before each run. Returns transformers' sequences.
    """
    gen = dict(do_sample=False, output_logits=True, return_dict_in_generate=True, **kwargs)
    s = ids.shape[1]
    with torch.no_grad():
        ref = hf.generate(ids, **gen, **dict(hf_kwargs))
        tokens, logits = ref.sequences[:, s:], torch.stack(ref.logits, 1)  # [b, n], [b, n, V]
        out = ours.generate(ids, **gen, **generate_kwargs(ours, poison(cache)))
        forced = ours.generate(ids, logits_processor=LogitsProcessorList([ForceTokens(tokens, s)]),
                               **gen, **generate_kwargs(ours, poison(cache)))
    top2 = logits.topk(2, dim=-1).values
    tie = top2[..., 0] - top2[..., 1] < TIE  # [b, n]
    for r in range(ids.shape[0]):
        n = int(tie[r].nonzero()[0, 0]) if tie[r].any() else tokens.shape[1]
        assert torch.equal(out.sequences[r, s:s + n], tokens[r, :n]), f"request {r}"
    assert torch.equal(forced.sequences, ref.sequences)
    torch.testing.assert_close(torch.stack(forced.logits, 1), logits, atol=ATOL, rtol=RTOL)
    return ref.sequences


def left_padded_prompts(b, s, pads):
    ids = torch.randint(2, VOCAB, (b, s))
    mask = torch.ones(b, s, dtype=torch.long)
    for r, p in enumerate(pads):
        mask[r, :p] = 0
    return ids.masked_fill(mask == 0, 0), mask


# --- RoPE ------------------------------------------------------------------------------------------


def _rope_as_concatenation(x, cos, sin, interleave):
    """apply_rope's former form, transformers' arithmetic written as one concatenation."""
    half = x.shape[-1] // 2
    x1, x2 = (x[..., 0::2], x[..., 1::2]) if interleave else (x[..., :half], x[..., half:])
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("interleave", [True, False])
def test_rope_is_the_concatenated_form_bit_for_bit(interleave, device):
    """apply_rope computes each element as the concatenated form does, eager and compiled (on a
    GPU: Triton), for every dtype pair a model passes: the same bits for finite inputs, signed
    zeros and large values (a NaN's sign bit may differ: [-x2 | x1] negates first)."""
    torch._dynamo.reset()
    ours = torch.compile(apply_rope, fullgraph=True, dynamic=False)
    theirs = torch.compile(_rope_as_concatenation, fullgraph=True, dynamic=False)
    for x_dtype, a_dtype in [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                             (torch.float16, torch.float16), (torch.float32, torch.float32)]:
        x = (torch.randn(3, 16, 5, 192, device=device) * 30).to(x_dtype)[..., 128:]
        x[0, 0, 0, :4] = torch.tensor([0.0, -0.0, 6e4, -6e4])
        angles = torch.rand(3, 1, 5, 32, device=device) * 4096
        cos, sin = angles.cos().to(a_dtype), angles.sin().to(a_dtype)
        # Eager against eager, compiled against compiled (inductor keeps products in float32
        # where eager rounds them to x's dtype: both forms alike).
        for got, want in [(apply_rope(x, cos, sin, interleave),
                           _rope_as_concatenation(x, cos, sin, interleave)),
                          (ours(x, cos, sin, interleave), theirs(x, cos, sin, interleave))]:
            assert got.dtype == want.dtype == x_dtype
            bits = torch.int16 if x_dtype != torch.float32 else torch.int32
            assert torch.equal(got.view(bits), want.view(bits)), (x_dtype, a_dtype)


@pytest.mark.parametrize("kind", ["v3", "v3_yarn", "v2"])
def test_rope_and_softmax_scale_match_transformers(kind):
    hf = hf_model(kind)
    attn, config = hf.model.layers[0].self_attn, hf.config
    assert softmax_scale(config) == pytest.approx(attn.scaling, rel=1e-12)
    pos = torch.randint(0, config.max_position_embeddings, (3, 7))
    x = torch.zeros(3, 7, config.hidden_size)
    hf_pe = hf.model.rotary_emb(x, pos)
    cos, sin = half_angles(hf_pe, config.qk_rope_head_dim)
    own_cos, own_sin = MLARotaryEmbedding(config.qk_rope_head_dim, rope_parameters(config),
                                          config.max_position_embeddings)(pos)
    torch.testing.assert_close(own_cos, cos.float(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(own_sin, sin.float(), atol=1e-6, rtol=1e-6)

    # The rotation itself, against transformers' functions on [b, heads, s, d] tensors.
    mod = sys.modules[type(attn).__module__]
    q = torch.randn(3, 4, 7, config.qk_rope_head_dim)
    k = torch.randn(3, 1, 7, config.qk_rope_head_dim)
    ours_q = apply_rope(q, cos[:, None], sin[:, None], interleave=True)
    ours_k = apply_rope(k, cos[:, None], sin[:, None], interleave=True)
    if kind == "v2":
        ref_q, ref_k = mod.apply_rotary_emb(q, k, hf_pe)
        # V2 keeps the pairs interleaved; this module writes them as [a | b] (same dot products).
        ref_q = torch.cat([ref_q[..., 0::2], ref_q[..., 1::2]], -1)
        ref_k = torch.cat([ref_k[..., 0::2], ref_k[..., 1::2]], -1)
    else:
        ref_q, ref_k = mod.apply_rotary_pos_emb_interleave(q, k, *hf_pe)
        halves_q, halves_k = mod.apply_rotary_pos_emb(q, k, *hf_pe)
        torch.testing.assert_close(apply_rope(q, cos[:, None], sin[:, None], False), halves_q)
        torch.testing.assert_close(apply_rope(k, cos[:, None], sin[:, None], False), halves_k)
    torch.testing.assert_close(ours_q, ref_q)
    torch.testing.assert_close(ours_k, ref_k)


# --- the module on its own ---------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["v3", "v2"])
def test_module_loads_state_dict_and_matches_attention(kind):
    hf = hf_model(kind)
    attn, config = hf.model.layers[1].self_attn, hf.config
    ours = MultiheadLatentAttention(config, layer_idx=1)
    ref_sd, our_sd = attn.state_dict(), ours.state_dict()
    assert {k: v.shape for k, v in our_sd.items()} == {k: v.shape for k, v in ref_sd.items()}
    ours.load_state_dict(ref_sd, strict=True)

    x = torch.randn(2, 9, config.hidden_size)
    pos = torch.arange(9).expand(2, -1)
    pe = hf.model.rotary_emb(x, pos)
    causal = torch.ones(9, 9, dtype=torch.bool).tril()[None, None].expand(2, 1, 9, 9)
    ref, _ = attn(hidden_states=x, position_embeddings=pe, attention_mask=causal)
    out, weights = ours(hidden_states=x, position_embeddings=pe, attention_mask=causal)
    assert weights is None
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)
    # Without the model's angles: its own RoPE from position_ids, and causality from no mask.
    out_own, _ = ours(x, position_ids=pos)
    torch.testing.assert_close(out_own, ref, atol=ATOL, rtol=RTOL)


# --- swapped model vs transformers --------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_transformers_prefill_and_every_decode_step(kind):
    hf = hf_model(kind)
    ours = swapped(hf)
    b, s = 3, 21
    ids, mask = left_padded_prompts(b, s, pads=(0, 5, 13))
    cache = poisoned_cache(ours, max_batch=4, max_len=s + 40)  # batch below the cache's maximum
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask, use_cache=True)
        out = ours(ids, attention_mask=mask, use_cache=True, **generate_kwargs(ours, cache))
        real = mask.bool()
        torch.testing.assert_close(out.logits[real], ref.logits[real], atol=ATOL, rtol=RTOL)
        # Padding never reaches the cache: each request holds its real tokens only.
        assert cache.cache_seqlens.tolist() == [21, 16, 8, 0]
        hf_cache = returned_cache(ref)
        lens = mask.sum(1)
        # Decode steps of 1 token, then 3 at once (causal among themselves), then 1.
        for n_new in (1, 1, 3, 1, 2):
            new = torch.randint(2, VOCAB, (b, n_new))
            mask = torch.cat([mask, torch.ones(b, n_new, dtype=torch.long)], 1)
            pos = lens[:, None] + torch.arange(n_new)
            assert torch.equal(cache.position_ids(b, n_new), pos)
            r = hf(new, attention_mask=mask, position_ids=pos, use_cache=True,
                   **generate_kwargs(hf, hf_cache))
            o = ours(new, attention_mask=mask, position_ids=pos, use_cache=True,
                     **generate_kwargs(ours, cache))
            torch.testing.assert_close(o.logits, r.logits, atol=ATOL, rtol=RTOL)
            lens = lens + n_new
            assert cache.cache_seqlens[:b].tolist() == lens.tolist()
        if kind == "v3":
            # The comparison has teeth: one position off changes the logits far past tolerance.
            o = ours(new[:, :1], position_ids=cache.position_ids(b, 1) + 1, use_cache=True,
                     **generate_kwargs(ours, copy.deepcopy(cache)))
            r = hf(new[:, :1], position_ids=cache.position_ids(b, 1),
                   attention_mask=torch.cat([mask, torch.ones(b, 1, dtype=torch.long)], 1),
                   use_cache=True, **generate_kwargs(hf, hf_cache))
            assert (o.logits - r.logits).abs().max() > 100 * ATOL


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_generate_matches_transformers(kind):
    hf = hf_model(kind)
    ours = swapped(hf)
    ids, mask = left_padded_prompts(3, 12, pads=(0, 3, 8))
    cache = poisoned_cache(ours, max_batch=3, max_len=12 + 16)
    ref = assert_greedy_matches(hf, ours, ids, cache, attention_mask=mask, max_new_tokens=16)
    assert ref.shape == (3, 28)
    assert len(set(ref[:, 12:].flatten().tolist())) > 8  # not a degenerate repetition
    # The last generated token is not fed back: 15 decode steps after the prompts.
    assert cache.cache_seqlens.tolist() == [12 + 15, 9 + 15, 4 + 15]


@pytest.mark.parametrize("kind", KINDS)
def test_chunked_prefill_with_padding_past_the_first_chunk(kind):
    # Chunks of 4: request 1's padding fills two chunks and part of a third, request 2's four.
    # Every chunk after the first is a decode step that must store only the real tokens.
    hf = hf_model(kind)
    ours = swapped(hf)
    ids, mask = left_padded_prompts(3, 21, pads=(0, 9, 17))
    cache = poisoned_cache(ours, max_batch=3, max_len=21 + 10)
    assert_greedy_matches(hf, ours, ids, cache, attention_mask=mask, max_new_tokens=10,
                          prefill_chunk_size=4)
    assert cache.cache_seqlens.tolist() == [21 + 9, 12 + 9, 4 + 9]


@pytest.mark.parametrize("kind", ["v3", "v3_halves_eager", "v2"])
def test_bf16_without_mla_cache_is_transformers_bit_for_bit(kind):
    # Without an MLACache the module runs transformers' own operations in its dtypes (RoPE in
    # bf16 from bf16 angles for V3, in fp32 complex for V2; its eager or SDPA attention; its
    # layouts), so the bound is zero. Anything else shows: in "v3" one bf16 step in one layer's
    # attention (RoPE rounded in fp32) sends tokens to other experts and moved logits by 4.9.
    hf = hf_model(kind).to(torch.bfloat16)
    ours = swapped(hf)
    ids, mask = left_padded_prompts(3, 12, pads=(0, 3, 8))
    gen = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, output_logits=True,
               return_dict_in_generate=True)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the swapped model on transformers' DynamicCache
        ref, out = hf.generate(ids, **gen), ours.generate(ids, **gen)
        assert torch.equal(ours(ids, attention_mask=mask).logits, hf(ids, attention_mask=mask).logits)
    assert torch.equal(out.sequences, ref.sequences)
    assert torch.equal(torch.stack(out.logits), torch.stack(ref.logits))


def test_generate_on_a_used_cache_starts_fresh_or_continues_as_transformers():
    hf = hf_model("v3")
    ours = swapped(hf)
    cache = poisoned_cache(ours, max_batch=2, max_len=64)
    ids, mask = left_padded_prompts(2, 10, pads=(0, 3))
    first = assert_greedy_matches(hf, ours, ids, cache, attention_mask=mask, max_new_tokens=6)
    # New prompts on the same cache, no reset: longer, then shorter than what it holds.
    for s in (30, 8):
        ids, mask = left_padded_prompts(2, s, pads=(0, 2))
        assert_greedy_matches(hf, ours, ids, cache, attention_mask=mask, max_new_tokens=5)
    # Continuing a sequence, transformers' way: the whole sequence again, with its cache.
    ids, mask = left_padded_prompts(2, 10, pads=(0, 3))
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                          return_dict_in_generate=True)
    more = torch.randint(2, VOCAB, (2, 3))
    full = torch.cat([out.sequences, more], 1)
    mask = torch.cat([mask, torch.ones(2, 9, dtype=torch.long)], 1)
    hf_cache = returned_cache(out)
    assert_greedy_matches(hf, ours, full, cache, attention_mask=mask, max_new_tokens=5,
                          hf_kwargs=generate_kwargs(hf, hf_cache))
    assert first.shape == (2, 16) and cache.cache_seqlens.tolist() == [19 + 4, 16 + 4]


def test_other_transformers_cache_falls_back_to_unabsorbed_attention():
    hf = hf_model("v3")
    ours = swapped(hf)
    ids = torch.randint(2, VOCAB, (2, 10))
    with torch.no_grad():
        ref = hf.generate(ids, max_new_tokens=6, do_sample=False)
        with pytest.warns(UserWarning, match="Pass a torch_mla.modules.MLACache"):
            import torch_mla.modules.attention as attention_module

            attention_module._warned_foreign_cache = False
            out = ours.generate(ids, max_new_tokens=6, do_sample=False)  # a DynamicCache
    assert torch.equal(out, ref)


def test_cache_bytes_per_token():
    hf = hf_model("v3")
    ours = swapped(hf)
    cache = MLACache.for_model(ours, 2, 100)
    # One latent row per token per layer: kv_lora_rank + qk_rope_head_dim fp32 values.
    assert cache.kv_bytes_per_token_per_layer == (48 + 16) * 4
    assert cache.kv_bytes_per_token == (48 + 16) * 4 * 2
    assert cache.nbytes == 2 * (2 * 2 * 64) * (48 + 16) * 4  # 2 layers x 2 requests x 2 pages
    # transformers (>= 5.15) also caches the latent, so the bytes per token are the same; what
    # the swap saves is the per-head K/V it expands at every step (h x (qk + v) per token).
    ids = torch.randint(2, VOCAB, (2, 10))
    with torch.no_grad():
        hf_cache = returned_cache(hf(ids, use_cache=True))
    hf_bytes = sum(t.numel() * t.element_size() for layer in hf_cache.layers
                   for t in (layer.keys, layer.values))
    assert hf_bytes / (2 * 10) == cache.kv_bytes_per_token
    bf16 = MLACache(hf.config, 1, 64, dtype=torch.bfloat16)
    assert bf16.kv_bytes_per_token_per_layer == (48 + 16) * 2


def test_cache_dtype_defaults_to_torch_default_dtype():
    config = make_config("v3")
    old = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.bfloat16)
        assert MLACache(config, 1, 64).kv_caches[0].dtype == torch.bfloat16
    finally:
        torch.set_default_dtype(old)
    assert MLACache(config, 1, 64).dtype == old
    assert MLACache(config, 1, 64, dtype=torch.float16).kv_caches[1].dtype == torch.float16


def test_fp32_cache_on_a_gpu_warns_once():
    import torch_mla.modules.cache as cache_module

    config = make_config("v3")
    cache_module._warned_fp32_on_gpu = False
    with pytest.warns(UserWarning) as record:
        for _ in range(2):
            try:
                MLACache(config, 1, 64, device="cuda", dtype=torch.float32)
            except (AssertionError, RuntimeError):
                if torch.cuda.is_available():
                    raise
                # no GPU here: the buffers cannot be allocated, the warning came before
        MLACache(config, 1, 64, device="cpu", dtype=torch.float32)
    assert [str(w.message) for w in record] == [
        "MLACache in float32 on a CUDA device: torch_mla's GPU kernel takes bfloat16 or float16, "
        "so every decode step runs the slow reference path. Build the cache in the model's dtype "
        "(MLACache.for_model(model, ...) reads it, or pass dtype=)"]


# --- every transformers MLA family --------------------------------------------------------------

# Families whose attention is DeepSeek-V2/V3's under another name, as tiny random models (the same
# fields for all; a family ignores those it does not have). kimi_k25 is multimodal: its text model
# (a DeepseekV3Config), the part swap_mla_attention changes.
FAMILIES = ["glm4_moe_lite", "youtu", "axk1", "minicpm3", "sarvam_mla", "kimi_k25"]
FAMILY_CONFIG = dict(COMMON, q_lora_rank=40, n_group=1, topk_group=1)


def family_config(family, **overrides):
    fields = dict(FAMILY_CONFIG, **overrides)
    if family == "kimi_k25":
        return AutoConfig.for_model(family, text_config=dict(fields, model_type="deepseek_v3"))
    return AutoConfig.for_model(family, **fields)


def family_model(family):
    config = family_config(family).get_text_config()
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("family", FAMILIES)
def test_every_mla_family_swaps_and_matches_transformers(family):
    hf = family_model(family)
    ours = swapped(hf)
    attns = [m for m in ours.modules() if isinstance(m, MultiheadLatentAttention)]
    assert len(attns) == hf.config.num_hidden_layers
    # MiniCPM3 rotates in halves (its config has no rope_interleave): pairing the dimensions
    # interleaved instead changes its logits by about 4.
    assert attns[0].rope_interleave == (family != "minicpm3")
    ids, mask = left_padded_prompts(3, 12, pads=(0, 3, 8))
    gen = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, output_logits=True,
               return_dict_in_generate=True)
    cache = poisoned_cache(ours, max_batch=3, max_len=12 + 8)
    with torch.no_grad():
        ref = hf.generate(ids, **gen)
        out = ours.generate(ids, **gen, **generate_kwargs(ours, cache))
    assert torch.equal(out.sequences, ref.sequences)
    torch.testing.assert_close(torch.stack(out.logits, 1), torch.stack(ref.logits, 1),
                               atol=1e-4, rtol=0)


class TestEveryMLAFamily(expecttest.TestCase):
    def test_what_swap_mla_attention_does_with_each_family(self):
        # Every transformers 5.24 model with kv_lora_rank whose tiny config builds, on the meta
        # device (no weights: the decision reads only the structure and the config).
        families = ["deepseek_v2", "deepseek_v3", *FAMILIES, "mistral4", "longcat_flash",
                    "kimi_linear", "bailing_hybrid", "deepseek_v32", "glm_moe_dsa", "axk2",
                    "hy_v4", "mistral_large4", "deepseek_v4"]
        lines = []
        for family in families:
            # The hybrids' first layer as an MLA one (by default their first layers are linear).
            extra = dict(layer_types=["full_attention", "linear_attention"]) \
                if family in ("kimi_linear", "bailing_hybrid") else {}
            with torch.device("meta"):
                model = AutoModel.from_config(family_config(family, **extra))
            try:
                swap_mla_attention(model)
                n = sum(isinstance(m, MultiheadLatentAttention) for m in model.modules())
                lines.append(f"{family}: swapped {n}")
            except ValueError as e:
                lines.append(f"{family}: {e}")
        self.assertExpectedInline("\n".join(lines), """\
deepseek_v2: swapped 2
deepseek_v3: swapped 2
glm4_moe_lite: swapped 2
youtu: swapped 2
axk1: swapped 2
minicpm3: swapped 2
sarvam_mla: swapped 2
kimi_k25: swapped 2
mistral4: layers.0.self_attn (Mistral4Attention) is not DeepSeek-V2/V3's attention: it scales its queries by position (rope_parameters['llama_4_scaling_beta'] = 0.1, Mistral 4's Llama-4 scaling). MultiheadLatentAttention would compute something else, so nothing was swapped
longcat_flash: layers.0.self_attn.0 (LongcatFlashMLA) is not DeepSeek-V2/V3's attention: it has attributes DeepSeek-V2/V3's attention does not have (mla_scale_kv_lora, mla_scale_q_lora), which may change its forward. MultiheadLatentAttention would compute something else, so nothing was swapped
kimi_linear: layers.0.self_attn (KimiLinearAttention) is not DeepSeek-V2/V3's attention: its forward takes no position_embeddings: it applies no RoPE from the model. MultiheadLatentAttention would compute something else, so nothing was swapped
bailing_hybrid: layers.0.self_attn (BailingHybridAttention) is not DeepSeek-V2/V3's attention: it has submodules DeepSeek-V2/V3's attention does not have (g_proj): they take part in its forward. MultiheadLatentAttention would compute something else, so nothing was swapped
deepseek_v32: swapped 2
glm_moe_dsa: swapped 2
axk2: layers.0.self_attn (AXK2Attention) is not DeepSeek-V3.2's attention: it has submodules DeepSeek-V3.2's attention does not have (q_gate_proj): they take part in its forward. SparseMultiheadLatentAttention would compute something else, so nothing was swapped
hy_v4: layers.0.self_attn (HYV4Attention) is not DeepSeek-V3.2's attention: it has submodules DeepSeek-V3.2's attention does not have (gate_proj): they take part in its forward. SparseMultiheadLatentAttention would compute something else, so nothing was swapped
mistral_large4: language_model.layers.0.self_attn (MistralLarge4TextAttention) is not DeepSeek-V3.2's attention: it has submodules DeepSeek-V3.2's attention does not have (softmax_scaling): they take part in its forward. SparseMultiheadLatentAttention would compute something else, so nothing was swapped
deepseek_v4: DeepseekV4Model has no MLA attention to swap (a module with kv_a_proj_with_mqa and kv_b_proj, as DeepSeek-V2/V3's)""")


# --- a model split over devices (device_map) -----------------------------------------------------


def test_cache_follows_each_layers_device():
    # Layer 1's attention on the meta device stands for a second GPU: the cache must put that
    # layer's buffers, block table, lengths and schedule there, and layer 0's where layer 0 is.
    # (A model with layers on cpu and meta cannot run; the cache's step can, on fake latents.)
    ours = swapped(hf_model("v3"))
    ours.model.layers[1].self_attn.to("meta")
    cache = MLACache.for_model(ours, 2, 70)
    cpu, meta = torch.device("cpu"), torch.device("meta")
    assert cache.layer_devices == [cpu, meta]
    assert [kv.device for kv in cache.kv_caches] == [cpu, meta]
    for s in (5, 1, 2):  # the prefill, then decode steps
        for layer, device in enumerate(cache.layer_devices):
            prefill = cache.begin_layer(layer, 2, s)
            step = cache.append_latents(layer, torch.randn(2, s, 48, device=device),
                                        torch.randn(2, s, 16, device=device), num_heads=6)
            assert prefill == (s == 5) and step.prefill == prefill
            tensors = [step.kv_cache, step.block_table, step.cache_seqlens,
                       *(step.schedule or ())]
            assert {t.device for t in tensors} == {device}, (s, layer)
    assert cache.cache_seqlens.tolist() == [8, 8]
    # Where accelerate offloads a layer (weights on the CPU or meta, moved in by a hook at each
    # call), the layer's device is its hook's execution device.
    ours.model.layers[1].self_attn.to_empty(device="cpu")
    ours.model.layers[1]._hf_hook = types.SimpleNamespace(execution_device="meta")
    assert MLACache.for_model(ours, 2, 70).layer_devices == [cpu, meta]


def test_split_cache_mirrors_lengths_and_schedule_and_matches_transformers():
    # "cpu" and "cpu:0" are different torch.device values for the same memory: a cache built
    # for them keeps a second block table, lengths and schedule for layer 1, filled once a step
    # from layer 0's, as for a layer on cuda:1. Stale lengths or a stale schedule there would
    # change the logits.
    hf = hf_model("v3_yarn")
    ours = swapped(hf)
    ids, mask = left_padded_prompts(3, 12, pads=(0, 3, 8))
    cache = poison(MLACache(hf.config, 3, 12 + 10, device=["cpu", "cpu:0"]))
    assert cache._seqlens[1].data_ptr() != cache.cache_seqlens.data_ptr()
    assert_greedy_matches(hf, ours, ids, cache, attention_mask=mask, max_new_tokens=10)
    assert cache._seqlens[1].tolist() == cache.cache_seqlens.tolist() == [12 + 9, 9 + 9, 4 + 9]
    with pytest.raises(ValueError, match="one per layer, 2 layers, got 3 devices"):
        MLACache(hf.config, 1, 64, device=["cpu"] * 3)


@pytest.mark.cuda
@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_split_over_two_gpus(tmp_path, dtype):
    # transformers dispatches a device_map over several devices with accelerate's hooks.
    pytest.importorskip("accelerate")
    hf_model("v3_yarn").save_pretrained(tmp_path)  # dense MLPs: no atomics in a MoE scatter
    device_map = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": 0,
                  "model.layers.1": 1, "model.norm": 1, "lm_head": 1}

    def load(device_map):
        return AutoModelForCausalLM.from_pretrained(tmp_path, device_map=device_map,
                                                    dtype=dtype).eval()

    hf, ours = load(device_map), swap_mla_attention(load(device_map))
    gpu0, gpu1 = torch.device("cuda", 0), torch.device("cuda", 1)
    assert ours.model.layers[1].self_attn.kv_b_proj.weight.device == gpu1
    ids, mask = left_padded_prompts(3, 12, pads=(0, 3, 8))
    ids, mask = ids.to(gpu0), mask.to(gpu0)
    cache = MLACache.for_model(ours, 3, 12 + 16)
    assert cache.layer_devices == [gpu0, gpu1]
    assert [kv.device for kv in cache.kv_caches] == [gpu0, gpu1]
    if dtype == torch.float32:  # the reference decode: transformers' tokens and logits
        assert_greedy_matches(hf, ours, ids, cache, attention_mask=mask, max_new_tokens=16)
        return
    # bf16, the GPU kernel on each layer's own device: the same model on one GPU runs the same
    # operations on the same kind of GPU, so its tokens and logits are the split model's (the
    # bound is under one bf16 step at these logits).
    one = swap_mla_attention(load({"": 0}))
    gen = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, output_logits=True,
               return_dict_in_generate=True)
    with torch.no_grad():
        split = ours.generate(ids, **gen, **generate_kwargs(ours, poison(cache)))
        single = one.generate(ids, **gen, **generate_kwargs(
            one, poison(MLACache.for_model(one, 3, 12 + 16))))
    assert torch.equal(split.sequences.cpu(), single.sequences.cpu())
    torch.testing.assert_close(torch.stack(split.logits, 1).cpu(),
                               torch.stack(single.logits, 1).cpu(), atol=1e-2, rtol=0)


def test_swap_shares_weights_and_keeps_state_dict_keys():
    hf = hf_model("v3")
    before = {k: v.data_ptr() for k, v in hf.state_dict().items()}
    out = swap_mla_attention(hf)
    assert out is hf
    assert all(isinstance(layer.self_attn, MultiheadLatentAttention) for layer in hf.model.layers)
    assert {k: v.data_ptr() for k, v in hf.state_dict().items()} == before
    assert swap_mla_attention(hf) is hf  # already swapped: nothing to do


class TestRefusals(expecttest.TestCase):
    def test_not_a_deepseek_model(self):
        with self.assertRaises(ValueError) as e:
            swap_mla_attention(nn.Sequential(nn.Linear(4, 4)))
        self.assertExpectedInline(str(e.exception), """Sequential has no MLA attention to swap (a module with kv_a_proj_with_mqa and kv_b_proj, as DeepSeek-V2/V3's)""")

    def test_attention_that_differs_from_deepseeks(self):
        # DeepSeek-V3's attention, changed in one layer as other families change it.
        def changed(change):
            hf = hf_model("v3")
            change(hf.model.layers[1].self_attn)
            with self.assertRaises(ValueError) as e:
                swap_mla_attention(hf)
            assert not any(isinstance(m, MultiheadLatentAttention) for m in hf.modules())
            return str(e.exception)

        gate = changed(lambda a: setattr(a, "g_proj", nn.Linear(96, 6)))
        self.assertExpectedInline(gate, """model.layers.1.self_attn (DeepseekV3Attention) is not DeepSeek-V2/V3's attention: it has submodules DeepSeek-V2/V3's attention does not have (g_proj): they take part in its forward. MultiheadLatentAttention would compute something else, so nothing was swapped""")
        field = changed(lambda a: setattr(a, "kv_lora_rank", 32))
        self.assertExpectedInline(field, """model.layers.1.self_attn (DeepseekV3Attention) is not DeepSeek-V2/V3's attention: its kv_lora_rank is 32 but its config's is 48. MultiheadLatentAttention would compute something else, so nothing was swapped""")
        shape = changed(lambda a: setattr(a, "o_proj", nn.Linear(6 * 20, 96)))
        self.assertExpectedInline(shape, """model.layers.1.self_attn (DeepseekV3Attention) is not DeepSeek-V2/V3's attention: its o_proj.in_features is 120, not the 144 its config's dimensions give. MultiheadLatentAttention would compute something else, so nothing was swapped""")

    def test_output_attentions(self):
        ours = swapped(hf_model("v3"))
        with self.assertRaises(NotImplementedError) as e, torch.no_grad():
            ours(torch.randint(2, VOCAB, (1, 4)), output_attentions=True)
        self.assertExpectedInline(str(e.exception), """output_attentions=True: MultiheadLatentAttention returns no attention weights (a decode step attends over the latent cache in torch_mla.mla_decode, which never forms them); run the model without swap_mla_attention to see them""")

    def test_quantized_projection(self):
        hf = hf_model("v3")
        hf.model.layers[1].self_attn.kv_b_proj.weight.data = \
            hf.model.layers[1].self_attn.kv_b_proj.weight.data.to(torch.float8_e4m3fn)
        with self.assertRaises(NotImplementedError) as e:
            swap_mla_attention(hf)
        self.assertExpectedInline(str(e.exception), """model.layers.1.self_attn.kv_b_proj is a Linear with torch.float8_e4m3fn weights; swap_mla_attention needs plain nn.Linear layers in fp32/bf16/fp16 (the decode path multiplies kv_b_proj.weight into the query and the output). Load or dequantize the model in bf16 first""")
        assert not any(isinstance(m, MultiheadLatentAttention) for m in hf.modules())

    def test_flex_attention(self):
        hf = hf_model("v3")
        hf.config._attn_implementation = "flex_attention"
        with self.assertRaises(NotImplementedError) as e:
            swap_mla_attention(hf)
        self.assertExpectedInline(str(e.exception), """the model uses attn_implementation='flex_attention', whose masks MultiheadLatentAttention cannot read; load it with attn_implementation='sdpa' or 'eager'""")

    def test_cache_given_to_unswapped_model(self):
        hf = hf_model("v3")
        cache = MLACache.for_model(hf, 1, 64)
        with self.assertRaises(TypeError) as e, torch.no_grad():
            hf(torch.randint(2, VOCAB, (1, 4)), use_cache=True, **generate_kwargs(hf, cache))
        self.assertExpectedInline(str(e.exception), """MLACache stores latents for torch_mla.modules.MultiheadLatentAttention; this model still has transformers' attention. Call torch_mla.modules.swap_mla_attention(model) first""")

    def test_batch_larger_than_cache(self):
        ours = swapped(hf_model("v3"))
        cache = MLACache.for_model(ours, 2, 64)
        with self.assertRaises(ValueError) as e, torch.no_grad():
            ours(torch.randint(2, VOCAB, (3, 4)), **generate_kwargs(ours, cache))
        self.assertExpectedInline(str(e.exception), """batch of 3 requests, but the cache was built for max_batch_size=2""")

    def test_cache_full(self):
        ours = swapped(hf_model("v3"))
        cache = MLACache.for_model(ours, 1, 6)
        with torch.no_grad():
            ours(torch.randint(2, VOCAB, (1, 4)), **generate_kwargs(ours, cache))
            ours(torch.randint(2, VOCAB, (1, 2)), **generate_kwargs(ours, cache))
            with self.assertRaises(ValueError) as e:
                ours(torch.randint(2, VOCAB, (1, 1)), **generate_kwargs(ours, cache))
        self.assertExpectedInline(str(e.exception), """MLACache is full: 7 positions (padding included) would exceed max_cache_len=6; build a larger cache""")
        assert cache.cache_seqlens.tolist() == [6]

    def test_set_seqlens_past_max_cache_len(self):
        cache = MLACache(make_config("v3"), 2, 70)  # 2 pages a request: room for 128 tokens
        with self.assertRaises(ValueError) as e:
            cache.set_seqlens(torch.tensor([71, 3], dtype=torch.int32))
        self.assertExpectedInline(str(e.exception), """2 requests of up to 71 tokens do not fit a cache of 2 x 70""")

    def test_zero_new_tokens(self):
        ours = swapped(hf_model("v3"))
        cache = MLACache.for_model(ours, 2, 64)
        with self.assertRaises(ValueError) as e, torch.no_grad():
            ours(torch.randint(2, VOCAB, (2, 5)), **generate_kwargs(ours, cache))
            ours(torch.randint(2, VOCAB, (2, 0)), **generate_kwargs(ours, cache))
        self.assertExpectedInline(str(e.exception), """MLACache got a forward with 0 new tokens: the cache already holds this input (generate passes only the tokens past cache.get_seq_length()); call cache.reset() before starting a new sequence""")

    def test_padding_after_a_real_token_in_a_decode_step(self):
        ours = swapped(hf_model("v3"))
        cache = MLACache.for_model(ours, 2, 64)
        mask = torch.ones(2, 8, dtype=torch.long)
        mask[1, 6] = 0  # request 1's new tokens: real, padding, real
        with self.assertRaises(ValueError) as e, torch.no_grad():
            ours(torch.randint(2, VOCAB, (2, 5)), **generate_kwargs(ours, cache))
            ours(torch.randint(2, VOCAB, (2, 3)), attention_mask=mask,
                 position_ids=cache.position_ids(2, 3), **generate_kwargs(ours, cache))
        self.assertExpectedInline(str(e.exception), """a padding token follows a real token in the same step of request 1: MLACache stores a step's real tokens in order and attends causally, which needs the padding first (left padding: a tokenizer with padding_side='left')""")
        assert cache.cache_seqlens.tolist() == [5, 5]  # raised before anything was written

    def test_beam_search(self):
        ours = swapped(hf_model("v3"))
        cache = MLACache.for_model(ours, 4, 64)
        with self.assertRaises(NotImplementedError) as e, torch.no_grad():
            ours.generate(torch.randint(2, VOCAB, (2, 4)), num_beams=2, max_new_tokens=3,
                          do_sample=False, **generate_kwargs(ours, cache))
        assert "MLACache does not support" in str(e.exception)


def test_import_torch_mla_does_not_import_transformers():
    code = "import sys, torch_mla; assert 'transformers' not in sys.modules, 'imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


WITHOUT_TRANSFORMERS = """
import sys, types
sys.modules["transformers"] = None  # import transformers now raises ImportError
import torch
from torch_mla.modules import MLACache, MultiheadLatentAttention
torch.manual_seed(0)
cfg = types.SimpleNamespace(
    hidden_size=64, num_attention_heads=4, q_lora_rank=None, kv_lora_rank=32,
    qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, num_hidden_layers=1,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, max_position_embeddings=128)
attn = MultiheadLatentAttention(cfg, layer_idx=0)
for p in attn.parameters():
    torch.nn.init.normal_(p, std=0.3)
x = torch.randn(2, 12, 64)
pos = torch.arange(12).expand(2, -1)
full, _ = attn(x, position_ids=pos)  # causal attention over all 12 tokens, no cache
cache = MLACache(cfg, 2, 64)
outs = [attn(x[:, :8], position_ids=pos[:, :8], past_key_values=cache)[0]]  # prefill
for a, b in ((8, 10), (10, 11), (11, 12)):  # decode steps of 2, 1, 1 tokens
    outs.append(attn(x[:, a:b], position_ids=cache.position_ids(2, b - a),
                     past_key_values=cache)[0])
torch.testing.assert_close(torch.cat(outs, 1), full, atol=1e-5, rtol=1e-5)
assert cache.cache_seqlens.tolist() == [12, 12]
assert "transformers" not in type(cache).__mro__[1].__module__
"""


def test_module_and_cache_work_without_transformers():
    subprocess.run([sys.executable, "-c", WITHOUT_TRANSFORMERS], check=True)
