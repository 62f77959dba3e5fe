"""Namespace descriptions (`namespaces/<ns>.json`) are untrusted input: whatever is at
that name reads as a description pagedkv wrote, or as none, never hangs or raises."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from pagedkv.storage.ssd.namespaces import (
    MAX_DESCRIPTION_BYTES,
    NamespaceInfo,
    description_path,
    read_namespace,
    record_namespace,
)

NS = "0123456789abcdef0123456789abcdef"
INFO = NamespaceInfo("tiny", "float32", "int8", 16, "torch", "files:ab", 0.0)


def test_recorded_once_private_and_read_back(tmp_path: Path) -> None:
    assert record_namespace(tmp_path, NS, INFO)
    path = description_path(tmp_path, NS)
    assert path is not None and stat.S_IMODE(path.stat().st_mode) == 0o600
    first = read_namespace(tmp_path, NS)
    assert first is not None and first.model == "tiny" and first.kv_dtype == "int8"
    assert first.first_seen > 0  # stamped when recorded
    # the first description stays: a later engine does not rewrite "first seen"
    assert not record_namespace(tmp_path, NS, NamespaceInfo("other", "bfloat16", "bfloat16", 64))
    assert read_namespace(tmp_path, NS) == first
    assert first.summary() == "tiny (float32, KV int8, block 16 tokens)"
    int4 = NamespaceInfo("tiny", "bfloat16", "bfloat16", 16, "int4-g32")
    assert int4.summary() == "tiny (bfloat16, int4 weights, KV bfloat16, block 16 tokens)"
    int8 = NamespaceInfo("tiny", "float32", "float32", 16, "int8-pair")
    assert int8.summary() == "tiny (float32, int8 weights, KV float32, block 16 tokens)"


def test_no_description_for_a_name_that_cannot_be_a_file(tmp_path: Path) -> None:
    for bad in ("../x", "a/b", "", "x" * 200):
        assert description_path(tmp_path, bad) is None
        assert not record_namespace(tmp_path, bad, INFO)
        assert read_namespace(tmp_path, bad) is None


def _plant(tmp_path: Path, content: object) -> Path:
    path = description_path(tmp_path, NS)
    assert path is not None
    path.parent.mkdir(exist_ok=True)
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


GOOD = {
    "namespace": NS, "model": "m", "dtype": "float32", "kv_dtype": "float32",
    "weights_kernel": "torch", "block_size": 16, "first_seen": 1.0, "weights": None,
}  # fmt: skip


@pytest.mark.parametrize(
    "content",
    [
        "not json",
        "[" * 4000,  # deeper than the parser goes, within the size bound
        json.dumps({**GOOD, "first_seen": 1e999}).replace("Infinity", "1e999"),
        {**GOOD, "namespace": "another"},  # a copy of another namespace's file
        {**GOOD, "block_size": "16"},
        {**GOOD, "block_size": True},
        {**GOOD, "model": ""},
        {**GOOD, "model": "m" * 10_000},
        {**GOOD, "first_seen": None},
        {**GOOD, "weights": 5},
        [GOOD],
    ],
)
def test_a_bad_file_reads_as_no_description_and_is_replaced(
    tmp_path: Path, content: object
) -> None:
    _plant(tmp_path, content)
    assert read_namespace(tmp_path, NS) is None
    assert record_namespace(tmp_path, NS, INFO)  # the next engine replaces it
    assert read_namespace(tmp_path, NS) is not None


def test_a_good_file_reads(tmp_path: Path) -> None:
    _plant(tmp_path, GOOD)
    assert read_namespace(tmp_path, NS) == NamespaceInfo(
        "m", "float32", "float32", 16, "torch", None, 1.0
    )


def test_links_fifos_and_huge_files_read_as_none(tmp_path: Path) -> None:
    path = _plant(tmp_path, GOOD)
    target = tmp_path / "elsewhere.json"
    os.replace(path, target)
    path.symlink_to(target)
    assert read_namespace(tmp_path, NS) is None  # never followed
    path.unlink()
    os.mkfifo(path)
    assert read_namespace(tmp_path, NS) is None  # not waited on
    path.unlink()
    path.write_text(json.dumps({**GOOD, "pad": "x" * MAX_DESCRIPTION_BYTES}))
    assert read_namespace(tmp_path, NS) is None
