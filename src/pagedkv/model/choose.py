"""Which backend computes the model (`--backend`), and loading through it.

`auto` picks MLX on macOS on Apple Silicon when `mlx` and `mlx-lm` import, else
torch; `torch` and `mlx` are taken as asked (MLX runs on Linux through mlx-cpu, as
CI does). Importing this module imports neither torch nor MLX.
"""

from __future__ import annotations

import importlib.util
import json
import platform
import sys
from pathlib import Path
from typing import Any

from pagedkv.config import BACKENDS
from pagedkv.errors import ModelNotSupportedError

MLX_INSTALL_HINT = "install it with `pip install 'pagedkv[mlx]'` (mlx, mlx-lm; mlx-cpu on Linux)"


def mlx_available() -> bool:
    """Whether MLX and mlx-lm import here (on Linux, mlx needs mlx-cpu or mlx-cuda)."""
    if importlib.util.find_spec("mlx") is None or importlib.util.find_spec("mlx_lm") is None:
        return False
    try:
        import mlx.core  # noqa: F401
    except (ImportError, OSError):
        return False
    return True


def choose_backend(name: str) -> str:
    """`torch` or `mlx` for `--backend name`; refuses `mlx` where it cannot import."""
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}; got {name!r}")
    if name == "auto":
        apple = sys.platform == "darwin" and platform.machine() == "arm64"
        return "mlx" if apple and mlx_available() else "torch"
    if name == "mlx" and not mlx_available():
        raise ModelNotSupportedError(f"--backend mlx was asked for but MLX is not installed: "
                                     f"{MLX_INSTALL_HINT}; or use --backend torch")  # fmt: skip
    return name


def mlx_quantization(directory: Path) -> dict[str, Any] | None:
    """The `quantization` of an MLX-quantized model directory (mlx-community's 4-bit and
    8-bit models), read from its config.json; None for other models."""
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return None
    quant = config.get("quantization") if isinstance(config, dict) else None
    return quant if isinstance(quant, dict) else None


def load_backend(
    name_or_path: str | Path, backend: str = "auto", device: str = "auto", dtype: str = "auto"
) -> Any:
    """The model `--model` names (`model.resolve`), loaded by the backend `--backend`
    names: a `model.hf.ModelAdapter` (torch) or a `model.mlx.MlxBackend`."""
    chosen = choose_backend(backend)
    if chosen == "torch":
        from pagedkv.model.hf import load_model

        return load_model(name_or_path, device=device, dtype=dtype)
    if device not in ("auto", "cpu"):
        raise ModelNotSupportedError(
            f"--device {device} is torch's; the MLX backend runs on MLX's default device "
            "(Metal on a Mac, the CPU through mlx-cpu); leave --device auto"
        )
    if dtype != "auto":
        raise ModelNotSupportedError(
            f"--dtype {dtype} is not available on the MLX backend, which computes in the "
            "dtype the model's weights are stored in; leave --dtype auto"
        )
    import mlx.core as mx

    from pagedkv.model.mlx import load_mlx_model
    from pagedkv.model.resolve import resolve_model

    if device == "cpu":  # on a Mac: the CPU instead of Metal (MLX's default device)
        mx.set_default_device(mx.cpu)

    resolved = resolve_model(name_or_path)
    return load_mlx_model(resolved.directory, resolved.name)
