"""Leased blocks on the SSD tier: evicted after every unleased block, within the
leased fraction of its capacity, and back in LRU order once released."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from ssd_worker import make_block

from pagedkv.storage.base import block_checksum
from pagedkv.storage.ssd.format import encode_file, file_size
from pagedkv.storage.ssd.index import _pick_lru
from pagedkv.storage.ssd.store import SSDStore


def _rows(*names: str) -> Iterator[tuple[float, str, bytes, int]]:
    return ((float(i), "1", name.encode(), 10) for i, name in enumerate(names))


def test_pick_lru_takes_leased_rows_last_and_only_within_their_allowance() -> None:
    rows = ("a", "b", "c", "d")
    assert _pick_lru(_rows(*rows), 20) == [("1", b"a"), ("1", b"b")]
    assert _pick_lru(_rows(*rows), 20, {b"a"}, 100) == [("1", b"b"), ("1", b"c")]
    assert _pick_lru(_rows(*rows), 40, {b"a", b"b"}, 100) == [
        ("1", b"c"), ("1", b"d"), ("1", b"a"), ("1", b"b"),
    ]  # fmt: skip
    # Only 10 bytes may be kept by leases: "b" is past the allowance, so it ages normally.
    assert _pick_lru(_rows(*rows), 20, {b"a", b"b"}, 10) == [("1", b"b"), ("1", b"c")]


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SSDStore]:
    a = make_block(0)
    size = file_size(*encode_file(a, block_checksum(a)))
    s = SSDStore(tmp_path / "kv", 4 * size, namespace=a.meta.namespace)
    s.set_max_leased_fraction(0.5)
    yield s
    s.close(timeout=2)


def test_a_leased_block_outlives_a_flood_and_ages_normally_once_released(
    store: SSDStore,
) -> None:
    leased = make_block(1)
    store.put([leased])
    assert store.flush(10)
    store.lease([leased.meta.block_hash], 300.0)
    for i in range(2, 14):  # three times the capacity
        store.put([make_block(i)])
        assert store.flush(10)
        assert store.contains([leased.meta.block_hash]) == [True]
    store.release_lease([leased.meta.block_hash])
    for i in range(14, 18):
        store.put([make_block(i)])
        assert store.flush(10)
    assert store.contains([leased.meta.block_hash]) == [False]
