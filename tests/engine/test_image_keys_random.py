"""200 random image pairs, 0 wrong reuses: two prompts with the same tokens (LLaVA gives
every image the same placeholder count whatever its size) whose images have the same
pixels get the same block keys; other pixels (one pixel changed, other noise, another
size) get keys that differ from the image's first block on, and the same keys before
it. On a sample of pairs a real engine answers the second prompt, after caching the
first, as a fresh engine does."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from engine_helpers import BS, GREEDY
from PIL import Image

from pagedkv import CacheConfig, Engine
from pagedkv.cache.hashing import ExtraKeys
from pagedkv.model.images import ImageInput, image_from_pixels
from pagedkv.model.vision import image_segments

PAIRS, ENGINE_SAMPLE = 200, 10
SIZES = [(32, 32), (40, 36), (33, 47), (64, 20)]


@pytest.fixture(scope="module")
def engines(tiny_llava_dir: Path) -> Iterator[tuple[Engine, Engine]]:
    with (
        Engine.from_pretrained(str(tiny_llava_dir), config=CacheConfig(block_size=BS)) as eng,
        Engine.from_pretrained(
            str(tiny_llava_dir), config=CacheConfig(enable_prefix_caching=False)
        ) as off,
    ):
        yield eng, off


def _image(pixels: np.ndarray) -> ImageInput:
    return image_from_pixels(Image.fromarray(pixels))


def _pair(rng: random.Random) -> tuple[ImageInput, ImageInput, bool]:
    """Two images and whether their pixels are the same."""
    size = rng.choice(SIZES)
    gen = np.random.default_rng(rng.randrange(2**32))
    a = gen.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    kind = rng.choice(["same", "one_pixel", "noise", "size"])
    if kind == "same":
        b = a.copy()
    elif kind == "one_pixel":
        b = a.copy()
        y, x, c = gen.integers(0, size[1]), gen.integers(0, size[0]), gen.integers(0, 3)
        b[y, x, c] ^= 1 + int(gen.integers(0, 255))
    elif kind == "noise":
        b = gen.integers(0, 256, a.shape, dtype=np.uint8)
    else:
        other = rng.choice([s for s in SIZES if s != size])
        b = gen.integers(0, 256, (other[1], other[0], 3), dtype=np.uint8)
    return _image(a), _image(b), kind == "same"


def _messages(text: str, image: ImageInput, after: str) -> list[dict[str, Any]]:
    parts = [{"type": "text", "text": text}, {"type": "image", "image": image}]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": after}]}]


def test_random_image_pairs_never_share_a_wrong_block(engines: tuple[Engine, Engine]) -> None:
    eng, off = engines
    assert eng.prefix is not None
    hasher = eng.prefix.hasher
    rng = random.Random(32)
    wrong = checked = 0
    sample: list[tuple[list[dict[str, Any]], list[dict[str, Any]], bool]] = []
    for _ in range(PAIRS):
        a, b, same = _pair(rng)
        text = "x" * rng.randrange(0, 3 * BS)  # the image starts anywhere in a block
        after = " " + "y" * rng.randrange(1, 2 * BS)
        ma, mb = _messages(text, a, after), _messages(text, b, after)
        pa, pb = eng.render_chat(ma), eng.render_chat(mb)
        assert pa.token_ids == pb.token_ids  # same placeholders, same text
        ka = hasher.chain(pa.token_ids, ExtraKeys(segments=image_segments(pa.images)))
        kb = hasher.chain(pb.token_ids, ExtraKeys(segments=image_segments(pb.images)))
        first = pa.images[0].start // BS
        assert ka.hashes[:first] == kb.hashes[:first]
        if same:
            assert ka.hashes == kb.hashes
        else:
            checked += 1
            wrong += sum(x == y for x, y in zip(ka.hashes[first:], kb.hashes[first:], strict=True))
        if len(sample) < ENGINE_SAMPLE:
            sample.append((ma, mb, same))
    assert checked > PAIRS // 2 and wrong == 0
    assert {same for *_, same in sample} == {True, False}
    for ma, mb, same in sample:
        pa, pb = eng.render_chat(ma), eng.render_chat(mb)
        eng.generate(pa.token_ids, GREEDY, images=pa.images)
        got = eng.generate(pb.token_ids, GREEDY, images=pb.images)
        want = off.generate(pb.token_ids, GREEDY, images=pb.images)
        reuse = len(pb.token_ids) - 1 if same else pb.images[0].start // BS * BS
        assert got.cached_tokens == reuse
        assert got.token_ids == want.token_ids
