"""LoRA adapters read from PEFT adapter directories, checked against the base model.

A PEFT LoRA directory holds `adapter_config.json` and `adapter_model.safetensors`
with, for each adapted linear layer `P`, `base_model.model.P.lora_A.weight`
`[r, in]` and `base_model.model.P.lora_B.weight` `[out, r]`; the layer then
computes `W x + scale * B (A x)` with `scale = lora_alpha / r` (`lora_alpha /
sqrt(r)` under `use_rslora`). The files are read with safetensors alone: serving
needs no `peft`.

Everything here runs off the worker thread (reading, hashing, checking); the
worker only installs the result (`model.lora_layers`). Every refusal is an
`AdapterError` that names the file or field, what was there and what to do; the
features PEFT has that pagedkv does not apply (DoRA, trained biases, extra saved
modules, per-layer ranks, non-linear targets) are refused, never ignored.

Identity: `LoraWeights.digest` is a SHA-256 of a versioned tag (`LORA_DIGEST_TAG`, whose
version also names how the products are computed), the config fields that reach the
forward pass and the weights file's bytes, never the adapter's name; it goes
into every block key's root (`ExtraKeys.adapter`), so a same-name reload with
other weights, another adapter or the base model never reuses a block.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as load_safetensors

from pagedkv.errors import AdapterError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
DEFAULT_MAX_LORA_RANK = 64
_PREFIX = "base_model.model."
_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<part>[AB])\.weight$")
LORA_DIGEST_TAG = b"pagedkv-lora-v2\x00"
# Config fields that do not change what the adapter computes: left out of the digest,
# so a copied or re-saved adapter keeps its cache.
_NOT_COMPUTED = ("base_model_name_or_path", "revision", "inference_mode", "task_type")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,127}$")


@dataclass(frozen=True, eq=False)
class LoraWeights:
    """One loaded adapter: `modules` maps a linear layer's path in the base model to
    `(A [r, in], B [out, r])` as read (float32 copies are made at install). Immutable:
    a running request keeps the object it started with, whatever is loaded later."""

    name: str
    path: str
    digest: str
    rank: int
    scale: float
    target_modules: tuple[str, ...]
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(repr=False)

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "path": self.path,
            "digest": self.digest,
            "rank": self.rank,
            "scale": self.scale,
            "target_modules": list(self.target_modules),
            "num_layers": len(self.modules),
        }


def check_adapter_name(name: str) -> str:
    """An adapter name requests can give as `model`: no ':' (which splits `BASE:NAME`)."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise AdapterError(
            f"adapter name {name!r} is not allowed: use 1-128 letters, digits, '.', '_', "
            "'-' or '/', starting with a letter or digit (no ':', which splits BASE:NAME)"
        )
    return name


def read_lora(
    name: str,
    directory: str | Path,
    model: torch.nn.Module,
    *,
    base_names: tuple[str, ...],
    max_rank: int = DEFAULT_MAX_LORA_RANK,
) -> LoraWeights:
    """Read and check the PEFT LoRA adapter in `directory` against `model` (whose
    names, e.g. its Hub id and directory name, are `base_names`)."""
    check_adapter_name(name)
    where = Path(directory).expanduser()
    if not where.is_dir():
        raise AdapterError(f"adapter {name!r}: {where} is not a directory (missing or a file)")
    config = _read_config(name, where)
    rank, scale, targets = _check_config(name, where, config, max_rank)
    _check_base(name, config, base_names)
    weights_path = where / ADAPTER_WEIGHTS
    try:
        raw = weights_path.read_bytes()
    except FileNotFoundError:
        also = " (adapter_model.bin, pickled, is not read: re-save with safetensors)"
        bin_note = also if (where / "adapter_model.bin").exists() else ""
        raise AdapterError(
            f"adapter {name!r}: {weights_path} does not exist{bin_note}; a PEFT LoRA "
            f"directory holds {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}"
        ) from None
    except OSError as exc:
        raise AdapterError(f"adapter {name!r}: cannot read {weights_path}: {exc}") from exc
    try:
        tensors = load_safetensors(raw)
    except Exception as exc:  # safetensors raises its own error types
        raise AdapterError(f"adapter {name!r}: {weights_path} is not safetensors: {exc}") from exc
    modules = _pair_tensors(name, tensors, rank)
    _check_modules(name, model, modules, targets)
    identity = {k: v for k, v in sorted(config.items()) if k not in _NOT_COMPUTED}
    identity["target_modules"] = sorted(targets)  # PEFT writes a set: any order
    # The tag's version also names how the products are computed (`model/lora_layers.py`):
    # v2 since siblings share one stacked A product, whose rows round otherwise than v1's
    # separate products, so KV that v1 stored (on SSD, in Redis) is never reused.
    h = hashlib.sha256(LORA_DIGEST_TAG)
    h.update(json.dumps(identity, sort_keys=True, default=str).encode())
    h.update(b"\x00")
    h.update(raw)
    return LoraWeights(
        name=name,
        path=str(where),
        digest=h.hexdigest()[:32],
        rank=rank,
        scale=scale,
        target_modules=targets,
        modules=modules,
    )


def _read_config(name: str, where: Path) -> dict[str, Any]:
    path = where / ADAPTER_CONFIG
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise AdapterError(
            f"adapter {name!r}: {path} does not exist; a PEFT LoRA directory holds "
            f"{ADAPTER_CONFIG} and {ADAPTER_WEIGHTS} (save_pretrained writes both)"
        ) from None
    except (OSError, ValueError) as exc:
        raise AdapterError(f"adapter {name!r}: cannot read {path} as JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise AdapterError(f"adapter {name!r}: {path} is not a JSON object")
    return config


def _check_config(
    name: str, where: Path, config: dict[str, Any], max_rank: int
) -> tuple[int, float, tuple[str, ...]]:
    """The rank, the scale and the target modules; refuses what is not applied."""
    what = f"adapter {name!r} ({where / ADAPTER_CONFIG})"
    kind = config.get("peft_type", "LORA")
    if str(kind).upper() != "LORA":
        raise AdapterError(f"{what}: peft_type is {kind!r}; only LORA adapters are served")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterError(f"{what}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise AdapterError(
            f"{what}: rank r={rank} is above --max-lora-rank {max_rank}; raise "
            "--max-lora-rank or use an adapter of lower rank"
        )
    alpha = config.get("lora_alpha", rank)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise AdapterError(f"{what}: lora_alpha must be a number, got {alpha!r}")
    refused = {
        "use_dora": "DoRA",
        "rank_pattern": "per-layer ranks",
        "alpha_pattern": "per-layer alphas",
        "modules_to_save": "extra trained modules",
        "layers_to_transform": "per-layer selection",
        "trainable_token_indices": "trained token embeddings",
        "lora_bias": "trained LoRA biases",
        "layer_replication": "replicated layers",
        "target_parameters": "LoRA on parameters, not linear layers",
        "alora_invocation_tokens": "activated LoRA",
        "use_qalora": "QALoRA",
        "use_bdlora": "block-diagonal LoRA",
    }
    for key, feature in refused.items():
        if config.get(key):
            raise AdapterError(
                f"{what}: {key} is set ({feature}), which pagedkv does not apply; "
                "merge the adapter into the model instead"
            )
    if config.get("bias", "none") != "none":
        raise AdapterError(
            f"{what}: bias is {config['bias']!r}; only adapters without trained biases "
            "(bias 'none') are served"
        )
    targets = config.get("target_modules")
    if isinstance(targets, str):
        targets = [targets]
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise AdapterError(f"{what}: target_modules must name modules, got {targets!r}")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scale), tuple(targets)


def _check_base(name: str, config: dict[str, Any], base_names: tuple[str, ...]) -> None:
    """Refuse an adapter whose config names another base model. Names are compared by
    their last path part, case-folded: a Hub id and a local copy's directory agree."""
    declared = config.get("base_model_name_or_path")
    if not isinstance(declared, str) or not declared.strip():
        return
    short = {_last_part(n) for n in base_names if n}
    if _last_part(declared) not in short:
        raise AdapterError(
            f"adapter {name!r} was trained on base model {declared!r}, but this server "
            f"serves {' / '.join(sorted(short))}; load it on a server for that model (or "
            "correct base_model_name_or_path in its config if it was trained on this one)"
        )


def _last_part(name: str) -> str:
    return name.rstrip("/\\").replace("\\", "/").rsplit("/", 1)[-1].casefold()


def _pair_tensors(
    name: str, tensors: dict[str, torch.Tensor], rank: int
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None or not key.startswith(_PREFIX):
            raise AdapterError(
                f"adapter {name!r}: weight {key!r} is not a LoRA A or B matrix of a linear "
                "layer (embedding LoRA, DoRA magnitudes and saved modules are not served)"
            )
        if tensor.dim() != 2 or not tensor.is_floating_point():
            raise AdapterError(
                f"adapter {name!r}: weight {key!r} has shape {tuple(tensor.shape)} and dtype "
                f"{tensor.dtype}; LoRA matrices are 2-D floating point"
            )
        module = match["module"].removeprefix(_PREFIX)
        parts.setdefault(module, {})[match["part"]] = tensor
    if not parts:
        raise AdapterError(f"adapter {name!r}: {ADAPTER_WEIGHTS} holds no LoRA weights")
    modules = {}
    for module, pair in sorted(parts.items()):
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"adapter {name!r}: layer {module!r} has lora_A or lora_B only")
        a, b = pair["A"], pair["B"]
        if a.shape[0] != rank or b.shape[1] != rank:
            raise AdapterError(
                f"adapter {name!r}: layer {module!r} has rank {a.shape[0]}/{b.shape[1]} "
                f"(lora_A rows / lora_B columns), the config says r={rank}"
            )
        modules[module] = (a, b)
    return modules


def _check_modules(
    name: str,
    model: torch.nn.Module,
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]],
    targets: tuple[str, ...],
) -> None:
    """Every target names a linear layer of the model, and every pair fits its layer."""
    linears = {p: m for p, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    everything = {p for p, _ in model.named_modules()}
    for target in targets:
        if not any(p == target or p.endswith("." + target) for p in linears):
            kinds = sorted({p.rsplit(".", 1)[-1] for p in linears})
            raise AdapterError(
                f"adapter {name!r}: target module {target!r} is not a linear layer of this "
                f"model (its linear layers: {', '.join(kinds)}); is the adapter for another "
                "model?"
            )
    for path, (a, b) in modules.items():
        layer = linears.get(path)
        if layer is None:
            there = "is not a linear layer" if path in everything else "does not exist"
            raise AdapterError(
                f"adapter {name!r}: layer {path!r} {there} in this model; is the adapter "
                "for another base model?"
            )
        want_a, want_b = (a.shape[0], layer.in_features), (layer.out_features, b.shape[1])
        if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
            raise AdapterError(
                f"adapter {name!r}: layer {path!r} is {layer.in_features} -> "
                f"{layer.out_features} in this model, but the adapter's lora_A is "
                f"{tuple(a.shape)} and lora_B {tuple(b.shape)}: it was trained on another "
                "base model"
            )
