"""Build the tests' tiny random LLaVA (`tests/fixtures_vision.py`) into a directory, for
`pagedkv bench --workload vision --model DIR` without downloading a model.

    python benchmarks/make_tiny_llava.py /tmp/tiny-llava [--seed 0]

Its figures measure the machinery (keys, restore, the encoder-row cache), not a real
model's compute: its language model is 64 wide and 2 layers deep."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from fixtures_vision import make_tiny_llava


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(make_tiny_llava(args.directory, seed=args.seed))


if __name__ == "__main__":
    main()
