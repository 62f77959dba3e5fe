"""GGUF files, converted once into a safetensors model directory under the user cache.

transformers reads a GGUF by de-quantizing every tensor to float32, which takes
seconds per hundred million parameters; converting once and loading the
safetensors copy afterwards makes every later start as fast as a plain Hugging
Face directory. The bundled model (`model.bundled`) and any `.gguf` passed to
`--model` go through the same `ensure_converted`.

A user's GGUF is keyed by the sha256 of its bytes (`fingerprint.file_digest`,
remembered while the file's stat is unchanged): a rewritten file converts
again into a new directory, and two different files never share one. The
digest is also written into the directory's `SOURCE_MARKER`, which
`fingerprint.weights_digest` folds into the model's cache namespace.

The de-quantized weights keep the file's grid: a Q4_1 tensor becomes `code * d + m`
per group of 32 along the input, which `--dtype int4` (`model.int4`) codes back to
the same codes (its bfloat16 scale and zero round d and m); other types are coded
afresh (the bundled file's Q8_0 embedding, so its tied output layer).

Invariants: a conversion is written to a temporary directory and renamed into
place, so a crash never leaves a half-written model; a file lock per target
keeps concurrent processes from converting twice. Nothing here touches the network.
"""

from __future__ import annotations

import contextlib
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
from pagedkv.model.fingerprint import SOURCE_MARKER, file_digest

logger = logging.getLogger(__name__)

# De-quantized weights are float32: 4 bytes per parameter on disk and in memory.
DEQUANTIZED_BYTES_PER_PARAM = 4


def gguf_models_dir() -> Path:
    """Where converted user GGUF files live (one directory per file content)."""
    return cache_home() / "models" / "gguf"


def ensure_gguf_model(gguf: Path, progress: bool = True) -> Path:
    """The converted model directory of a GGUF file, converting it first if needed."""
    if not gguf.is_file():
        raise ModelNotSupportedError(f"GGUF file {str(gguf)!r} does not exist or is not a file")
    digest = file_digest(gguf)
    # Named by content alone: a renamed or copied file reuses the conversion.
    target = gguf_models_dir() / digest[:32]
    record = {"sha256": digest, "size": gguf.stat().st_size}
    converted = ensure_converted(gguf, target, record, progress=progress)
    _note_name(converted, gguf)
    return converted


def _note_name(directory: Path, gguf: Path) -> None:
    """Remember which files were converted here, for a person looking at the cache."""
    names = directory / "pagedkv-gguf-files.txt"
    try:
        known = names.read_text().splitlines() if names.exists() else []
        if str(gguf.resolve()) not in known:
            with open(names, "a") as f:
                f.write(f"{gguf.resolve()}\n")
    except OSError:
        pass  # a read-only cache loses only this note


def is_complete(directory: Path) -> bool:
    return (directory / "config.json").is_file() and any(directory.glob("*.safetensors"))


def read_source_record(directory: Path) -> dict[str, object] | None:
    try:
        recorded = json.loads((directory / SOURCE_MARKER).read_text())
    except (OSError, ValueError):
        return None
    return recorded if isinstance(recorded, dict) else None


def ensure_converted(
    gguf: Path, target: Path, record: dict[str, object], *, progress: bool = True
) -> Path:
    """`target`, converted from `gguf` unless it already holds a conversion whose
    `SOURCE_MARKER` equals `record` (which says what the source was)."""
    if is_complete(target) and read_source_record(target) == record:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _conversion_lock(target):
        if is_complete(target) and read_source_record(target) == record:
            return target  # another process converted it while we waited
        for leftover in target.parent.glob(f".{target.name}.tmp-*"):
            shutil.rmtree(leftover, ignore_errors=True)  # a crashed conversion's remains
        _convert(gguf, target, record, progress)
    return target


@contextlib.contextmanager
def _conversion_lock(target: Path) -> Iterator[None]:
    """Exclusive lock so that parallel processes (e.g. test workers) convert once."""
    try:
        import fcntl
    except ImportError:  # not POSIX: rely on the atomic rename alone
        yield
        return
    with open(target.parent / f".{target.name}.lock", "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def dequantized_bytes(gguf: Path) -> int:
    """Bytes the file's tensors take once de-quantized to float32."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(gguf)
    except (ValueError, OSError) as exc:
        raise ModelNotSupportedError(
            f"{str(gguf)!r} is not a readable GGUF file ({exc}); pass a .gguf written by "
            "llama.cpp or the gguf package, or a Hugging Face model directory"
        ) from exc
    return sum(int(t.n_elements) for t in reader.tensors) * DEQUANTIZED_BYTES_PER_PARAM


def _check_disk(gguf: Path, parent: Path) -> None:
    """Refuse before a long conversion that would fill the disk halfway through."""
    needed = dequantized_bytes(gguf)
    free = shutil.disk_usage(parent).free
    if needed > free:
        raise ModelNotSupportedError(
            f"converting {gguf.name} needs {needed / 2**30:.1f} GiB for its float32 weights "
            f"under {parent}, which has {free / 2**30:.1f} GiB free; free some space or point "
            "PAGEDKV_CACHE_HOME at a larger disk"
        )


def _convert(gguf: Path, target: Path, record: dict[str, object], progress: bool) -> None:
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    # transformers' own GGUF path (`from_pretrained(gguf_file=...)`) insists on
    # `accelerate`; building the model from the GGUF config and loading the
    # de-quantized tensors ourselves needs only `gguf`.
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    _check_disk(gguf, target.parent)
    started = time.perf_counter()
    logger.info(
        "converting %s once to float32 safetensors in %s (later starts load that copy)",
        gguf,
        target,
    )
    steps = tqdm(
        total=4,
        desc=f"pagedkv: one-time conversion of {gguf.name} to safetensors",
        disable=not progress,
        unit="step",
    )
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        try:
            config = AutoConfig.from_pretrained(
                gguf.parent, gguf_file=gguf.name, local_files_only=True
            )
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            steps.update(1)
            # The long part: transformers shows its own per-tensor bar while it de-quantizes.
            tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)[
                "tensors"
            ]
        except (ValueError, KeyError, OSError) as exc:
            raise ModelNotSupportedError(
                f"transformers cannot read {gguf.name} as a causal LM ({exc}); pass a Hugging "
                "Face model directory of the same model instead"
            ) from exc
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
        try:
            tokenizer = AutoTokenizer.from_pretrained(
                gguf.parent, gguf_file=gguf.name, local_files_only=True
            )
        except (ValueError, KeyError, OSError) as exc:
            raise ModelNotSupportedError(
                f"transformers cannot build a tokenizer from {gguf.name} ({exc}); pass a "
                "Hugging Face model directory of the same model instead"
            ) from exc
        steps.update(1)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / SOURCE_MARKER).write_text(json.dumps(record, indent=2))
        steps.update(1)
        _replace_dir(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        steps.close()
    logger.info(
        "converted %s in %.1f s; later starts load it from %s",
        gguf.name,
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
