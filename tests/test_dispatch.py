"""Kernel selection: which implementation runs where, the reason given, and the one-time warning
when a GPU call falls back to the reference (CPU-only: the device is described, not used)."""

import math
import re
import types
import warnings

import expecttest
import pytest
import torch
from expecttest import assert_expected_inline

import torch_mla
from torch_mla import contract
from torch_mla.constants import COMBINE_VARIANTS
from torch_mla.contract import has_pdl
from torch_mla.ops import dispatch, registry, selfcheck
from torch_mla.reference import mla_decode_reference
from torch_mla.testing import make_decode_inputs


@pytest.fixture
def arch(monkeypatch):
    """Pretend the CUDA device has the given compute capability."""
    cap = {"value": (9, 0)}
    monkeypatch.setattr(dispatch, "cuda_capability", lambda device: cap["value"])
    monkeypatch.delenv("TORCH_MLA_FORCE_REFERENCE", raising=False)
    monkeypatch.delenv("TORCH_MLA_PORTABLE", raising=False)
    dispatch.clear_caches()  # (warnings given, first-use checks, arches of other tests' GPUs)
    yield cap
    dispatch.clear_caches()


class TestBackend(expecttest.TestCase):
    def test_reasons(self):
        mp = pytest.MonkeyPatch()
        mp.setattr(dispatch, "cuda_capability", lambda device: (9, 0))
        mp.delenv("TORCH_MLA_FORCE_REFERENCE", raising=False)
        mp.delenv("TORCH_MLA_PORTABLE", raising=False)
        try:
            rows = [
                dispatch.decode_backend("cpu", torch.bfloat16),
                dispatch.decode_backend("cuda", torch.bfloat16),
                dispatch.decode_backend("cuda", torch.float16),
                dispatch.decode_backend("cuda", torch.float32),
                dispatch.decode_backend("cuda", torch.bfloat16, d_qk=192, d_v=128),
            ]
            for cap in [(7, 5), (8, 0), (8, 6), (8, 9), (10, 0), (12, 0)]:
                mp.setattr(dispatch, "cuda_capability", lambda device, cap=cap: cap)
                rows.append(dispatch.decode_backend("cuda", torch.bfloat16))
            mp.setenv("TORCH_MLA_PORTABLE", "1")
            for cap in [(9, 0), (7, 5)]:
                mp.setattr(dispatch, "cuda_capability", lambda device, cap=cap: cap)
                rows.append(dispatch.decode_backend("cuda", torch.bfloat16))
            rows.append(dispatch.decode_backend("cuda", torch.float32))
            mp.setenv("TORCH_MLA_FORCE_REFERENCE", "1")
            rows.append(dispatch.decode_backend("cuda", torch.bfloat16))
        finally:
            mp.undo()
        self.assertExpectedInline("\n".join(f"{n}: {r}" for n, r in rows), """\
reference: cpu tensors: the kernels run on NVIDIA GPUs
sm90: compute capability 9.0: the SM90 CuTe DSL kernel (its keys-on-M variant where s_q * h_q <= 32)
sm90: compute capability 9.0: the SM90 CuTe DSL kernel (its keys-on-M variant where s_q * h_q <= 32)
reference: torch.float32 inputs: the kernels take bfloat16 or float16
reference: d_qk=192, d_v=128, page size 64: the kernels are built for d_qk=576, d_v=512, page size 64
reference: compute capability 7.5: the kernels need 8.0 (Ampere) or newer
sm80: compute capability 8.0: the portable CuTe DSL kernel (SM80 instructions; verified on an H200, checked against the reference on first use on this GPU)
sm80: compute capability 8.6: the portable CuTe DSL kernel (SM80 instructions; verified on an H200, checked against the reference on first use on this GPU)
sm80: compute capability 8.9: the portable CuTe DSL kernel (SM80 instructions; verified on an H200, checked against the reference on first use on this GPU)
sm80: compute capability 10.0 (the native SM100 kernel has not run on a Blackwell GPU yet: TORCH_MLA_SM100=1 opts in to it): the portable CuTe DSL kernel (SM80 instructions; verified on an H200, checked against the reference on first use on this GPU)
sm80: compute capability 12.0: the portable CuTe DSL kernel (SM80 instructions; verified on an H200, checked against the reference on first use on this GPU)
sm80: TORCH_MLA_PORTABLE=1: the portable CuTe DSL kernel (SM80 instructions; verified on an H200)
reference: compute capability 7.5: the kernels need 8.0 (Ampere) or newer
reference: torch.float32 inputs: the kernels take bfloat16 or float16
reference: TORCH_MLA_FORCE_REFERENCE=1 is set""")


def _fake_cuda_q(dtype, d_qk=576):
    """What find_decode_kernel reads of q, for a CUDA tensor this machine cannot make."""
    return types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0), dtype=dtype,
                                 shape=(1, 1, 16, d_qk))


def test_fallback_on_gpu_warns_once_per_reason(arch, monkeypatch):
    cache = torch.empty(1, 64, 1, 576)
    with pytest.warns(UserWarning, match="float32 inputs: the kernels take bfloat16 or float16"):
        assert dispatch.find_decode_kernel(_fake_cuda_q(torch.float32), cache, 512) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same reason again: silent
        assert dispatch.find_decode_kernel(_fake_cuda_q(torch.float32), cache, 512) is None
    arch["value"] = (7, 5)
    with pytest.warns(UserWarning, match="compute capability 7.5"):
        assert dispatch.find_decode_kernel(_fake_cuda_q(torch.bfloat16), cache, 512) is None
    arch["value"] = (9, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a kernel: no warning
        assert dispatch.find_decode_kernel(_fake_cuda_q(torch.bfloat16), cache, 512) is \
            dispatch.run_sm90
    # Other GPUs of compute capability 8.0+ run the portable kernel, after a first-use check
    # against the reference (it was verified on an H200 only); TORCH_MLA_PORTABLE=1 forces it
    # on the H200, where it needs none.
    checked = []
    monkeypatch.setattr(selfcheck, "check_kernel",
                        lambda run, device, dtype: checked.append((arch["value"], run)))
    caps = [(8, 0), (8, 9), (10, 0), (12, 0)]
    for cap in caps:
        arch["value"] = cap
        dispatch.clear_caches()  # (each pretends another GPU as device 0)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert dispatch.find_decode_kernel(_fake_cuda_q(torch.bfloat16), cache, 512) is \
                dispatch.run_sm80
    assert checked == [(cap, dispatch.run_sm80) for cap in caps]
    arch["value"] = (9, 0)
    monkeypatch.setenv("TORCH_MLA_PORTABLE", "1")
    assert dispatch.find_decode_kernel(_fake_cuda_q(torch.bfloat16), cache, 512) is \
        dispatch.run_sm80
    assert len(checked) == 4


def test_portable_kernel_falls_back_when_its_first_use_check_fails(arch, monkeypatch):
    check = selfcheck.check_kernel
    monkeypatch.setattr(selfcheck, "check_kernel",
                        lambda run, device, dtype: check(run, "cpu", dtype))
    monkeypatch.setattr(dispatch, "run_sm80", lambda q, kv, table, seqlens, meta, splits, scale,
                        causal: _ignores_causal(q, kv, table, seqlens, scale, causal))
    arch["value"] = (8, 6)
    cache = torch.empty(1, 64, 1, 576)
    with pytest.warns(UserWarning) as w:
        assert dispatch.find_decode_kernel(_fake_cuda_q(torch.bfloat16), cache, 512) is None
    # The values are the data's; where and how many differ is the check's.
    message = re.sub(r"(?<=[=e] )-?\d[\d.e+-]*", "X", str(w[0].message))
    expecttest.assert_expected_inline(message, """torch_mla.mla_decode runs the slow plain-PyTorch reference on this GPU: the portable kernel did not match the reference in its first-use check (lengths [200, 7, 64], s_q 2, h_q 64, causal True: out[0, 0, 0, 5] = X, reference X (50038 of 196608 values differ))""")



def test_portable_kernel_is_compiled_for_the_device_arch(arch, monkeypatch):
    """Each GPU gets the portable decode step built for its own arch; the H200, forced, gets it
    for sm_90a, and the SM90 step is sm_90a's."""
    got = []
    monkeypatch.setattr(registry, "compiled", lambda config, a: got.append((config, a)))
    for cap in [(8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (10, 3), (12, 0), (12, 1)]:
        arch["value"] = cap
        dispatch.clear_caches()
        dispatch.STEPS["sm80"](torch.bfloat16, cap == (8, 6), 0)
    dispatch.STEPS["sm90"](torch.float16, True, 0)
    assert [(c.name, c.key(), a) for c, a in got] == [
        ("step_sm80", {"dtype": "bf16", "causal": False}, "sm_80"),
        ("step_sm80", {"dtype": "bf16", "causal": True}, "sm_86"),
        ("step_sm80", {"dtype": "bf16", "causal": False}, "sm_89"),
        ("step_sm80", {"dtype": "bf16", "causal": False}, "sm_90a"),
        ("step_sm80", {"dtype": "bf16", "causal": False}, "sm_100a"),
        ("step_sm80", {"dtype": "bf16", "causal": False}, "sm_103a"),
        ("step_sm80", {"dtype": "bf16", "causal": False}, "sm_120a"),
        ("step_sm80", {"dtype": "bf16", "causal": False}, "sm_121a"),
        ("step_sm90", {"dtype": "fp16", "causal": True}, "sm_90a")]
    assert [has_pdl(a) for a in ("sm_80", "sm_89", "sm_90a", "sm_100a", "sm_120a")] == [
        False, False, True, True, True]


def test_forced_reference_and_cpu_do_not_warn(arch, monkeypatch):
    monkeypatch.setenv("TORCH_MLA_FORCE_REFERENCE", "1")
    cache = torch.empty(1, 64, 1, 576)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dispatch.find_decode_kernel(_fake_cuda_q(torch.bfloat16), cache, 512) is None
        q = torch.empty(1, 1, 16, 576, dtype=torch.float32)
        assert dispatch.find_decode_kernel(q, cache, 512) is None


def _fake_cuda(dtype, shape, ptr=0):
    """A CUDA tensor's metadata, as the small kernels' dispatch reads it."""
    return types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0), dtype=dtype,
                                 shape=shape, data_ptr=lambda: ptr)


def test_small_kernels_run_from_sm80_and_compile_for_the_device_arch(arch, monkeypatch):
    """schedule and append_kv use no arch-specific instruction: the kernel compiled for the
    device's arch (sm_90a on an H200: the arch the decode kernel and precompile use)."""
    monkeypatch.setattr(registry, "compiled", lambda config, a: " ".join(
        [config.name, a, *config.key().values()]))
    bf16, fp32 = torch.bfloat16, torch.float32
    cuda = torch.device("cuda", 0)

    def append(cache=bf16, src=bf16, slot=torch.int64, d_rope=64, ptr=0):
        return dispatch.find_append_kernel(
            _fake_cuda(cache, (4, 64, 1, 512 + d_rope), ptr), _fake_cuda(src, (3, 512)),
            _fake_cuda(src, (3, d_rope)), _fake_cuda(slot, (3,)))

    rows = []
    for cap in [(7, 5), (8, 0), (8, 6), (9, 0), (10, 0), (12, 0), (13, 0)]:
        arch["value"] = cap
        dispatch.clear_caches()
        rows.append(f"{cap}: {dispatch.find_schedule_kernel(cuda)} | {append(src=fp32)}")
    arch["value"] = (9, 0)
    dispatch.clear_caches()
    rows += [f"{append(slot=torch.int32)}", f"{append(fp32, fp32)}", f"{append(bf16, fp32)}",
             f"{append(src=torch.float16)} {append(d_rope=32)} {append(ptr=8)}",
             f"{dispatch.find_schedule_kernel(torch.device('cpu'))}"]
    k_pe16 = _fake_cuda(torch.float16, (3, 64))
    rows.append(str(dispatch.find_append_kernel(_fake_cuda(bf16, (4, 64, 1, 576)),
                                                _fake_cuda(bf16, (3, 512)), k_pe16,
                                                _fake_cuda(torch.int64, (3,)))))
    monkeypatch.setenv("TORCH_MLA_FORCE_REFERENCE", "1")
    rows.append(f"{dispatch.find_schedule_kernel(cuda)} {append()}")
    assert_expected_inline("\n".join(rows), """\
(7, 5): None | None
(8, 0): schedule sm_80 | append_kv sm_80 bf16 fp32 int64
(8, 6): schedule sm_86 | append_kv sm_86 bf16 fp32 int64
(9, 0): schedule sm_90a | append_kv sm_90a bf16 fp32 int64
(10, 0): schedule sm_100a | append_kv sm_100a bf16 fp32 int64
(12, 0): schedule sm_120a | append_kv sm_120a bf16 fp32 int64
(13, 0): None | None
append_kv sm_90a bf16 bf16 int32
None
append_kv sm_90a bf16 fp32 int64
append_kv sm_90a bf16 fp16 int64 None None
None
None
None None""")


# --- SM100: opt-in, and checked against the reference on first use ---------------------------


def test_sm100_is_opt_in(arch, monkeypatch):
    monkeypatch.delenv("TORCH_MLA_SM100", raising=False)
    rows = []
    for cap, env in [((10, 0), None), ((10, 0), "1"), ((10, 0), "0"), ((10, 3), "1")]:
        arch["value"] = cap
        if env is None:
            monkeypatch.delenv("TORCH_MLA_SM100", raising=False)
        else:
            monkeypatch.setenv("TORCH_MLA_SM100", env)
        name, reason = dispatch.decode_backend("cuda", torch.bfloat16)
        rows.append(f"{cap} {env}: {name}: {reason}")
    expecttest.assert_expected_inline("\n".join(rows), """\
(10, 0) None: sm80: compute capability 10.0 (the native SM100 kernel has not run on a Blackwell GPU yet: TORCH_MLA_SM100=1 opts in to it): the portable CuTe DSL kernel (SM80 instructions; verified on an H200, checked against the reference on first use on this GPU)
(10, 0) 1: sm100: compute capability 10.0 and TORCH_MLA_SM100=1: the SM100 CuTe DSL kernel (not yet run on a Blackwell GPU; checked against the reference on first use)
(10, 0) 0: sm80: compute capability 10.0 (the native SM100 kernel has not run on a Blackwell GPU yet: TORCH_MLA_SM100=1 opts in to it): the portable CuTe DSL kernel (SM80 instructions; verified on an H200, checked against the reference on first use on this GPU)
(10, 3) 1: sm80: compute capability 10.3: the portable CuTe DSL kernel (SM80 instructions; verified on an H200, checked against the reference on first use on this GPU)""")  # noqa: E501


@pytest.fixture
def sm100(arch, monkeypatch):
    """A compute-capability-10.0 device with TORCH_MLA_SM100=1, a fresh first-use record, and
    the check's problems sent to the CPU (this machine has no GPU to send them to)."""
    arch["value"] = (10, 0)
    monkeypatch.setenv("TORCH_MLA_SM100", "1")
    check = selfcheck.check_kernel
    monkeypatch.setattr(selfcheck, "check_kernel",
                        lambda run, device, dtype: check(run, "cpu", dtype))
    calls = []

    def use(kernel):
        def run(q, kv, table, seqlens, meta, splits, scale, causal):
            calls.append((q.device.type, int((splits[1:] - splits[:-1]).max()),
                          int(seqlens.min()), causal))
            return kernel(q, kv, table, seqlens, scale, causal)
        monkeypatch.setattr(dispatch, "run_sm100", run)
        return run

    return types.SimpleNamespace(use=use, calls=calls)


def reference_kernel(q, kv, table, seqlens, scale, causal):
    return mla_decode_reference(q, kv, table, seqlens, scale, causal, 512)


def test_sm100_right_kernel_is_used_after_one_check(sm100):
    run = sm100.use(reference_kernel)
    cache = torch.empty(1, 64, 1, 576)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dispatch.find_decode_kernel(_fake_cuda_q(torch.bfloat16), cache, 512) is run
        assert dispatch.find_decode_kernel(_fake_cuda_q(torch.bfloat16), cache, 512) is run
    # One check per (device, dtype), over every problem: split requests (pieces > 1), an empty
    # request, causal and not. fp16 is checked on its own.
    assert sm100.calls == [("cpu", 3, 0, False), ("cpu", 4, 7, True), ("cpu", 16, 1000, True)]
    assert dispatch.find_decode_kernel(_fake_cuda_q(torch.float16), cache, 512) is run
    assert len(sm100.calls) == 6


def _reads_poison(q, kv, table, seqlens, scale, causal):
    out, lse = reference_kernel(q, kv, table, seqlens, scale, causal)
    return out + kv[:, :, :, :512].float().sum() * 0, lse  # touches every cache slot


def _ignores_causal(q, kv, table, seqlens, scale, causal):
    return reference_kernel(q, kv, table, seqlens, scale, False)


def _lse_in_log2(q, kv, table, seqlens, scale, causal):
    out, lse = reference_kernel(q, kv, table, seqlens, scale, causal)
    return out, lse / math.log(2.0)


def _raises(q, kv, table, seqlens, scale, causal):
    raise RuntimeError("CUDA error: an illegal instruction was encountered")


@pytest.mark.parametrize("kernel,expected", [
    (_reads_poison, "lengths [1, 63, 64, 65, 130, 0], s_q 1, h_q 16, causal False: "
                    "out[0, 0, 0, 0] = nan, reference X (49152 of 49152 values differ)"),
    (_ignores_causal, "lengths [200, 7, 64], s_q 2, h_q 64, causal True: "
                      "out[0, 0, 0, 5] = X, reference X (50038 of 196608 values differ)"),
    (_lse_in_log2, "lengths [1, 63, 64, 65, 130, 0], s_q 1, h_q 16, causal False: "
                   "lse[0, 0, 0] = X, reference X (80 of 96 values differ)"),
    (_raises, "lengths [1, 63, 64, 65, 130, 0], s_q 1, h_q 16, causal False: RuntimeError: "
              "CUDA error: an illegal instruction was encountered"),
])
def test_sm100_wrong_kernel_warns_and_falls_back(sm100, kernel, expected):
    sm100.use(kernel)
    cache = torch.empty(1, 64, 1, 576)
    with pytest.warns(UserWarning) as record:
        assert dispatch.find_decode_kernel(_fake_cuda_q(torch.bfloat16), cache, 512) is None
    # The values are the data's; where and how many differ is the check's.
    message = re.sub(r"(?<=[=e] )-?\d[\d.e+-]*", "X", str(record[0].message))
    prefix = ("torch_mla.mla_decode runs the slow plain-PyTorch reference on this GPU: the "
              "SM100 kernel did not match the reference in its first-use check (")
    assert message == prefix + expected + ")"
    n = len(sm100.calls)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # decided once: no second check, no second warning
        assert dispatch.find_decode_kernel(_fake_cuda_q(torch.bfloat16), cache, 512) is None
    assert len(sm100.calls) == n


def test_sm100_check_waits_for_a_call_outside_graph_capture(sm100, monkeypatch):
    run = sm100.use(reference_kernel)
    cache = torch.empty(1, 64, 1, 576)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.warns(UserWarning, match="first-use check cannot run during a CUDA-graph "
                                         "capture; make one call before capturing"):
        assert dispatch.find_decode_kernel(_fake_cuda_q(torch.bfloat16), cache, 512) is None
    assert sm100.calls == []
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert dispatch.find_decode_kernel(_fake_cuda_q(torch.bfloat16), cache, 512) is run
    assert len(sm100.calls) == 3


def contract_mismatches(args, names, sizes: dict) -> list[str]:
    """The arguments a stand-in step received that differ from their definition in
    torch_mla/contract.py (shape with these sizes, fixed strides, 16-byte rows, alignment,
    index and fp32 dtypes, scalar types): what the kernels were compiled for."""
    dtypes = {"i32": torch.int32, "f32": torch.float32}
    bad = []
    for name, a in zip(names, args, strict=True):
        spec = contract.ARGS[name]
        if spec.shape is None:
            ok = isinstance(a, int if spec.dtype == "i32" else float)
        else:
            want = [sizes.get(d, d) for d in spec.shape]
            ok = (len(a.shape) == len(want) and all(w in ("?", n) for w, n in zip(want, a.shape))
                  and all(s == st if isinstance(s, int) else
                          s == "dyn" or st * a.element_size() % 16 == 0
                          for s, st in zip(spec.stride, a.stride()))
                  and a.data_ptr() % spec.align == 0
                  and a.dtype == dtypes.get(spec.dtype, a.dtype))
        if not ok:
            bad.append(name)
    return bad


@pytest.mark.parametrize("h_kv, s_q, misaligned", [(1, 1, False), (1, 3, False), (2, 2, False),
                                                   (1, 2, True)])
def test_split_kv_hands_the_step_the_kernels_layout(monkeypatch, h_kv, s_q, misaligned):
    """The host side of a kernel call (run_split_kv) on CPU tensors, with a stand-in for the
    compiled step (the launch needs a GPU): each KV head's query rows, cache rows, output rows and
    workspace reach the step in the layouts the kernels were compiled for, and what the step
    writes comes back as out [b, s_q, h_q, 512] and lse [b, h_q, s_q] in the right places."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: None)  # (CPU: device index None)
    monkeypatch.setenv("TORCH_MLA_KEYSM", "0")  # the heads-on-M step (4 heads: keys-on-M else)
    inp = make_decode_inputs([3, 70, 130], s_q, 4, h_kv=h_kv)
    if misaligned:  # a contiguous q 2 bytes past a 16-byte boundary: the step gets a copy
        inp.q = torch.empty(inp.q.numel() + 1, dtype=inp.q.dtype)[1:].view(inp.q.shape).copy_(
            inp.q)
    b, g = 3, 4 // h_kv
    meta, splits = torch_mla.get_decode_schedule(inp.cache_seqlens, s_q, 4, h_kv=h_kv)
    layouts, mismatches = set(), []

    def step(q3, kv, table, seqlens, meta_, splits_, out3, lse, oacc, lseacc, scale_log2,
             variant, *extra):
        rows, slots = s_q * g, b + meta.shape[0]
        sizes = {"b": b, "rows": rows, "n_blocks": inp.kv_cache.shape[0],
                 "max_blocks": inp.block_table.shape[1], "parts": meta.shape[0],
                 "slots": slots, "h_q": g, "s_q": s_q}
        mismatches.extend(contract_mismatches(
            (q3, kv, table, seqlens, meta_, splits_, out3, lse, oacc, lseacc, scale_log2,
             variant), contract.STEP_ARGS[:-1], sizes))  # (the stream is TVM-FFI's)
        layouts.add((q3.shape == (b, rows, 576) and q3.stride()[1:] == (576, 1)
                     and q3.data_ptr() % 16 == 0,
                     kv.shape == (inp.kv_cache.shape[0], 64, 576) and kv.stride(-1) == 1,
                     out3.shape == (b, rows, 512) and out3.is_contiguous(),
                     lse.shape == (b, g, s_q) and lse.is_contiguous(),
                     oacc.shape == (slots, rows, 512) and oacc.is_contiguous(),
                     lseacc.shape == (slots, rows) and lseacc.is_contiguous(),
                     table is inp.block_table and seqlens is inp.cache_seqlens,
                     meta_ is meta and splits_ is splits, extra == (None, None, None),
                     round(scale_log2, 6), variant))
        # Stand-in results: a row's output is its query's first 512 columns plus the first
        # cached row of request 0 in its KV head; its lse is its query's first entry.
        out3.copy_(q3[..., :512] + kv[table[0, 0], 0, :512])
        lse.copy_(q3[..., 0].view(b, s_q, g).transpose(1, 2))

    monkeypatch.setitem(dispatch.STEPS, "sm90", lambda dtype, causal, index: step)
    out, lse = dispatch.run_sm90(inp.q, inp.kv_cache, inp.block_table, inp.cache_seqlens, meta,
                                  splits, 0.5, True)
    variant = dispatch.combine_variant(b, meta.shape[0], s_q * g,
                                       dispatch.device_num_sms(inp.q.device))
    assert layouts == {(True,) * 9 + (round(0.5 * math.log2(math.e), 6), variant)}
    assert mismatches == []
    heads = inp.kv_cache[inp.block_table[0, 0], 0, torch.arange(4) // g, :512]  # (h_q, 512)
    torch.testing.assert_close(out, inp.q[..., :512] + heads, rtol=0, atol=0)
    torch.testing.assert_close(lse, inp.q[..., 0].float().transpose(1, 2), rtol=0, atol=0)


@pytest.mark.parametrize("h_kv", [1, 2])
def test_split_kv_loads_no_step_for_an_empty_batch(monkeypatch, h_kv):
    # b = 0 launches nothing, so it loads (or compiles) no step either; the outputs keep their
    # shapes and dtypes (the stand-in loader fails the test if called).
    monkeypatch.setattr(torch.cuda, "current_device", lambda: None)

    def no_step(*key):
        raise AssertionError(f"a step was loaded for an empty batch: {key}")

    monkeypatch.setattr(dispatch, "STEPS", {k: no_step for k in dispatch.STEPS})
    inp = make_decode_inputs([3], 2, 4, h_kv=h_kv)
    q = inp.q[:0]
    lens = inp.cache_seqlens[:0]
    meta, splits = torch_mla.get_decode_schedule(lens, 2, 4, h_kv=h_kv)
    out, lse = dispatch.run_sm90(q, inp.kv_cache, inp.block_table[:0], lens, meta, splits, 0.5,
                                 True)
    assert out.shape == (0, 2, 4, 512) and out.dtype == q.dtype
    assert lse.shape == (0, 4, 2) and lse.dtype == torch.float32


@pytest.mark.parametrize("compute,dither", [("exact", False), ("fp8", False), ("fp8", True),
                                            ("exact", True)])
def test_split_kv_hands_an_fp8_step_its_bytes_and_scales(monkeypatch, compute, dither):
    """The float8_e4m3fn paths of run_split_kv (stand-in step, CPU tensors): the cache as its
    bytes, an e4m3 q as bf16 (exact mode) or as its bytes (fast mode), out in bf16, and the
    scales behind the combine variant; TORCH_MLA_FAST_DITHER=1: fast mode's dithered step."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: None)  # (CPU: device index None)
    monkeypatch.setenv("TORCH_MLA_KEYSM", "0")  # the heads-on-M step (8 rows: keys-on-M else)
    monkeypatch.setenv("TORCH_MLA_FAST_DITHER", "1" if dither else "0")
    inp = make_decode_inputs([3, 70], 2, 4)
    q8, kv8 = inp.q.to(torch.float8_e4m3fn), inp.kv_cache.to(torch.float8_e4m3fn)
    kv_scale, q_scale = torch.full((1,), 0.5), torch.full((1,), 0.25)
    meta, splits = torch_mla.get_decode_schedule(inp.cache_seqlens, 2, 4)
    seen = []

    def step(q3, kv, table, seqlens, meta_, splits_, out3, lse, oacc, lseacc, scale_log2,
             variant, *extra):
        seen.append((q3.dtype, tuple(q3.shape), kv.dtype, tuple(kv.shape), out3.dtype,
                     tuple(out3.shape), extra[0] is kv_scale, extra[1] is q_scale, extra[2]))
        sizes = {"b": 2, "rows": 8, "n_blocks": kv8.shape[0], "max_blocks": table.shape[1],
                 "parts": meta.shape[0], "slots": 2 + meta.shape[0], "h_q": 4, "s_q": 2}
        seen.append(contract_mismatches(
            (q3, kv, table, seqlens, meta_, splits_, out3, lse, oacc, lseacc, scale_log2,
             variant, *extra), contract.STEP_ARGS[:-1] + contract.FP8_ARGS, sizes))
        q_bytes = q8.view(torch.uint8).view(2, 8, 576)
        assert torch.equal(q3, q_bytes if compute == "fp8" else q8.to(torch.bfloat16).view(
            2, 8, 576))
        assert torch.equal(kv, kv8.view(torch.uint8).view(-1, 64, 576))
        out3.fill_(1.0)
        lse.fill_(2.0)

    key = "sm90_fp8" if compute == "exact" else "sm90_fp8_fast_q8"
    key += "_dither" if dither and compute == "fp8" else ""  # (exact mode: no P to dither)
    for other in {"sm90_fp8", "sm90_fp8_fast_q8", "sm90_fp8_fast_q8_dither"} - {key}:
        monkeypatch.setitem(dispatch.STEPS, other, None)  # (a call would fail)
    monkeypatch.setitem(dispatch.STEPS, key, lambda dtype, causal, index: step)
    config = dispatch._STEP_KINDS[key]
    assert config.get("p_dither", False) == (dither and compute == "fp8") and config.get(
        "compute") == (
        "fp8" if compute == "fp8" else None)
    out, lse = dispatch.run_sm90_fp8(q8, kv8, inp.block_table, inp.cache_seqlens, meta, splits,
                                      0.5, False, kv_scale, q_scale, compute)
    q_dtype = torch.uint8 if compute == "fp8" else torch.bfloat16
    assert seen == [(q_dtype, (2, 8, 576), torch.uint8, (kv8.shape[0], 64, 576), torch.bfloat16,
                     (2, 8, 512), True, True, 1), []]
    torch.testing.assert_close(out, torch.ones(2, 2, 4, 512, dtype=torch.bfloat16))
    torch.testing.assert_close(lse, torch.full((2, 4, 2), 2.0))


@pytest.mark.parametrize("num_sms", [132, 78, 64])
def test_combine_16_warps_a_row_by_waves_of_their_ctas(num_sms):
    """With 16 warps a row in reach (16 x batch <= num_parts): unroll 4 while its 512-thread
    CTAs (one an SM) fit one wave, unroll 2 (two an SM) while they fit one wave of those, then
    4 warps a row; below that the choice does not depend on the device's size."""
    from torch_mla.scheduling import CombineConfig

    if dispatch._COMBINE_WPR:
        pytest.skip("TORCH_MLA_DEV_COMBINE_WPR overrides the choice")

    def pick(batch, parts, rows, sms=num_sms):
        c = CombineConfig.from_heuristic(batch, parts, rows, sms)
        assert COMBINE_VARIANTS[c.variant] == (c.warps_per_row, c.unroll)
        return c.warps_per_row, c.unroll

    for batch, rows in [(1, 64), (1, 128), (2, 64), (2, 128), (4, 128), (2, 256), (4, 64)]:
        ctas = batch * rows
        want = ((16, 4) if ctas <= num_sms else (16, 2)
                if ctas <= 2 * num_sms else (4, 4))
        assert pick(batch, 16 * batch, rows) == want, (batch, rows)
        below = pick(batch, 16 * batch - 1, rows)
        assert below == pick(batch, 16 * batch - 1, rows, 10 ** 6) and below[0] != 16
    caches = (dispatch.combine_config, dispatch.combine_variant)
    for f in caches:
        f.cache_clear()
    try:
        assert dispatch.combine_variant(2, 66, 256, 132) == COMBINE_VARIANTS.index((4, 4))
        assert dispatch.combine_variant(2, 66, 128, 132) == COMBINE_VARIANTS.index((16, 2))
        assert dispatch.combine_variant(1, 66, 128, 132) == COMBINE_VARIANTS.index((16, 4))
    finally:
        for f in caches:  # (no choice made under the patch outlives it)
            f.cache_clear()
    assert dispatch.device_num_sms(torch.device("cpu")) == 132


def test_no_import_cycle_between_torch_mla_modules():
    """No torch_mla module imports, at module level or inside a function, one that imports it
    back (a package's __init__, which always runs first, aside): the dependencies form layers
    (ops -> dispatch -> registry -> kernel_cache; kernels -> contract -> constants)."""
    import ast
    from pathlib import Path

    root = Path(torch_mla.__file__).parent
    files = {}
    for f in root.rglob("*.py"):
        parts = list(f.relative_to(root.parent).with_suffix("").parts)
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    graph = {}
    for mod, f in files.items():
        package = mod if f.name == "__init__.py" else mod.rsplit(".", 1)[0]
        targets = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets.update(f"{base}.{a.name}" if f"{base}.{a.name}" in files else base
                               for a in node.names)
        graph[mod] = {t for t in targets if t in files and t != mod
                      and not mod.startswith(t + ".")}
    cycles, state, path = [], {}, []

    def visit(mod):
        state[mod] = "open"
        path.append(mod)
        for t in sorted(graph[mod]):
            if state.get(t) == "open":
                cycles.append(" -> ".join(path[path.index(t):] + [t]))
            elif t not in state:
                visit(t)
        path.pop()
        state[mod] = "done"

    for mod in sorted(graph):
        if mod not in state:
            visit(mod)
    assert cycles == []
    assert "torch_mla.ops.registry" in graph["torch_mla.ops.dispatch"]  # (the graph is real)
