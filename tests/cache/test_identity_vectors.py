"""The published key vectors (docs/identity_vectors.json) hold: pagedkv's code computes
them, and so does a second implementation written from the spec alone."""

from __future__ import annotations

import hashlib
import json
import struct
from typing import Any

import pytest
import xxhash
from make_identity_vectors import VECTORS_PATH, compute, render

from pagedkv.cache.identity import NAMESPACE_FIELDS, encode_fields, namespace_digest

VECTORS = json.loads(VECTORS_PATH.read_text(encoding="utf-8"))
CASES = VECTORS["cases"]


# ---- the spec of docs/architecture.md ("Cache identity"), written out without pagedkv ----


def _lv(tag: bytes, value: bytes | None) -> bytes:
    return tag.lower() if value is None else tag + struct.pack("<I", len(value)) + value


def _utf8(value: str | None) -> bytes | None:
    return None if value is None else value.encode("utf-8")


def spec_keys(inputs: dict[str, Any]) -> dict[str, Any]:
    fields = inputs["namespace_fields"]
    ns_bytes = b"pagedkv-namespace\x00v2\x00" + b"".join(
        bytes([len(name)]) + name.encode() + struct.pack("<I", len(fields[name].encode()))
        + fields[name].encode()
        for name in ("layout", "backend", "device", "weights", "config", "dtype",
                     "kv_dtype", "linear", "attention", "mode", "block_size")
    )  # fmt: skip
    namespace = hashlib.sha256(ns_bytes).hexdigest()[:32]
    seed = bytes.fromhex(inputs["seed_hex"])
    if inputs["algorithm"] == "xxh3_128":
        seed64 = int.from_bytes(hashlib.sha256(b"pagedkv-seed64" + seed).digest()[:8], "little")

        def digest(data: bytes) -> bytes:
            return xxhash.xxh3_128(data, seed=seed64).digest()  # big-endian, canonical
    else:

        def digest(data: bytes) -> bytes:
            return hashlib.sha256(_lv(b"K", seed) + data).digest()

    root = digest(
        b"pagedkv-root\x00" + _lv(b"K", seed) + _lv(b"N", namespace.encode())
        + _lv(b"S", _utf8(inputs["cache_salt"])) + _lv(b"A", _utf8(inputs["adapter"]))
    )  # fmt: skip
    size = inputs["block_size"]
    segments = sorted(inputs["segments"], key=lambda s: s[0])

    def fold(parent: bytes, block: int) -> bytes:
        starts = [key for start, key in segments if start < (block + 1) * size]
        if not starts:
            return parent
        return digest(b"pagedkv-segment\x00" + parent + _lv(b"G", starts[-1].encode()))

    tokens = inputs["tokens"]
    keys, parents, parent = [], [], root
    for block in range(len(tokens) // size):
        parent = fold(parent, block)
        parents.append(parent)
        ids = tokens[block * size : (block + 1) * size]
        parent = digest(parent + struct.pack(f"<{size}i", *ids))
        keys.append(parent)
    parents.append(fold(parent, len(tokens) // size))
    return {
        "namespace": namespace,
        "root": root.hex(),
        "block_keys": [k.hex() for k in keys],
        "parent_keys": [k.hex() for k in parents],
    }


# ---- the checks -------------------------------------------------------------------------


def test_the_file_is_what_the_generator_writes() -> None:
    """A change of the key format shows here first: regenerate the file on purpose (see
    tests/cache/make_identity_vectors.py) and change the format's domain with it."""
    assert VECTORS_PATH.read_text(encoding="utf-8") == render()
    assert VECTORS["namespace_fields"] == list(NAMESPACE_FIELDS)


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_pagedkv_computes_the_published_keys(case: dict[str, Any]) -> None:
    assert compute(case["inputs"]) == case["expected"]


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_the_spec_alone_computes_the_published_keys(case: dict[str, Any]) -> None:
    assert spec_keys(case["inputs"]) == case["expected"]


def test_every_case_has_its_own_keys() -> None:
    """Cases that share tokens and block size but differ in one input share no key."""
    plain = {c["name"]: c for c in CASES}
    for name in ("sha256", "salt", "adapter", "adapter-equals-salt", "salt-and-adapter",
                 "empty-salt", "unicode-salt", "kv-int8", "rope-theta"):  # fmt: skip
        assert set(plain[name]["expected"]["block_keys"]).isdisjoint(
            plain["plain"]["expected"]["block_keys"]
        ), name
    assert plain["adapter"]["expected"]["root"] != plain["adapter-equals-salt"]["expected"]["root"]


def test_namespace_fields_are_all_required_and_strings() -> None:
    fields = dict(CASES[0]["inputs"]["namespace_fields"])
    with pytest.raises(ValueError, match="missing: \\['device'\\]"):
        namespace_digest({k: v for k, v in fields.items() if k != "device"})
    with pytest.raises(ValueError, match="unknown: \\['tokenizer'\\]"):
        namespace_digest({**fields, "tokenizer": "x"})
    with pytest.raises(TypeError, match="'block_size' must be a str"):
        namespace_digest({**fields, "block_size": 4})  # type: ignore[dict-item]


def test_a_value_cannot_spill_into_the_next_field() -> None:
    """Length prefixes: moving bytes from one field's end to the next one's start
    changes the encoding, though the concatenated values are the same."""
    fields = dict(CASES[0]["inputs"]["namespace_fields"])
    moved = {**fields, "dtype": "float3", "kv_dtype": "2" + fields["kv_dtype"]}
    assert encode_fields(moved) != encode_fields(fields)
    assert namespace_digest(moved) != namespace_digest(fields)
