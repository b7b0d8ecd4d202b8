"""A schedule that was not computed for this call's cache_seqlens, s_q or h_q (GPU).

The schedule (metadata [num_parts, 8], num_splits [b + 1]) depends on the lengths and, through
num_parts, on s_q * h_q. The kernels read num_parts from the metadata's shape, so a schedule for
another s_q or h_q only spreads the same blocks differently: the output stays right. A schedule
for other lengths cuts requests where those lengths put the cuts: while every piece of a split
request still starts inside its length now, the output stays right too (blocks past the length
are not walked, and a request's last piece runs to its end now, so a request that has grown
keeps its new blocks); a piece that starts past the length has no partial result, and a request
that the schedule saw empty has no piece: the combine reports either and stops the launch
(splitkv.segment, splitkv.empty_segment, MLACombine.check_pieces). Each test runs on the
SM90 kernel and on the portable SM80-class kernel (TORCH_MLA_PORTABLE=1)."""

import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

import torch_mla
from torch_mla.constants import META_BEGIN_BLK, META_BEGIN_REQ, META_END_BLK, META_END_REQ
from torch_mla.reference import mla_decode_reference
from torch_mla.scheduling import walk_schedule
from torch_mla.testing import make_decode_inputs

# Each test runs on each kernel this GPU has (conftest.py's dense_backend).
pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("dense_backend")]

# As tests/test_kernel_sm90.py: the kernel rounds P to bf16 before P @ V, as FlashMLA does.
TOL = dict(atol=8e-4, rtol=2.01 / 128)


def check_against_reference(inp, sched, causal):
    out, lse = torch_mla.mla_decode(inp.q, inp.kv_cache, inp.block_table, inp.cache_seqlens,
                                    sched, causal=causal)
    ref_out, ref_lse = mla_decode_reference(inp.q, inp.kv_cache, inp.block_table,
                                            inp.cache_seqlens, 576**-0.5, causal, 512)
    assert not out.isnan().any(), "NaN in output"
    torch.testing.assert_close(out.float(), ref_out.float(), **TOL)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)  # +inf must match +inf


def last_piece_starts(lens: list[int], s_q: int, h_q: int) -> dict[int, int]:
    """{request: the first block of its last piece} for the requests that the schedule for
    lens (on this GPU) cuts into several pieces."""
    sched = torch_mla.get_decode_schedule(torch.tensor(lens, dtype=torch.int32, device="cuda"),
                                          s_q, h_q)
    starts = {}
    for _part, r, lo, _hi, slot in walk_schedule(sched.metadata, sched.num_splits,
                                                  torch.tensor(lens)):
        if slot >= 0:
            starts[r] = max(starts.get(r, 0), lo)
    return starts


@pytest.mark.parametrize("s_q,h_q", [(1, 64), (2, 128), (2, 16)])
def test_schedule_for_other_query_rows_gives_the_right_output(s_q, h_q):
    """A step with s_q = 2, h_q = 64 (causal) run over schedules for other s_q * h_q (other
    m-block counts and so other part counts: 132 SMs give 132, 66, 33 parts for 1, 2, 4
    m-blocks) matches the reference as its own schedule does."""
    lens = [20, 140, 4096, 0, 1, 65, 3000, 777]
    inp = make_decode_inputs(lens, 2, 64, device="cuda")
    own = torch_mla.get_decode_schedule(inp.cache_seqlens, 2, 64)
    other = torch_mla.get_decode_schedule(inp.cache_seqlens, s_q, h_q)
    check_against_reference(inp, own, True)
    check_against_reference(inp, other, True)


def test_schedule_for_longer_lengths_with_cuts_inside_gives_the_right_output():
    """A schedule for longer lengths, where every piece of a split request still starts inside
    the request's length now: the parts walk no block past a request's end (the cache holds
    NaN there and the block table huge ids), and an unsplit request that has no key now gets
    output 0 and lse +inf."""
    longer = [20, 140, 4096, 6000, 1, 65, 3000, 8192]
    starts = last_piece_starts(longer, 1, 16)
    assert starts, "the schedule splits no request: nothing to test"
    lens = [L // 3 for L in longer]
    for r, lo in starts.items():
        lens[r] = lo * 64 + 1  # the last piece keeps one key
    unsplit = [r for r in range(len(longer)) if r not in starts and longer[r] > 0]
    assert unsplit, starts
    lens[unsplit[0]] = 0
    inp = make_decode_inputs(lens, 1, 16, device="cuda", max_blocks=max(longer) // 64 + 2,
                             num_blocks=sum(-(-L // 64) for L in longer) + 2)
    sched = torch_mla.get_decode_schedule(torch.tensor(longer, dtype=torch.int32,
                                                       device="cuda"), 1, 16)
    check_against_reference(inp, sched, False)


def test_schedule_for_longer_lengths_with_parts_starting_on_emptied_requests():
    """Unsplit requests that begin a part (at block 0) lose all their keys: the SM90 kernel
    loads a part's first Q before it has read the length, so that load belongs to a segment
    with no block. Part A: its first two requests emptied, a later one still has keys (the
    load lands before that segment's own Q load reuses the barrier). Part B: every request it
    holds blocks of emptied (no segment left: the load lands before the CTA exits). Emptied
    requests get output 0 and lse +inf. Many short requests, so that parts hold several."""
    gen = torch.Generator().manual_seed(0)
    longer = torch.randint(1, 200, (256,), generator=gen).tolist()
    sched = torch_mla.get_decode_schedule(torch.tensor(longer, dtype=torch.int32,
                                                       device="cuda"), 1, 16)
    splits = sched.num_splits.cpu().tolist()
    unsplit = [splits[r + 1] - splits[r] == 1 for r in range(len(longer))]
    lens, found = list(longer), []
    for row in sched.metadata.cpu().tolist():
        r0, blk0, r1, blk1 = (row[META_BEGIN_REQ], row[META_BEGIN_BLK], row[META_END_REQ],
                              row[META_END_BLK])
        if r0 >= len(longer) or blk0 != 0 or lens[r0] != longer[r0]:  # (an empty part: r0 = b)
            continue
        if "A" not in found and r0 + 1 < r1 and blk1 > 0 and unsplit[r0] and unsplit[r0 + 1]:
            lens[r0] = lens[r0 + 1] = 0
            found.append("A")
        elif "B" not in found and r0 < r1 and blk1 == 0 and all(unsplit[r0:r1]):
            lens[r0:r1] = [0] * (r1 - r0)
            found.append("B")
    assert sorted(found) == ["A", "B"], found
    inp = make_decode_inputs(lens, 1, 16, device="cuda", max_blocks=max(longer) // 64 + 2)
    check_against_reference(inp, sched, False)


def test_schedule_for_shorter_lengths_gives_the_right_output():
    """A schedule for shorter lengths (each request grew since, by a few keys up to several
    pages): a request's last piece runs to its end now, split or not, so no key is lost."""
    shorter = [20, 140, 4096, 6000, 1, 65, 3000, 8192, 64, 700]
    starts = last_piece_starts(shorter, 1, 16)
    assert starts, "the schedule splits no request: nothing to test"
    assert len(starts) < len(shorter), starts  # unsplit requests too
    lens = [L + g for L, g in zip(shorter, [1, 63, 64, 65, 300, 200, 1, 2000, 1, 129])]
    inp = make_decode_inputs(lens, 1, 16, device="cuda")
    sched = torch_mla.get_decode_schedule(torch.tensor(shorter, dtype=torch.int32,
                                                       device="cuda"), 1, 16)
    check_against_reference(inp, sched, False)


MISMATCH = """
import torch, torch_mla
from torch_mla.testing import make_decode_inputs
longer = {longer}
inp = make_decode_inputs(longer, 1, 16, device="cuda")
lens = inp.cache_seqlens
sched = torch_mla.get_decode_schedule(lens, 1, 16)
print("pieces", int(sched.num_splits[{r} + 1] - sched.num_splits[{r}]), flush=True)
shorter = torch.tensor({shorter}, dtype=torch.int32, device="cuda")
if {graph}:
    torch_mla.mla_decode(inp.q, inp.kv_cache, inp.block_table, lens, sched)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        torch_mla.mla_decode(inp.q, inp.kv_cache, inp.block_table, lens, sched)
    lens.copy_(shorter)  # the lengths change, the schedule is not recomputed
    g.replay()
else:
    torch_mla.mla_decode(inp.q, inp.kv_cache, inp.block_table, shorter, sched)
torch.cuda.synchronize()
print("no error")
"""


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "cuda_graph"])
def test_schedule_cutting_a_request_past_its_length_stops_the_launch(graph):
    """The lengths shrink below where the schedule (for the old ones) cut a request: the
    piece past the end has no partial result; the launch stops with a message naming the
    request (a fresh process: the error ends the CUDA context)."""
    longer = [300, 8192, 100]
    starts = last_piece_starts(longer, 1, 16)
    assert 1 in starts and starts[1] >= 2, starts
    shorter = list(longer)
    shorter[1] = starts[1] * 64 - 70  # the last piece now starts past the length
    code = MISMATCH.format(longer=longer, shorter=shorter, r=1, graph=graph)
    root = pathlib.Path(__file__).resolve().parents[1]
    res = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                         env=dict(os.environ))
    log = res.stdout + res.stderr
    assert res.returncode != 0 and "no error" not in log, log
    pieces = int(re.search(r"pieces (\d+)", log).group(1))
    assert pieces > 1, log
    want = (f"torch_mla.mla_decode: the schedule cuts request 1 into {pieces} pieces, which do "
            f"not fit its cache_seqlens ({shorter[1]} tokens) now: it was computed for other "
            "lengths; compute it again with torch_mla.get_decode_schedule")
    assert want in log, log


EMPTY = """
import torch, torch_mla
from torch_mla.testing import make_decode_inputs
inp = make_decode_inputs([300, 200, 100], 1, 16, device="cuda")
sched = torch_mla.get_decode_schedule(torch.tensor([300, 0, 100], dtype=torch.int32,
                                                   device="cuda"), 1, 16)
print("pieces", int(sched.num_splits[2] - sched.num_splits[1]), flush=True)
torch_mla.mla_decode(inp.q, inp.kv_cache, inp.block_table, inp.cache_seqlens, sched)
torch.cuda.synchronize()
print("no error")
"""


def test_schedule_that_saw_a_request_empty_stops_the_launch():
    """A request that had no key when the schedule was made (no piece) has 200 keys now:
    nothing would merge it; the launch stops with a message naming it."""
    root = pathlib.Path(__file__).resolve().parents[1]
    res = subprocess.run([sys.executable, "-c", EMPTY], cwd=root, capture_output=True,
                         text=True, env=dict(os.environ))
    log = res.stdout + res.stderr
    assert "pieces 0" in log, log
    assert res.returncode != 0 and "no error" not in log, log
    want = ("torch_mla.mla_decode: the schedule cuts request 1 into 0 pieces, which do not fit "
            "its cache_seqlens (200 tokens) now: it was computed for other lengths; compute it "
            "again with torch_mla.get_decode_schedule")
    assert want in log, log
