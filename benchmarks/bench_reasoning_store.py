"""Eager (after the turn, in the background) vs lazy (at the next request) storing of a
turn whose reasoning the chat template strips: the next turn's TTFT, and the decode time
of another stream running meanwhile. Tiny random model, reasoning template of our own.

    PYTHONPATH=src:tests python benchmarks/bench_reasoning_store.py [--answer 300] [--reps 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from pagedkv import CacheConfig, Engine, SamplingParams


def one(model: Path, mode: str, gap: float, answer: int, other: bool) -> tuple[float, int, float]:
    """Turn 2's TTFT and cached tokens, and the other stream's decode time (0: none)."""
    config = CacheConfig(block_size=16, reasoning_cache=mode)
    with Engine.from_pretrained(str(model), config=config) as eng:
        system = {"role": "system", "content": "You plan releases. " * 60}
        history = [system, {"role": "user", "content": "Plan the release."}]
        first = eng.apply_chat_template(history)
        r = eng.generate(first, SamplingParams(max_tokens=answer, ignore_eos=True))
        history.append({"role": "assistant", "content": r.text})
        side: list[float] = []
        if other:
            ids = eng.apply_chat_template([{"role": "user", "content": "Another user. " * 20}])

            def run() -> None:
                t0 = time.perf_counter()
                eng.generate(ids, SamplingParams(max_tokens=200, ignore_eos=True))
                side.append(time.perf_counter() - t0)

            thread = threading.Thread(target=run)
            thread.start()
            time.sleep(0.2)
        eng.store_next_turn(history, first + r.token_ids)
        time.sleep(gap)  # the client's think or tool time
        history.append({"role": "user", "content": "Now step two."})
        second = eng.apply_chat_template(history)
        out = eng.generate(second, SamplingParams(max_tokens=1))
        if other:
            thread.join()
        return out.ttft_s, out.cached_tokens, side[0] if side else 0.0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--answer", type=int, default=300)
    p.add_argument("--reps", type=int, default=3)
    a = p.parse_args()
    from fixtures_models import REASONING_CHAT_TEMPLATE, make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "m", arch="qwen2", seed=1,
                                chat_template=REASONING_CHAT_TEMPLATE)  # fmt: skip
        cases = [("off", 0.0, False), ("on", 0.0, False), ("off", 1.0, False),
                 ("on", 1.0, False), ("off", 0.0, True), ("on", 0.0, True)]  # fmt: skip
        for mode, gap, other in cases:
            runs = [one(model, mode, gap, a.answer, other) for _ in range(a.reps)]
            ttft = statistics.median(r[0] for r in runs)
            side = statistics.median(r[2] for r in runs)
            print(f"mode={mode:3} gap={gap:.1f}s other_stream={other!s:5} "
                  f"turn2 ttft median {ttft * 1000:7.1f} ms cached {runs[0][1]:4d}"
                  + (f"  other stream 200 tokens {side:.2f} s" if other else ""))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
