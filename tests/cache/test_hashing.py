"""Block hashing: chained, keyed, tagged, stable across processes, strict on input."""

from __future__ import annotations

import random
import struct
import subprocess
import sys

import numpy as np
import pytest

from pagedkv.cache.hashing import BlockHasher, ExtraKeys, pack_tokens

SEED = b"test-seed"
ALGORITHMS = ["xxh3_128", "sha256"]


def reference_hashes(
    hasher: BlockHasher, tokens: list[int], extra: ExtraKeys | None
) -> list[bytes]:
    """The obviously correct version: one struct.pack per token, one call per block."""
    bs = hasher.block_size
    parent = hasher.root(extra)
    out = []
    for i in range(len(tokens) // bs):
        key = hasher.parent_key(parent, i, extra)
        block = b"".join(struct.pack("<i", t) for t in tokens[i * bs : (i + 1) * bs])
        parent = hasher.hash_block(key, block)
        out.append(parent)
    return out


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize(
    "extra",
    [None, ExtraKeys(cache_salt="t", adapter="lora", segments=[(5, "img"), (30, b"\x01")])],
)
def test_fast_chain_equals_reference(algorithm: str, extra: ExtraKeys | None) -> None:
    hasher = BlockHasher(block_size=8, algorithm=algorithm, seed=SEED)
    tokens = [random.Random(1).randrange(-(2**31), 2**31) for _ in range(77)]
    chain = hasher.chain(tokens, extra)
    assert chain.hashes == reference_hashes(hasher, tokens, extra)
    assert hasher.hash_blocks(tokens, extra) == chain.hashes
    assert len(chain.hashes) == 9 and len(chain.parent_keys) == 10
    assert {len(h) for h in chain.hashes} == {hasher.digest_size}
    assert hasher.digest_size == (16 if algorithm == "xxh3_128" else 32)
    assert chain.tokens.dtype == np.int32 and chain.tokens.tolist() == tokens
    # The last parent key is what the partial tail (tokens 72..76) hangs from.
    assert chain.parent_keys[-1] == hasher.parent_key(chain.hashes[-1], 9, extra)


def test_hash_names_the_whole_prefix() -> None:
    hasher = BlockHasher(block_size=4, seed=SEED)
    tokens = list(range(16))
    base = hasher.hash_blocks(tokens)
    assert hasher.hash_blocks(tokens[:9]) == base[:2]  # partial blocks get no hash
    changed = tokens.copy()
    changed[5] = 999  # block 1
    other = hasher.hash_blocks(changed)
    assert other[0] == base[0]
    assert all(a != b for a, b in zip(other[1:], base[1:], strict=True))


@pytest.mark.parametrize(
    "as_input",
    [
        list,
        tuple,
        np.array,
        lambda t: np.array(t, dtype=np.int64),
        lambda t: np.array(t, np.uint16),
    ],
)
def test_every_input_type_hashes_alike(as_input) -> None:  # type: ignore[no-untyped-def]
    hasher = BlockHasher(block_size=4, seed=SEED)
    tokens = list(range(100, 120))
    assert hasher.hash_blocks(as_input(tokens)) == hasher.hash_blocks(tokens)
    assert pack_tokens(as_input(tokens)) == struct.pack("<20i", *tokens)


@pytest.mark.parametrize(
    ("tokens", "error", "words"),
    [
        ([1, 2.0, 3], TypeError, "index 1"),
        ([1, "2"], TypeError, "str"),
        ([None], TypeError, "NoneType"),
        ([0, 2**31], ValueError, "2147483648"),
        ([-(2**31) - 1], ValueError, "int32"),
        (np.array([1.0, 2.0]), TypeError, "float64"),
        (np.array([1, 2**40]), ValueError, "int32"),
        (np.zeros((2, 2), dtype=np.int32), ValueError, "one-dimensional"),
        ("abc", TypeError, "str"),
    ],
)
def test_bad_token_ids_are_refused_clearly(tokens, error, words) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(error, match=words):
        BlockHasher(block_size=2, seed=SEED).hash_blocks(tokens)


def test_int32_extremes_are_accepted() -> None:
    hasher = BlockHasher(block_size=2, seed=SEED)
    assert len(hasher.hash_blocks([-(2**31), 2**31 - 1])) == 1


@pytest.mark.parametrize("block_size", [0, 3, 48, 2048, -4, 2.0])
def test_block_size_must_be_a_power_of_two(block_size) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="power of two"):
        BlockHasher(block_size=block_size)


def test_unknown_algorithm_is_refused() -> None:
    with pytest.raises(ValueError, match="sha256"):
        BlockHasher(algorithm="md5")


def test_seeds_key_every_hash() -> None:
    tokens = list(range(8))
    a = BlockHasher(block_size=4, seed=b"one").hash_blocks(tokens)
    assert BlockHasher(block_size=4, seed="one").hash_blocks(tokens) == a
    assert BlockHasher(block_size=4, seed=b"two").hash_blocks(tokens)[0] != a[0]
    # Without a seed every hasher draws its own: outsiders cannot predict hashes.
    assert BlockHasher(block_size=4).hash_blocks(tokens) != BlockHasher(block_size=4).hash_blocks(
        tokens
    )


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_hashes_are_stable_across_processes(algorithm: str) -> None:
    code = (
        "from pagedkv.cache.hashing import BlockHasher, ExtraKeys\n"
        f"h = BlockHasher(block_size=4, namespace='m', algorithm={algorithm!r}, seed=b'stable')\n"
        "x = ExtraKeys(cache_salt='s', segments=[(3, 'img')])\n"
        "print(' '.join(v.hex() for v in h.hash_blocks(list(range(12)), x)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    here = BlockHasher(block_size=4, namespace="m", algorithm=algorithm, seed=b"stable")
    extra = ExtraKeys(cache_salt="s", segments=[(3, "img")])
    assert out.stdout.split() == [v.hex() for v in here.hash_blocks(list(range(12)), extra)]


def test_salt_adapter_and_namespace_change_every_block() -> None:
    tokens = list(range(12))
    hasher = BlockHasher(block_size=4, seed=SEED)
    plain = hasher.hash_blocks(tokens)
    variants = [
        hasher.hash_blocks(tokens, ExtraKeys(cache_salt="x")),
        hasher.hash_blocks(tokens, ExtraKeys(adapter="x")),  # same text, other kind
        hasher.hash_blocks(tokens, ExtraKeys(cache_salt="y")),
        BlockHasher(block_size=4, namespace="other-model", seed=SEED).hash_blocks(tokens),
    ]
    for variant in variants:
        assert all(a != b for a, b in zip(variant, plain, strict=True))
    assert len({v[0] for v in variants}) == len(variants)
    assert hasher.hash_blocks(tokens, ExtraKeys()) == plain


def test_segment_changes_the_block_it_ends_in_and_all_after() -> None:
    hasher = BlockHasher(block_size=4, seed=SEED)
    tokens = list(range(16))
    plain = hasher.hash_blocks(tokens)
    image = hasher.hash_blocks(tokens, ExtraKeys(segments=[(6, "image-a")]))
    other = hasher.hash_blocks(tokens, ExtraKeys(segments=[(6, "image-b")]))
    assert image[0] == plain[0] == other[0]  # block 0 ends at 4 <= 6
    for i in (1, 2, 3):
        assert len({plain[i], image[i], other[i]}) == 3
    # Order of the given ranges does not matter; the later range wins from its block on.
    two = [(9, "b"), (1, "a")]
    assert hasher.hash_blocks(tokens, ExtraKeys(segments=two)) == hasher.hash_blocks(
        tokens, ExtraKeys(segments=sorted(two))
    )


@pytest.mark.parametrize("segments", [[(-1, "k")], [(0, 3)], [("0", "k")], [(0,)]])
def test_bad_segments_are_refused(segments) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="segment"):
        ExtraKeys(segments=segments)
