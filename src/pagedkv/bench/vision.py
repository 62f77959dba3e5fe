"""`pagedkv bench --workload vision`: multi-turn chats about one to three images.

Each session opens with a shared system prompt and a user turn holding 1 to 3 images
(made here from the seed: gradients with noise, a few sizes; nothing is downloaded),
then asks further questions about the same images. Like the text workloads
(`bench/run.py`), a cached pass generates the conversations online, then a cold
replay sends the same prompts and images to an engine with prefix caching off and
no encoder-row cache (`vision_cache_bytes=0`: every image runs the vision encoder),
with `max_tokens` fixed and `ignore_eos`, and outputs are compared token for token.

The ideal cache must not reuse an image's placeholder tokens for another image: it
sees the prompt with each placeholder token replaced by a value derived from the
image's key and its offset in the image (`keyed_ids`), so two images with the same
placeholders part where the image starts, as the engine's segment keys do.

Besides reuse / ideal it reports the TTFT of the second turn of each session (cached,
the same images) against the first turn's cold TTFT, and where the time of a turn
goes outside the engine (rendering through the processor)."""

from __future__ import annotations

import dataclasses
import random
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from pagedkv.bench.ideal import IdealCache
from pagedkv.bench.report import RequestRecord, percentile, summarize
from pagedkv.bench.workloads import _text
from pagedkv.config import CacheConfig
from pagedkv.model.images import ImageInput, image_from_pixels
from pagedkv.model.vision import ImagePrompt

# sessions, turns, system prompt words, max_tokens
SHAPES = {"tiny": (2, 3, 12, 6), "quick": (4, 4, 60, 16), "full": (8, 6, 200, 32)}
IMAGE_SIZES = ((64, 48), (96, 96), (160, 120), (224, 224))
REUSE_TARGET = 0.98
TTFT_TARGET = 0.2  # second turn cached / first turn cold


class NotAVisionModelError(ValueError):
    """The bench's model takes no images."""


@dataclass(frozen=True, slots=True)
class VisionStep:
    session: int
    turn: int
    text: str
    image_seeds: tuple[int, ...]
    max_tokens: int


def vision_steps(size: str, seed: int) -> tuple[str, list[VisionStep]]:
    """The system prompt and the steps, session by session in turn order."""
    sessions, turns, words, max_tokens = SHAPES[size]
    rng = random.Random(f"pagedkv-bench:vision:{size}:{seed}")
    system = "You are a helpful assistant who describes pictures. " + _text(rng, words)
    steps = []
    for s in range(sessions):
        for t in range(turns):
            images = tuple(rng.randrange(2**31) for _ in range(1 + s % 3)) if t == 0 else ()
            text = ("Look at these pictures. " if images else "About the same pictures: ") + (
                _text(rng, rng.randint(6, 14))
            )
            steps.append(VisionStep(s, t, text, images, max_tokens))
    return system, steps


def make_image(seed: int) -> ImageInput:
    """A picture from `seed`: a colour gradient with noise, in one of `IMAGE_SIZES`."""
    rng = np.random.default_rng(seed)
    width, height = IMAGE_SIZES[seed % len(IMAGE_SIZES)]
    y, x = np.mgrid[0:height, 0:width]
    base = rng.integers(0, 256, 3)
    grad = np.stack([x * 255 // width, y * 255 // height, (x + y) * 127 // (width + height)], -1)
    noise = rng.integers(0, 32, (height, width, 3))
    pixels = ((grad + base + noise) % 256).astype(np.uint8)
    from PIL import Image

    return image_from_pixels(Image.fromarray(pixels))


def keyed_ids(prompt: ImagePrompt) -> list[int]:
    """The prompt's ids with each image's placeholder tokens replaced by negative values
    from the image's key and the offset in the image (for the ideal cache)."""
    ids = list(prompt.token_ids)
    for span in prompt.images:
        base = int.from_bytes(span.key[:6], "little") << 16
        for j in range(span.num_tokens):
            ids[span.start + j] = -1 - (base + j)
    return ids


def check_takes_images(adapter: Any, model: str) -> None:
    if getattr(adapter, "vision", None) is None:
        raise NotAVisionModelError(
            f"--workload vision needs a model that takes images (a VLM of a family pagedkv "
            f"serves with images, such as LLaVA); {model} takes none. Build a tiny one with "
            "`python benchmarks/make_tiny_llava.py DIR` and pass --model DIR"
        )


def run_vision(
    adapter: Any, size: str, config: CacheConfig, seed: int, scheduling: Any = None
) -> dict[str, Any]:
    from pagedkv.engine import Engine, SamplingParams

    system, steps = vision_steps(size, seed)
    images = {k: make_image(k) for step in steps for k in step.image_seeds}
    ideal = IdealCache()
    histories: dict[int, list[dict[str, Any]]] = {}
    records: list[RequestRecord] = []
    prompts: list[ImagePrompt] = []
    outputs: list[list[int]] = []
    render_s: dict[int, list[float]] = {}
    misses: dict[str, int] = {}
    t_start = time.perf_counter()
    with Engine(adapter, config, scheduling=scheduling) as engine:
        _warm_up(engine, ideal)
        t0 = time.perf_counter()
        for i, step in enumerate(steps):
            history = histories.setdefault(step.session, [{"role": "system", "content": system}])
            parts: list[dict[str, Any]] = [{"type": "text", "text": step.text}]
            parts += [{"type": "image", "image": images[k]} for k in step.image_seeds]
            history.append({"role": "user", "content": parts})
            t = time.perf_counter()
            prompt = engine.render_chat(history)
            render_s.setdefault(step.turn, []).append(time.perf_counter() - t)
            miss = engine.explain(prompt.token_ids, images=prompt.images).miss
            reason = "hit" if miss is None else miss.reason
            misses[reason] = misses.get(reason, 0) + 1
            params = SamplingParams(max_tokens=step.max_tokens, temperature=0.0)
            r = engine.generate(prompt.token_ids, params, images=prompt.images)
            history.append({"role": "assistant", "content": r.text})
            keyed = keyed_ids(prompt)
            records.append(
                RequestRecord(
                    step=i,
                    session=step.session,
                    turn=step.turn,
                    prompt_tokens=r.prompt_tokens,
                    cached_tokens=r.cached_tokens,
                    ideal_tokens=ideal.observe(keyed, r.token_ids),
                    generated_tokens=len(r.token_ids),
                    ttft_cached_s=r.ttft_s,
                    total_cached_s=r.total_s,
                    tier_hits=dict(r.tier_hits),
                )
            )
            prompts.append(prompt)
            outputs.append(list(r.token_ids))
            print(f"vision: cached {i + 1}/{len(steps)}", file=sys.stderr, end="\r")
        cached_wall = time.perf_counter() - t0
        stats = engine.cache_stats()
        # The floor of a cached turn's TTFT: a second-turn prompt sent again, all of it
        # cached but its last token (one forward step of one token).
        again = next((p for p, r in zip(prompts, records, strict=True) if r.turn == 1), None)
        floor = None
        if again is not None:
            one = SamplingParams(max_tokens=1, temperature=0.0)
            floor = engine.generate(again.token_ids, one, images=again.images).ttft_s
    cold_config = dataclasses.replace(
        config, enable_prefix_caching=False, ssd_cache_dir=None, redis_url=None,
        vision_cache_bytes=0,
    )  # fmt: skip
    with Engine(adapter, cold_config, scheduling=scheduling) as cold:
        _warm_up(cold, None)
        t0 = time.perf_counter()
        for rec, prompt, want in zip(records, prompts, outputs, strict=True):
            params = SamplingParams(
                max_tokens=rec.generated_tokens, temperature=0.0, ignore_eos=True
            )
            r = cold.generate(prompt.token_ids, params, images=prompt.images)
            rec.ttft_cold_s, rec.total_cold_s = r.ttft_s, r.total_s
            rec.cold_cached_tokens = r.cached_tokens
            rec.same_output = list(r.token_ids) == want
        cold_wall = time.perf_counter() - t0
    print(file=sys.stderr)
    second = [r.ttft_cached_s for r in records if r.turn == 1]
    first_cold = [r.ttft_cold_s for r in records if r.turn == 0 and r.ttft_cold_s is not None]
    first_cached = [r.ttft_cached_s for r in records if r.turn == 0]
    s_med, f_med = percentile(second, 50), percentile(first_cold, 50)
    return summarize(
        workload="vision", model=adapter.name, mode="local", records=records,
        cached_wall_s=cached_wall, cold_wall_s=cold_wall,
        wall_s=time.perf_counter() - t_start,
        extra={
            "size": size, "seed": seed,
            "description": (
                f"{SHAPES[size][0]} chats x {SHAPES[size][1]} turns, 1 to 3 images in the "
                "first turn of each, questions about the same images after"
            ),
            "block_size": config.block_size,
            "reuse_target": REUSE_TARGET,
            "ttft_second_turn_cached_median_s": s_med,
            "ttft_first_turn_cold_median_s": f_med,
            "ttft_first_turn_cached_median_s": percentile(first_cached, 50),
            "ttft_second_over_first_cold": s_med / f_med if s_med and f_med else None,
            "ttft_target": TTFT_TARGET,
            "ttft_fully_cached_s": floor,
            "render_median_s": {t: percentile(v, 50) for t, v in sorted(render_s.items())},
            "miss_reasons": misses,
            "vision_cache": dataclasses.asdict(stats.vision) if stats.vision else None,
            "cold_pass": "same prompt ids and images, prefix caching and the encoder-row "
            "cache off, max_tokens = cached pass's output length, ignore_eos",
            "ideal_method": "exact: prompt ids (image placeholders keyed by image) + "
            "generated ids of the cached pass",
            "notes": [],
        },
    )  # fmt: skip


def _warm_up(engine: Any, ideal: IdealCache | None) -> None:
    """A text request and one with an image the workload never sends, so that the first
    measured request pays no one-off setup (the encoder's first call included)."""
    from pagedkv.engine import SamplingParams

    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    image = make_image(-1 % 2**31)
    parts = [{"type": "text", "text": "Warm-up: "}, {"type": "image", "image": image}]
    for messages in ([{"role": "user", "content": "Warm-up: say hello."}],
                     [{"role": "user", "content": parts}]):  # fmt: skip
        prompt = engine.render_chat(messages)
        r = engine.generate(prompt.token_ids, params, images=prompt.images)
        if ideal is not None:
            ideal.remember(keyed_ids(prompt), r.token_ids)


def format_vision(result: dict[str, Any]) -> str:
    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x * 1000:.1f} ms"

    ratio = result["reuse_ratio"]
    ttft = result["ttft_second_over_first_cold"]
    renders = ", ".join(f"turn {t}: {ms(v)}" for t, v in result["render_median_s"].items())
    return "\n".join(
        [
            f"vision: reuse {result['reused_tokens']}/{result['ideal_reused_tokens']} = "
            f"{'-' if ratio is None else f'{ratio:.3f}'} of ideal (target >= {REUSE_TARGET})",
            f"vision: TTFT second turn cached {ms(result['ttft_second_turn_cached_median_s'])}"
            f" / first turn cold {ms(result['ttft_first_turn_cold_median_s'])} = "
            f"{'-' if ttft is None else f'{ttft:.2f}'} (target <= {TTFT_TARGET}); first turn "
            f"cached {ms(result['ttft_first_turn_cached_median_s'])}; a second-turn prompt "
            f"sent again, all cached but one token: {ms(result['ttft_fully_cached_s'])}",
            f"vision: render through the processor (median, outside TTFT): {renders}",
            f"vision: outputs identical {result['outputs_identical']}/"
            f"{result['outputs_compared']}; misses {result['miss_reasons']}",
        ]
    )
