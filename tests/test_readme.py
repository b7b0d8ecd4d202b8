"""README.md's runnable examples, run as written, and the slot helper they use."""

import re
from pathlib import Path

import expecttest
import pytest
import torch

import torch_mla
from torch_mla.testing import POISON_BLOCK_ID

from oracle import mla_decode_fp64

README = Path(__file__).resolve().parents[1] / "README.md"
MARKER = "<!-- runnable: tests/test_readme.py executes this block -->"


def runnable_blocks() -> list[str]:
    """The ```python blocks that directly follow the marker comment."""
    text = README.read_text()
    return re.findall(re.escape(MARKER) + r"\n```python\n(.*?)\n```", text, flags=re.S)


def test_readme_has_the_api_and_hugging_face_blocks():
    assert len(runnable_blocks()) == 2, "expected the API and the Hugging Face block marked runnable"


def test_readme_api_example_runs_as_written_and_is_right(capsys):
    ns: dict = {}
    exec(compile(runnable_blocks()[0], "README.md:API", "exec"), ns)
    assert capsys.readouterr().out == ("[36, 448]\n"
                                       "torch.Size([2, 1, 16, 512]) torch.float32 "
                                       "torch.Size([2, 16, 1])\n")
    # The step's latents landed in the slots the example names, and the lengths grew by one.
    cache = ns["kv_cache"].view(-1, 576)
    new = torch.cat([ns["kv_c"], ns["k_pe"]], dim=-1)
    torch.testing.assert_close(cache[[36, 448]], new, atol=0, rtol=0)
    assert ns["cache_seqlens"].tolist() == [101, 65]
    # The output attends over the grown cache (new token included): an independent fp64 oracle.
    ref_out, ref_lse = mla_decode_fp64(ns["q"], ns["kv_cache"], ns["block_table"],
                                       ns["cache_seqlens"], 576**-0.5, True, 512)
    torch.testing.assert_close(ns["out"].cpu().double(), ref_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(ns["lse"].cpu().double(), ref_lse, atol=1e-3, rtol=1e-3)


def test_readme_hugging_face_example_gives_transformers_tokens(capsys):
    transformers = pytest.importorskip("transformers")
    from torch_mla.modules import MultiheadLatentAttention

    ns: dict = {}
    exec(compile(runnable_blocks()[1], "README.md:Hugging Face", "exec"), ns)
    model, ids, tokens, cache = ns["model"], ns["ids"], ns["tokens"], ns["cache"]
    attns = [m for m in model.modules() if hasattr(m, "kv_b_proj")]
    assert attns and all(isinstance(m, MultiheadLatentAttention) for m in attns)
    # The decode steps ran on the MLACache: 8 prompt tokens + 7 decoded ones cached a request
    # (the last token is sampled, not yet fed back).
    assert cache.cache_seqlens.tolist() == [15, 15]
    # transformers' own generate on an unswapped model with the swapped one's state dict (the
    # keys are the same): the tokens the example printed, decided independently of its run.
    hf = transformers.AutoModelForCausalLM.from_config(ns["config"]).eval()
    hf.load_state_dict(model.state_dict())
    with torch.no_grad():
        ref = hf.generate(ids, max_new_tokens=8, do_sample=False)
    assert ref.shape == (2, 16)
    assert torch.equal(tokens, ref)
    assert capsys.readouterr().out == (f"{ref[:, 8:].tolist()}\n"
                                       "same tokens as transformers: True\n")


def test_slot_mapping_hand_computed():
    # Request 0 crosses a page boundary (positions 62..64), request 1 starts on a fresh page
    # (128..130), request 2 is empty (0..2). Entries past each request's reach are poison.
    block_table = torch.tensor([[4, 9, POISON_BLOCK_ID],
                                [2, 0, 7],
                                [5, POISON_BLOCK_ID, POISON_BLOCK_ID]], dtype=torch.int32)
    lens = torch.tensor([62, 128, 0], dtype=torch.int32)
    slots = torch_mla.slot_mapping(block_table, lens, 3)
    assert slots.dtype == torch.int64
    assert slots.tolist() == [4 * 64 + 62, 4 * 64 + 63, 9 * 64 + 0,
                              7 * 64 + 0, 7 * 64 + 1, 7 * 64 + 2,
                              5 * 64 + 0, 5 * 64 + 1, 5 * 64 + 2]
    assert torch_mla.slot_mapping(block_table, lens, 0).tolist() == []
    empty = torch.zeros(0, 3, dtype=torch.int32)
    assert torch_mla.slot_mapping(empty, torch.zeros(0, dtype=torch.int32), 2).tolist() == []
    assert lens.tolist() == [62, 128, 0]  # the lengths are the caller's to advance


def test_slot_mapping_then_append_fills_the_next_positions():
    # Two steps of 2 tokens each: every token lands at the position its request's length says.
    block_table = torch.tensor([[1, 3], [0, 2]], dtype=torch.int32)
    lens = torch.tensor([63, 5], dtype=torch.int32)
    cache = torch.full((4, 64, 1, 8), float("nan"))
    for _ in range(2):
        kv_c, k_pe = torch.randn(4, 6), torch.randn(4, 2)
        torch_mla.append_kv(cache, kv_c, k_pe, torch_mla.slot_mapping(block_table, lens, 2))
        new = torch.cat([kv_c, k_pe], dim=-1).view(2, 2, 8)
        for r in range(2):
            for i in range(2):
                p = int(lens[r]) + i
                torch.testing.assert_close(cache[block_table[r, p // 64], p % 64, 0], new[r, i])
        lens += 2
    assert int(cache.isnan().all(dim=-1).logical_not().sum()) == 8


class TestSlotMappingErrors(expecttest.TestCase):
    def err(self, lens, num_tokens=2, block_table=None):
        if block_table is None:
            block_table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
        with self.assertRaises((ValueError, TypeError)) as cm:
            torch_mla.slot_mapping(block_table, torch.tensor(lens, dtype=torch.int32), num_tokens)
        return str(cm.exception)

    def test_past_the_block_table(self):
        self.assertExpectedInline(self.err([10, 127]), """slot_mapping: request 1 has length 127, so its next 2 token(s) take positions 127..128, but its block_table row holds only 2 pages x 64 = 128 positions; give it more pages""")

    def test_negative_length(self):
        self.assertExpectedInline(self.err([-1, 0]), """slot_mapping: cache_seqlens[0] is -1; lengths must be >= 0""")

    def test_no_pages(self):
        self.assertExpectedInline(self.err([0], 1, torch.zeros(1, 0, dtype=torch.int32)), """slot_mapping: request 0 has length 0, so its next 1 token(s) take positions 0..0, but its block_table row holds only 0 pages x 64 = 0 positions; give it more pages""")

    def test_bad_types(self):
        bt = torch.tensor([[0, 1], [2, 3]])
        self.assertExpectedInline(self.err([0, 0], 1, bt), """block_table must be int32 [batch, max_blocks], got torch.int64 [2, 2]""")
        self.assertExpectedInline(self.err([0], 1), """cache_seqlens (1 entries on cpu) must match block_table (2 rows on cpu)""")


def test_slot_mapping_compiles_fullgraph_and_checks_on_the_device():
    block_table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    f = torch.compile(torch_mla.slot_mapping, fullgraph=True)
    ok = torch.tensor([63, 5], dtype=torch.int32)
    assert f(block_table, ok, 2).tolist() == [63, 64, 2 * 64 + 5, 2 * 64 + 6]
    with pytest.raises(RuntimeError, match="new tokens lie past its block_table row"):
        f(block_table, torch.tensor([127, 5], dtype=torch.int32), 2)
    # With the checks off, tokens that do not fit get slot -1 (append_kv skips them).
    torch_mla.set_value_checks(False)
    try:
        assert f(block_table, torch.tensor([127, 5], dtype=torch.int32), 2).tolist() == [
            127, -1, 2 * 64 + 5, 2 * 64 + 6]
    finally:
        torch_mla.set_value_checks(True)
