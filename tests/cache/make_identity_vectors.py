"""Writes docs/identity_vectors.json: inputs and the block keys pagedkv computes for them.

Regenerate (only after a deliberate change of the key format, which must also
change `NAMESPACE_DOMAIN` or the root's domain, since every stored key changes):

    PYTHONPATH=src python tests/cache/make_identity_vectors.py

tests/cache/test_identity_vectors.py checks that the file is what this script
writes, that pagedkv's code computes every case's keys, and that a second
implementation written from the spec in docs/architecture.md ("Cache identity")
does too.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from pagedkv.cache.hashing import BlockHasher, ExtraKeys
from pagedkv.cache.identity import NAMESPACE_FIELDS, namespace_digest

VECTORS_PATH = Path(__file__).resolve().parents[2] / "docs" / "identity_vectors.json"

# A small model on the CPU, as `ModelAdapter.identity` reports it (the config
# shortened: any string is hashed the same way).
_FIELDS = {
    "layout": "2",
    "backend": "torch",
    "device": "cpu",
    "weights": "files:" + "ab" * 32,
    "config": '{"hidden_size":64,"model_type":"llama","rms_norm_eps":1e-05,'
    '"rope_parameters":{"rope_theta":10000.0,"rope_type":"default"}}',
    "dtype": "float32",
    "kv_dtype": "float32",
    "linear": "onednn-packed",
    "attention": "pagedkv_ragged:key_align=2048,key_block=512,query_rows=4",
    "mode": "grouped",
    "block_size": "4",
}
_SEED = "7061676564b76e2d766563746f7273"  # any bytes; given as hex
_ADAPTER = "c0ffee" * 10 + "c0ff"  # a LoRA digest (hex, 64 characters)
_TOKENS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]


def _case(name: str, about: str, **changes: Any) -> dict[str, Any]:
    fields = dict(_FIELDS)
    fields.update(changes.pop("fields", {}))
    inputs: dict[str, Any] = {
        "seed_hex": _SEED,
        "algorithm": "xxh3_128",
        "block_size": int(fields["block_size"]),
        "namespace_fields": fields,
        "cache_salt": None,
        "adapter": None,
        "segments": [],
        "tokens": _TOKENS,
    }
    inputs.update(changes)
    return {"name": name, "about": about, "inputs": inputs}


CASES = [
    _case("plain", "no extra keys"),
    _case("sha256", "the sha256 algorithm", algorithm="sha256"),
    _case("salt", "a tenant's cache_salt", cache_salt="tenant-a"),
    _case("adapter", "a LoRA adapter's digest", adapter=_ADAPTER),
    _case("adapter-equals-salt", "the same string as salt and as adapter: other keys",
          cache_salt=_ADAPTER),
    _case("salt-and-adapter", "both", cache_salt="tenant-a", adapter=_ADAPTER),
    _case("empty-salt", "an empty salt is not no salt", cache_salt=""),
    _case("segments", "an image at token 5, another at 9",
          segments=[[5, "img-digest-1"], [9, "img-digest-2"]]),
    _case("unicode-salt", "a salt is hashed as UTF-8", cache_salt="t\u00e9nant-\u65e5"),
    _case("int32-extremes", "token ids are int32 little-endian",
          tokens=[-(2**31), 2**31 - 1, 0, -1, 65536, 7, 8, 9]),
    _case("block-size-1", "one token per block", fields={"block_size": "1"},
          tokens=[42, 43, 44]),
    _case("block-size-16-sha256", "one full block and a partial one", algorithm="sha256",
          fields={"block_size": "16"}, tokens=list(range(100, 121))),
    _case("kv-int8", "another namespace field (kv_dtype)", fields={"kv_dtype": "int8"}),
    _case("rope-theta", "another config (rope_theta 500000)",
          fields={"config": _FIELDS["config"].replace("10000.0", "500000.0")}),
    _case("short", "fewer tokens than a block: no block key, only the root",
          tokens=[1, 2]),
]  # fmt: skip


def compute(inputs: dict[str, Any]) -> dict[str, Any]:
    """What pagedkv's code makes of one case's inputs."""
    namespace = namespace_digest(inputs["namespace_fields"])
    hasher = BlockHasher(
        block_size=inputs["block_size"],
        namespace=namespace,
        algorithm=inputs["algorithm"],
        seed=bytes.fromhex(inputs["seed_hex"]),
    )
    extra = ExtraKeys(
        cache_salt=inputs["cache_salt"],
        adapter=inputs["adapter"],
        segments=[(int(start), key) for start, key in inputs["segments"]],
    )
    chain = hasher.chain(inputs["tokens"], extra)
    return {
        "namespace": namespace,
        "root": hasher.root(extra).hex(),
        "block_keys": [h.hex() for h in chain.hashes],
        "parent_keys": [k.hex() for k in chain.parent_keys],
    }


def build() -> dict[str, Any]:
    return {
        "format": "pagedkv block keys, identity v2",
        "spec": "docs/architecture.md, section 'Cache identity'",
        "namespace_fields": list(NAMESPACE_FIELDS),
        "cases": [{**case, "expected": compute(case["inputs"])} for case in CASES],
    }


def render() -> str:
    return json.dumps(build(), indent=1, ensure_ascii=False) + "\n"


if __name__ == "__main__":
    VECTORS_PATH.write_text(render(), encoding="utf-8")
    sys.stdout.write(f"wrote {len(CASES)} cases to {VECTORS_PATH}\n")
