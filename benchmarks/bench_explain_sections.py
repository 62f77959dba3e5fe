"""Time of naming a miss's section (`pagedkv.server.sections.locate_section`, what
POST /v1/cache/explain adds to `Engine.explain`) with the bundled model's tokenizer
and chat template, for a conversation of ~8K tokens.

    .venv/bin/python benchmarks/bench_explain_sections.py [--messages 64 256] [--repeats 5]

The miss is put at the first token where the conversation differs from the same one
with message k changed, for k at the start, the middle and the end; each case prints
the section found, the renders it took and the median time.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

WORDS = [
    "the",
    "cache",
    "keeps",
    "blocks",
    "of",
    "keys",
    "and",
    "values",
    "for",
    "every",
    "prompt",
    "prefix",
]


def main() -> None:
    from transformers import AutoTokenizer

    from pagedkv.model.bundled import bundled_model_dir
    from pagedkv.server.sections import locate_section

    p = argparse.ArgumentParser()
    p.add_argument("--messages", type=int, nargs="+", default=[64, 256])
    p.add_argument("--tokens", type=int, default=8000, help="about this many in all")
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    tok = AutoTokenizer.from_pretrained(str(bundled_model_dir()))
    renders = 0

    def render(messages: Any, tools: Any = None) -> list[int]:
        nonlocal renders
        renders += 1
        ids = tok.apply_chat_template(
            list(messages), add_generation_prompt=True, tokenize=True, return_dict=False
        )
        return [int(t) for t in ids]

    for n in a.messages:
        per = max(1, a.tokens // n)
        chat = [{"role": "system", "content": "You are helpful. Today is Monday."}]
        for i in range(1, n):
            text = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(per))
            chat.append({"role": "user" if i % 2 else "assistant", "content": text})
        for k in (0, n // 2, n - 1):
            changed = [*chat[:k], {**chat[k], "content": "changed"}, *chat[k + 1 :]]
            prompt, theirs = render(changed), render(chat)
            index = next(i for i, (x, y) in enumerate(zip(prompt, theirs, strict=False)) if x != y)
            times = []
            for _ in range(a.repeats):
                renders = 0
                t = time.perf_counter()
                found = locate_section(render, changed, None, prompt, len(prompt), index)
                times.append(time.perf_counter() - t)
            print(
                f"{n} messages, {len(prompt)} tokens, miss in message {k}: {found}, "
                f"{renders} renders, median {statistics.median(times) * 1e3:.1f} ms"
            )


if __name__ == "__main__":
    main()
