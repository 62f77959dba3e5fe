"""The sampling defaults a model recommends, read from its `generation_config`.

Many instruct models ship them (Qwen2.5: temperature 0.7, top_p 0.8, top_k 20,
repetition_penalty 1.05); the server and `pagedkv generate` use them for the
fields a request leaves out (`engine.defaults.resolve_sampling`). Only fields the
config sets count: transformers 5 leaves the others None, where transformers 4
filled in its own defaults (top_k 50), which no model recommended.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    """Recommended values; None where the model recommends nothing. `source` says
    where they came from, for the start-up log and the docs."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    source: str = "none"

    def describe(self) -> str:
        """`temperature=0.2 top_p=0.9 (from ...)`, or `none`."""
        set_ = [f"{f.name}={getattr(self, f.name)}" for f in fields(self) if f.name in FIELDS]
        set_ = [s for s in set_ if not s.endswith("=None")]
        return f"{' '.join(set_)} (from {self.source})" if set_ else "none"


# SmolLM2-135M-Instruct's generation_config sets no sampling fields. Its model card
# samples with temperature 0.2 and top_p 0.9; measured on the bundled Q4_1 weights,
# that alone still loops on "Write a haiku about caches" for some seeds ("a caché
# lies, a caché lies, ..." to max_tokens), and a repetition_penalty of 1.2 (greedy
# or sampled) ends it (docs/usage.md, "Model defaults").
BUNDLED_DEFAULTS = SamplingDefaults(
    temperature=0.2,
    top_p=0.9,
    repetition_penalty=1.2,
    source="pagedkv's defaults for the bundled model: its model card's temperature and "
    "top_p, plus a repetition penalty",
)


def read_sampling_defaults(generation_config: Any) -> SamplingDefaults:
    """The sampling fields `generation_config` sets. With `do_sample` set false the
    model asks for greedy decoding, and its temperature, top_p, top_k and min_p are
    not used (transformers ignores them too); its repetition_penalty still is."""
    if generation_config is None:
        return SamplingDefaults()
    values: dict[str, Any] = {}
    for name in FIELDS:
        value = getattr(generation_config, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            values[name] = int(value) if name == "top_k" else float(value)
    if getattr(generation_config, "do_sample", None) is False:
        values = {k: v for k, v in values.items() if k == "repetition_penalty"}
    if values.get("repetition_penalty") == 1.0:
        del values["repetition_penalty"]
    if not values:
        return SamplingDefaults()
    return SamplingDefaults(**values, source="the model's generation_config")
