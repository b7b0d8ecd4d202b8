"""Split-KV work schedule for MLA decode, computed on the device from ``cache_seqlens``.

The decode kernel runs one wave of ``num_m_blocks x num_parts`` CTAs per KV head (a cache of
h_kv > 1 heads runs one launch per head, each over the same schedule). Each request's key blocks
(pages of 64 tokens) are laid end to end in one stream, each request preceded by a fixed overhead
of ``OVERHEAD_BLOCKS`` (the cost of starting a request: loading Q, writing its output), and the
stream is cut into runs of equal length (within one unit): as few runs as keep the heaviest at ``C =
ceil(T / num_parts)`` units (T: the stream's length), that is ``Q = ceil(T / C)`` runs, one for each
of the first Q parts; the other parts are empty. A part walks its run request by request; a request
cut across parts is computed as partial results that the combine step merges. Cutting the stream
into num_parts runs would not shorten the heaviest, but would cut requests into more pieces, each
writing fp32 partial results that the combine reads back: at b 2, topk 2048, h_q 128 (74 units, 66
parts) 37 runs of 2 units instead of 66 of 1 or 2: 24.7 against 26.2 us a step (H100, same start,
docs/kernel-notes.md, session 45). When cutting only at request
boundaries costs little (the heaviest part at most ``OVERHEAD_BLOCKS`` units heavier: a batch of
many equal requests), no request is split (:func:`whole_request_cuts`).

Everything here is a handful of tensor ops with static shapes and no host synchronisation, so the
schedule can be computed once per decode step, shared by every layer, and captured in a CUDA graph.

Metadata layout (int32 ``[num_parts, 8]``), one row per part:
    0 begin_req, 1 begin_blk, 2 end_req (inclusive), 3 end_blk (exclusive, in end_req),
    4 split index of the first segment, 5-7 reserved (0).
``num_splits`` (int32 ``[b + 1]``) is the exclusive prefix sum of each request's number of pieces;
request r's partial results live in workspace slots ``num_splits[r] .. num_splits[r + 1] - 1``.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from .constants import (  # noqa: F401  (the names this module has always offered)
    BLOCK_M,
    COMBINE_VARIANTS,
    METADATA_WIDTH,
    OVERHEAD_BLOCKS,
    PAGE_SIZE,
)

# Batches up to this size may get a schedule of whole requests (whole_request_cuts): the
# schedule kernel's one chunk of requests (cute_kernels/schedule.py CHUNK).
WHOLE_MAX_BATCH = 1024


def num_m_blocks(s_q: int, h_q: int) -> int:
    return max(1, -(-(s_q * h_q) // BLOCK_M))


@dataclasses.dataclass(frozen=True)
class DecodeSplitConfig:
    """How the decode work is spread over the GPU."""

    num_parts: int  # CTAs per m-block; each walks one contiguous piece of the block stream

    @classmethod
    def from_heuristic(cls, s_q: int, h_q: int, num_sms: int,
                       h_kv: int = 1) -> "DecodeSplitConfig":
        # One wave: num_m_blocks * num_parts CTAs fill the SMs exactly once (as FlashMLA does);
        # each CTA needs ~230 KB of shared memory, so only one fits per SM. With h_kv > 1 the
        # KV heads run one launch after another (torch_mla/ops/dispatch.py), each a full wave
        # over its s_q * h_q // h_kv query rows.
        return cls(num_parts=max(1, num_sms // num_m_blocks(s_q, h_q // h_kv)))


@dataclasses.dataclass(frozen=True)
class CombineConfig:
    """How many warps of the combine kernel (cute_kernels/combine.py) merge one row (1, 4 or
    16), and how many pieces a warp loads at once (unroll): one of constants.COMBINE_VARIANTS.
    Here, not beside the kernel, so that choosing one imports no DSL."""

    warps_per_row: int
    unroll: int = 4

    # 16 warps a row are a CTA of 512 threads: at unroll 4 (80 registers) one an SM, at 2 (59)
    # two. Up to one wave of the first (batch * rows <= num_sms) unroll 4, up to one wave of
    # the second unroll 2, past that 4 warps a row. H100 (session 36, us; 16 warps at unroll 4
    # / 16 at 2 / 4 warps, one start; at 128-256 rows the 4-warp figure is another start's, its
    # 16-warp one in brackets): sparse decode over the 656-byte rows, 128 rows (2,1,64) 21.5 /
    # 21.7 / 23.8 (21.8); 256 (2,1,128) 29.0 / 26.8 / 29.7 (29.1), (2,2,64) 28.4 / 27.0 / 29.0
    # (28.7); 512 (2,2,128) 36.0 / 32.0 / 31.0, (4,1,128) 36.1 / 32.0 / 31.2, (8,1,64) 37.4 /
    # 33.6 / 31.8. Dense (bench_decode.py): 64 rows (1,1,4096,64) 21.4 / 23.4 / -; 128
    # (1,1,4096,128) 22.4 / 24.4 / -, (2,1,4096,64) 25.5 / 27.8 / -; 256 (2,1,4096,128) 32.1 /
    # 30.2 / -, (4,1,4096,64) 33.2 / 30.9 / -, (1,2,4096,128) 24.9 / 23.1 / -; 512
    # (4,1,4096,128) 39.2 / - / 33.3, (8,1,4096,64) 47.2 / - / 41.7, (2,2,4096,128) 37.9 / - /
    # 32.6. The four variants in one step passed the split's GPU tests and every variant's
    # (150), and the dense split-KV ones (132), on an H100 in session 37.
    CTAS_16_UNROLL_2 = 2  # 16-warp CTAs an SM at unroll 2

    @property
    def variant(self) -> int:
        """The index of this choice in constants.COMBINE_VARIANTS (the step's runtime index)."""
        return COMBINE_VARIANTS.index((self.warps_per_row, self.unroll))

    @classmethod
    def from_heuristic(cls, batch: int, num_parts: int, rows: int,
                       num_sms: int = 132) -> "CombineConfig":
        """rows: query rows per request (s_q * h_q). A request is cut into up to
        ~num_parts / batch + 1 pieces. H200, anchor workload, us for 1 / 4 / 16 warps per row
        (tools/sweep_schedule.py, docs/kernel-notes.md). num_sms: the device's
        multiprocessors (the 16-warp CTAs' waves, above)."""
        if 16 * batch <= num_parts:  # b=1 h128 (~60 pieces a row): 46.2 / 29.5 / 25.5
            if batch * rows <= num_sms:
                return cls(16)
            if batch * rows <= cls.CTAS_16_UNROLL_2 * num_sms:
                return cls(16, 2)
            return cls(4)
        if 4 * batch <= num_parts:  # b=8 h128 (~9 pieces): 46.6 / 44.1 / 50.5
            return cls(4)
        if batch * rows <= 1024:  # 64 x 2048 h16 (~3 pieces, few rows): 65.1-65.6 / 64.5-65.0
            return cls(4)
        return cls(1)  # b=32 h128 (~3 pieces): 92.1 / 96.4 / 122.2; 128 x 8k h16: 326 / 329


@dataclasses.dataclass(frozen=True)
class IndexerSplit:
    """How the DSA indexer kernel (cute_kernels/sm90_indexer.py) cuts the work: CTA (c, r)
    takes pages [c * pages_per_cta, +pages_per_cta) of request r's output row."""

    pages_per_cta: int

    # A CTA's start (barriers, Q from L2, the first page's latency), in pages' worth of its
    # streaming time: a guess, not measured yet (the other CTA on its SM hides part of it).
    OVERHEAD_PAGES = 2
    CTAS_PER_SM = 2  # the kernel's shared memory (<= 113 KB) and registers (<= 128) allow two

    @classmethod
    def from_heuristic(cls, batch: int, n_pages: int, num_sms: int) -> "IndexerSplit":
        """n_pages: pages of the output row (ceil(max_len / 64)); the host knows no lengths
        (reading them would sync), so every request is taken to fill its row, which is what
        costs most (a shorter request's CTAs past its end only write -inf). Predicted time of
        a size: rounds of CTAS_PER_SM * num_sms CTAs, each as long as its CTAs' pages plus
        OVERHEAD_PAGES. Of the sizes within SLACK of the least, the smallest: more, shorter
        CTAs even out requests of different lengths, which the prediction cannot see.
        (Predictions, not measured yet: docs/kernel-notes.md.)"""
        return cls(_indexer_pages_per_cta(batch, n_pages, num_sms))

    SLACK = 0.03


@functools.lru_cache(maxsize=4096)
def _indexer_pages_per_cta(batch: int, n_pages: int, num_sms: int) -> int:
    slots = IndexerSplit.CTAS_PER_SM * max(num_sms, 1)
    sizes = range(1, max(n_pages, 1) + 1)
    cost = [-(-batch * -(-n_pages // c) // slots) * (c + IndexerSplit.OVERHEAD_PAGES)
            for c in sizes]
    least = min(cost)
    return next(c for c, t in zip(sizes, cost) if t <= least * (1 + IndexerSplit.SLACK))


def default_num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # an H100/H200: CPU runs then exercise the same schedule shapes as the GPU


def compute_schedule(
    cache_seqlens: torch.Tensor, num_parts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(metadata int32 [num_parts, 8], num_splits int32 [b + 1])`` on seqlens' device."""
    dev = cache_seqlens.device
    b = cache_seqlens.shape[0]
    meta = torch.zeros(num_parts, METADATA_WIDTH, dtype=torch.int32, device=dev)
    if b == 0:
        return meta, torch.zeros(1, dtype=torch.int32, device=dev)
    L = cache_seqlens.to(torch.int64).clamp(min=0)
    nb = (L + PAGE_SIZE - 1) // PAGE_SIZE
    units = torch.where(nb > 0, nb + OVERHEAD_BLOCKS, 0)
    end = torch.cumsum(units, 0)
    first_real = end - units + OVERHEAD_BLOCKS  # stream position of each request's block 0
    total = end[-1]
    t = total.clamp(min=1)  # (all requests empty: no part has work, nothing is split)
    # Q = ceil(T / C) parts with work, C = ceil(T / P): no more than keep the heaviest at C units
    # (module docstring); 1 <= Q <= min(T, P) for T >= 1.
    q = (t + (t + num_parts - 1) // num_parts - 1) // ((t + num_parts - 1) // num_parts)
    # Part p < Q takes stream positions [p T / Q, (p + 1) T / Q) (rounded down): sizes differ by
    # at most one unit, none is empty (T >= Q), and the parts from Q on are (cut at T). (Cuts
    # at multiples of C would also make Q runs, the last one shorter.)
    cut = torch.arange(num_parts + 1, device=dev, dtype=torch.int64).clamp(max=q) * total // q
    a, z = cut[:-1], cut[1:]
    nonempty = a < z
    cut_req = torch.searchsorted(end, cut, right=True)  # the request holding each cut (b at T)
    begin_req = cut_req[:-1]
    end_req = torch.searchsorted(end, (z - 1).clamp(min=0), right=True)
    bi = begin_req.clamp(max=b - 1)
    ei = end_req.clamp(max=b - 1)
    begin_blk = torch.minimum((a - first_real[bi]).clamp(min=0), nb[bi])
    end_blk = torch.minimum((z - first_real[ei]).clamp(min=0), nb[ei])
    # The part holding stream position x: the p with p T / Q <= x < (p + 1) T / Q (rounded down).
    first_part = ((first_real + 1) * q + t - 1) // t - 1
    last_part = ((first_real + nb) * q + t - 1) // t - 1
    # Pieces are counted over non-empty parts only: those are the parts before Q, so a part's
    # rank among them is its index, clamped to Q - 1 (the schedule kernel's closed form).
    # (torch.minimum: q is a 0-dim tensor, which clamp's max would read on the host)
    first_rank = torch.minimum(first_part.clamp(min=0), q - 1)
    nsplit = torch.where(nb > 0, torch.minimum(last_part.clamp(min=0), q - 1) - first_rank + 1, 0)
    begin_split = (torch.arange(num_parts, device=dev) - first_rank[bi]).clamp(min=0)
    meta[:, 0] = torch.where(nonempty, begin_req, b).to(torch.int32)
    meta[:, 1] = torch.where(nonempty, begin_blk, 0).to(torch.int32)
    meta[:, 2] = torch.where(nonempty, end_req, b - 1).to(torch.int32)
    meta[:, 3] = torch.where(nonempty, end_blk, 0).to(torch.int32)
    meta[:, 4] = torch.where(nonempty, begin_split, 0).to(torch.int32)
    # Whole requests instead, when that costs little (see whole_request_cuts): chosen on the
    # device (no host sync), so both schedules are computed and one is selected.
    snap, use_snap = whole_request_cuts(cut, cut_req, end, units, total, q)
    sa, sz = snap[:-1], snap[1:]
    s_nonempty = sa < sz
    s_begin = torch.searchsorted(end, sa, right=True).clamp(max=b - 1)
    s_end = torch.searchsorted(end, (sz - 1).clamp(min=0), right=True).clamp(max=b - 1)
    whole = torch.stack([torch.where(s_nonempty, s_begin, b),
                         torch.zeros_like(s_begin),
                         torch.where(s_nonempty, s_end, b - 1),
                         torch.where(s_nonempty, nb[s_end], 0),
                         torch.zeros_like(s_begin)], 1).to(torch.int32)
    meta[:, :5] = torch.where(use_snap, whole, meta[:, :5])
    nsplit = torch.where(use_snap, (nb > 0).to(nsplit.dtype), nsplit)
    num_splits = torch.zeros(b + 1, dtype=torch.int32, device=dev)
    num_splits[1:] = torch.cumsum(nsplit, 0).to(torch.int32)
    return meta, num_splits


def whole_request_cuts(cut: torch.Tensor, cut_req: torch.Tensor, end: torch.Tensor,
                       units: torch.Tensor, total: torch.Tensor,
                       q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The schedule that splits no request, and whether to use it (a 0-dim bool tensor).

    Each of the uniform cut positions ``cut`` (min(p, Q) T / Q, p = 0..P; ``cut_req``: the
    request holding each, b for T; q: Q, the parts with work, compute_schedule) moves to the
    nearer boundary of that request (the lower one on a tie): parts take whole requests. That is
    chosen when its largest part is at most ``OVERHEAD_BLOCKS`` units above the uniform cut's,
    ceil(T / Q), and the batch fits the
    schedule kernel's one chunk (``WHOLE_MAX_BATCH``). A split request costs more than the
    closed form charges: each of its pieces writes fp32 partial results that the combine reads
    back (H200, 64 or 128 requests of 4097 keys, h_q 128: 154.3 -> 139.8 us and 284.5 -> 270.8
    us with whole requests, docs/kernel-notes.md).

    Returns ``(cuts int64 [num_parts + 1], use)``: part p takes stream positions
    [cuts[p], cuts[p + 1])."""
    b = end.shape[0]
    kc = cut_req.clamp(max=b - 1)
    hi = torch.where(cut_req < b, end[kc], total)
    lo = torch.where(cut_req < b, hi - units[kc], total)
    cuts = torch.where(cut - lo <= hi - cut, lo, hi)
    largest = (cuts[1:] - cuts[:-1]).max()
    use = (largest <= (total + q - 1) // q + OVERHEAD_BLOCKS) & (total > 0)
    return cuts, use & (b <= WHOLE_MAX_BATCH)


def walk_schedule(meta: torch.Tensor, num_splits: torch.Tensor, cache_seqlens: torch.Tensor):
    """Host-side replay of what each part computes: yields (part, req, blk_begin, blk_end, slot).

    ``slot`` is the workspace slot of a split request's partial result, or -1 when the request is
    done by this part alone. Used by tests to check that the schedule covers every block once.
    """
    meta, num_splits = meta.cpu().tolist(), num_splits.cpu().tolist()
    L = cache_seqlens.cpu().tolist()
    for p, (br, bb, er, eb, bs, *_rest) in enumerate(meta):
        for r in range(br, er + 1):
            nb = -(-max(L[r], 0) // PAGE_SIZE)
            lo = bb if r == br else 0
            hi = eb if r == er else nb
            if lo >= hi:
                continue
            split = bs if r == br else 0
            pieces = num_splits[r + 1] - num_splits[r]
            yield p, r, lo, hi, (num_splits[r] + split if pieces > 1 else -1)
