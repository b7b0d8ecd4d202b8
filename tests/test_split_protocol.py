"""The split sparse kernel's cluster pair (cute_kernels/sm90_split_sparse_decode.py, h_q 65-128
over the 656-byte rows) as a model under random interleavings: no GPU, no DSL.

Two CTAs, each with a producer, WG0 and WG1, walk the same segments of blocks; block b of a
segment goes to buffer b % 2. Each producer fills its half of the keys of every buffer half in
both CTAs (the peer's copy lands later, by st.async, completing bytes on the peer's tile
mbarrier); a tile mbarrier's phase completes with the local producer's arrival and the peer's
bytes. WG0 waits for both halves' tiles, reads them (S), hands P to WG1 (NB_P), reads half 0
again (its P V) and frees half 0; WG1 reads half 1 (its P V) and frees half 1 (NB_FREE back to
WG0). A free reaches this CTA's "empty" mbarrier and, later, the peer's. A segment starts with
WG0 freeing the halves of its first two blocks (the prologue's _load_tiles hook), after both
warpgroups finished the previous segment (_sync_consumers). Each half has its own empty
mbarrier of 2 arrivals (this CTA's release and the peer's), and the producer waits before each
half. (Session 39's whole-buffer mode, one mbarrier of 4 arrivals a buffer, was modelled here too;
it measured slower and left the kernel in session 40.)

A segment's last two blocks do not free their halves: the epilogue stages O in those
buffers, and the next segment's start frees them. (Session 42's O_DIRECT, every block freeing
its halves and no segment start anything, was modelled here too; it measured slower and left
the kernel in session 49.)

Checks: every read sees both key halves of the block it expects, no write (local or the peer's)
lands in a half while a warpgroup reads it or stages O in it (each warpgroup's epilogue holds
every half from its segment's last block until the next segment's start), and nothing
deadlocks. run_rope_early models one CTA
without the pair under the developer knob ROPE_EARLY (the rope tile's own release) the same way."""

import random

import pytest
from test_keysm import MBarrier, interleave


def run_pair(segments, seed=0, empty_count=2, prologue=True, release_last=False,
             epilogue_sync=True):
    """One random interleaving of the pair over `segments` (blocks per segment); empty_count:
    the empty mbarriers' arrival count (the kernel's: 2); prologue: a segment's start frees
    its first two blocks' halves (the kernel's); release_last: a segment's last two blocks
    free their halves too (not the kernel's: a mutant); epilogue_sync: WG0's segment start
    waits for WG1's epilogue (the kernel's _sync_consumers), not only for its blocks (a
    mutant)."""
    rng = random.Random(seed)
    tile = [[[MBarrier(2) for _ in range(2)] for _ in range(2)] for _ in range(2)]  # [c][s][h]
    empty = [[MBarrier(empty_count) for _ in range(4)] for _ in range(2)]  # [c][2 s + h]
    data = [[[{} for _ in range(2)] for _ in range(2)] for _ in range(2)]  # [c][s][h]: {part: blk}
    readers = {}  # (c, s, h) -> the warpgroups reading it
    in_flight = []  # ("data", c, s, h, part, blk) or ("free", c, index)
    progress = {}  # (c, wg) -> blocks that warpgroup finished, over all segments
    blocks = [(k, b) for k, n in enumerate(segments) for b in range(n)]

    def release(c, s, h):
        i = 2 * s + h
        empty[c][i].arrive()
        in_flight.append(("free", 1 - c, i))

    def read(c, s, h, who, blk):
        got = data[c][s][h]
        assert got == {0: blk, 1: blk}, f"CTA {c} {who} read {got} in ({s}, {h}), wants {blk}"
        readers.setdefault((c, s, h), set()).add(who)

    def producer(c):
        waits = [0] * 4
        for k, n in enumerate(segments):
            for b in range(n):
                s = b % 2
                for h in range(2):
                    i = 2 * s + h
                    while not empty[c][i].passed(waits[i] % 2):
                        yield True
                    waits[i] += 1
                    assert not readers.get((c, s, h)), f"CTA {c} writes ({s}, {h}) while read"
                    data[c][s][h][c] = (k, b)
                    in_flight.append(("data", 1 - c, s, h, c, (k, b)))
                    tile[c][s][h].arrive()
                    yield False

    nb_p = [[0, 0], [0, 0]]  # [c][0]: blocks WG0 handed to WG1 (NB_P); [c][1]: WG1 done (NB_FREE)

    epilogues = {}  # (c, wg) -> segments whose epilogue that warpgroup finished

    def epilogue(c, wg, k, n):
        # O staged in the page buffers (every half) and copied out; a segment without blocks
        # writes nothing there.
        if n:
            for i in range(4):
                readers.setdefault((c, i // 2, i % 2), set()).add(f"EPI{wg}")
            yield False
            for i in range(4):
                readers[(c, i // 2, i % 2)].discard(f"EPI{wg}")
        epilogues[(c, wg)] = k + 1

    def wg0(c):
        waits = [[0, 0], [0, 0]]
        done = 0
        for k, n in enumerate(segments):
            while (epilogues.get((c, 1), 0) < k if epilogue_sync  # (_sync_consumers: WG1's
                   else progress.get((c, 1), 0) < done):  # epilogue done too)
                yield True
            for s in range(min(n, 2) if prologue else 0):  # (frees the first two blocks')
                for h in range(2):
                    release(c, s, h)
            for b in range(n):
                s = b % 2
                for h in range(2):
                    while not tile[c][s][h].passed(waits[s][h] % 2):
                        yield True
                    waits[s][h] += 1
                    read(c, s, h, "WG0", (k, b))
                yield False  # (S)
                readers[(c, s, 1)].discard("WG0")
                while nb_p[c][1] < done:  # (NB_FREE: WG1 is done with the previous P)
                    yield True
                nb_p[c][0] += 1
                yield False  # (P V over half 0)
                readers[(c, s, 0)].discard("WG0")
                if release_last or b + 2 < n:
                    release(c, s, 0)
                done += 1
                progress[(c, 0)] = done
            yield from epilogue(c, 0, k, n)

    def wg1(c):
        done = 0
        for k, n in enumerate(segments):
            for b in range(n):
                s = b % 2
                while nb_p[c][0] <= done:  # (NB_P)
                    yield True
                read(c, s, 1, "WG1", (k, b))
                yield False  # (P V over half 1)
                readers[(c, s, 1)].discard("WG1")
                done += 1
                nb_p[c][1] = done
                if release_last or b + 2 < n:
                    release(c, s, 1)
                progress[(c, 1)] = done
            yield from epilogue(c, 1, k, n)

    def land(item):  # (the peer's bytes, or its free)
        if item[0] == "data":
            _, c, s, h, part, blk = item
            assert not readers.get((c, s, h)), f"the peer's bytes land in CTA {c} ({s}, {h}) " \
                                               "while it is read"
            data[c][s][h][part] = blk
            tile[c][s][h].arrive()
        else:
            empty[item[1]][item[2]].arrive()

    interleave([f(c) for c in range(2) for f in (producer, wg0, wg1)], in_flight, land, rng,
               limit=2000)
    assert all(progress.get((c, w), 0) == len(blocks) for c in range(2) for w in range(2))


SEGMENTS = [[5, 0, 1, 3, 0, 0, 7], [1], [0, 2, 2], [9, 9], [2, 1, 4]]


def test_pair_protocol():
    for seed in range(60):
        run_pair(SEGMENTS[seed % len(SEGMENTS)], seed)


@pytest.mark.parametrize("mutant,kind", [
    # (a segment's last two blocks free their halves as well as the next segment's start: a
    # half freed twice, so a producer overwrites a half while it is read, in some interleaving)
    (dict(release_last=True), "overwrite"),
    (dict(prologue=False), "deadlock"),  # (nothing frees the first two blocks' halves)
    # (WG0 frees the next segment's buffers while WG1 still stages its half of O in them)
    (dict(epilogue_sync=False), "overwrite"),
])
def test_pair_protocol_model_catches_a_wrong_release(mutant, kind):
    failures = []
    for seed in range(120):
        try:
            run_pair(SEGMENTS[seed % len(SEGMENTS)], seed, **mutant)
        except AssertionError as e:
            failures.append(str(e))
    if kind == "deadlock":
        assert failures and all(f.startswith("deadlock") for f in failures), failures[:3]
    else:
        assert any("while read" in f for f in failures), failures[:3]


def test_pair_protocol_model_catches_a_wrong_count():
    # A count of 1 (the peer's release not awaited): a producer may overwrite a half that the
    # peer's warpgroups still read; the model sees it (a wrong read or a write under a reader,
    # not only a deadlock) in some interleaving.
    failures = []
    for seed in range(200):
        try:
            run_pair([9, 9], seed, empty_count=1)
        except AssertionError as e:
            failures.append(str(e))
    assert any(not f.startswith("deadlock") for f in failures), failures[:3]


def run_rope_early(segments, seed=0, release=lambda b, n: b + 2 < n, prologue=True):
    """One random interleaving of one CTA of the split without the pair under ROPE_EARLY: per
    buffer s the halves' "empty" mbarriers and the rope tile's (barE[4 + s], one arrival),
    released by WG0 once S landed for blocks b with release(b, n) and, at a segment's start,
    with its halves (prologue). The producer waits for the rope tile at its block's start and
    issues the rope copies (cp.async, landing later), then fills half 0 and half 1; half 1's
    tile phase completes only once the block's rope copies landed (cp.async.mbarrier.arrive).
    WG0 reads both halves and the rope tile (S), then half 0 (its P V); WG1 reads half 1."""
    rng = random.Random(seed)
    tile = [[MBarrier(1) for _ in range(2)] for _ in range(2)]  # [s][h]
    empty = [MBarrier(1) for _ in range(4)]  # [2 s + h]
    rope_free = [MBarrier(1) for _ in range(2)]  # [s]
    data = [[None] * 3 for _ in range(2)]  # [s][half 0, half 1, rope]: the block held
    readers = {}  # (s, part) -> the warpgroups reading it
    in_flight = []  # ("rope", s, blk): a rope copy, landing in any order
    ropes_pending = [0, 0]  # [s]: rope copies not yet landed
    deferred = []  # buffers whose half-1 arrival waits for its rope copies
    progress = {}  # wg -> blocks finished
    nb = [0, 0]  # blocks WG0 handed to WG1 (NB_P), blocks WG1 finished (NB_FREE)

    def read(s, part, who, blk):
        assert data[s][part] == blk, f"{who} read {data[s][part]} in ({s}, {part}), wants {blk}"
        readers.setdefault((s, part), set()).add(who)

    def write(s, part, blk):
        assert not readers.get((s, part)), f"write ({s}, {part}) while read"
        data[s][part] = blk

    def producer():
        waits, rope_waits = [0] * 4, [0, 0]
        for k, n in enumerate(segments):
            for b in range(n):
                s = b % 2
                while not rope_free[s].passed(rope_waits[s] % 2):
                    yield True
                rope_waits[s] += 1
                ropes_pending[s] += 1
                in_flight.append(("rope", s, (k, b)))
                yield False
                for h in range(2):
                    while not empty[2 * s + h].passed(waits[2 * s + h] % 2):
                        yield True
                    waits[2 * s + h] += 1
                    write(s, h, (k, b))
                    if h == 0:
                        tile[s][0].arrive()
                    else:  # (cp.async.mbarrier.arrive: once the block's rope landed)
                        deferred.append(s)
                        arrive_landed()
                    yield False

    def wg0():
        waits, done = [[0, 0], [0, 0]], 0
        for k, n in enumerate(segments):
            while progress.get(1, 0) < done:  # (_sync_consumers)
                yield True
            for s in range(min(n, 2)):  # (_load_tiles: the halves and, with them, the rope)
                for h in range(2):
                    empty[2 * s + h].arrive()
                if prologue:
                    rope_free[s].arrive()
            for b in range(n):
                s = b % 2
                for h in range(2):
                    while not tile[s][h].passed(waits[s][h] % 2):
                        yield True
                    waits[s][h] += 1
                for part in range(3):
                    read(s, part, "WG0", (k, b))
                yield False  # (S)
                readers[(s, 1)].discard("WG0")
                readers[(s, 2)].discard("WG0")
                if release(b, n):
                    rope_free[s].arrive()
                while nb[1] < done:  # (NB_FREE)
                    yield True
                nb[0] += 1
                yield False  # (P V over half 0)
                readers[(s, 0)].discard("WG0")
                if b + 2 < n:
                    empty[2 * s].arrive()
                done += 1
                progress[0] = done

    def wg1():
        done = 0
        for k, n in enumerate(segments):
            for b in range(n):
                s = b % 2
                while nb[0] <= done:  # (NB_P)
                    yield True
                read(s, 1, "WG1", (k, b))
                yield False  # (P V over half 1)
                readers[(s, 1)].discard("WG1")
                done += 1
                nb[1] = done
                if b + 2 < n:
                    empty[2 * s + 1].arrive()
                progress[1] = done

    def arrive_landed():  # (the deferred half-1 arrivals whose rope copies landed)
        for s in list(deferred):
            if ropes_pending[s] == 0:
                deferred.remove(s)
                tile[s][1].arrive()

    def land(item):
        _, s, blk = item
        write(s, 2, blk)
        ropes_pending[s] -= 1
        arrive_landed()

    interleave([producer(), wg0(), wg1()], in_flight, land, rng, limit=3000)
    assert not deferred
    assert progress.get(0, 0) == progress.get(1, 0) == sum(segments), progress


ROPE_SEGMENTS = SEGMENTS + [[1, 1, 1], [2, 2, 0, 3], [4, 0, 5]]


def test_rope_early_protocol():
    for seed in range(80):
        run_rope_early(ROPE_SEGMENTS[seed % len(ROPE_SEGMENTS)], seed)


@pytest.mark.parametrize("mutant", [
    dict(release=lambda b, n: True),  # (released for the segment's last two blocks too)
    dict(release=lambda b, n: b + 1 < n),
    dict(prologue=False),  # (no release at a segment's start: a deadlock)
])
def test_rope_early_model_catches_a_wrong_release(mutant):
    failures = []
    for seed in range(120):
        try:
            run_rope_early(ROPE_SEGMENTS[seed % len(ROPE_SEGMENTS)], seed, **mutant)
        except AssertionError as e:
            failures.append(str(e))
    assert failures
