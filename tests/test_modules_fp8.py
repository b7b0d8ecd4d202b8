"""The FP8 latent cache in the Hugging Face module (issue 13): MLACache(dtype=float8_e4m3fn).

fp32 tiny DeepSeek models on the CPU (the decode takes the reference path over the dequantized
cache). What must hold: the fp8 cache stores exactly ``quantize_fp8(latent, scale)``; the scale is
amax / 448 of the prefill's stored latents (padding excluded) or the given one; the logits differ
from the unquantized cache's by the storage error and by nothing else (an fp32 cache fed the
quantized-then-dequantized latents gives the fp8 run's logits); the decode step compiles to one
graph that a new prefill's scale does not recompile; the bytes per token halve.
"""

from unittest import mock

import expecttest
import pytest
import torch

pytest.importorskip("transformers")

from test_modules import (  # noqa: E402
    ATOL,
    RTOL,
    VOCAB,
    ForceTokens,
    hf_model,
    left_padded_prompts,
    poison,
    swapped,
)
from transformers import LogitsProcessorList  # noqa: E402

import torch_mla.modules.cache as cache_module  # noqa: E402
from torch_mla.modules import MLACache, generate_kwargs  # noqa: E402
from torch_mla.reference import dequantize_fp8, quantize_fp8  # noqa: E402

FP8 = torch.float8_e4m3fn
R, DR = 48, 16  # the test models' kv_lora_rank, qk_rope_head_dim


def stored_rows(cache, layer, b):
    """[tokens, R + DR] of the rows request 0..b-1 hold (default block table), in order."""
    kv = cache.kv_caches[layer].view(cache.max_batch_size, -1, R + DR)
    return torch.cat([kv[r, :int(cache.cache_seqlens[r])] for r in range(b)])


def generate(model, ids, mask, cache, new_tokens, force=None):
    """Greedy (or teacher-forced on ``force`` [b, new_tokens]) generate: (sequences, logits
    [b, new_tokens, vocab])."""
    procs = LogitsProcessorList([ForceTokens(force, ids.shape[1])] if force is not None else [])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens,
                             do_sample=False, output_logits=True, return_dict_in_generate=True,
                             logits_processor=procs, **generate_kwargs(model, cache))
    return out.sequences, torch.stack(out.logits, 1)


def test_fp8_logits_differ_from_the_unquantized_cache_by_the_storage_error_alone(monkeypatch):
    # Dense layers (v3_yarn): with experts, one rounding can route a token elsewhere and the
    # difference is no longer the storage error's.
    hf = hf_model("v3_yarn")
    ours = swapped(hf)
    b, s, n = 3, 12, 12
    ids, mask = left_padded_prompts(b, s, pads=(0, 3, 8))
    tokens, exact = generate(ours, ids, mask, poison(MLACache.for_model(ours, b, s + n)), n)
    fp8 = poison(MLACache.for_model(ours, b, s + n, dtype=FP8))
    _, logits = generate(ours, ids, mask, fp8, n, force=tokens[:, s:])
    # Step 1 is the prefill's: attention over the prompt's own (unquantized) latents.
    assert torch.equal(logits[:, 0], exact[:, 0])
    rel = [float((logits[:, t] - exact[:, t]).norm() / exact[:, t].norm()) for t in range(1, n)]
    # Each cached latent is off by up to 1/16 of itself (e4m3's 3 mantissa bits): the attention
    # over the cache by e_store, 2-7e-2 relative (tests/test_fp8.py), and these two-layer models
    # pass that on to the logits at 1-2x (measured over 8 seeds of v3_yarn and v2: 5e-2 to 0.124
    # per step). An fp32 cache differs from the absorbed fp32 math by ~1e-6, so 1e-2 is only
    # reached by quantizing.
    assert all(1e-2 < e < 0.2 for e in rel), rel
    agree = (logits.argmax(-1) == exact.argmax(-1)).float().mean()
    assert agree >= 0.75, agree  # measured 0.89-0.94

    # Nothing but the storage: an fp32 cache whose append writes the quantized-then-dequantized
    # latents (the fp8 run's scales) gives the fp8 run's logits.
    scales = [t.clone() for t in fp8.kv_scales]
    qdq = poison(MLACache.for_model(ours, b, s + n))
    real_append = cache_module.append_kv

    def append_dequantized(kv, kv_c, k_pe, slots, kv_scale=None):
        scale = scales[next(i for i, t in enumerate(qdq.kv_caches) if t is kv)]
        row = dequantize_fp8(quantize_fp8(torch.cat([kv_c, k_pe], -1), scale), scale)
        real_append(kv, row[:, :R], row[:, R:], slots)

    monkeypatch.setattr(cache_module, "append_kv", append_dequantized)
    _, simulated = generate(ours, ids, mask, qdq, n, force=tokens[:, s:])
    torch.testing.assert_close(logits, simulated, atol=ATOL, rtol=RTOL)


def test_fp8_auto_scale_is_amax_over_448_of_the_stored_prefill_latents():
    hf = hf_model("v3_yarn")
    ours = swapped(hf)
    b, s = 3, 10
    ids, mask = left_padded_prompts(b, s, pads=(0, 4, 7))
    exact = MLACache.for_model(ours, b, s + 4)
    fp8 = MLACache.for_model(ours, b, s + 4, dtype=FP8)
    assert fp8.auto_scale and all(t.isnan().all() for t in fp8.kv_scales)  # NaN until a prefill
    with torch.no_grad():
        for cache in (exact, fp8):
            ours(ids, attention_mask=mask, use_cache=True, **generate_kwargs(ours, cache))
    for layer in range(2):
        rows = stored_rows(exact, layer, b)  # fp32: exactly the latents the fp8 cache was given
        assert rows.shape[0] == 10 + 6 + 3
        expected = (rows.abs().amax() / 448).reshape(1)
        torch.testing.assert_close(fp8.kv_scales[layer], expected, atol=0, rtol=1e-7)
        assert fp8.kv_scales[layer].device == fp8.kv_caches[layer].device
        assert torch.equal(stored_rows(fp8, layer, b).view(torch.uint8),
                           quantize_fp8(rows, expected).view(torch.uint8))
    # Frozen during the sequence: a decode step leaves it; the next prefill measures again.
    before = [t.clone() for t in fp8.kv_scales]
    with torch.no_grad():
        ours(torch.randint(2, VOCAB, (b, 1)), position_ids=fp8.position_ids(b), use_cache=True,
             **generate_kwargs(ours, fp8))
        assert all(torch.equal(t, u) for t, u in zip(fp8.kv_scales, before))
        fp8.reset()
        ours(ids[:, 5:], use_cache=True, **generate_kwargs(ours, fp8))
    assert not any(torch.equal(t, u) for t, u in zip(fp8.kv_scales, before))


def test_fp8_auto_scale_leaves_out_padding():
    # Through the cache's own API, with latents of 1000 at the padding positions (which are not
    # stored, so they must not set the scale) and in k_pe at a real token of layer 1.
    cache = MLACache(hf_model("v3_yarn").config, 2, 64, dtype=FP8)
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    kv_c, k_pe = torch.randn(2, 5, R), torch.randn(2, 5, DR)
    kv_c[0, :2], k_pe[0, 1] = 1000.0, -1000.0
    k_pe_1 = k_pe.clone()
    k_pe_1[1, 3, 7] = -9.0
    for layer, pe in enumerate((k_pe, k_pe_1)):
        cache.begin_layer(layer, 2, 5, mask)
        cache.append_latents(layer, kv_c, pe, num_heads=6)
    real = mask.bool()
    amax = torch.maximum(kv_c[real].abs().amax(), k_pe[real].abs().amax())
    assert cache.kv_scales[0].item() == pytest.approx(amax.item() / 448, rel=1e-7)
    assert cache.kv_scales[1].item() == pytest.approx(9.0 / 448, rel=1e-7)
    assert cache.cache_seqlens.tolist() == [3, 5]


class TestGivenScale(expecttest.TestCase):
    def test_a_given_scale_is_used_as_given(self):
        ours = swapped(hf_model("v3_yarn"))
        b, s = 2, 9
        ids, mask = left_padded_prompts(b, s, pads=(0, 2))
        exact = MLACache.for_model(ours, b, s)
        one = MLACache.for_model(ours, b, s, dtype=FP8, kv_scale=0.004)
        per_layer = MLACache.for_model(ours, b, s, dtype=FP8,
                                       kv_scale=[0.002, torch.tensor([0.05], dtype=torch.float64)])
        with torch.no_grad():
            for cache in (exact, one, per_layer):
                ours(ids, attention_mask=mask, use_cache=True, **generate_kwargs(ours, cache))
        for cache, scales in ((one, [0.004, 0.004]), (per_layer, [0.002, 0.05])):
            assert not cache.auto_scale
            for layer, x in enumerate(scales):
                scale = torch.tensor([x], dtype=torch.float32)
                assert torch.equal(cache.kv_scales[layer], scale)
                # 0.002 saturates this model's largest latents at +-448 (0.9 and more).
                assert torch.equal(stored_rows(cache, layer, b).view(torch.uint8),
                                   quantize_fp8(stored_rows(exact, layer, b), scale)
                                   .view(torch.uint8))
        assert stored_rows(per_layer, 0, b).float().abs().max() == 448

    def test_bad_scales_are_refused(self):
        config = hf_model("v3_yarn").config
        cases = [dict(kv_scale=0.1), dict(dtype=FP8, kv_scale=[0.1] * 3),
                 dict(dtype=FP8, kv_scale=0.0), dict(dtype=FP8, kv_scale=float("nan")),
                 dict(dtype=FP8, kv_scale=torch.ones(2)), dict(dtype=FP8, kv_scale="max")]
        messages = []
        for kwargs in cases:
            with self.assertRaises(ValueError) as e:
                MLACache(config, 1, 64, **kwargs)
            messages.append(str(e.exception))
        self.assertExpectedInline("\n".join(messages), """\
kv_scale is the scale of a float8_e4m3fn cache; this cache is torch.float32: pass kv_scale=None
kv_scale: one per layer, 2 layers, got 3 scales
kv_scale of layer 0 must be finite and > 0, got 0.0
kv_scale of layer 0 must be finite and > 0, got nan
kv_scale of layer 0: one element, got shape [2]
kv_scale must be "auto", a float, a tensor of one element or a list of them (one per layer), got 'max'""")


def test_fp8_cache_bytes_per_token_halve():
    config = hf_model("v3_yarn").config
    bf16 = MLACache(config, 2, 100, dtype=torch.bfloat16)
    fp8 = MLACache(config, 2, 100, dtype=FP8)
    assert fp8.kv_bytes_per_token_per_layer == R + DR
    assert 2 * fp8.kv_bytes_per_token == bf16.kv_bytes_per_token == (R + DR) * 2 * 2
    assert 2 * fp8.nbytes == bf16.nbytes
    assert "dtype=torch.float8_e4m3fn, 128 bytes/token" in repr(fp8)


class TestCompute(expecttest.TestCase):
    def test_compute_reaches_the_decode_and_is_validated(self):
        """MLACache(compute=...) is what each layer's LatentStep carries to mla_decode; fast
        mode belongs to an fp8 cache. (On the CPU both modes run the reference: equal logits.)"""
        config = hf_model("v3_yarn").config
        for compute in ("exact", "fp8"):
            cache = MLACache(config, 2, 70, dtype=FP8, compute=compute)
            cache.begin_layer(0, 2, 3)
            step = cache.append_latents(0, torch.randn(2, 3, R), torch.randn(2, 3, DR),
                                        num_heads=6)
            assert step.compute == compute
        with self.assertRaises(ValueError) as cm:
            MLACache(config, 2, 70, dtype=torch.bfloat16, compute="fp8")
        self.assertExpectedInline(str(cm.exception), """compute='fp8' is a float8_e4m3fn cache's fast mode; this cache is torch.bfloat16: pass compute='exact'""")
        with self.assertRaises(ValueError) as cm:
            MLACache(config, 2, 70, dtype=FP8, compute="e4m3")
        self.assertExpectedInline(str(cm.exception), """compute must be 'exact' or 'fp8', got 'e4m3'""")
        ours = swapped(hf_model("v3_yarn"))
        ids, mask = left_padded_prompts(2, 9, pads=(0, 2))
        # Each generate's decode steps call mla_decode with the cache's compute (a spy on the
        # modules' name for it); the logits are equal since the CPU runs the reference.
        from torch_mla.modules import attention

        seen, decode = [], attention.mla_decode

        def spy(*args, **kwargs):
            seen.append(kwargs.get("compute"))
            return decode(*args, **kwargs)

        runs = []
        with mock.patch.object(attention, "mla_decode", spy):
            for c in ("exact", "fp8"):
                seen.clear()
                runs.append(generate(ours, ids, mask, MLACache(ours.config, 2, 9 + 6, dtype=FP8,
                                                               compute=c), 6))
                assert seen and set(seen) == {c}, (c, seen)
        assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])


def test_fp8_cache_split_over_devices_keeps_each_layers_scale_there():
    # Layer 1 on the meta device stands for a second GPU (as in test_modules).
    ours = swapped(hf_model("v3_yarn"))
    ours.model.layers[1].self_attn.to("meta")
    cache = MLACache.for_model(ours, 2, 70, dtype=FP8)
    cpu, meta = torch.device("cpu"), torch.device("meta")
    assert [t.device for t in cache.kv_scales] == [cpu, meta]
    for s in (5, 1):
        for layer, device in enumerate(cache.layer_devices):
            cache.begin_layer(layer, 2, s)
            step = cache.append_latents(layer, torch.randn(2, s, R, device=device),
                                        torch.randn(2, s, DR, device=device), num_heads=6)
            assert step.kv_scale is cache.kv_scales[layer] and step.kv_scale.device == device
    # "cpu" and "cpu:0": two devices for the cache, the same memory; the logits are the
    # one-device cache's.
    ours = swapped(hf_model("v3_yarn"))
    ids, mask = left_padded_prompts(3, 12, pads=(0, 3, 8))
    one = MLACache(ours.config, 3, 12 + 8, dtype=FP8)
    two = MLACache(ours.config, 3, 12 + 8, dtype=FP8, device=["cpu", "cpu:0"])
    tokens, logits = generate(ours, ids, mask, one, 8)
    _, split = generate(ours, ids, mask, two, 8, force=tokens[:, 12:])
    assert torch.equal(split, logits)
    assert two._seqlens[1].data_ptr() != two.cache_seqlens.data_ptr()


def test_fp8_compiled_decode_step_is_one_graph_across_prefills_and_matches_eager():
    from test_modules_compile import decode_step, models
    from torch._inductor.compile_fx import compile_fx

    torch._dynamo.reset()
    _, ours = models()
    b, s = 3, 11
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return compile_fx(gm, example_inputs)

    compiled = torch.compile(decode_step, backend=backend, fullgraph=True)  # no graph breaks
    eager_cache, compiled_cache = (MLACache.for_model(ours, b, 64, dtype=FP8) for _ in range(2))
    with torch.no_grad():
        for scale_up in (1.0, 3.0):  # two sequences: the second prefill measures a new scale
            ids = torch.randint(2, VOCAB, (b, s))
            mask = torch.ones(b, s, dtype=torch.long)
            mask[2, :4] = 0
            for cache in (eager_cache, compiled_cache):
                cache.reset()
                ours(ids, attention_mask=mask, use_cache=True, **generate_kwargs(ours, cache))
                for t in cache.kv_scales:
                    t.mul_(scale_up)  # as if its latents were larger: the graph reads the buffer
            for _ in range(3):
                new = torch.randint(2, VOCAB, (b, 1))
                eager = decode_step(ours, eager_cache, new)
                out = compiled(ours, compiled_cache, new)
                torch.testing.assert_close(out, eager, atol=1e-5, rtol=1e-5)
            for x, y in zip(compiled_cache.kv_caches, eager_cache.kv_caches):
                assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))
    assert len(graphs) == 1, f"recompiled: {len(graphs)} graphs"
    ops = [str(n.target) for n in graphs[0].graph.nodes
           if n.op == "call_function" and "torch_mla" in str(n.target)]
    assert ops == ["torch_mla.get_decode_schedule"] + ["torch_mla.append_kv",
                                                       "torch_mla._head_matmul",
                                                       "torch_mla.mla_decode",
                                                       "torch_mla._head_matmul"] * 2


@pytest.mark.cuda
def test_fp8_reduce_overhead_decode_step_replays_cuda_graphs_on_the_kernel():
    from test_modules_compile import decode_step, kernel_sized_models
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    _, ours = kernel_sized_models()  # the decode runs the SM90 kernel (exact mode)
    b, s = 4, 100
    ids = torch.randint(2, VOCAB, (b, s), device="cuda")
    mask = torch.ones(b, s, dtype=torch.long, device="cuda")
    mask[1, :37] = 0
    caches = []
    # eager, compiled, and the reference decode: three caches filled alike (the same model, so
    # the same latents, scales and e4m3 bytes; an fp32 copy of the model would round some
    # latents to neighbouring e4m3 codes, a 6% step, and differ by more than the kernel does).
    for model in (ours, ours, ours):
        cache = MLACache.for_model(model, b, 256, dtype=FP8)
        with torch.no_grad():
            model(ids, attention_mask=mask, use_cache=True, **generate_kwargs(model, cache))
        caches.append(cache)
    compiled = torch.compile(decode_step, mode="reduce-overhead", fullgraph=True)
    with torch.no_grad():
        for _ in range(6):  # warm-up, recording, then replays
            new = torch.randint(2, VOCAB, (b, 1), device="cuda")
            eager = decode_step(ours, caches[0], new)
            out = compiled(ours, caches[1], new).clone()
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("TORCH_MLA_FORCE_REFERENCE", "1")  # the fp32 reference decode
                ref = decode_step(ours, caches[2], new).float()
            scale = ref.abs().max().item()
            # bf16 through 2 layers, as in test_modules_compile (2.2e-2 * scale seen there): the
            # kernel against the reference over the same fp8 cache.
            torch.testing.assert_close(out.float(), eager.float(), atol=5e-2 * scale, rtol=0)
            torch.testing.assert_close(out.float(), ref, atol=5e-2 * scale, rtol=0)
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
