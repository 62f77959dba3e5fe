"""Run an engine in a separate process: `python engine_worker.py SPEC_JSON` prints results.

SPEC: {"model": dir, "cache": {CacheConfig kwargs}, "prompts": [[ids], ...],
       "max_tokens": n, "loras": {name: dir} (optional), "adapters": [name or null
       per prompt] (optional), "image_chats": [{"text": str, "seeds": [int, ...]}]
       (optional: one-message chats about `tests/fixtures_vision.tiny_image(seed)`
       images, rendered by the engine after the prompts)}. Output: one JSON line per
prompt and image chat with token_ids and cached_tokens (an image chat's also its
images' first token), then the cache stats.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from pagedkv import CacheConfig, Engine, SamplingParams


def main() -> None:
    spec = json.loads(sys.argv[1])
    engine = Engine.from_pretrained(spec["model"], config=CacheConfig(**spec["cache"]))
    params = SamplingParams(max_tokens=spec.get("max_tokens", 8), ignore_eos=True)
    for name, directory in spec.get("loras", {}).items():
        engine.load_adapter(name, directory)
    adapters = spec.get("adapters", [None] * len(spec["prompts"]))
    for prompt, lora in zip(spec["prompts"], adapters, strict=True):
        r = engine.generate(prompt, params, lora=lora)
        print(
            json.dumps(
                {
                    "token_ids": r.token_ids,
                    "cached_tokens": r.cached_tokens,
                    "tier_hits": r.tier_hits,
                }
            ),
            flush=True,
        )
    for chat in spec.get("image_chats", []):
        print(json.dumps(_image_chat(engine, params, chat["text"], chat["seeds"])), flush=True)
    stats = engine.cache_stats()
    engine.close()
    print(json.dumps({"stats": dataclasses.asdict(stats)}, default=str), flush=True)


def _image_chat(
    engine: Engine, params: SamplingParams, text: str, seeds: list[int]
) -> dict[str, Any]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from fixtures_vision import tiny_image

    parts: list[dict[str, Any]] = [{"type": "text", "text": text}]
    parts += [{"type": "image", "image": tiny_image(seed)} for seed in seeds]
    prompt = engine.render_chat([{"role": "user", "content": parts}])
    r = engine.generate(prompt.token_ids, params, images=prompt.images)
    return {
        "token_ids": r.token_ids,
        "cached_tokens": r.cached_tokens,
        "tier_hits": r.tier_hits,
        "image_starts": [span.start for span in prompt.images],
    }


if __name__ == "__main__":
    main()
