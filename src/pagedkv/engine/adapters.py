"""The engine's LoRA adapters by name: loaded and unloaded while requests run.

Loading reads, hashes and checks the adapter (`model.lora.read_lora`) and prepares
its products (`LoraLayers.prepare`: the model's dtype, oneDNN packing) on a thread
started for it that then ends, so no second OpenMP team outlives it
(docs/architecture.md, "One thread computes"). Only the install, a dictionary
update, runs on the worker, as one queued call between two steps: running
streams pause for that alone (returned as `install_s`; the pause streams see is
measured in `benchmarks/bench_lora.py`).

A request takes the `LoraWeights` object its name maps to when it is submitted
and keeps it to its end: unloading or reloading a name changes what later
requests get and never what a running one computes. The object's products stay
installed until no running request holds it (`release`).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from pagedkv.errors import AdapterError, UnknownAdapterError
from pagedkv.model.backend import Backend
from pagedkv.model.lora import DEFAULT_MAX_LORA_RANK, LoraWeights, check_adapter_name, read_lora

T = TypeVar("T")


class Adapters:
    """Name → loaded adapter. Thread-safe: any thread may load, unload and look up;
    `call` runs a function on the worker thread and returns its result."""

    def __init__(
        self,
        model: Backend,
        call: Callable[[Callable[[], Any]], Any],
        max_rank: int = DEFAULT_MAX_LORA_RANK,
    ) -> None:
        if not isinstance(max_rank, int) or max_rank < 1:
            raise ValueError(f"max_lora_rank must be a positive integer, got {max_rank!r}")
        self.max_rank = max_rank
        self._model = model
        self._call = call
        self._lock = threading.Lock()
        self._by_name: dict[str, LoraWeights] = {}
        self._held: dict[int, int] = {}  # id(LoraWeights) -> running requests holding it
        self._dropped: dict[int, LoraWeights] = {}  # unloaded or replaced, still held

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._by_name)

    def describe(self) -> list[dict[str, Any]]:
        with self._lock:
            return [self._by_name[n].describe() for n in sorted(self._by_name)]

    def load(self, name: str, directory: str | Path) -> dict[str, Any]:
        """Load (or reload: the name then maps to the new weights) an adapter; its
        description, with `install_s`, the seconds the worker spent installing it."""
        check_adapter_name(name)
        if name == self._model.name:
            raise AdapterError(f"adapter name {name!r} is the base model's name; pick another")
        model = self._model
        layers, module = model.lora_layers, getattr(model, "model", None)
        if layers is None or module is None:
            raise AdapterError(
                f"the {model.backend_name} backend takes no LoRA adapters; "
                f"serve {name!r} with --backend torch"
            )
        model_dir = getattr(model, "model_dir", None)
        names = (model.name, *((model_dir.name,) if model_dir else ()))
        prepared = _off_thread(
            lambda: layers.prepare(
                read_lora(name, directory, module, base_names=names, max_rank=self.max_rank)
            )
        )
        lora = prepared.lora

        def install() -> float:
            started = time.perf_counter()
            layers.install(prepared)
            with self._lock:
                old = self._by_name.get(name)
                self._by_name[name] = lora
                if old is not None:
                    self._drop(old)
            return time.perf_counter() - started

        seconds: float = self._call(install)
        return {**lora.describe(), "install_s": seconds}

    def unload(self, name: str) -> None:
        def remove() -> None:
            with self._lock:
                lora = self._by_name.pop(name, None)
                if lora is None:
                    raise UnknownAdapterError(name, sorted(self._by_name))
                self._drop(lora)

        self._call(remove)

    def acquire(self, name: str) -> LoraWeights:
        """The adapter named `name`, held for a request until `release`."""
        with self._lock:
            lora = self._by_name.get(name)
            if lora is None:
                raise UnknownAdapterError(name, sorted(self._by_name))
            self._held[id(lora)] = self._held.get(id(lora), 0) + 1
            return lora

    def release(self, lora: LoraWeights) -> None:
        """A request holding `lora` ended (any thread; the products are freed on the
        worker's next `collect`)."""
        with self._lock:
            left = self._held.get(id(lora), 0) - 1
            if left > 0:
                self._held[id(lora)] = left
            else:
                self._held.pop(id(lora), None)

    def collect(self) -> None:
        """On the worker: uninstall the dropped adapters no request holds any more."""
        if not self._dropped:
            return
        with self._lock:
            gone = [lora for key, lora in self._dropped.items() if key not in self._held]
            for lora in gone:
                del self._dropped[id(lora)]
        for lora in gone:
            self._model.lora_layers.remove(lora)

    def _drop(self, lora: LoraWeights) -> None:
        """Under the lock, on the worker: `lora` is no longer served by name."""
        if id(lora) in self._held:
            self._dropped[id(lora)] = lora
        else:
            self._model.lora_layers.remove(lora)


def _yield_cpu() -> None:
    """Give the calling thread the lowest CPU priority (Linux: a thread's nice value is
    its own, and threads it starts, its OpenMP team included, inherit it), so a load
    takes the cores the worker leaves and the running streams keep their pace; elsewhere
    nothing changes."""
    if sys.platform != "linux":
        return
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


def _off_thread(fn: Callable[[], T]) -> T:
    """`fn()` on a new thread at the lowest CPU priority, which ends when it returns (its
    OpenMP team with it)."""
    box: list[Any] = []

    def run() -> None:
        _yield_cpu()
        try:
            box.append(fn())
        except BaseException as exc:  # handed back to the caller
            box.append(exc)

    thread = threading.Thread(target=run, name="pagedkv-lora-load", daemon=True)
    thread.start()
    thread.join()
    if isinstance(box[0], BaseException):
        raise box[0]
    return typing.cast(T, box[0])
