"""The README's main job, `python -m torch_mla.demo`, on tiny sizes (CPU, eager)."""

import pytest

pytest.importorskip("transformers")

from torch_mla import demo  # noqa: E402

TINY = ["--device", "cpu", "--batch", "3", "--prompt-len", "12", "--new-tokens", "10",
        "--layers", "2", "--no-compile"]


def test_demo_fp32_reproduces_transformers_tokens(capsys):
    demo.main(TINY + ["--dtype", "fp32"])
    out = capsys.readouterr().out
    assert "greedy tokens identical to transformers: 3/3 requests (all tokens)" in out, out
    assert "| torch_mla (eager) |" in out


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
