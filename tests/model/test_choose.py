"""`--backend`: which backend `auto` picks, refusals that name the fix, and the torch
backend refusing an MLX-quantized model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pagedkv import CacheConfig
from pagedkv.cli import build_parser
from pagedkv.errors import ModelNotSupportedError
from pagedkv.flags import cache_config_from_args
from pagedkv.model import choose


def test_auto_picks_mlx_on_apple_silicon_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(choose, "mlx_available", lambda: True)
    for platform, machine, want in (
        ("darwin", "arm64", "mlx"),
        ("darwin", "x86_64", "torch"),
        ("linux", "x86_64", "torch"),
        ("linux", "aarch64", "torch"),
    ):
        monkeypatch.setattr(choose.sys, "platform", platform)
        monkeypatch.setattr(choose.platform, "machine", lambda m=machine: m)
        assert choose.choose_backend("auto") == want, (platform, machine)
    monkeypatch.setattr(choose, "mlx_available", lambda: False)
    assert choose.choose_backend("auto") == "torch"  # a Mac without MLX installed
    assert choose.choose_backend("torch") == "torch"


def test_mlx_asked_for_but_missing_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(choose, "mlx_available", lambda: False)
    with pytest.raises(ModelNotSupportedError, match=r"pagedkv\[mlx\]"):
        choose.choose_backend("mlx")
    with pytest.raises(ValueError, match="backend must be one of"):
        choose.choose_backend("metal")


def test_the_flag_reaches_the_cache_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PAGEDKV_BACKEND", raising=False)
    args = build_parser().parse_args(["serve", "--backend", "mlx"])
    assert cache_config_from_args(args).backend == "mlx"
    assert cache_config_from_args(build_parser().parse_args(["serve"])).backend == "auto"
    with pytest.raises(ValueError, match="backend must be one of"):
        CacheConfig(backend="metal")


def test_torch_refuses_an_mlx_quantized_model(tiny_llama_dir: Path, tmp_path: Path) -> None:
    directory = tmp_path / "q4"
    shutil.copytree(tiny_llama_dir, directory)
    config = json.loads((directory / "config.json").read_text())
    config["quantization"] = {"group_size": 64, "bits": 4}
    (directory / "config.json").write_text(json.dumps(config))
    assert choose.mlx_quantization(directory) == {"group_size": 64, "bits": 4}
    assert choose.mlx_quantization(tiny_llama_dir) is None
    with pytest.raises(ModelNotSupportedError, match="--backend mlx"):
        choose.load_backend(directory, "torch")


@pytest.mark.skipif(not choose.mlx_available(), reason="MLX is not installed")
def test_load_backend_dispatches(tiny_llama_dir: Path) -> None:
    from pagedkv.model.hf import ModelAdapter
    from pagedkv.model.mlx import MlxBackend

    mlx = choose.load_backend(tiny_llama_dir, "mlx")
    assert isinstance(mlx, MlxBackend) and mlx.backend_name == "mlx"
    assert isinstance(choose.load_backend(tiny_llama_dir, "torch"), ModelAdapter)
    with pytest.raises(ModelNotSupportedError, match="--dtype bfloat16"):
        choose.load_backend(tiny_llama_dir, "mlx", dtype="bfloat16")
    with pytest.raises(ModelNotSupportedError, match="--device cuda"):
        choose.load_backend(tiny_llama_dir, "mlx", device="cuda")
