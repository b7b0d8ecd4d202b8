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
    return cap


class TestBackend(expecttest.TestCase):
    def test_reasons(self):
        mp = pytest.MonkeyPatch()
        mp.setattr(dispatch, "_cuda_arch", lambda device: (9, 0))
        mp.delenv("TORCH_MLA_FORCE_REFERENCE", raising=False)
        try:
            rows = [
                dispatch.decode_backend("cpu", torch.bfloat16),
                dispatch.decode_backend("cuda", torch.bfloat16),
                dispatch.decode_backend("cuda", torch.float16),
                dispatch.decode_backend("cuda", torch.float32),
                dispatch.decode_backend("cuda", torch.bfloat16, d_qk=192, d_v=128),
            ]
            mp.setattr(dispatch, "_cuda_arch", lambda device: (8, 6))
            rows.append(dispatch.decode_backend("cuda", torch.bfloat16))
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
reference: compute capability 8.6: torch_mla has a kernel for 9.0 (H100/H200) only so far
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
    arch["value"] = (8, 0)
    with pytest.warns(UserWarning, match="compute capability 8.0"):
        assert dispatch.find_decode_kernel(_fake_cuda_q(torch.bfloat16), cache, 512) is None
    arch["value"] = (9, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the kernel: no warning
        assert dispatch.find_decode_kernel(_fake_cuda_q(torch.bfloat16), cache, 512) is not None


def test_forced_reference_and_cpu_do_not_warn(arch, monkeypatch):
    monkeypatch.setattr(dispatch, "_warned", set())
    monkeypatch.setenv("TORCH_MLA_FORCE_REFERENCE", "1")
    cache = torch.empty(1, 64, 1, 576)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dispatch.find_decode_kernel(_fake_cuda_q(torch.bfloat16), cache, 512) is None
        q = torch.empty(1, 1, 16, 576, dtype=torch.float32)
        assert dispatch.find_decode_kernel(q, cache, 512) is None
