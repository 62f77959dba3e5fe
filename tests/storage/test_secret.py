"""The cache secret: loading, MACs and the seed derived from it."""

from __future__ import annotations

import pytest

from pagedkv.cache.builder import resolve_seed
from pagedkv.storage.secret import MAC_SIZE, CacheSecret, load_secret


def test_mac_verifies_its_parts_and_nothing_else() -> None:
    secret = CacheSecret(b"k" * 32)
    mac = secret.mac(b"meta", b"payload")
    assert len(mac) == MAC_SIZE
    assert secret.verify(mac, b"meta", b"payload")
    assert not secret.verify(mac, b"meta", b"payloae")
    assert not secret.verify(mac, b"metap", b"ayload")  # parts cannot shift
    assert not CacheSecret(b"j" * 32).verify(mac, b"meta", b"payload")


def test_seed_comes_from_the_secret_and_differs_from_its_macs() -> None:
    a, b = CacheSecret(b"a" * 32), CacheSecret(b"b" * 32)
    assert a.seed == CacheSecret(b"a" * 32).seed
    assert a.seed != b.seed
    assert resolve_seed(None, [], a) == a.seed
    assert resolve_seed(b"configured", [], a) == b"configured"


def test_load_secret_from_value_file_and_environment(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("PAGEDKV_CACHE_SECRET", raising=False)
    assert load_secret(None, None) is None
    file = tmp_path / "cache.secret"
    file.write_bytes(b"f" * 32 + b"\n")
    from_file = load_secret(None, file)
    assert from_file is not None and from_file.seed == CacheSecret(b"f" * 32).seed
    monkeypatch.setenv("PAGEDKV_CACHE_SECRET", "e" * 32)
    from_env = load_secret(None, None)
    assert from_env is not None and from_env.seed == CacheSecret(b"e" * 32).seed
    with pytest.raises(ValueError, match="at least 16 bytes"):
        load_secret("short", None)
    with pytest.raises(ValueError, match="cannot read the cache secret file"):
        load_secret(None, tmp_path / "missing")
