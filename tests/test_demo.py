"""The README's main job, `python -m torch_mla.demo`, on tiny sizes (CPU, eager)."""

import os
import re
import subprocess
import sys
import types
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
    # The accuracy table's last row, numbers out: fp32 against fp32, every pick fp32's.
    lines = [re.sub(r"^\| all 10 \|.*\| 30/30 \|.*\| 30/30 \|$", "| all 10 | top-1 |", line)
             for line in lines]
    expected = ["1/4 transformers as shipped (eager attention, DynamicCache)",
                "  transformers generating: 3/10 tokens",
                "  transformers generating: 5/10 tokens",
                "  transformers generating: 8/10 tokens",
                "  transformers generating: 10/10 tokens",
                "3/4 torch_mla (eager, MLACache)",
                "  torch_mla    generating: 3/10 tokens",
                "  torch_mla    generating: 5/10 tokens",
                "  torch_mla    generating: 8/10 tokens",
                "  torch_mla    generating: 10/10 tokens",
                "4/4 fp32 copy of the same weights, re-scoring both runs' tokens (the exact result)",
                "| | decode tokens/s | KV cache bytes/token (all layers) | peak memory over weights |",
                "| all 10 | top-1 |"]
    at = [lines.index(e) for e in expected]
    assert at == sorted(at), out


@pytest.mark.parametrize("cuda", [False, True])
def test_demo_every_option_has_help(cuda):
    parser = demo.build_parser(cuda)
    options = [a for a in parser._actions if a.dest != "help"]
    assert len(options) == 20
    missing = [a.option_strings[0] for a in options if not (a.help or "").strip()]
    assert missing == []
    hidden = next(a for a in options if a.dest == "hidden")
    assert hidden.help % {"default": hidden.default} == (
        f"model width (hidden_size) (default: {7168 if cuda else 256})")


def test_demo_v32_reproduces_transformers_tokens_with_sparse_attention(capsys):
    # DeepSeek-V3.2 on the CPU in fp32: prompts of 40 and an index_topk of 32, so that every
    # decode step attends to 32 of its 40-50 tokens, through the indexer op and the sparse decode.
    demo.main([*TINY, "--model", "v32", "--dtype", "fp32", "--prompt-len", "40"])
    out = capsys.readouterr().out
    assert ("model: DeepseekV32ForCausalLM, 2 layers, hidden 256, 8 heads, q_lora_rank 128, "
            "kv_lora_rank 64 + rope 16, indexer 64 heads x 32 selecting 32 tokens") in out, out
    assert ("its decode runs reference: cpu tensors: the kernels run on NVIDIA GPUs (the "
            "lightning indexer and the sparse decode: plain PyTorch)") in out, out
    assert "greedy tokens identical to transformers: 3/3 requests (all tokens)" in out, out
    # Bytes per token, 2 layers in fp32: the latent (64 + 16) and an index key (32), both caches.
    bpt = re.findall(r"^\| (transformers|torch_mla) \(eager[^|]*\) \| [0-9,]+ \| ([0-9,]+) \|",
                     out, flags=re.M)
    assert bpt == [("transformers", f"{2 * (64 + 16 + 32) * 4:,}"),
                   ("torch_mla", f"{2 * (64 + 16 + 32) * 4:,}")], out


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


def test_demo_bf16_measures_both_runs_against_fp32_and_the_verdict_follows(capsys):
    demo.main([*TINY, "--dtype", "bf16"])
    out = capsys.readouterr().out
    rows = re.findall(r"^\| (\d+) \| ([0-9.e-]+) / ([0-9.e-]+) \| (\d) \| ([0-9.e-]+) / "
                      r"([0-9.e-]+) \| (\d) \|$", out, flags=re.M)
    assert [r[0] for r in rows] == ["1", "2", "4", "8", "10"], out
    # Step 1 scores the prompt, which the swapped model computes with transformers' own
    # operations: the same bf16 logits, so the same error against fp32.
    assert rows[0][1:4] == rows[0][4:7]
    # bf16 against fp32: errors of a few bf16 steps at these logits, not zero and not more.
    errors = [float(x) for r in rows for x in (r[1], r[4])]
    assert all(0 < e < 0.1 for e in errors), out
    m = re.search(r"^verdict: torch_mla \(bfloat16\) is (closer to the fp32 result than|as close to "
                  r"the fp32 result as|further from the fp32 result than) transformers "
                  r"\(bfloat16\): mean logit error ([0-9.e-]+) vs ([0-9.e-]+), picks equal to "
                  r"fp32's (\d+)/30 vs (\d+)/30\.$", out, flags=re.M)
    assert m, out
    ours, theirs = float(m[2]), float(m[3])
    expected = demo.fp32_verdict({"mean": ours}, {"mean": theirs})
    assert m[1].startswith({"closer": "closer", "as close": "as close", "further": "further"}[
        expected])
    # The alarm comes where tokens part and the numbers say torch_mla is further from fp32, and
    # only there.
    m = re.search(r"^greedy tokens identical to transformers: (\d+)/(\d+) requests", out,
                  flags=re.M)
    assert m, out
    parted = int(m[1]) < int(m[2])
    assert ("further from fp32 than transformers'" in out) == (parted and expected == "further")


def test_demo_fp8_cache_reports_agreement_with_the_bf16_cache_run(capsys):
    demo.main([*TINY, "--dtype", "bf16", "--kv-cache", "fp8"])
    out = capsys.readouterr().out
    for k, mode in ((4, "exact"), (5, "fp8")):
        assert (f"{k}/6 torch_mla (eager, MLACache in float8_e4m3fn, scales measured at the "
                f"prefill, compute='{mode}'), teacher-forced on run 3's tokens; its decode runs "
                "reference: cpu tensors: the kernels run on NVIDIA GPUs") in out, out
    assert "6/6 fp32 copy of the same weights" in out
    bpt = dict(re.findall(r"^\| (torch_mla \(eager(?:, fp8 cache, compute='\w+')?\)) \| [0-9,]+ "
                          r"\| ([0-9,]+) \|", out, flags=re.M))
    assert int(bpt["torch_mla (eager)"].replace(",", "")) == 2 * 2 * (64 + 16)  # bf16, 2 layers
    for mode in ("exact", "fp8"):
        got = bpt[f"torch_mla (eager, fp8 cache, compute='{mode}')"]
        assert int(got.replace(",", "")) == 2 * (64 + 16)
    rows = re.findall(r"^\| (\d+|all 10) \| ([0-9.e-]+) \| ([0-9.e-]+) \| (\d+|\d+/30) \|$", out,
                      flags=re.M)
    # One table per mode; on the CPU both run the reference (fp32 math), so they are equal.
    assert [r[0] for r in rows] == ["1", "2", "4", "8", "10", "all 10"] * 2, out
    assert rows[:6] == rows[6:]
    rows = rows[:6]
    # Step 1 is the prefill: attention over the prompt's own latents, identical logits.
    assert rows[0][1:] == ("0", "0", "3")
    # Later steps: the storage error of e4m3 (measured 1.9-2.1e-2 relative here; e_store
    # 2-7e-2 in tests/test_fp8.py), far above the zero of identical runs and below 0.1.
    assert all(5e-3 < float(r[2]) < 0.1 for r in rows[1:]), out
    agree = int(rows[-1][3].split("/")[0])
    assert agree >= 24, out  # measured 30/30
    for mode in ("exact", "fp8"):
        m = re.search(rf"^fp8 cache \(compute='{mode}'\): top-1 agreement with the bfloat16 "
                      r"cache (\d+)/30 \(([0-9.]+)%\), relative logit error ([0-9.e-]+) ", out,
                      flags=re.M)
        assert m and int(m[1]) == agree
        assert float(m[2]) == pytest.approx(100 * agree / 30, abs=0.05)
        assert float(m[3]) == float(rows[-1][2])


def test_demo_against_run_per_step_numbers():
    import torch

    ref = [torch.tensor([[3.0, 4.0], [1.0, 0.0]]), torch.tensor([[0.0, 2.0], [2.0, 0.0]])]
    ours = [torch.tensor([[3.0, 4.0], [1.0, 0.0]]), torch.tensor([[0.0, 1.0], [2.0, 3.0]])]
    vs = demo.against_run(ref, ours)
    assert vs["max_err"] == [0.0, 3.0] and vs["top1"] == [2, 1]
    assert vs["rel_err"] == pytest.approx([0.0, 10**0.5 / 8**0.5])
    assert vs["rel"] == pytest.approx((10 / (26 + 8)) ** 0.5)
    assert (vs["max"], vs["agree"], vs["picks"]) == (3.0, 3, 4)


def test_demo_against_fp32_per_step_numbers():
    import torch

    # Two requests, prompt of 2, 2 new tokens; fp32's logits for the 2 steps, and a run's.
    ref = torch.tensor([[[1.0, 3.0, 0.0], [2.0, 0.0, 0.0]],
                        [[0.0, 1.0, 5.0], [0.0, 4.0, 1.0]]])  # [b, n, vocab]
    calls = []

    def exact(ids, logits_to_keep):
        calls.append((ids.tolist(), logits_to_keep))
        return types.SimpleNamespace(logits=ref)

    steps = [torch.tensor([[1.0, 3.5, 0.0], [0.0, 1.0, 5.0]]),   # both pick fp32's token
             torch.tensor([[2.0, 2.5, 0.0], [0.0, 4.0, 1.25]])]  # request 0 does not
    seqs = torch.tensor([[7, 8, 1, 1], [7, 9, 2, 1]])
    acc = demo.against_fp32(exact, seqs, steps)
    assert calls == [([[7, 8, 1], [7, 9, 2]], 2)]  # the run's tokens, all but the last, fed in
    assert acc["max_err"] == [0.5, 2.5] and acc["top1"] == [2, 1]
    assert acc["mean_err"] == pytest.approx([0.5 / 6, 2.75 / 6])
    assert (acc["max"], acc["agree"], acc["picks"]) == (2.5, 3, 4)
    assert acc["mean"] == pytest.approx((0.5 + 2.75) / 12)
    verdict = [demo.fp32_verdict({"mean": x}, {"mean": 1.0}) for x in (0.89, 0.91, 1.09, 1.11)]
    assert verdict == ["closer", "as close", "as close", "further"]
