"""`python -m torch_mla`: versions, GPUs, and which decode implementation runs where, and why."""

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import expecttest
import torch

import torch_mla
from torch_mla import __main__ as cli

ROOT = Path(__file__).resolve().parents[1]


def table(text: str) -> str:
    return text[text.index("torch_mla.mla_decode with"):]


class TestMain(expecttest.TestCase):
    def test_module_runs_and_reports_versions_and_the_cpu(self):
        env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
        env.pop("TORCH_MLA_FORCE_REFERENCE", None)
        env.pop("TORCH_MLA_PORTABLE", None)
        run = subprocess.run([sys.executable, "-m", "torch_mla"], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=120)
        self.assertEqual(run.returncode, 0, run.stderr)
        lines = run.stdout.splitlines()
        self.assertEqual(lines[0], f"torch_mla {torch_mla.__version__} ({ROOT / 'torch_mla'})")
        self.assertTrue(lines[1].startswith(f"torch {torch.__version__} ("), lines[1])
        dsl = importlib.metadata.version("nvidia-cutlass-dsl")
        self.assertTrue(lines[2].startswith(f"nvidia-cutlass-dsl {dsl}"), lines[2])
        self.assertTrue(any(x.startswith("no CUDA GPU (") for x in lines), run.stdout)
        self.assertNotIn("TORCH_MLA_FORCE_REFERENCE", run.stdout)
        self.assertNotIn("TORCH_MLA_PORTABLE", run.stdout)
        self.assertExpectedInline(table(run.stdout), """\
torch_mla.mla_decode with d_qk 576, d_v 512, page size 64:
  device  q dtype   cache dtype           runs       why
  cpu     bfloat16  bfloat16              reference  cpu tensors: the kernels run on NVIDIA GPUs
  cpu     float16   float16               reference  cpu tensors: the kernels run on NVIDIA GPUs
  cpu     float32   float32               reference  cpu tensors: the kernels run on NVIDIA GPUs
  cpu     bfloat16  float8_e4m3fn         reference  cpu tensors: the kernels run on NVIDIA GPUs
  cpu     bfloat16  float8_e4m3fn (fast)  reference  cpu tensors: the kernels run on NVIDIA GPUs
""")

    def fake_gpus(self, *gpus):
        """Patches torch.cuda to show these (name, major, minor, SMs) GPUs."""
        props = [SimpleNamespace(name=n, major=a, minor=b, multi_processor_count=sms,
                                 total_memory=141 * 2**30) for n, a, b, sms in gpus]
        return [
            mock.patch("torch.cuda.is_available", return_value=True),
            mock.patch("torch.cuda.device_count", return_value=len(props)),
            mock.patch("torch.cuda.get_device_properties", side_effect=lambda i: props[i]),
            mock.patch("torch_mla.ops.dispatch.cuda_capability",
                       side_effect=lambda d: (props[d.index].major, props[d.index].minor)),
        ]

    def test_each_kind_of_gpu_gets_its_rows(self):
        patches = self.fake_gpus(("NVIDIA H200", 9, 0, 132), ("NVIDIA H200", 9, 0, 132),
                                 ("NVIDIA A100-SXM4-80GB", 8, 0, 108))
        with mock.patch.dict(os.environ), patches[0], patches[1], patches[2], patches[3]:
            os.environ.pop("TORCH_MLA_FORCE_REFERENCE", None)
            os.environ.pop("TORCH_MLA_PORTABLE", None)
            text = cli.report()
        gpus = [x for x in text.splitlines() if x.startswith("GPU ")]
        self.assertEqual(gpus, ["GPU 0: NVIDIA H200, compute capability 9.0, 132 SMs, 141 GiB, "
                                "kernels compiled for sm_90a",
                                "GPU 1: NVIDIA H200, compute capability 9.0, 132 SMs, 141 GiB, "
                                "kernels compiled for sm_90a",
                                "GPU 2: NVIDIA A100-SXM4-80GB, compute capability 8.0, 108 SMs, "
                                "141 GiB, kernels compiled for sm_80"])
        self.assertExpectedInline(table(text), """\
torch_mla.mla_decode with d_qk 576, d_v 512, page size 64:
  device                          q dtype   cache dtype           runs       why
  cuda:0 (NVIDIA H200)            bfloat16  bfloat16              sm90       compute capability 9.0: the SM90 CuTe DSL kernel (its keys-on-M variant where s_q * h_q <= 32)
  cuda:0 (NVIDIA H200)            float16   float16               sm90       compute capability 9.0: the SM90 CuTe DSL kernel (its keys-on-M variant where s_q * h_q <= 32)
  cuda:0 (NVIDIA H200)            float32   float32               reference  torch.float32 inputs: the kernels take bfloat16 or float16
  cuda:0 (NVIDIA H200)            bfloat16  float8_e4m3fn         sm90       compute capability 9.0, float8_e4m3fn cache: the SM90 CuTe DSL kernel, exact mode (pages converted exactly to 16 bits on chip, 16-bit MMAs; its keys-on-M variant where s_q * h_q <= 32)
  cuda:0 (NVIDIA H200)            bfloat16  float8_e4m3fn (fast)  sm90       compute capability 9.0, float8_e4m3fn cache: the SM90 CuTe DSL kernel, fast mode (compute='fp8': Q, quantized per row, on the fp8 tensor cores; P in e4m3 too, except on its keys-on-M variant, which keeps P in f16: bf16/fp16 q, one KV head, up to 16 query rows, or 32 from a batch of 4)
  cuda:2 (NVIDIA A100-SXM4-80GB)  bfloat16  bfloat16              sm80       compute capability 8.0: the portable CuTe DSL kernel (SM80 instructions; verified on an H200, checked against the reference on first use on this GPU)
  cuda:2 (NVIDIA A100-SXM4-80GB)  float16   float16               sm80       compute capability 8.0: the portable CuTe DSL kernel (SM80 instructions; verified on an H200, checked against the reference on first use on this GPU)
  cuda:2 (NVIDIA A100-SXM4-80GB)  float32   float32               reference  torch.float32 inputs: the kernels take bfloat16 or float16
  cuda:2 (NVIDIA A100-SXM4-80GB)  bfloat16  float8_e4m3fn         reference  float8_e4m3fn cache on compute capability 8.0: the only FP8 kernel is the SM90 one (the reference dequantizes the pages it reads to float32)
  cuda:2 (NVIDIA A100-SXM4-80GB)  bfloat16  float8_e4m3fn (fast)  reference  float8_e4m3fn cache on compute capability 8.0: the only FP8 kernel is the SM90 one (the reference dequantizes the pages it reads to float32)
  cpu                             bfloat16  bfloat16              reference  cpu tensors: the kernels run on NVIDIA GPUs
  cpu                             float16   float16               reference  cpu tensors: the kernels run on NVIDIA GPUs
  cpu                             float32   float32               reference  cpu tensors: the kernels run on NVIDIA GPUs
  cpu                             bfloat16  float8_e4m3fn         reference  cpu tensors: the kernels run on NVIDIA GPUs
  cpu                             bfloat16  float8_e4m3fn (fast)  reference  cpu tensors: the kernels run on NVIDIA GPUs""")

    def test_force_reference_is_reported(self):
        patches = self.fake_gpus(("NVIDIA H100 80GB HBM3", 9, 0, 132))
        with mock.patch.dict(os.environ, TORCH_MLA_FORCE_REFERENCE="1"), patches[0], \
                patches[1], patches[2], patches[3]:
            text = cli.report()
        self.assertIn("TORCH_MLA_FORCE_REFERENCE=1 is set: every call runs the reference path",
                      text)
        self.assertIn("cuda:0 (NVIDIA H100 80GB HBM3)  bfloat16  bfloat16              reference  "
                      "TORCH_MLA_FORCE_REFERENCE=1 is set", text)
        with mock.patch.dict(os.environ, TORCH_MLA_FORCE_REFERENCE="true"):
            self.assertIn("TORCH_MLA_FORCE_REFERENCE=true is set: no effect: only the value 1 "
                          "forces the reference path", cli.report())

    def test_forced_portable_kernel_is_reported(self):
        patches = self.fake_gpus(("NVIDIA H200", 9, 0, 132), ("NVIDIA GeForce RTX 5090", 12, 0, 170))
        with mock.patch.dict(os.environ, TORCH_MLA_PORTABLE="1"), patches[0], patches[1], \
                patches[2], patches[3]:
            os.environ.pop("TORCH_MLA_FORCE_REFERENCE", None)
            text = cli.report()
        self.assertIn("TORCH_MLA_PORTABLE=1 is set: GPUs of compute capability 8.0 or newer run "
                      "the portable kernel", text)
        self.assertExpectedInline(table(text), """\
torch_mla.mla_decode with d_qk 576, d_v 512, page size 64:
  device                            q dtype   cache dtype           runs       why
  cuda:0 (NVIDIA H200)              bfloat16  bfloat16              sm80       TORCH_MLA_PORTABLE=1: the portable CuTe DSL kernel (SM80 instructions; verified on an H200)
  cuda:0 (NVIDIA H200)              float16   float16               sm80       TORCH_MLA_PORTABLE=1: the portable CuTe DSL kernel (SM80 instructions; verified on an H200)
  cuda:0 (NVIDIA H200)              float32   float32               reference  torch.float32 inputs: the kernels take bfloat16 or float16
  cuda:0 (NVIDIA H200)              bfloat16  float8_e4m3fn         reference  float8_e4m3fn cache with TORCH_MLA_PORTABLE=1: the only FP8 kernel is the SM90 one (the reference dequantizes the pages it reads to float32)
  cuda:0 (NVIDIA H200)              bfloat16  float8_e4m3fn (fast)  reference  float8_e4m3fn cache with TORCH_MLA_PORTABLE=1: the only FP8 kernel is the SM90 one (the reference dequantizes the pages it reads to float32)
  cuda:1 (NVIDIA GeForce RTX 5090)  bfloat16  bfloat16              sm80       TORCH_MLA_PORTABLE=1: the portable CuTe DSL kernel (SM80 instructions; verified on an H200, checked against the reference on first use on this GPU)
  cuda:1 (NVIDIA GeForce RTX 5090)  float16   float16               sm80       TORCH_MLA_PORTABLE=1: the portable CuTe DSL kernel (SM80 instructions; verified on an H200, checked against the reference on first use on this GPU)
  cuda:1 (NVIDIA GeForce RTX 5090)  float32   float32               reference  torch.float32 inputs: the kernels take bfloat16 or float16
  cuda:1 (NVIDIA GeForce RTX 5090)  bfloat16  float8_e4m3fn         reference  float8_e4m3fn cache with TORCH_MLA_PORTABLE=1: the only FP8 kernel is the SM90 one (the reference dequantizes the pages it reads to float32)
  cuda:1 (NVIDIA GeForce RTX 5090)  bfloat16  float8_e4m3fn (fast)  reference  float8_e4m3fn cache with TORCH_MLA_PORTABLE=1: the only FP8 kernel is the SM90 one (the reference dequantizes the pages it reads to float32)
  cpu                               bfloat16  bfloat16              reference  cpu tensors: the kernels run on NVIDIA GPUs
  cpu                               float16   float16               reference  cpu tensors: the kernels run on NVIDIA GPUs
  cpu                               float32   float32               reference  cpu tensors: the kernels run on NVIDIA GPUs
  cpu                               bfloat16  float8_e4m3fn         reference  cpu tensors: the kernels run on NVIDIA GPUs
  cpu                               bfloat16  float8_e4m3fn (fast)  reference  cpu tensors: the kernels run on NVIDIA GPUs""")
