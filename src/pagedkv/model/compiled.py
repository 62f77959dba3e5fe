"""A compiled decode step: a plain decoder's one-token rows through AOTInductor.

A decode step of the bundled model spends much of its time outside the linear
products: 30 layers of small operations (norms, rotary embedding, the MLP's
element-wise work, views) dispatched one at a time from Python and
transformers' modules. Inductor generates C++ that fuses each layer's
element-wise work into a few loops.

What is compiled: `decode_layer`, one decoder layer's decode rows (RMS norms,
rotary positions, a SiLU-gated MLP; llama, mistral without a window, qwen2,
qwen3) written here over the model's own tensors, which it takes as inputs
(`LayerArgs`): every layer has the same shapes, so one compiled layer serves
all of them. `DecodeStep` runs the embedding, the rotary angles and the output
layer eagerly (a few operations) and the layers through it. The linear products:
- 4-bit layers (`model.int4`) inside the generated code: the kernel
  `_weight_int4pack_mm_for_cpu` over their tensors, q/k/v and gate/up
  concatenated along the outputs (one product instead of three and two);
- other layers as an opaque op (`pagedkv::linear`) that calls a registered
  layer by index (a 0-d tensor input: one layer's index is not a constant of the
  code), with the kernel the eager path uses (oneDNN over packed weights, which
  inductor cannot take as inputs): the model's own o and down projections, and
  fused copies of q/k/v and gate/up (~20 us a call saved, for ~two thirds of the
  weights' bytes again in memory). Rejected: inductor's `freezing`, which packs
  its own copy of every weight and whose packed constants its disk cache cannot
  store (every start compiled again: 90-105 s for the bundled model here).
Attention is an opaque op too (`pagedkv::decode_attention`): the ragged batch's
(`model.batch.ragged_attention`), which writes each row's keys and values into
its sequence's buffer and attends with the grouped decode attention. So the
layer's shapes depend on its number of rows only, never on a context length or
a buffer, and the rows are a dynamic size of the export: one compiled layer for
every row count, never compiled again while serving.

Ahead of time: `torch.export` and AOTInductor build a package (`.pt2`: the
generated code as a shared library) under the user cache's `compiled/`, named by
what it depends on (`package_key`: the compiler, the CPU instructions, this file,
the model's shapes and input dtypes; not the weights). A restart loads it: no
trace, no compile (measured for the bundled model: built in ~11-30 s, loaded in
0.1-0.2 s; a first answer 7.8 s after launch with `--dtype int4`). Rejected:
`torch.compile` of the whole step, whose warm start re-traces the 30 layers
(13-15 s, and its per-call guards cost ~20% of a layer's time).

Which steps: those whose every chunk is one decode row with no LoRA adapter, in
the default batching mode. A step with a prompt chunk runs eagerly; so does
every step in deterministic mode, where a row must round alike whatever else
runs. A compiled row rounds otherwise than an eager one (fused element-wise
work), so the compiled step is part of the namespace's `mode`
(`ModelAdapter.identity`): KV decoded one way is never restored into a run that
decodes the other way. Cached == fresh holds within the mode: a prompt's rows
are computed eagerly either way, and decode rows are decode rows whether their
prompt was cached or not.

Fallback: a model this step does not describe (`compile_reason`), a build or
load that fails (no C++ compiler, an op inductor cannot lower) or a compiled
step whose logits disagree with the eager forward's leaves the step eager, with
the reason logged and kept (`CompiledDecode.reason`): never a failed start.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from pagedkv.model import decode_layer as layer_code
from pagedkv.model.batch import SeqChunk, plan_batch
from pagedkv.model.decode_layer import DecodeStep, LayerArgs, LayerShape, flat_inputs, running
from pagedkv.storage.ssd.ownership import check_directory, make_private_dir

log = logging.getLogger(__name__)

# The row counts run at start-up (the last is the example the layer is exported at).
COMPILED_ROWS = (1, 2)
# What the packages' folder is, and what a writer to it could do.
_PACKAGES = ("compiled decode directory", "run code in the server")
# The most rows the exported layer takes (a step's decode rows: one per running sequence).
_MAX_ROWS = 1 << 16
# Model types whose decoder `DecodeStep` computes, layer for layer.
_PLAIN_DECODERS = ("llama", "mistral", "qwen2", "qwen3")
# Bumped when `DecodeStep` computes otherwise (part of the namespace's `mode`).
_STEP_VERSION = 1


def compile_reason(model: Any, batched: bool, windows: Sequence[int | None]) -> str | None:
    """Why `model`'s decode step cannot be compiled here (`windows`: its KV layers'
    sliding windows); None if it can."""
    config = model.config
    text = config.get_text_config(decoder=True)
    kind = getattr(text, "model_type", None)
    if kind not in _PLAIN_DECODERS:
        return f"the compiled step computes {', '.join(_PLAIN_DECODERS)} decoders, not {kind}"
    if not batched:
        return "the model runs one sequence per forward, not in the ragged batch"
    if any(w is not None for w in windows):
        return "sliding-window layers"
    if getattr(text, "hidden_act", "silu") != "silu":
        return f"activation {text.hidden_act}"
    inner = getattr(model, "model", None)
    rotary = getattr(inner, "rotary_emb", None)
    fixed = ("default", "linear", "llama3")  # a frequency table set once, at load
    if rotary is None or getattr(rotary, "rope_type", "default") not in fixed:
        return "rotary positions other than a fixed frequency table"
    if getattr(model, "lm_head", None) is None:
        return "no lm_head"
    return None


def is_decode_step(chunks: Sequence[SeqChunk]) -> bool:
    """Whether every chunk is one decode row the compiled step computes."""
    return all(
        not c.is_prompt and c.lora is None and not c.images and c.positions is None for c in chunks
    )


class _Exported(torch.nn.Module):
    """`decode_layer` as `torch.export` takes it: tensors (in nested tuples) in, `h` out."""

    def __init__(self, shape: LayerShape) -> None:
        super().__init__()
        self.shape = shape

    def forward(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, args: tuple[Any, ...]
    ) -> torch.Tensor:
        return layer_code.decode_layer(self.shape, h, cos, sin, LayerArgs(*args))


class CompiledDecode:
    """The decode step's layer compiled once, ahead of time, for any number of rows;
    `reason` says why it is not in use (None: it is)."""

    def __init__(self, model: Any, directory: Path) -> None:
        self.reason: str | None = None
        self.loaded = False  # the package was on disk (not built now)
        self.seconds = 0.0  # building or loading it, and its first steps
        self.steps = 0  # decode steps computed compiled
        self._step = DecodeStep(model).eval()
        self.path = directory / f"{self.package_key()}.pt2"

    @property
    def active(self) -> bool:
        return self._step.package is not None and self.reason is None

    def signature(self) -> str:
        """What the namespace's `mode` names: the compiler, its version, the CPU
        instructions its code was generated for (they round otherwise), the step's."""
        cpu = torch.backends.cpu.get_cpu_capability().lower()
        return f"aotinductor:torch-{torch.__version__}:{cpu}:v{_STEP_VERSION}"

    def package_key(self) -> str:
        """What the compiled layer depends on: the signature, the code exported (this
        file's and `model.decode_layer`'s), the model's shape constants and each
        input's dtype and size (not the weights: inputs)."""
        args = [(str(t.dtype), tuple(t.shape)) for t in flat_inputs(self._step.layers[0])]
        text = repr((self.signature(), tuple(self._step.shape), args))
        digest = hashlib.sha256(text.encode())
        for source in (__file__, layer_code.__file__):  # the code exported
            digest.update(Path(source).read_bytes())
        return digest.hexdigest()[:24]

    def compile(
        self,
        new_buffer: Callable[[int], torch.Tensor],
        kv_format: Any,
        device: torch.device,
        check: Callable[[CompiledDecode], str | None],
    ) -> None:
        """Load the layer's package from disk, or build it there (`build`); run
        `COMPILED_ROWS` rows over throwaway buffers from `new_buffer(capacity)`, then
        `check(self)`: why the compiled step disagrees with the eager forward, or None.
        On any failure the step stays eager (`reason`)."""
        started = time.perf_counter()
        try:
            # A package is code the server runs: never from a folder others may write.
            check_directory(self.path.parent, _PACKAGES)
            package = None
            if self.path.is_file():
                try:
                    package = _load(self.path)
                    self.loaded = True
                except Exception as exc:  # a damaged file: built again
                    log.warning("decode step: package %s did not load (%s)", self.path, exc)
                    self.path.unlink(missing_ok=True)
            if package is None:
                log.info(
                    "decode step: building the layer package, once for this model, dtype and "
                    "torch (the bundled model: 10-30 s on 2 cores) into %s", self.path
                )  # fmt: skip
                self.build()
                package = _load(self.path)
            self._step.package = package
            for rows in COMPILED_ROWS:
                chunks = [SeqChunk(new_buffer(4), 1, [0], True) for _ in range(rows)]
                self(chunks, kv_format, device)
            self.reason = check(self)
        except Exception as exc:  # any compiler failure: stay eager
            self.reason = f"compiling failed ({type(exc).__name__}: {exc})"
        self.seconds = time.perf_counter() - started
        if self.reason is not None:
            log.warning("the decode step stays eager: %s", self.reason)
            self._step.package = None
        else:
            how = "loaded" if self.loaded else "built"
            log.info("decode step: layer package %s in %.1f s (%s)", how, self.seconds, self.path)

    def build(self) -> None:
        """Export `decode_layer` with the rows dynamic and compile it with AOTInductor
        into `path` (written whole, then renamed: a concurrent start never loads half)."""
        step = self._step
        b = COMPILED_ROWS[-1]  # an example size torch.export does not specialize
        hidden, hd = step.shape.hidden, step.shape.head_dim
        h = torch.zeros(b, hidden, dtype=step.embed.dtype)
        cos = torch.zeros(b, 1, hd, dtype=step.embed.dtype)
        args = tuple(step.layers[0])
        rows = torch.export.Dim("rows", min=1, max=_MAX_ROWS)
        dims = {"h": {0: rows}, "cos": {0: rows}, "sin": {0: rows}}
        dims["args"] = torch.utils._pytree.tree_map(lambda _: None, args)
        with torch.inference_mode():
            exported = torch.export.export(
                _Exported(step.shape), (h, cos, cos.clone(), args), dynamic_shapes=dims,
                strict=False,
            )  # fmt: skip
        make_private_dir(self.path.parent)
        partial = self.path.with_suffix(f".{os.getpid()}.partial.pt2")
        try:
            torch._inductor.aoti_compile_and_package(exported, package_path=str(partial))
            os.replace(partial, self.path)
        finally:
            partial.unlink(missing_ok=True)

    def __call__(
        self, chunks: list[SeqChunk], kv_format: Any, device: torch.device
    ) -> torch.Tensor:
        """The float32 logits `[wanted, vocab]` of one decode step (`is_decode_step`)."""
        plan, ids, positions, keep = plan_batch(chunks, None, device, kv_format, True)
        running.plan = plan
        try:
            with torch.inference_mode():
                logits = self._step(ids[0], positions[0])
        finally:
            running.plan = None
        self.steps += 1
        return logits[keep]


def _load(path: Path) -> Any:
    """The package at `path`, through torch's loader itself: `aoti_load_package` first
    probes which vector instructions the CPU runs (2-2.5 s of subprocesses here) only
    to warn where they differ from the build's, which the package's name includes, and
    its call parses the package's input layout every time."""
    return torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
