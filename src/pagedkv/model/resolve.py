"""What `--model` names, turned into a local Hugging Face model directory.

Accepted, in the order they are tried:
1. the bundled model's name (`model.bundled`);
2. a local directory holding a Hugging Face causal LM (config.json, weights, tokenizer);
3. a GGUF file (`.gguf`, or any file starting with the GGUF magic, as Ollama's
   blobs do), converted once to safetensors under the user cache (`model.gguf`);
4. a Hub id `ORG/NAME` or `ORG/NAME@REVISION`, found in the local Hugging Face
   cache by huggingface_hub's own offline lookup (`snapshot_download` with
   `local_files_only=True`, as under `HF_HUB_OFFLINE=1`). Never a download.

A path that exists wins over a Hub id of the same spelling, as in transformers.
Nothing here touches the network.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pagedkv.errors import ModelNotSupportedError
from pagedkv.model.bundled import BUNDLED_MODEL_NAME, ensure_bundled_model
from pagedkv.model.gguf import ensure_gguf_model

ModelSource = Literal["bundled", "directory", "gguf", "hub"]

# huggingface_hub's own rule for a repo id, with the namespace required: a bare
# NAME is far more often a mistyped local path than a Hub model.
_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")

ACCEPTED = (
    f"pagedkv accepts the bundled model name {BUNDLED_MODEL_NAME!r}, a local directory "
    "holding a Hugging Face causal LM (config.json, weights, tokenizer), a .gguf file, or a "
    "Hub id ORG/NAME[@REVISION] already in the local Hugging Face cache"
)


@dataclass(frozen=True, slots=True)
class ResolvedModel:
    """A model ready for `from_pretrained(directory, local_files_only=True)`.

    `name` is what the server shows as the model id: the bundled name, the
    directory's or GGUF file's name, or the Hub id as given (without a revision).
    """

    directory: Path
    name: str
    source: ModelSource


def resolve_model(spec: str | Path, *, progress: bool = True) -> ResolvedModel:
    """Resolve `--model`; raises ModelNotSupportedError saying what was accepted."""
    text = str(spec)
    if text.lower() == BUNDLED_MODEL_NAME:
        return ResolvedModel(ensure_bundled_model(progress), BUNDLED_MODEL_NAME, "bundled")
    path = Path(text).expanduser()
    if path.is_dir():
        return ResolvedModel(_checked_dir(path, text), path.resolve().name, "directory")
    if path.is_file() and (path.suffix.lower() == ".gguf" or _has_gguf_magic(path)):
        return ResolvedModel(ensure_gguf_model(path, progress), path.name, "gguf")
    if path.suffix.lower() == ".gguf":
        raise ModelNotSupportedError(f"cannot load model {text!r}: no such GGUF file. {ACCEPTED}")
    if path.exists():
        raise ModelNotSupportedError(
            f"cannot load model {text!r}: it is a file but not a .gguf. {ACCEPTED}"
        )
    repo_id, _, revision = text.partition("@")
    if _HUB_ID.match(repo_id) and ".." not in repo_id and "--" not in repo_id:
        directory = hub_snapshot(repo_id, revision or None)
        return ResolvedModel(_checked_dir(directory, text), repo_id, "hub")
    raise ModelNotSupportedError(
        f"cannot load model {text!r}: it is not a local directory or file, nor a Hub id "
        f"ORG/NAME. {ACCEPTED}"
    )


def _has_gguf_magic(path: Path) -> bool:
    """Ollama keeps its GGUF files as `blobs/sha256-...`, without the suffix."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def _checked_dir(directory: Path, text: str) -> Path:
    if (directory / "config.json").is_file():
        return directory
    ggufs = sorted(str(p) for p in directory.glob("*.gguf"))
    hint = f" but holds {', '.join(ggufs)}: pass one of those files instead" if ggufs else ""
    raise ModelNotSupportedError(
        f"cannot load model {text!r}: {directory} has no config.json{hint}. {ACCEPTED}"
    )


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache, by huggingface_hub's rule: $HF_HUB_CACHE, else
    $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub.

    Read at each call: huggingface_hub reads these once, at import, so a process
    (or a test) that sets them later would otherwise look in the old place."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    home = os.environ.get("HF_HOME")
    if home:
        return Path(home).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "huggingface" / "hub"


def hub_snapshot(repo_id: str, revision: str | None) -> Path:
    """The cached snapshot directory of a Hub model, without any network access."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    cache = hub_cache_dir()
    shown = f"{repo_id}@{revision}" if revision else repo_id
    fetch = f"hf download {repo_id}" + (f" --revision {revision}" if revision else "")
    try:
        # local_files_only: the lookup HF_HUB_OFFLINE=1 does, set or not by the user.
        snapshot = snapshot_download(
            repo_id, revision=revision, cache_dir=cache, local_files_only=True
        )
    except HFValidationError as exc:
        raise ModelNotSupportedError(
            f"cannot load model {shown!r}: not a valid Hub id ({exc}). {ACCEPTED}"
        ) from exc
    except LocalEntryNotFoundError as exc:
        raise ModelNotSupportedError(
            f"cannot load model {shown!r}: it is not a local directory, and the Hub model is "
            f"not in the local Hugging Face cache ({cache}); pagedkv never downloads. Fetch it "
            f"first with `{fetch}` (or set HF_HUB_CACHE to the cache that holds it), or pass a "
            f"local directory; the bundled model is {BUNDLED_MODEL_NAME!r}"
        ) from exc
    return Path(snapshot)
