"""The FP8 latent cache (issue 13, CPU side): float8_e4m3fn cache + kv_scale (and an fp8 q +
q_scale) through mla_decode, append_kv, the custom ops, dispatch and the FlashMLA/vLLM compat."""

import struct
import types
import warnings

import expecttest
import pytest
import torch
import torch._dynamo.testing

import torch_mla
from torch_mla.ops import dispatch, registry
from torch_mla.reference import dequantize_fp8, mla_decode_reference, quantize_fp8
from torch_mla.testing import make_decode_inputs, varlen_seqlens

from oracle import mla_decode_fp64

FP8 = torch.float8_e4m3fn
SCALE = 576**-0.5


def fp8_inputs(lens, s_q, h_q, mult=1.0, **sizes):
    """make_decode_inputs (NaN past each length, huge unused block ids) with the cache quantized
    to e4m3 at the per-tensor scale amax / 448; returns (inputs, fp8 cache, kv_scale [1])."""
    inp = make_decode_inputs(lens, s_q, h_q, **sizes)
    cache = inp.kv_cache.float() * mult
    kv_scale = (cache.nan_to_num(0).abs().amax() / 448).reshape(1)  # (on cache's device)
    return inp, quantize_fp8(cache, kv_scale), kv_scale


def e4m3_values() -> torch.Tensor:
    """Every finite float8_e4m3fn value, as float64 (an independent table for the rounding)."""
    v = torch.arange(256, dtype=torch.uint8).view(FP8).double()
    return v[torch.isfinite(v)]


@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16])
def test_decode_bf16_fp16_q_matches_fp64_over_the_dequantized_cache(q_dtype):
    inp, cache, kv_scale = fp8_inputs([1, 63, 64, 65, 300, 0], 2, 16)
    q = inp.q.to(q_dtype)
    out, lse = torch_mla.mla_decode(q, cache, inp.block_table, inp.cache_seqlens, causal=True,
                                    kv_scale=kv_scale)
    assert out.dtype == q_dtype and lse.dtype == torch.float32
    ref_out, ref_lse = mla_decode_fp64(q, dequantize_fp8(cache, kv_scale), inp.block_table,
                                       inp.cache_seqlens, SCALE, True, 512)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-3, rtol=1e-2)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)


def test_decode_fp8_q_with_q_scale_outputs_bf16():
    inp, cache, kv_scale = fp8_inputs([5, 64, 129], 1, 16)
    q_scale = (inp.q.float().abs().amax() / 448).reshape(1)
    q8 = quantize_fp8(inp.q, q_scale)
    out, lse = torch_mla.mla_decode(q8, cache, inp.block_table, inp.cache_seqlens,
                                    kv_scale=kv_scale, q_scale=q_scale)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    ref_out, ref_lse = mla_decode_fp64(dequantize_fp8(q8, q_scale),
                                       dequantize_fp8(cache, kv_scale), inp.block_table,
                                       inp.cache_seqlens, SCALE, False, 512)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-3, rtol=1e-2)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)


def test_reference_over_fp8_equals_fp32_math_over_the_dequantized_cache():
    # Dequantizing page by page in the gather is the same float32 product as dequantizing the
    # whole cache first: equal to the last bit, and to fp64 up to fp32 rounding.
    inp, cache, kv_scale = fp8_inputs([1, 64, 65, 700, 0], 3, 16)
    q = inp.q.float()
    out, lse = torch_mla.mla_decode(q, cache, inp.block_table, inp.cache_seqlens, causal=True,
                                    kv_scale=kv_scale)
    deq = dequantize_fp8(cache, kv_scale)
    ref_out, ref_lse = mla_decode_reference(q, deq, inp.block_table, inp.cache_seqlens, SCALE,
                                            True, 512)
    torch.testing.assert_close(out, ref_out, atol=0, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=0, rtol=0)
    f64_out, f64_lse = mla_decode_fp64(q, deq, inp.block_table, inp.cache_seqlens, SCALE, True,
                                       512)
    torch.testing.assert_close(out.double(), f64_out, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(lse.double(), f64_lse, atol=1e-6, rtol=1e-6)


# The e_store (h_q 128, L 4096): 2.8e-2 for randn / 10, 2.0e-2 for randn, 6.5e-2 for
# 2 * randn. Trimmed to h_q 16, L 1024 for the CPU (measured there: 2.7-2.8e-2, 2.8-3.0e-2,
# 5.4-6.2e-2); the bounds are the values / 2 and x 2.
@pytest.mark.parametrize("mult, lo, hi", [(0.1, 1.4e-2, 5.6e-2), (1.0, 1.0e-2, 4.0e-2),
                                          (2.0, 3.2e-2, 1.3e-1)])
def test_e_store_of_the_fp8_cache(mult, lo, hi, capsys):
    """e_store: exact attention over the dequantized fp8 cache (written by append_kv) against
    exact attention over the original bf16 latents."""
    L, h_q = 1024, 16
    latents = (torch.randn(L, 576) * mult).bfloat16()
    q = (torch.randn(1, 1, h_q, 576) * mult).bfloat16()
    kv_scale = (latents.float().abs().amax() / 448).reshape(1)
    cache = torch.full((L // 64, 64, 1, 576), float("nan")).to(FP8)
    torch_mla.append_kv(cache, latents[:, :512], latents[:, 512:], torch.arange(L), kv_scale)
    table = torch.arange(L // 64, dtype=torch.int32)[None]
    lens = torch.tensor([L], dtype=torch.int32)
    exact, _ = mla_decode_fp64(q, latents.view(L // 64, 64, 1, 576), table, lens, SCALE, False,
                               512)
    stored, _ = mla_decode_fp64(q, dequantize_fp8(cache, kv_scale), table, lens, SCALE, False,
                                512)
    e_store = ((stored - exact).norm() / exact.norm()).item()
    with capsys.disabled():
        print(f"\ne_store (x{mult} randn, h_q {h_q}, L {L}): {e_store:.2e}")
    assert lo <= e_store <= hi
    # The decode over the fp8 cache is that stored attention, up to the bf16 output's rounding.
    out, _ = torch_mla.mla_decode(q, cache, table, lens, kv_scale=kv_scale)
    assert ((out.double() - stored).norm() / stored.norm()).item() < 4e-3


def test_append_quantizes_saturates_and_rounds_to_nearest_even():
    kv_scale = torch.tensor([0.25])  # a power of two: x / kv_scale is exact
    cache = torch.full((3, 64, 1, 576), float("nan")).to(FP8)
    before = cache.clone()
    kv_c, k_pe = torch.randn(4, 512, dtype=torch.bfloat16), torch.randn(4, 64)
    # Past +-448 * kv_scale saturates; ties between neighbours round to the even mantissa:
    # 1.0625 lies between 1.0 and 1.125 (-> 1.0), 1.1875 between 1.125 and 1.25 (-> 1.25).
    kv_c[0, :4] = torch.tensor([1e4, -113.0, 1.0625 * 0.25, 1.1875 * 0.25])
    slots = torch.tensor([130, -1, 5, 64])
    torch_mla.append_kv(cache, kv_c, k_pe, slots, kv_scale=kv_scale)
    flat, old = cache.view(-1, 576), before.view(-1, 576)
    assert flat[130, :4].float().tolist() == [448.0, -448.0, 1.0, 1.25]
    table = e4m3_values()
    src = torch.cat([kv_c.double(), k_pe.double()], dim=-1) / 0.25
    for i, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        y = src[i].clamp(-448, 448)
        # Nearest: no e4m3 value lies closer to y than the stored one.
        nearest = (table[None, :] - y[:, None]).abs().amin(dim=1)
        torch.testing.assert_close((flat[s].double() - y).abs(), nearest, atol=0, rtol=0)
    written = torch.zeros(flat.shape[0], dtype=torch.bool)
    written[[130, 5, 64]] = True
    assert torch.equal(flat[~written].view(torch.uint8), old[~written].view(torch.uint8))


# Not test_schema: its SchemaCheckMode compares each aten op's inputs before and after with a
# multiply that torch has no float8 CPU kernel for. The schemas' aliasing is checked by the
# bf16 opchecks (tests/test_ops.py: the same schemas), the schemas themselves are pinned there.
FP8_OPCHECKS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def test_opcheck_fp8():
    inp, cache, kv_scale = fp8_inputs([3, 70, 0], 2, 16)
    sched = torch_mla.get_decode_schedule(inp.cache_seqlens, 2, 16)
    q_scale = torch.tensor([0.01])
    for q, qs in ((inp.q, None), (quantize_fp8(inp.q, q_scale), q_scale)):
        args = (q, cache, inp.block_table, inp.cache_seqlens, sched.metadata, sched.num_splits,
                SCALE, True, 512, kv_scale, qs)
        torch.library.opcheck(torch.ops.torch_mla.mla_decode.default, args,
                              test_utils=FP8_OPCHECKS)
    cache = torch.randn(4, 64, 1, 576).to(FP8)
    args = (cache, torch.randn(5, 512, dtype=torch.bfloat16),
            torch.randn(5, 64, dtype=torch.bfloat16), torch.tensor([3, 70, 200, 64, 1]),
            torch.tensor([0.003]))
    torch.library.opcheck(torch.ops.torch_mla.append_kv.default, args, test_utils=FP8_OPCHECKS)


def test_compute_fp8_on_the_reference_path_is_exact_and_reaches_the_op():
    """compute="fp8" permits e4m3 Q and P; the CPU reference keeps fp32 math, so the result is
    exact mode's to the bit, through the eager call, the op and the vLLM name."""
    from torch_mla.compat.flash_mla import flash_mla_with_kvcache_fp8

    inp, cache, kv_scale = fp8_inputs([3, 70, 129], 2, 16)
    args = (inp.q, cache, inp.block_table, inp.cache_seqlens)
    exact = torch_mla.mla_decode(*args, causal=True, kv_scale=kv_scale)
    fast = torch_mla.mla_decode(*args, causal=True, kv_scale=kv_scale, compute="fp8")
    sched = torch_mla.get_decode_schedule(inp.cache_seqlens, 2, 16)
    op = torch.ops.torch_mla.mla_decode(*args, sched.metadata, sched.num_splits, SCALE, True,
                                        512, kv_scale, None, "fp8")
    compat = flash_mla_with_kvcache_fp8(*args, 512, sched.metadata, sched.num_splits,
                                        causal=True, descale_k=kv_scale, compute="fp8")
    for got in (fast, op, compat):
        torch.testing.assert_close(got, exact, atol=0, rtol=0)
    ref_out, _ = mla_decode_fp64(inp.q, dequantize_fp8(cache, kv_scale), inp.block_table,
                                 inp.cache_seqlens, SCALE, True, 512)
    torch.testing.assert_close(fast[0].double(), ref_out, atol=1e-3, rtol=1e-2)
    torch.library.opcheck(torch.ops.torch_mla.mla_decode.default,
                          (*args, sched.metadata, sched.num_splits, SCALE, True, 512, kv_scale,
                           None, "fp8"), test_utils=FP8_OPCHECKS)


def fp8_step(q, kv_c, k_pe, slots, kv_cache, block_table, cache_seqlens, kv_scale):
    sched = torch_mla.get_decode_schedule(cache_seqlens, q.shape[1], q.shape[2])
    torch_mla.append_kv(kv_cache, kv_c, k_pe, slots, kv_scale=kv_scale)
    return torch_mla.mla_decode(q, kv_cache, block_table, cache_seqlens, sched, causal=True,
                                kv_scale=kv_scale)


def test_compiled_fp8_step_matches_eager_without_recompiling():
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(fp8_step, backend=counter, fullgraph=True)
    for lens in ([70, 3, 300], [129, 64, 2], [5, 250, 190]):
        # Same shapes, new lengths, block-table contents and scale value at every step.
        inp, cache, kv_scale = fp8_inputs(lens, 2, 16, max_blocks=8, num_blocks=12)
        kv_scale = kv_scale * (1 + torch.rand(1))  # a new scale value: no recompile either
        b = len(lens)
        # Each request's last 2 tokens are this step's: written through append_kv.
        slots = torch_mla.slot_mapping(inp.block_table, inp.cache_seqlens - 2, 2)
        kv_c, k_pe = torch.randn(b * 2, 512) / 10, torch.randn(b * 2, 64) / 10
        args = (inp.q, kv_c, k_pe, slots)
        c1, c2 = cache.clone(), cache.clone()
        out_c, lse_c = compiled(*args, c1, inp.block_table, inp.cache_seqlens, kv_scale)
        out_e, lse_e = fp8_step(*args, c2, inp.block_table, inp.cache_seqlens, kv_scale)
        assert torch.equal(c1.view(torch.uint8), c2.view(torch.uint8))
        torch.testing.assert_close(out_c, out_e, atol=0, rtol=0)
        torch.testing.assert_close(lse_c, lse_e, atol=0, rtol=0)
        ref_out, _ = mla_decode_fp64(inp.q, dequantize_fp8(c1, kv_scale), inp.block_table,
                                     inp.cache_seqlens, SCALE, True, 512)
        torch.testing.assert_close(out_c.double(), ref_out, atol=1e-3, rtol=1e-2)
    assert counter.frame_count == 1, f"recompiled: {counter.frame_count} frames"


def test_compat_vllm_fp8_names():
    from torch_mla.compat.flash_mla import (
        flash_mla_with_kvcache_fp8,
        get_mla_metadata,
        get_mla_metadata_dense_fp8,
    )

    inp, cache, kv_scale = fp8_inputs([10, 200], 2, 16)
    meta, splits = get_mla_metadata_dense_fp8(inp.cache_seqlens, 2 * 16, 1)
    meta2, splits2 = get_mla_metadata(inp.cache_seqlens, 2 * 16, 1)
    assert torch.equal(meta, meta2) and torch.equal(splits, splits2)
    q_scale = (inp.q.float().abs().amax() / 448).reshape(1)
    q8 = quantize_fp8(inp.q, q_scale)
    out, lse = flash_mla_with_kvcache_fp8(q8, cache, inp.block_table, inp.cache_seqlens, 512,
                                          meta, splits, causal=True, descale_q=q_scale,
                                          descale_k=kv_scale)
    assert out.dtype == torch.bfloat16
    ref_out, ref_lse = mla_decode_fp64(dequantize_fp8(q8, q_scale),
                                       dequantize_fp8(cache, kv_scale), inp.block_table,
                                       inp.cache_seqlens, SCALE, True, 512)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-3, rtol=1e-2)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
    # bf16 q over the fp8 cache, with a softmax scale of its own.
    out, lse = flash_mla_with_kvcache_fp8(inp.q, cache, inp.block_table, inp.cache_seqlens, 512,
                                          meta, splits, softmax_scale=0.05, descale_k=kv_scale)
    ref_out, ref_lse = mla_decode_fp64(inp.q, dequantize_fp8(cache, kv_scale), inp.block_table,
                                       inp.cache_seqlens, 0.05, False, 512)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-3, rtol=1e-2)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)


class TestFp8Dispatch(expecttest.TestCase):
    def setUp(self):
        self.mp = pytest.MonkeyPatch()
        self.mp.setattr(dispatch, "cuda_capability", lambda device: (9, 0))
        dispatch.clear_caches()
        self.mp.delenv("TORCH_MLA_FORCE_REFERENCE", raising=False)
        self.mp.delenv("TORCH_MLA_PORTABLE", raising=False)

    def tearDown(self):
        self.mp.undo()
        dispatch.clear_caches()

    def query(self, dtype):
        return types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0), dtype=dtype,
                                     shape=(1, 1, 16, 576))

    def test_fp8_cache_runs_the_sm90_kernel_on_an_h200(self):
        cache = torch.empty(1, 64, 1, 576, dtype=FP8)
        for q_dtype in (torch.bfloat16, torch.float16, FP8):
            name, why = dispatch.decode_backend("cuda", q_dtype, cache_dtype=FP8)
            self.assertExpectedInline(f"{name}: {why}", """sm90: compute capability 9.0, float8_e4m3fn cache: the SM90 CuTe DSL kernel, exact mode (pages converted exactly to 16 bits on chip, 16-bit MMAs; its keys-on-M variant where s_q * h_q <= 32)""")
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                self.assertIs(dispatch.find_decode_kernel(self.query(q_dtype), cache, 512),
                              dispatch.run_sm90_fp8)
        # a bf16 cache still gets the 16-bit kernel's runner
        self.assertIs(dispatch.find_decode_kernel(self.query(torch.bfloat16),
                                                  torch.empty(1, 64, 1, 576,
                                                              dtype=torch.bfloat16), 512),
                      dispatch.run_sm90)

    def test_fp8_cache_takes_the_reference_elsewhere_and_warns_once(self):
        cache = torch.empty(1, 64, 1, 576, dtype=FP8)
        name, why = dispatch.decode_backend("cuda", torch.float32, cache_dtype=FP8)
        self.assertExpectedInline(f"{name}: {why}", """reference: torch.float32 q with a float8_e4m3fn cache: the FP8 kernel takes a bfloat16, float16 or float8_e4m3fn q (the reference dequantizes the pages it reads to float32)""")
        name, why = dispatch.decode_backend("cuda", torch.bfloat16, d_qk=320, cache_dtype=FP8)
        self.assertExpectedInline(f"{name}: {why}", """reference: d_qk=320, d_v=512, page size 64: the FP8 kernel is built for d_qk=576, d_v=512, page size 64""")
        self.mp.setenv("TORCH_MLA_PORTABLE", "1")
        name, why = dispatch.decode_backend("cuda", torch.bfloat16, cache_dtype=FP8)
        self.assertExpectedInline(f"{name}: {why}", """reference: float8_e4m3fn cache with TORCH_MLA_PORTABLE=1: the only FP8 kernel is the SM90 one (the reference dequantizes the pages it reads to float32)""")
        self.mp.delenv("TORCH_MLA_PORTABLE")
        for cap in [(8, 0), (8, 9), (10, 0)]:
            self.mp.setattr(dispatch, "cuda_capability", lambda device, cap=cap: cap)
            name, why = dispatch.decode_backend("cuda", FP8, cache_dtype=FP8)
            self.assertEqual(name, "reference")
            self.assertEqual(dispatch.decode_backend("cuda", torch.bfloat16, cache_dtype=FP8),
                             (name, why))
        self.assertExpectedInline(why, """float8_e4m3fn cache on compute capability 10.0: the only FP8 kernel is the SM90 one (the reference dequantizes the pages it reads to float32)""")
        with self.assertWarns(UserWarning) as cm:
            self.assertIsNone(dispatch.find_decode_kernel(self.query(torch.bfloat16), cache,
                                                          512))
        self.assertExpectedInline(str(cm.warning), """torch_mla.mla_decode runs the slow plain-PyTorch reference on this GPU: float8_e4m3fn cache on compute capability 10.0: the only FP8 kernel is the SM90 one (the reference dequantizes the pages it reads to float32)""")
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the same reason again: silent
            self.assertIsNone(dispatch.find_decode_kernel(self.query(FP8), cache, 512))
        self.mp.setenv("TORCH_MLA_FORCE_REFERENCE", "1")
        self.assertEqual(dispatch.decode_backend("cuda", FP8, cache_dtype=FP8),
                         ("reference", "TORCH_MLA_FORCE_REFERENCE=1 is set"))

    def test_fast_mode_is_the_sm90_kernel(self):
        cache = torch.empty(1, 64, 1, 576, dtype=FP8)
        name, why = dispatch.decode_backend("cuda", torch.bfloat16, cache_dtype=FP8,
                                            compute="fp8")
        self.assertExpectedInline(f"{name}: {why}", """sm90: compute capability 9.0, float8_e4m3fn cache: the SM90 CuTe DSL kernel, fast mode (compute='fp8': Q, quantized per row, on the fp8 tensor cores; P in e4m3 too, except on its keys-on-M variant, which keeps P in f16: bf16/fp16 q, one KV head, up to 16 query rows, or 32 from a batch of 4)""")
        self.assertIs(dispatch.find_decode_kernel(self.query(torch.bfloat16), cache, 512),
                      dispatch.run_sm90_fp8)

    def test_append_kernel_for_an_fp8_cache_from_sm89(self):
        cache = types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0), dtype=FP8,
                                      shape=(4, 64, 1, 576), data_ptr=lambda: 0)
        src = types.SimpleNamespace(dtype=torch.bfloat16, shape=(3, 512))
        pe = types.SimpleNamespace(dtype=torch.bfloat16, shape=(3, 64))
        slots = types.SimpleNamespace(dtype=torch.int64, shape=(3,))
        self.mp.setattr(registry, "compiled", lambda config, arch: (arch, *config.key().values()))
        got = {}
        for cap in ((8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0)):
            self.mp.setattr(dispatch, "cuda_capability", lambda device, cap=cap: cap)
            dispatch.clear_caches()
            got[cap] = dispatch.find_append_kernel(cache, src, pe, slots)
        self.assertExpectedInline("\n".join(f"{c}: {k}" for c, k in got.items()), """\
(8, 0): None
(8, 6): None
(8, 9): ('sm_89', 'e4m3', 'bf16', 'int64')
(9, 0): ('sm_90a', 'e4m3', 'bf16', 'int64')
(10, 0): ('sm_100a', 'e4m3', 'bf16', 'int64')
(12, 0): ('sm_120a', 'e4m3', 'bf16', 'int64')""")


class TestFp8Errors(expecttest.TestCase):
    def err(self, fn=None, **change):
        inp, cache, kv_scale = fp8_inputs([3, 70], 1, 16)
        args = dict(q=inp.q, kv_cache=cache, block_table=inp.block_table,
                    cache_seqlens=inp.cache_seqlens, kv_scale=kv_scale)
        args.update(change)
        with self.assertRaises((ValueError, TypeError)) as cm:
            (fn or torch_mla.mla_decode)(**args)
        return str(cm.exception)

    def test_decode(self):
        inp = make_decode_inputs([3, 70], 1, 16)
        q8, one = inp.q.to(FP8), torch.tensor([1.0])
        self.assertExpectedInline(self.err(kv_scale=None), """kv_cache is float8_e4m3fn: pass kv_scale=, a float32 tensor of shape [1] (value = kv_cache.float() * kv_scale)""")
        self.assertExpectedInline(self.err(kv_cache=inp.kv_cache), """kv_scale is the scale of a float8_e4m3fn kv_cache; this kv_cache is torch.bfloat16: pass kv_scale=None""")
        self.assertExpectedInline(self.err(kv_scale=torch.ones(2)), """kv_scale must hold one scale (shape [1]): one scale per tensor only for now, got shape [2]""")
        self.assertExpectedInline(self.err(kv_scale=torch.ones(1, dtype=torch.bfloat16)), """kv_scale must be float32, got torch.bfloat16""")
        self.assertExpectedInline(self.err(kv_scale=0.01), """kv_scale must be a torch.Tensor (float32, shape [1]), got float""")
        self.assertExpectedInline(self.err(kv_scale=torch.ones(1, device="meta")), """kv_scale must be on kv_cache's device (cpu), got meta""")
        self.assertExpectedInline(self.err(q=q8), """q is float8_e4m3fn: pass q_scale=, a float32 tensor of shape [1] (value = q.float() * q_scale)""")
        self.assertExpectedInline(self.err(q_scale=one), """q_scale is the scale of a float8_e4m3fn q; this q is torch.bfloat16: pass q_scale=None""")
        self.assertExpectedInline(self.err(q=q8, q_scale=one, kv_cache=inp.kv_cache, kv_scale=None), """a float8_e4m3fn q needs a float8_e4m3fn kv_cache, got torch.bfloat16""")
        self.assertExpectedInline(self.err(q=q8, q_scale=torch.ones(1, 2)), """q_scale must hold one scale (shape [1]): one scale per tensor only for now, got shape [1, 2]""")
        self.assertExpectedInline(self.err(q=inp.q.to(torch.int8)), """with a float8_e4m3fn kv_cache, q must be bfloat16, float16, float32 or float8_e4m3fn, got torch.int8""")
        self.assertExpectedInline(self.err(kv_cache=inp.kv_cache, q_scale=one, kv_scale=None), """q_scale is the scale of a float8_e4m3fn q; this q is torch.bfloat16: pass q_scale=None""")

    def test_compute(self):
        inp = make_decode_inputs([3, 70], 1, 16)
        self.assertExpectedInline(self.err(compute="fast"), """compute must be 'exact' or 'fp8', got 'fast'""")
        self.assertExpectedInline(self.err(compute="fp8", kv_cache=inp.kv_cache, kv_scale=None), """compute='fp8' (e4m3 Q and P on fp8 tensor cores) needs a float8_e4m3fn kv_cache; this kv_cache is torch.bfloat16: pass compute='exact'""")
        from torch_mla.compat.flash_mla import flash_mla_with_kvcache_fp8, get_mla_metadata

        meta, splits = get_mla_metadata(inp.cache_seqlens, 16, 1)
        self.assertExpectedInline(self.err(fn=lambda q, kv_cache, block_table, cache_seqlens,
                                           kv_scale: flash_mla_with_kvcache_fp8(
                                               q, kv_cache, block_table, cache_seqlens, 512, meta,
                                               splits, descale_k=kv_scale, compute="e4m3")),
                                  """compute must be 'exact' or 'fp8', got 'e4m3'""")

    def test_append(self):
        def append(cache, scale):
            with self.assertRaises((ValueError, TypeError)) as cm:
                torch_mla.append_kv(cache, torch.randn(2, 512), torch.randn(2, 64),
                                    torch.tensor([0, 1]), kv_scale=scale)
            return str(cm.exception)

        fp8 = torch.zeros(2, 64, 1, 576).to(FP8)
        self.assertExpectedInline(append(fp8, None), """kv_cache is float8_e4m3fn: pass kv_scale=, a float32 tensor of shape [1] (value = kv_cache.float() * kv_scale)""")
        self.assertExpectedInline(append(fp8, torch.ones(64)), """kv_scale must hold one scale (shape [1]): one scale per tensor only for now, got shape [64]""")
        self.assertExpectedInline(append(torch.zeros(2, 64, 1, 576), torch.ones(1)), """kv_scale is the scale of a float8_e4m3fn kv_cache; this kv_cache is torch.float32: pass kv_scale=None""")
        self.assertExpectedInline(append(fp8.view(torch.uint8), None), """a uint8 kv_cache is DeepSeek-V3.2's FP8 layout: shape [num_blocks, 64, 1, 656], got [2, 64, 1, 576]""")


def test_fp8_cache_with_q_requiring_grad_is_forward_only():
    inp, cache, kv_scale = fp8_inputs([3, 70], 1, 16)
    q = inp.q.clone().requires_grad_()
    out, lse = torch_mla.mla_decode(q, cache, inp.block_table, inp.cache_seqlens,
                                    kv_scale=kv_scale)
    ref_out, _ = mla_decode_fp64(inp.q, dequantize_fp8(cache, kv_scale), inp.block_table,
                                 inp.cache_seqlens, SCALE, False, 512)
    torch.testing.assert_close(out.detach().double(), ref_out, atol=1e-3, rtol=1e-2)
    with pytest.raises(RuntimeError, match="torch_mla.mla_decode is forward-only"):
        out.float().sum().backward()


@pytest.mark.parametrize("n_tiles", [4, 5])
def test_sm90_in_place_expansion_is_race_free_and_lands_in_the_swizzled_layout(n_tiles):
    """The FP8 kernel expands a page-buffer half (4 or 5 tiles of 64 keys x 64 columns) from
    its fp8 bytes in the upper half of the region to 16-bit, in place, by 128 threads with
    barriers between steps (fp8_expand_schedule, fp8_expand_addrs). Model of it: no thread
    stores, between two barriers, a byte another thread loads there (any interleaving then
    gives the sequential result), and the result is every value in the 128-byte-swizzled
    K-major tile layout that TMA writes and wgmma reads (16-byte chunk c of row r of a tile
    at chunk c ^ (r % 8))."""
    from torch_mla.cute_kernels.sm90_decode import fp8_expand_addrs, fp8_expand_schedule

    size = n_tiles * 8192
    codes = torch.randint(0, 256, (size // 2,), dtype=torch.uint8)
    mem = torch.full((size,), 0xA5, dtype=torch.uint8)  # bf16 leftovers of the last page
    mem[size // 2:] = codes
    steps = fp8_expand_schedule(n_tiles)
    epochs, cur = [], []
    for step in steps:
        if step[0] == "bar":
            epochs.append(cur)
            cur = []
        else:
            cur.append(step)
    epochs.append(cur)
    assert sum(len(e) for e in epochs) == 4 * n_tiles  # a load and a store per wave
    regs = {}
    for epoch in epochs:
        loads, stores = {}, {}
        for i in range(128):
            for kind, w in epoch:
                src, d0, d1 = fp8_expand_addrs(n_tiles, w, i)
                if kind == "load":
                    for b in range(src, src + 16):
                        loads.setdefault(b, set()).add(i)
                else:
                    for b in [*range(d0, d0 + 16), *range(d1, d1 + 16)]:
                        assert b not in stores, (epoch, b)
                        stores[b] = i
        for b, i in stores.items():
            assert loads.get(b, set()) <= {i}, (epoch, b)
        # sequential per thread (a thread's own load precedes its store in program order)
        for i in range(128):
            for kind, w in epoch:
                src, d0, d1 = fp8_expand_addrs(n_tiles, w, i)
                if kind == "load":
                    regs[w, i] = mem[src:src + 16].clone()
                else:
                    vals = regs[w, i].view(FP8).to(torch.bfloat16).view(torch.uint8)
                    mem[d0:d0 + 16], mem[d1:d1 + 16] = vals[:16], vals[16:]
    # unswizzle: tile t, row r, chunk c at t * 8 KB + 128 r + 16 (c ^ (r % 8))
    t, r, c = torch.meshgrid(torch.arange(n_tiles), torch.arange(64), torch.arange(8),
                             indexing="ij")
    offs = t * 8192 + r * 128 + 16 * (c ^ (r % 8))
    chunks = mem.view(-1, 16)[(offs // 16).flatten()].view(n_tiles, 64, 64, 2)
    got = chunks.reshape(-1).view(torch.bfloat16).view(n_tiles, 64, 64)
    want = codes.view(n_tiles, 64, 64).view(FP8).to(torch.bfloat16)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


# --- the SM90 kernel over an fp8 cache (exact mode): GPU tests -----------------------------

sm90 = pytest.mark.skipif(not torch.cuda.is_available()
                          or torch.cuda.get_device_capability() != (9, 0),
                          reason="needs an SM90 GPU")


@pytest.fixture
def kernel_env(monkeypatch):
    monkeypatch.delenv("TORCH_MLA_FORCE_REFERENCE", raising=False)
    monkeypatch.delenv("TORCH_MLA_PORTABLE", raising=False)


@pytest.mark.cuda
@sm90
@pytest.mark.parametrize("compute", ["exact", "fp8"])
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16, FP8])
def test_sm90_fp8_kernel_converts_every_code_exactly(q_dtype, compute, kernel_env):
    """Fast mode too: these rows quantize to e4m3 exactly and the one-hot P is exact in e4m3,
    so this checks its V^T transpose and P layout at every row and column position."""
    from torch_mla.testing import make_fp8_code_case

    c = make_fp8_code_case(q_dtype, "cuda")
    assert dispatch.find_decode_kernel(c.q, c.kv_cache, 512) is dispatch.run_sm90_fp8
    out, lse = torch_mla.mla_decode(c.q, c.kv_cache, c.block_table, c.cache_seqlens,
                                    softmax_scale=1.0, kv_scale=c.kv_scale, q_scale=c.q_scale,
                                    compute=compute)
    assert out.dtype == (torch.bfloat16 if q_dtype == FP8 else q_dtype)
    bad = (out.float() != c.out).nonzero()
    assert bad.numel() == 0, f"{len(bad)} wrong values, first at {bad[:4].tolist()}"
    torch.testing.assert_close(lse, torch.full_like(lse, c.lse), atol=1e-3, rtol=1e-6)


def check_fast_mode(out, lse, q, q_scale, cache, kv_scale, latents, block_table, cache_seqlens,
                    scale, causal):
    """Fast mode (compute="fp8") against the fp32 reference over the same dequantized cache:
    output error (relative norm) <= 2.5 x e_store (the error storing the latents in e4m3
    already costs: the reference over them against the reference over the originals); lse
    within what e4m3 rounding of Q can move a score by (2^-4 |q| max|k| scale, per row)."""
    args = (block_table, cache_seqlens, scale, causal, 512)
    ref_out, ref_lse = mla_decode_reference(q, cache, *args, kv_scale=kv_scale, q_scale=q_scale)
    q16 = (q.float() * q_scale).to(torch.bfloat16) if q_scale is not None else q
    orig_out, _ = mla_decode_reference(q16, latents, *args)

    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()

    e_store = rel(ref_out, orig_out)
    assert not out.isnan().any()
    if ref_out.norm() == 0:
        assert out.float().norm() == 0
    else:
        assert rel(out, ref_out) <= 2.5 * e_store, (rel(out, ref_out), e_store)
    k_norm = dequantize_fp8(cache, kv_scale).float().nan_to_num(0).norm(dim=-1).amax()
    bound = 2.0**-4 * (q.float() * (1 if q_scale is None else q_scale)).norm(dim=-1) \
        .transpose(1, 2) * k_norm * scale
    fin = torch.isfinite(ref_lse)
    assert torch.equal(lse[~fin], ref_lse[~fin])  # rows that see no key: +inf
    assert ((lse[fin] - ref_lse[fin]).abs() <= 1e-3 + bound[fin]).all()
    return e_store


def run_fp8_and_check(lens, s_q, h_q, causal, dtype=torch.bfloat16, scale=None, mult=1.0,
                      h_kv=1, q_fp8=False, compute="exact"):
    """The kernel against the fp32 reference over the same dequantized cache, within the bf16
    kernel's tolerances (atol scaled with the data: the errors are relative to |V|); fast
    mode within check_fast_mode's."""
    from test_kernel_sm90 import TOL

    inp, cache, kv_scale = fp8_inputs(lens, s_q, h_q, mult, device="cuda", h_kv=h_kv)
    q = (inp.q.float() * mult).to(dtype)
    q_scale = None
    if q_fp8:
        q_scale = (q.float().abs().amax() / 448).reshape(1)
        q = quantize_fp8(q, q_scale)
    scale = scale or SCALE
    assert dispatch.find_decode_kernel(q, cache, 512) is dispatch.run_sm90_fp8
    sched = torch_mla.get_decode_schedule(inp.cache_seqlens, s_q, h_q, h_kv=h_kv)
    out, lse = torch_mla.mla_decode(q, cache, inp.block_table, inp.cache_seqlens, sched,
                                    softmax_scale=scale, causal=causal, kv_scale=kv_scale,
                                    q_scale=q_scale, compute=compute)
    if compute == "fp8":
        latents = (inp.kv_cache.float() * mult).to(dtype)
        check_fast_mode(out, lse, q, q_scale, cache, kv_scale, latents, inp.block_table,
                        inp.cache_seqlens, scale, causal)
        return
    ref_out, ref_lse = mla_decode_reference(q, cache, inp.block_table, inp.cache_seqlens, scale,
                                            causal, 512, kv_scale=kv_scale, q_scale=q_scale)
    assert not out.isnan().any()
    tol = TOL[torch.bfloat16 if q_fp8 else dtype]
    torch.testing.assert_close(out.float(), ref_out.float(), atol=tol["atol"] * mult,
                               rtol=tol["rtol"])
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)


COMPUTE = pytest.mark.parametrize("compute", ["exact", "fp8"])


@pytest.mark.cuda
@sm90
@COMPUTE
@pytest.mark.parametrize("h_q", [1, 3, 16, 63, 64, 128])
@pytest.mark.parametrize("s_q,causal", [(1, False), (2, True), (4, True)])
def test_sm90_fp8_heads_and_query_tokens(h_q, s_q, causal, compute, kernel_env):
    run_fp8_and_check([20, 140, 4096, 0, 1, 65], s_q, h_q, causal, compute=compute)


@pytest.mark.cuda
@sm90
@COMPUTE
@pytest.mark.parametrize("L", [1, 63, 64, 65, 128, 129, 192, 193])
def test_sm90_fp8_page_boundaries(L, compute, kernel_env):
    run_fp8_and_check([L, L + 1, max(L - 1, 0)], 1, 64, False, compute=compute)
    run_fp8_and_check([L, L + 1, max(L - 1, 0)], 3, 32, True, compute=compute)


@pytest.mark.cuda
@sm90
@COMPUTE
@pytest.mark.parametrize("b", [1, 6, 128])
def test_sm90_fp8_batches_varlen(b, compute, kernel_env):
    lens = varlen_seqlens(b)
    run_fp8_and_check(lens, 2, 128, True, compute=compute)
    run_fp8_and_check(lens, 1, 16, False, compute=compute)


@pytest.mark.cuda
@sm90
@COMPUTE
@pytest.mark.parametrize("mult", [1.0, 10.0, 20.0])  # randn / 10, randn, 2 randn
def test_sm90_fp8_data_scales_fp16_and_fp8_q(mult, compute, kernel_env):
    run_fp8_and_check([20, 140, 4096, 0], 2, 64, True, mult=mult, compute=compute)
    run_fp8_and_check([20, 140, 4096, 0], 2, 64, True, dtype=torch.float16, mult=mult,
                      compute=compute)
    run_fp8_and_check([20, 140, 4096, 0], 1, 128, False, mult=mult, q_fp8=True,
                      compute=compute)


@pytest.mark.cuda
@sm90
@COMPUTE
def test_sm90_fp8_long_context_and_h_kv_heads(compute, kernel_env):
    run_fp8_and_check([32768, 5], 1, 128, False, scale=0.01, compute=compute)
    run_fp8_and_check([20, 140, 0, 65], 2, 16, True, h_kv=4, compute=compute)


@pytest.mark.cuda
@sm90
def test_sm90_fp8_fast_zero_query_row(kernel_env):
    """Fast mode on the heads-on-M kernel (64 rows): a query row of zeros gives the mean of V,
    not NaN (e4m3_row_factors: a finite scale for amax 0)."""
    inp, cache, kv_scale = fp8_inputs([20, 140, 65], 1, 64, device="cuda")
    q = inp.q.clone()
    q[:, :, 7] = 0
    sched = torch_mla.get_decode_schedule(inp.cache_seqlens, 1, 64)
    out, lse = torch_mla.mla_decode(q, cache, inp.block_table, inp.cache_seqlens, sched,
                                    kv_scale=kv_scale, compute="fp8")
    check_fast_mode(out, lse, q, None, cache, kv_scale, inp.kv_cache, inp.block_table,
                    inp.cache_seqlens, SCALE, False)


@pytest.mark.cuda
@sm90
@COMPUTE
def test_sm90_fp8_graph_replays_with_new_lengths(compute, kernel_env):
    steps = [fp8_inputs(lens, 2, 64, device="cuda", max_blocks=6, num_blocks=14)
             for lens in ([70, 3, 300], [129, 64, 0], [5, 250, 190])]
    static = [steps[0][0].q.clone(), steps[0][1].clone(), steps[0][0].block_table.clone(),
              steps[0][0].cache_seqlens.clone(), steps[0][2].clone()]

    def step(q, cache, table, lens, kv_scale):
        sched = torch_mla.get_decode_schedule(lens, 2, 64)
        return torch_mla.mla_decode(q, cache, table, lens, sched, causal=True,
                                    kv_scale=kv_scale, compute=compute)

    torch_mla.set_value_checks(False)
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            step(*[t.clone() for t in static])  # compiles outside the capture
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out, lse = step(*static)
        for inp, cache, kv_scale in steps * 2:
            for dst, src in zip(static, [inp.q, cache, inp.block_table, inp.cache_seqlens,
                                         kv_scale]):
                dst.copy_(src)
            g.replay()
            torch.cuda.synchronize()
            if compute == "fp8":
                eager = step(*static)
                assert torch.equal(out, eager[0]) and torch.equal(lse, eager[1])
                check_fast_mode(out, lse, static[0], None, static[1], static[4],
                                inp.kv_cache, *static[2:4], SCALE, True)
                continue
            ref_out, ref_lse = mla_decode_reference(*static[:4], SCALE, True, 512,
                                                    kv_scale=static[4])
            torch.testing.assert_close(out.float(), ref_out.float(), atol=8e-4, rtol=2.01 / 128)
            torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)
    finally:
        torch_mla.set_value_checks(True)


def wavefronts(addrs, nbytes):
    """Shared-memory wavefronts of one warp-wide access of nbytes (8 or 16) per lane: the
    hardware splits the warp into phases of 128 / nbytes lanes, and a phase takes as many
    wavefronts as the most distinct 4-byte words any one of the 32 banks holds."""
    per_phase = 128 // nbytes
    total = 0
    for p in range(0, 32, per_phase):
        banks: dict[int, set] = {}
        for a in addrs[p:p + per_phase]:
            for w in range(a // 4, (a + nbytes) // 4):
                banks.setdefault(w % 32, set()).add(w)
        total += max(len(v) for v in banks.values())
    return total


def test_fast_mode_v_transpose_and_p_fragment_compute_p_v():
    """Fast mode's layouts (sm90_decode.fp8_vt_unit / fp8_pv_key / fp8_p_fragment), simulated
    byte by byte: the transposed V lands in the K-major 64-byte-swizzled layout with every byte
    written once, P's register fragment (the scores' registers, unmoved) against it gives P V;
    the transpose's shared-memory wavefronts are counted per warp."""
    from torch_mla.cute_kernels.sm90_decode import (
        fp8_p_fragment,
        fp8_pv_key,
        fp8_vt_unit,
        sw64,
    )

    page = torch.randint(0, 256, (64, 576), dtype=torch.uint8)
    page[page.view(FP8).float().isnan()] = 0  # (finite codes, for the product below)
    buf = torch.zeros(9 * 4096, dtype=torch.uint8)
    for t in range(9):
        for r in range(64):
            for col in range(0, 64, 16):
                o = t * 4096 + sw64(r, col)
                buf[o:o + 16] = page[r, 64 * t + col:64 * t + col + 16]
    vt = [torch.full((256 * 64,), -1, dtype=torch.int16) for _ in range(2)]
    load_waves = store_waves = 0
    for half in range(2):
        units = [fp8_vt_unit(w, half) for w in range(128)]
        for loads, stores in units:
            regs = [buf[o:o + 8] for o, _ in loads]
            for o, _, src in stores:
                assert (vt[half][o:o + 16] == -1).all()  # each byte once
                vt[half][o:o + 16] = torch.stack([regs[n][b] for n, b in src]).to(torch.int16)
        for warp_i in range(4):
            lanes = units[32 * warp_i:32 * warp_i + 32]
            load_waves += sum(wavefronts([u[0][s][0] for u in lanes], 8) for s in range(16))
            store_waves += sum(wavefronts([u[1][e][0] for u in lanes], 16) for e in range(8))
    for half in range(2):
        for dl in range(256):
            for k in range(0, 64, 16):
                got = vt[half][sw64(dl, k):sw64(dl, k) + 16]
                want = torch.tensor([page[fp8_pv_key(k + b), 256 * half + dl] for b in range(16)])
                assert torch.equal(got, want.to(torch.int16)), (half, dl, k)
    # Conflict-free: loads 2 phases x 16 per warp, stores 4 phases x 8, 8 warps.
    assert (load_waves, store_waves) == (8 * 2 * 16, 8 * 4 * 8), (load_waves, store_waves)

    # P: thread (warp w, lane) holds S[16 w + lane // 4 + 8 h, 8 j + 2 (lane % 4) + c] at
    # accumulator index c + 2 h + 4 j; its e4m3 fragment is read in the A operand's order.
    S = torch.rand(64, 64)
    A = torch.full((64, 64), float("nan"))
    for t in range(128):
        r0, q = 16 * (t // 32) + (t % 32) // 4, t % 4
        acc = {c + 2 * h + 4 * j: S[r0 + 8 * h, 8 * j + 2 * q + c]
               for c in range(2) for h in range(2) for j in range(8)}
        for kk in range(2):
            for v in range(16):
                i, h, u = v % 4, (v // 4) % 2, v // 8
                A[r0 + 8 * h, 32 * kk + 16 * u + 4 * q + i] = acc[fp8_p_fragment(kk, v)]
    V = page[:, :512].view(FP8).float()
    Vt = torch.stack([torch.stack([vt[d // 256][sw64(d % 256, k)] for k in range(64)])
                      for d in range(512)]).to(torch.uint8).view(FP8).float()  # (512, 64)
    # (float64: the same products summed in another order; fp32 would cancel differently)
    torch.testing.assert_close(A.double() @ Vt.double().T, S.double() @ V.double(), rtol=1e-9,
                               atol=1e-9)


def _run_dither_asm(asm: str, p: float) -> float:
    """ptx.DITHER_ASM's instructions on the fp32 value p, one by one (32-bit registers as
    Python ints; fma.rn: the exact product and sum in float64, rounded once to fp32)."""
    def f32(bits):
        return struct.unpack("<f", struct.pack("<I", bits & 0xFFFFFFFF))[0]

    def bits(x):
        return struct.unpack("<I", struct.pack("<f", x))[0]

    def s32(x):
        return x - (1 << 32) if x & 0x80000000 else x

    regs = {"$1": bits(p)}

    def val(tok):
        if tok in regs:
            return regs[tok]
        if tok.startswith("0f"):
            return int(tok[2:], 16)
        return int(tok, 0) & 0xFFFFFFFF

    for line in asm.strip("{} ").split(";"):
        line = line.strip()
        if not line or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        dst, *src = [t.strip() for t in args.split(",")]
        x = [val(t) for t in src]
        if op == "mov.b32":
            r = x[0]
        elif op == "max.s32":
            r = max(s32(x[0]), s32(x[1])) & 0xFFFFFFFF
        elif op == "and.b32":
            r = x[0] & x[1]
        elif op == "xor.b32":
            r = x[0] ^ x[1]
        elif op == "or.b32":
            r = x[0] | x[1]
        elif op == "shl.b32":
            r = (x[0] << x[1]) & 0xFFFFFFFF
        elif op == "sub.s32":
            r = (x[0] - x[1]) & 0xFFFFFFFF
        elif op == "add.f32":
            r = bits(f32(x[0]) + f32(x[1]))  # (exact here: the operands share an exponent)
        elif op == "fma.rn.f32":
            r = bits(f32(x[0]) * f32(x[1]) + f32(x[2]))
        else:
            raise AssertionError(f"an instruction the test does not know: {line}")
        regs[dst] = r
    return f32(regs["$0"])


def test_fast_mode_p_dither_model():
    """The P dither of the heads-on-M fast mode (ptx.e4m3_dither, opt-in p_dither): its PTX
    text (ptx.DITHER_ASM, run here instruction by instruction) equals its Python model, which
    equals the float64 form tools/fast_mode_error.py emulates (p + ((b' + 0.5) / 256 - 0.5) x
    e4m3's step at p, b' = p's fp32 bits 8-15 with the top one flipped, the step from log2);
    it moves p by less than half a step (its rounding by less than one); every value e4m3
    holds exactly (0, powers of two: P's 2^8) rounds back to itself; and inside a binade its
    rounding is locally unbiased."""
    from torch_mla.cute_kernels.ptx import DITHER_ASM
    from torch_mla.cute_kernels.sm90_decode import e4m3_dither_model

    g = torch.Generator().manual_seed(0)
    p = torch.cat([torch.zeros(1), torch.rand(2000, generator=g) * 256,
                   torch.exp2(torch.rand(2000, generator=g) * 16 - 12),  # 2^-12 .. 2^4
                   torch.rand(500, generator=g) * 2**-6, torch.tensor([2.0**-6, 256.0])])
    low = (((p.view(torch.int32) >> 8) & 0xFF) ^ 0x80).double()
    step = torch.exp2(torch.floor(torch.log2(p.double().clamp(min=2**-6))) - 3)
    want = (p.double() + ((low + 0.5) / 256 - 0.5) * step).float()
    got = torch.tensor([e4m3_dither_model(float(x)) for x in p])
    assert torch.equal(got, want), (got - want).abs().max()
    asm = torch.tensor([_run_dither_asm(DITHER_ASM, float(x)) for x in p[::7]])
    assert torch.equal(asm, got[::7]), (asm - got[::7]).abs().max()
    assert ((got.double() - p.double()).abs() < step / 2).all()
    assert ((got.to(FP8).double() - p.double()).abs() < step).all()  # (the step at p)
    # every finite e4m3 value from 0 to 448 (the codes 0x00-0x7E) rounds back to itself, by
    # the model and by the instructions
    exact = torch.arange(0, 0x7F, dtype=torch.uint8).view(FP8).float()
    back = torch.tensor([e4m3_dither_model(float(x)) for x in exact])
    assert torch.equal(back, torch.tensor([_run_dither_asm(DITHER_ASM, float(x))
                                           for x in exact]))
    back = back.to(FP8).float()
    assert torch.equal(back, exact), exact[back != exact]
    # locally unbiased inside a binade: over [240, 244) (e4m3's step there is 16) rounding to
    # nearest gives 240 throughout (mean error -2); the dithered rounding's mean error is near
    # 0. (At a binade's lower edge a negative dither meets the half-size step below: a bias of
    # about -1/64 step over the first step, as with a random dither; the review, session 25.)
    grid = torch.linspace(240, 244, 4001)[:-1]
    assert abs((grid.to(FP8).double() - grid.double()).mean() + 2) < 0.01  # (the premise)
    dith = torch.tensor([e4m3_dither_model(float(x)) for x in grid]).to(FP8).double()
    assert abs((dith - grid.double()).mean()) < 0.5, (dith - grid.double()).mean()
