"""A request's sampling fields, with the model's recommended defaults for those it
leaves out (`model.generation_defaults`).

A request that asks for greedy decoding (temperature 0, or top_p 0) gets none of
the defaults, the repetition penalty included: greedy stays exactly greedy, the
same tokens as every other greedy run and as the cache tests check. Without a
model default, a left-out field is off, and temperature is `fallback_temperature`
(OpenAI's 1.0 on the server).
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.model.generation_defaults import SamplingDefaults

MIN_TEMPERATURE = 1e-5  # below this is greedy: logits / 1e-300 overflow to inf
# top_p below this is greedy. OpenAI clients send 0 for "most likely token only", and the
# sampler compares in float32, where values under ~1e-38 become 0 and drop every token.
MIN_TOP_P = 1e-6


@dataclass(frozen=True, slots=True)
class ResolvedSampling:
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float


def resolve_sampling(
    defaults: SamplingDefaults | None,
    *,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    repetition_penalty: float | None = None,
    fallback_temperature: float = 1.0,
) -> ResolvedSampling:
    """The values to sample with: the request's, else the model's, else off."""
    greedy = (temperature is not None and temperature < MIN_TEMPERATURE) or (
        top_p is not None and top_p < MIN_TOP_P
    )
    d = SamplingDefaults() if greedy or defaults is None else defaults

    def pick(asked: float | None, recommended: float | None, off: float) -> float:
        return asked if asked is not None else recommended if recommended is not None else off

    t = pick(temperature, d.temperature, fallback_temperature)
    p = pick(top_p, d.top_p, 1.0)
    if greedy or t < MIN_TEMPERATURE or p < MIN_TOP_P:
        t, p = 0.0, 1.0  # a nucleus this small holds only the top token
    k = top_k if top_k is not None else d.top_k
    return ResolvedSampling(
        temperature=t,
        top_p=p,
        top_k=k if k is not None and k > 0 else 0,
        min_p=pick(min_p, d.min_p, 0.0),
        repetition_penalty=pick(repetition_penalty, d.repetition_penalty, 1.0),
    )
