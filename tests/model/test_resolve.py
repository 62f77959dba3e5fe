"""`--model` as a Hub id in the local Hugging Face cache, and as a .gguf file.

The Hugging Face cache here is a fake one laid out as huggingface_hub lays out
its own (models--ORG--NAME/refs, snapshots/<commit>/ links into blobs/); the
GGUF is written by the `gguf` package from a tiny random model (tiny_gguf.py).
No test touches the network: sockets refuse to connect while they run.
"""

from __future__ import annotations

import shutil
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from fixtures_models import make_tiny_model
from hub_cache import COMMIT, add_to_hub_cache
from tiny_gguf import write_tiny_gguf

from pagedkv import CacheConfig, Engine, SamplingParams
from pagedkv.errors import ModelNotSupportedError
from pagedkv.model import gguf as gguf_conversion
from pagedkv.model import load_model
from pagedkv.model.resolve import hub_cache_dir, resolve_model

PROMPT = "A cache keeps the answers to questions that were asked before"


@pytest.fixture(autouse=True)
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A private pagedkv cache home and Hugging Face cache; no network at all."""
    monkeypatch.setenv("PAGEDKV_CACHE_HOME", str(tmp_path / "pagedkv-home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-hub"))

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"network access attempted: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    yield


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", arch="llama")


# ---- Hub ids ------------------------------------------------------------------------


@pytest.mark.parametrize("offline_env", ["unset", "1"])
def test_hub_id_loads_from_the_local_cache_without_network(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, offline_env: str
) -> None:
    import huggingface_hub.constants

    # Resolution must not depend on the user having set HF_HUB_OFFLINE.
    if offline_env == "unset":
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    else:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    snapshot = add_to_hub_cache(tmp_path / "hf-hub", "tiny-org/tiny-llama", tiny_dir)

    resolved = resolve_model("tiny-org/tiny-llama")
    assert (resolved.directory, resolved.name, resolved.source) == (
        snapshot,
        "tiny-org/tiny-llama",
        "hub",
    )
    assert resolve_model(f"tiny-org/tiny-llama@{COMMIT}").directory == snapshot
    adapter = load_model("tiny-org/tiny-llama", device="cpu", dtype="float32")
    reference = load_model(tiny_dir, device="cpu", dtype="float32")
    assert adapter.name == "tiny-org/tiny-llama"
    ids = reference.encode(PROMPT)
    assert adapter.encode(PROMPT) == ids
    assert torch.equal(adapter.forward(ids)[0], reference.forward(ids)[0])
    # Same config and weight bytes: the Hub copy shares the directory's cache namespace.
    assert adapter.fingerprint(16) == reference.fingerprint(16)


def test_hub_cache_location_follows_hf_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    assert hub_cache_dir() == tmp_path / "hf-home" / "hub"
    monkeypatch.delenv("HF_HOME")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hub_cache_dir() == tmp_path / "xdg" / "huggingface" / "hub"


def test_absent_hub_model_names_hf_download(tiny_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelNotSupportedError, match=r"`hf download tiny-org/absent`") as err:
        resolve_model("tiny-org/absent")
    assert str(tmp_path / "hf-hub") in str(err.value), "the message names where it looked"
    add_to_hub_cache(tmp_path / "hf-hub", "tiny-org/tiny-llama", tiny_dir)
    fetch = r"hf download tiny-org/tiny-llama --revision v2"
    with pytest.raises(ModelNotSupportedError, match=fetch):
        resolve_model("tiny-org/tiny-llama@v2")


def test_hub_snapshot_without_config_points_at_its_gguf(tmp_path: Path) -> None:
    files = tmp_path / "gguf-repo"
    files.mkdir()
    (files / "model-Q4_K_M.gguf").write_bytes(b"GGUF")
    snapshot = add_to_hub_cache(tmp_path / "hf-hub", "tiny-org/tiny-GGUF", files)
    with pytest.raises(ModelNotSupportedError, match=r"no config\.json") as err:
        resolve_model("tiny-org/tiny-GGUF")
    assert str(snapshot / "model-Q4_K_M.gguf") in str(err.value)


def test_unaccepted_specs_say_what_is_accepted(tmp_path: Path) -> None:
    other = tmp_path / "weights.bin"
    other.write_bytes(b"x")
    for spec, why in [
        (str(other), "not a .gguf"),
        (str(tmp_path / "missing.gguf"), "no such GGUF file"),
        ("not a model", "nor a Hub id"),
    ]:
        with pytest.raises(ModelNotSupportedError, match=why) as err:
            resolve_model(spec)
        assert ".gguf file" in str(err.value) and "Hub id" in str(err.value)


# ---- GGUF files -----------------------------------------------------------------------


def test_gguf_file_computes_what_its_source_model_computes(tiny_dir: Path, tmp_path: Path) -> None:
    gguf = write_tiny_gguf(tiny_dir, tmp_path / "tiny.Q.gguf")
    resolved = resolve_model(gguf)
    assert (resolved.name, resolved.source) == ("tiny.Q.gguf", "gguf")
    adapter = load_model(gguf, device="cpu", dtype="float32")
    reference = load_model(tiny_dir, device="cpu", dtype="float32")
    ids = reference.encode(PROMPT)
    assert adapter.encode(PROMPT) == ids
    chat = [{"role": "user", "content": "hello"}]
    assert adapter.apply_chat_template(chat) == reference.apply_chat_template(chat)
    assert adapter.eos_token_ids == reference.eos_token_ids
    assert torch.equal(adapter.forward(ids)[0], reference.forward(ids)[0])
    # The namespace names the GGUF file, not only the weights it de-quantizes to.
    assert adapter.fingerprint(16) != reference.fingerprint(16)


def test_gguf_converts_once_per_content(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gguf = write_tiny_gguf(tiny_dir, tmp_path / "a.gguf")
    first = resolve_model(gguf).directory
    fingerprint = load_model(gguf, device="cpu").fingerprint(16)

    def refuse(*args: object) -> None:
        raise AssertionError("converted an unchanged GGUF again")

    convert = gguf_conversion._convert
    monkeypatch.setattr(gguf_conversion, "_convert", refuse)
    assert resolve_model(gguf).directory == first
    copy = shutil.copy(gguf, tmp_path / "b.gguf")  # same bytes elsewhere: same conversion
    assert resolve_model(copy).directory == first
    blob = shutil.copy(gguf, tmp_path / "sha256-0a1b")  # as Ollama stores it: no suffix
    assert (resolve_model(blob).directory, resolve_model(blob).source) == (first, "gguf")
    monkeypatch.setattr(gguf_conversion, "_convert", convert)

    other_model = make_tiny_model(tmp_path / "other", arch="llama", seed=1)
    write_tiny_gguf(other_model, gguf)  # the file is rewritten with other weights
    second = resolve_model(gguf).directory
    assert second != first and (second / "config.json").is_file()
    assert load_model(gguf, device="cpu").fingerprint(16) != fingerprint


def test_unreadable_gguf_is_refused_and_leaves_nothing(tmp_path: Path) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF but not really")
    with pytest.raises(ModelNotSupportedError, match="not a readable GGUF file"):
        load_model(bad)
    converted = gguf_conversion.gguf_models_dir()
    assert [p.name for p in converted.iterdir() if not p.name.endswith(".lock")] == []


def test_gguf_cached_equals_fresh(tiny_dir: Path, tmp_path: Path) -> None:
    gguf = write_tiny_gguf(tiny_dir, tmp_path / "tiny.gguf")
    prompt = [{"role": "user", "content": PROMPT + " and again " + PROMPT}]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    cache = CacheConfig(block_size=8, ram_cache_bytes=32 << 20)
    with Engine.from_pretrained(str(gguf), config=cache, device="cpu", dtype="float32") as eng:
        assert eng.model_name == "tiny.gguf"
        ids = eng.adapter.apply_chat_template(prompt)
        first = eng.generate(ids, params)
        second = eng.generate(ids, params)
    off = CacheConfig(enable_prefix_caching=False)
    with Engine.from_pretrained(str(gguf), config=off, device="cpu", dtype="float32") as eng:
        fresh = eng.generate(ids, params)
    assert first.cached_tokens == 0 and second.cached_tokens >= len(ids) - 8
    assert first.token_ids == second.token_ids == fresh.token_ids
    assert len(set(fresh.token_ids)) > 1, "greedy output is varied enough to show a difference"
