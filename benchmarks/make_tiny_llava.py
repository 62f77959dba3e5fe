"""Build a random LLaVA into a directory, for `pagedkv bench --workload vision --model
DIR` without downloading a model.

    python benchmarks/make_tiny_llava.py /tmp/tiny-llava            # the tests' tiny one
    python benchmarks/make_tiny_llava.py /tmp/small-llava --small   # compute-bound sizes
    python benchmarks/make_tiny_llava.py /tmp/tiny-gemma3 --family gemma3      # the tests'
    python benchmarks/make_tiny_llava.py /tmp/tiny-qwen2-vl --family qwen2_vl  # tiny others

The default is the tests' tiny LLaVA (`tests/fixtures_vision.py`: 32x32 images, 16
placeholder tokens, a 64-wide 2-layer Llama): its figures measure the machinery, and a
forward step's fixed cost outweighs its compute. `--small` builds the same shape at
sizes where compute counts: 224x224 images in 14x14 patches (256 placeholder tokens,
a 4-layer 256-wide CLIP tower) and a 512-wide 8-layer Llama. Random weights either way."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import fixtures_vision
from fixtures_vision import make_tiny_gemma3, make_tiny_llava, make_tiny_qwen2_vl


def make_small_llava(path: Path, seed: int) -> Path:
    """`make_tiny_llava` with its sizes raised (the fixture reads them from its module)."""
    import transformers

    sizes = {"IMAGE_SIZE": 224, "PATCH": 14, "IMAGE_TOKENS": (224 // 14) ** 2}
    old = {k: getattr(fixtures_vision, k) for k in sizes}
    clip, llama = transformers.CLIPVisionConfig, transformers.LlamaConfig

    def bigger_clip(**kw: object) -> object:
        kw.update(hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                  num_attention_heads=4)  # fmt: skip
        return clip(**kw)

    def bigger_llama(**kw: object) -> object:
        kw.update(hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=4)  # fmt: skip
        return llama(**kw)

    try:
        for k, v in sizes.items():
            setattr(fixtures_vision, k, v)
        transformers.CLIPVisionConfig, transformers.LlamaConfig = bigger_clip, bigger_llama
        return make_tiny_llava(path, seed=seed)
    finally:
        for k, v in old.items():
            setattr(fixtures_vision, k, v)
        transformers.CLIPVisionConfig, transformers.LlamaConfig = clip, llama


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--small", action="store_true", help="compute-bound sizes (see above)")
    parser.add_argument(
        "--family", choices=("llava", "gemma3", "qwen2_vl", "qwen2_5_vl"), default="llava",
        help="the tests' tiny model of another family (--small is LLaVA's only)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.small and args.family != "llava":
        parser.error("--small builds a LLaVA only")
    build = {
        "llava": make_small_llava if args.small else make_tiny_llava,
        "gemma3": make_tiny_gemma3,
        "qwen2_vl": make_tiny_qwen2_vl,
        "qwen2_5_vl": lambda path, seed: make_tiny_qwen2_vl(path, seed, family="qwen2_5_vl"),
    }[args.family]
    print(build(Path(args.directory), args.seed))


if __name__ == "__main__":
    main()
