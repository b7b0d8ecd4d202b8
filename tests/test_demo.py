"""The README's main job, `python -m torch_mla.demo`, on tiny sizes (CPU, eager)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from torch_mla import demo  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--device", "cpu", "--batch", "3", "--prompt-len", "12", "--new-tokens", "10",
        "--layers", "2", "--no-compile"]


def test_demo_fp32_reproduces_transformers_tokens_with_progress_lines_in_a_pipe():
    # stdout and stderr into one pipe, as `... 2>&1 | tee log` does: no terminal, so progress
    # must come as plain lines, and stdout must not sit in a buffer until the end (the ordering
    # below fails if the step headers arrive after the progress lines).
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("PYTHONUNBUFFERED", None)  # a user's default: stdout into a pipe is block-buffered
    run = subprocess.run([sys.executable, "-m", "torch_mla.demo", *TINY, "--dtype", "fp32"],
                         cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, timeout=300)
    out = run.stdout
    assert run.returncode == 0, out
    assert "greedy tokens identical to transformers: 3/3 requests (all tokens)" in out, out
    assert "| torch_mla (eager) |" in out
    assert "\r" not in out, "a terminal progress bar was drawn into a pipe"
    assert ("swapped in torch_mla's attention; its decode runs reference: cpu tensors: the "
            "kernels run on NVIDIA GPUs") in out
    lines = [re.sub(r", [0-9.]+ steps/s$", "", line) for line in out.splitlines()]
    expected = ["1/3 transformers as shipped (eager attention, DynamicCache)",
                "  transformers generating: 3/10 tokens",
                "  transformers generating: 5/10 tokens",
                "  transformers generating: 8/10 tokens",
                "  transformers generating: 10/10 tokens",
                "3/3 torch_mla (eager, MLACache)",
                "  torch_mla    generating: 3/10 tokens",
                "  torch_mla    generating: 5/10 tokens",
                "  torch_mla    generating: 8/10 tokens",
                "  torch_mla    generating: 10/10 tokens",
                "| | decode tokens/s | KV cache bytes/token (all layers) | peak memory over weights |"]
    at = [lines.index(e) for e in expected]
    assert at == sorted(at), out


@pytest.mark.parametrize("cuda", [False, True])
def test_demo_every_option_has_help(cuda):
    parser = demo.build_parser(cuda)
    options = [a for a in parser._actions if a.dest != "help"]
    assert len(options) == 17
    missing = [a.option_strings[0] for a in options if not (a.help or "").strip()]
    assert missing == []
    hidden = next(a for a in options if a.dest == "hidden")
    assert hidden.help % {"default": hidden.default} == (
        f"model width (hidden_size) (default: {7168 if cuda else 256})")


def test_demo_compare_greedy_tells_near_ties_from_disagreements():
    import torch

    ref = torch.tensor([[5, 6, 7], [1, 2, 3]])
    ours = torch.tensor([[5, 6, 7], [1, 4, 9]])
    # top-3 scores per step (values, ids) of each run; request 1 parts at step 1 on token 4,
    # which the reference scores 0.01 below its own pick.
    ref_top = [
        (torch.tensor([[3.0, 1.0, 0.5], [2.0, 1.0, 0.0]]), torch.tensor([[5, 0, 1], [1, 8, 9]])),
        (torch.tensor([[3.0, 1.0, 0.5], [2.00, 1.99, 0.0]]), torch.tensor([[6, 0, 1], [2, 4, 9]])),
        (torch.tensor([[3.0, 1.0, 0.5], [2.0, 1.0, 0.0]]), torch.tensor([[7, 0, 1], [3, 8, 0]])),
    ]
    top = [(v + 0.02, i) for v, i in ref_top]
    cmp = demo.compare_greedy(ref, ref_top, ours, top)
    assert cmp["identical"] == 1 and cmp["first_diff"] == 1
    assert cmp["score_diff"] == pytest.approx(0.02)
    assert cmp["tie_gap"] == pytest.approx(0.01)
    assert cmp["outside_top"] == 0
    # A parting at a token outside the reference's top k is counted as such.
    ours[1, 1] = 42
    assert demo.compare_greedy(ref, ref_top, ours, top)["outside_top"] == 1
