"""Content identity of a model: the config fields that reach its forward pass (for the
namespace, `cache.identity`) and the digest of its weights.

Weights are identified by the sha256 of their files' bytes, streamed. A file's
digest is remembered in `<cache home>/weight-digests.json`, keyed by its
resolved path and checked against (size, mtime_ns, ctime_ns, inode, device),
so a 500 MB model is hashed once (~0.4 s), not at every start. Any rewrite
changes mtime or ctime and forces a re-hash. Hashing the in-memory state dict
instead was rejected as the default: it costs the same at every start and
needs a device-to-host copy on GPU; it remains the fallback for a model that
was not loaded from files.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
from pathlib import Path
from typing import Any

from pagedkv.config import cache_home
from pagedkv.storage.ssd.namespaces import NamespaceInfo

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
DIGEST_CACHE_NAME = "weight-digests.json"
# Written by `model.gguf` into a directory converted from a GGUF file: what it came from.
SOURCE_MARKER = "pagedkv-source.json"
_MAX_REMEMBERED = 512
_CHUNK_BYTES = 8 << 20

# Config fields left out of the namespace, each because it cannot change the KV (or
# the logits) computed for given token ids. Everything else in `config.to_dict()` is
# in, nested configs and `_`-prefixed fields included: a field wrongly in costs cache
# misses, a field wrongly out costs wrong answers, so the list names what is out
# (an allowlist of RoPE, norm, window... fields would silently miss the next field
# transformers adds). tests/model/test_identity.py checks that the tokenizer, template
# and generation fields leave the namespace alone; test_identity_mutations.py that the
# forward fields change it.
NOT_IN_FORWARD = {
    # where the model was loaded from, and by which library version
    "_name_or_path": "a path; a moved or copied model computes the same",
    "name_or_path": "a path",
    "transformers_version": "the writer's library version, not the forward's",
    # how it was loaded: in the namespace as their own fields, measured on the model
    "dtype": "in the namespace as the parameters' real dtype",
    "torch_dtype": "in the namespace as the parameters' real dtype",
    "attn_implementation": "in the namespace as the attention kernel",
    # what the forward returns, not what it computes
    "use_cache": "whether a cache is returned",
    "output_attentions": "extra outputs only",
    "output_hidden_states": "extra outputs only",
    "return_dict": "the output's container",
    # tokenizer and template: pagedkv hashes token ids, so these cannot reach a key
    "bos_token_id": "a tokenizer fact; the ids are hashed",
    "eos_token_id": "decides when to stop, not what is computed",
    "pad_token_id": "padding; pagedkv batches ragged rows, never pads a prompt",
    "sep_token_id": "a tokenizer fact",
    "decoder_start_token_id": "encoder-decoder generation only",
    "tokenizer_class": "a tokenizer fact",
    "chat_template": "templates render text; the ids are hashed",
    # training and heads pagedkv never runs
    "initializer_range": "initialisation only; the weights digest covers the weights",
    "id2label": "classification heads",
    "label2id": "classification heads",
    "problem_type": "classification heads",
    "task_specific_params": "generation defaults",
    # generation settings older configs carry: sampling, not the forward pass
    **dict.fromkeys(
        ("max_length", "min_length", "do_sample", "early_stopping", "num_beams",
         "num_beam_groups", "diversity_penalty", "temperature", "top_k", "top_p",
         "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
         "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences",
         "output_scores", "return_dict_in_generate", "forced_bos_token_id",
         "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty",
         "suppress_tokens", "begin_suppress_tokens"),
        "a generation setting",
    ),
}  # fmt: skip

_lock = threading.Lock()


def config_identity(config: Any) -> Any:
    """The config as plain JSON data, minus the fields of `NOT_IN_FORWARD` (its own and
    its sub-configs')."""
    return _strip(json.loads(json.dumps(config.to_dict(), sort_keys=True, default=str)))


def canonical_config(config: Any) -> str:
    """`config_identity` as the namespace's `config` field: JSON with sorted keys, no
    spaces, ASCII only (floats as Python prints them: the shortest exact form)."""
    return json.dumps(
        config_identity(config), sort_keys=True, separators=(",", ":"), ensure_ascii=True
    )


def _strip(value: Any, is_config: bool = True) -> Any:
    """Drop `NOT_IN_FORWARD` keys from a config and its sub-configs (a dict with a
    `model_type`, such as `text_config`), never from other values: a RoPE dict's
    `temperature`, say, is not a generation setting."""
    if isinstance(value, dict):
        return {
            k: _strip(v, isinstance(v, dict) and "model_type" in v)
            for k, v in value.items()
            if not (is_config and k in NOT_IN_FORWARD)
        }
    if isinstance(value, list):
        return [_strip(v, isinstance(v, dict) and "model_type" in v) for v in value]
    return value


def weights_digest(model: Any, model_dir: Path | None) -> str:
    """sha256 over (relative name, file digest) of the weight files in `model_dir`;
    over the state dict's tensors when there is no directory or it holds no weights.

    A directory converted from a user's GGUF file also folds in that file's sha256
    (from its `SOURCE_MARKER`), so the namespace names the file itself, not only
    what transformers de-quantized it to."""
    files = _weight_files(model_dir) if model_dir is not None else []
    if not files:
        return "tensors:" + _state_dict_digest(model)
    assert model_dir is not None
    outer = hashlib.sha256()
    source = _source_digest(model_dir)
    if source is not None:  # absent for plain directories: their namespaces stay as they were
        outer.update(b"gguf\0" + bytes.fromhex(source))
    for path in files:
        outer.update(str(path.relative_to(model_dir)).encode() + b"\0")
        outer.update(bytes.fromhex(file_digest(path)))
    return "files:" + outer.hexdigest()


def _source_digest(model_dir: Path) -> str | None:
    recorded = _read(model_dir / SOURCE_MARKER).get("sha256")
    if isinstance(recorded, str) and len(recorded) == 64:
        try:
            bytes.fromhex(recorded)
        except ValueError:
            return None
        return recorded
    return None


def _weight_files(model_dir: Path) -> list[Path]:
    # Top level only: transformers loads nothing from subfolders such as `original/`.
    return sorted(p for p in model_dir.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file())


def _stat_key(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def file_digest(path: Path) -> str:
    """sha256 hex of a file's bytes, remembered across processes while the file is unchanged."""
    key = str(path.resolve())
    stat = _stat_key(path)
    store = cache_home() / DIGEST_CACHE_NAME
    with _lock:
        remembered = _read(store).get(key)
        if isinstance(remembered, dict) and remembered.get("stat") == stat:
            return str(remembered["sha256"])
    digest = _hash_file(path)
    if _stat_key(path) != stat:  # changed while we read it: do not remember a torn digest
        return digest
    with _lock:
        entries = _read(store)
        entries[key] = {"stat": stat, "sha256": digest}
        if len(entries) > _MAX_REMEMBERED:
            entries = {k: v for k, v in entries.items() if os.path.exists(k)}
            entries = dict(list(entries.items())[-_MAX_REMEMBERED:])
        _write(store, entries)
    return digest


def _hash_file(path: Path) -> str:
    h = hashlib.sha256()
    buffer = bytearray(_CHUNK_BYTES)
    view = memoryview(buffer)
    with open(path, "rb") as f:
        while n := f.readinto(buffer):
            h.update(view[:n])
    return h.hexdigest()


def _read(store: Path) -> dict[str, Any]:
    try:
        data = json.loads(store.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write(store: Path, entries: dict[str, Any]) -> None:
    """Atomic replace; a cache we cannot write (read-only home) only costs a re-hash later."""
    try:
        store.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{store.name}.", dir=store.parent)
    except OSError:
        return
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(entries, f)
        os.replace(tmp, store)
    except OSError:
        Path(tmp).unlink(missing_ok=True)


def _state_dict_digest(model: Any) -> str:
    import torch

    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().to("cpu")
        t = (t.to_dense() if t.is_mkldnn else t).contiguous()  # packed linear weights
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}\0".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def files_weights_digest(model_dir: Path) -> str | None:
    """`weights_digest` of a model directory from its files alone, without loading the
    model (what `pagedkv cache clear --model` matches namespaces by); None when the
    directory holds no weight files."""
    if not _weight_files(model_dir):
        return None
    return weights_digest(None, model_dir)


def describe_namespace(adapter: Any, block_size: int) -> NamespaceInfo:
    """What `pagedkv cache stats` shows for the namespace `adapter.fingerprint(block_size)`.

    The weights digest comes from the files only, whose digests `fingerprint` has just
    remembered (hashed again only when the cache home cannot be written); a model not
    loaded from files records none rather than hashing its tensors twice."""
    model_dir = getattr(adapter, "model_dir", None)
    kv_format = getattr(adapter, "kv_format", None)
    dtype = str(getattr(adapter, "dtype", "unknown")).removeprefix("torch.")
    kv_dtype = dtype
    if kv_format is not None:
        stored = str(kv_format.storage_dtype).removeprefix("torch.")
        kv_dtype = stored if kv_format.name == "auto" else kv_format.name
    return NamespaceInfo(
        model=str(getattr(adapter, "name", "unknown")),
        dtype=dtype,
        kv_dtype=kv_dtype,
        block_size=int(block_size),
        weights_kernel=str(getattr(adapter, "linear_kernel", "torch")),
        weights=files_weights_digest(model_dir) if model_dir is not None else None,
    )
