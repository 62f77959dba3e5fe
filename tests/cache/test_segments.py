"""`cache.segments.ImageHistory`: which images started in which block after which prefix,
newest first, bounded in prefixes and in lists per prefix."""

from __future__ import annotations

from pagedkv.cache.hashing import BlockHasher, ExtraKeys
from pagedkv.cache.segments import ImageHistory, starting_in, unfolded_parent

BS = 4


def _record(history: ImageHistory, hasher: BlockHasher, segments: list[tuple[int, bytes]]) -> None:
    extra = ExtraKeys(segments=segments)
    tokens = list(range(1, 13))
    history.record(hasher.chain(tokens, extra), hasher.root(extra), extra, BS)


def test_the_segments_starting_in_a_block_are_kept_under_its_unfolded_parent() -> None:
    hasher, history = BlockHasher(BS, seed=b"s"), ImageHistory(capacity=8, per_prefix=2)
    _record(history, hasher, [(1, b"a"), (2, b"b"), (5, b"c")])
    chain = hasher.chain(list(range(1, 13)), ExtraKeys(segments=[(1, b"a"), (2, b"b")]))
    root = hasher.root(None)
    assert history.seen(root, 0) == [((1, b"a"), (2, b"b"))]
    # block 1's unfolded parent is block 0's hash, which the segments of block 0 made
    extra = ExtraKeys(segments=[(1, b"a"), (2, b"b"), (5, b"c")])
    assert starting_in(extra, 1, BS) == ((5, b"c"),)
    full = hasher.chain(list(range(1, 13)), extra)
    assert history.seen(unfolded_parent(full, root, 1), 1) == [((5, b"c"),)]
    assert unfolded_parent(chain, root, 1) == full.hashes[0]
    # newest first, a repeat moves to the front, at most per_prefix lists
    _record(history, hasher, [(1, b"x")])
    _record(history, hasher, [(1, b"y")])
    _record(history, hasher, [(1, b"x")])
    assert history.seen(root, 0) == [((1, b"x"),), ((1, b"y"),)]


def test_the_history_is_bounded_in_prefixes() -> None:
    hasher, history = BlockHasher(BS, seed=b"s"), ImageHistory(capacity=3)
    for k in range(10):
        _record(history, hasher, [(1 + k % 3, bytes([k]))])
        _record(history, hasher, [(BS * 2 + 1, bytes([k]))])
    assert len(history) <= 3
    history.clear()
    assert len(history) == 0
