"""One thread computes: the engine loads, warms up and runs every forward on its worker."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from pagedkv import CacheConfig, Engine, SamplingParams
from pagedkv.engine import engine as engine_module
from pagedkv.errors import ModelNotSupportedError
from pagedkv.model import ModelAdapter, load_model


def test_from_pretrained_loads_and_computes_on_the_worker_thread(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict[str, set[threading.Thread]] = {"load": set(), "forward": set()}
    forward = ModelAdapter.forward_batch
    load = engine_module.load_backend

    def recording_load(*args: object, **kwargs: object) -> ModelAdapter:
        seen["load"].add(threading.current_thread())
        return load(*args, **kwargs)  # type: ignore[no-any-return, arg-type]

    def recording_forward(self: ModelAdapter, *args: object, **kwargs: object) -> object:
        seen["forward"].add(threading.current_thread())
        return forward(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(engine_module, "load_backend", recording_load)
    monkeypatch.setattr(ModelAdapter, "forward_batch", recording_forward)
    with Engine.from_pretrained(str(tiny_llama_dir), config=CacheConfig(block_size=8)) as eng:
        eng.generate([5, 6, 7, 8, 9, 10, 11, 12, 13], SamplingParams(max_tokens=4))
        worker = eng._thread
    assert seen["load"] == {worker}
    assert seen["forward"] == {worker}


def test_a_model_that_cannot_load_raises_from_the_constructor(tmp_path: Path) -> None:
    before = threading.active_count()
    with pytest.raises(ModelNotSupportedError, match=r"config\.json"):
        Engine.from_pretrained(str(tmp_path))
    assert threading.active_count() == before


def test_a_failing_warm_up_closes_the_tiers_it_opened(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    adapter = load_model(str(tiny_llama_dir))

    def broken() -> None:
        raise RuntimeError("warm-up failed")

    monkeypatch.setattr(adapter, "warmup", broken)
    before = threading.active_count()
    with pytest.raises(RuntimeError, match="warm-up failed"):
        Engine(adapter, CacheConfig(block_size=8, ssd_cache_dir=tmp_path / "ssd"))
    assert threading.active_count() == before
