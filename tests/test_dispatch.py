"""Kernel selection: which implementation runs where, the reason given, and the one-time warning
when a GPU call falls back to the reference (CPU-only: the device is described, not used)."""

import types
import warnings

import expecttest
import pytest
import torch

from torch_mla.ops import dispatch


@pytest.fixture
def arch(monkeypatch):
    """Pretend the CUDA device has the given compute capability."""
    cap = {"value": (9, 0)}
    monkeypatch.setattr(dispatch, "_cuda_arch", lambda device: cap["value"])
    monkeypatch.delenv("TORCH_MLA_FORCE_REFERENCE", raising=False)
    monkeypatch.delenv("TORCH_MLA_PORTABLE", raising=False)
    return cap


class TestBackend(expecttest.TestCase):
    def test_reasons(self):
        mp = pytest.MonkeyPatch()
        mp.setattr(dispatch, "_cuda_arch", lambda device: (9, 0))
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
                mp.setattr(dispatch, "_cuda_arch", lambda device, cap=cap: cap)
                rows.append(dispatch.decode_backend("cuda", torch.bfloat16))
            mp.setenv("TORCH_MLA_PORTABLE", "1")
            for cap in [(9, 0), (7, 5)]:
                mp.setattr(dispatch, "_cuda_arch", lambda device, cap=cap: cap)
                rows.append(dispatch.decode_backend("cuda", torch.bfloat16))
            rows.append(dispatch.decode_backend("cuda", torch.float32))
            mp.setenv("TORCH_MLA_FORCE_REFERENCE", "1")
            rows.append(dispatch.decode_backend("cuda", torch.bfloat16))
        finally:
            mp.undo()
        self.assertExpectedInline("\n".join(f"{n}: {r}" for n, r in rows), """\
reference: cpu tensors: the kernels run on NVIDIA GPUs
sm90: compute capability 9.0: the SM90 CuTe DSL kernel
sm90: compute capability 9.0: the SM90 CuTe DSL kernel
reference: torch.float32 inputs: the kernels take bfloat16 or float16
reference: d_qk=192, d_v=128, page size 64: the kernels are built for d_qk=576, d_v=512, page size 64
reference: compute capability 7.5: the kernels need 8.0 (Ampere) or newer
sm80: compute capability 8.0: the portable CuTe DSL kernel (SM80 instructions; no native kernel for this GPU yet)
sm80: compute capability 8.6: the portable CuTe DSL kernel (SM80 instructions; no native kernel for this GPU yet)
sm80: compute capability 8.9: the portable CuTe DSL kernel (SM80 instructions; no native kernel for this GPU yet)
sm80: compute capability 10.0: the portable CuTe DSL kernel (SM80 instructions; no native kernel for this GPU yet)
sm80: compute capability 12.0: the portable CuTe DSL kernel (SM80 instructions; no native kernel for this GPU yet)
sm80: TORCH_MLA_PORTABLE=1: the portable CuTe DSL kernel (SM80 instructions)
reference: compute capability 7.5: the kernels need 8.0 (Ampere) or newer
reference: torch.float32 inputs: the kernels take bfloat16 or float16
reference: TORCH_MLA_FORCE_REFERENCE=1 is set""")


def _fake_cuda_q(dtype, d_qk=576):
    """What find_decode_kernel reads of q, for a CUDA tensor this machine cannot make."""
    return types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0), dtype=dtype,
                                 shape=(1, 1, 16, d_qk))


def test_fallback_on_gpu_warns_once_per_reason(arch, monkeypatch):
    monkeypatch.setattr(dispatch, "_warned", set())
    cache = torch.empty(1, 64, 1, 576)
    with pytest.warns(UserWarning, match="float32 inputs: the kernels take bfloat16 or float16"):
        assert dispatch.find_decode_kernel(_fake_cuda_q(torch.float32), cache, 512) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same reason again: silent
        assert dispatch.find_decode_kernel(_fake_cuda_q(torch.float32), cache, 512) is None
    arch["value"] = (7, 5)
    with pytest.warns(UserWarning, match="compute capability 7.5"):
        assert dispatch.find_decode_kernel(_fake_cuda_q(torch.bfloat16), cache, 512) is None
    for cap, kernel in [((9, 0), "sm90"), ((8, 0), "sm80"), ((8, 9), "sm80"), ((12, 0), "sm80")]:
        arch["value"] = cap
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a kernel: no warning
            run = dispatch.find_decode_kernel(_fake_cuda_q(torch.bfloat16), cache, 512)
        assert run.args == (kernel,), (cap, run)


def test_portable_kernel_is_compiled_for_the_device_arch(monkeypatch):
    """Each GPU gets the portable kernel (and the combine) built for its own arch; the H200,
    forced, gets them for sm_90a."""
    got = []
    monkeypatch.setattr(dispatch, "_compiled_decode_sm80",
                        lambda dtype, causal, arch: got.append(("decode", causal, arch)))
    monkeypatch.setattr(dispatch, "_compiled_decode_sm90",
                        lambda dtype, causal: got.append(("decode_sm90", causal)))
    for cap in [(8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (10, 3), (12, 0), (12, 1)]:
        arch = dispatch.gpu_arch(*cap)
        dispatch.compiled_decode("sm80", torch.bfloat16, cap == (8, 6), arch)
    dispatch.compiled_decode("sm90", torch.bfloat16, True, dispatch.SM90_ARCH)
    assert got == [("decode", False, "sm_80"), ("decode", True, "sm_86"),
                   ("decode", False, "sm_89"), ("decode", False, "sm_90a"),
                   ("decode", False, "sm_100a"), ("decode", False, "sm_103a"),
                   ("decode", False, "sm_120a"), ("decode", False, "sm_121a"),
                   ("decode_sm90", True)]
    assert [dispatch._has_pdl(a) for a in ("sm_80", "sm_89", "sm_90a", "sm_100a", "sm_120a")] == [
        False, False, True, True, True]


def test_forced_reference_and_cpu_do_not_warn(arch, monkeypatch):
    monkeypatch.setattr(dispatch, "_warned", set())
    monkeypatch.setenv("TORCH_MLA_FORCE_REFERENCE", "1")
    cache = torch.empty(1, 64, 1, 576)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dispatch.find_decode_kernel(_fake_cuda_q(torch.bfloat16), cache, 512) is None
        q = torch.empty(1, 1, 16, 576, dtype=torch.float32)
        assert dispatch.find_decode_kernel(q, cache, 512) is None
