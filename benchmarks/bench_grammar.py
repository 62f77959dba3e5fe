"""Grammar-constrained decoding on CPU: the libraries compared, and the engine's cost.

    .venv/bin/python benchmarks/bench_grammar.py masks [--model smollm2-135m]
    .venv/bin/python benchmarks/bench_grammar.py engine [--streams 8] [--tokens 48]

`masks` compares xgrammar, llguidance and outlines-core (whichever are
installed; only llguidance is a dependency) on the model's tokenizer (49152
tokens for the bundled model): the time to compile each JSON schema below, and
the time to compute one token mask (a bitmask over the whole vocabulary) and
consume one token, walking the tokens of a valid instance of the schema. The
figures are medians over the walk; the last column is each library's mask time
over the fastest library's.

`engine` runs the engine with `--streams` concurrent requests on the same
prompt, greedy, with and without a JSON schema, and prints the mean step time
(wall time over the worker's steps) of each and the ratio; the schema's cost
is the mask computed after each token and applied before each sample
(`pagedkv.engine.grammar`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

# A tool call's arguments and an extraction record: the sizes structured-output
# clients send (a dozen properties, nesting, enums, arrays).
SCHEMAS: dict[str, tuple[dict[str, Any], Any]] = {
    "weather_tool": (
        {
            "type": "object",
            "properties": {
                "location": {"type": "string", "description": "City and country"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 14},
                "include_hourly": {"type": "boolean"},
            },
            "required": ["location", "unit"],
            "additionalProperties": False,
        },
        {"location": "Paris, France", "unit": "celsius", "days": 3, "include_hourly": False},
    ),
    "person_record": (
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 64},
                "age": {"type": "integer"},
                "email": {"type": "string"},
                "employed": {"type": "boolean"},
                "role": {"type": "string", "enum": ["engineer", "manager", "designer", "other"]},
                "skills": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
                "address": {
                    "type": "object",
                    "properties": {
                        "street": {"type": "string"},
                        "city": {"type": "string"},
                        "zip": {"type": "string"},
                        "country": {"type": "string"},
                    },
                    "required": ["street", "city", "country"],
                    "additionalProperties": False,
                },
                "projects": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "title": {"type": "string"},
                            "year": {"type": "integer"},
                            "lead": {"type": "boolean"},
                        },
                        "required": ["title", "year"],
                        "additionalProperties": False,
                    },
                },
                "notes": {"type": "string"},
            },
            "required": ["name", "age", "employed", "role", "skills", "address"],
            "additionalProperties": False,
        },
        {
            "name": "Ada Lovelace",
            "age": 36,
            "email": "ada@example.org",
            "employed": True,
            "role": "engineer",
            "skills": ["mathematics", "poetry", "analytical engines"],
            "address": {"street": "12 St James's Square", "city": "London", "country": "UK"},
            "projects": [{"title": "Note G", "year": 1843, "lead": True}],
            "notes": "Wrote the first published algorithm for a machine.",
        },
    ),
}


class Candidate:
    """One library: compile(schema) -> state; mask(state, out) fills a bitmask row;
    accept(state, token)."""

    name = ""
    compile: Callable[[str], Any]
    mask: Callable[[Any, np.ndarray], None]
    accept: Callable[[Any, int], None]


def llguidance_candidate(tokenizer: Any, vocab: int) -> Candidate:
    import llguidance
    import llguidance.hf

    tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
    c = Candidate()
    c.name = "llguidance"

    def compile_(schema: str) -> Any:
        m = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_json_schema(schema))
        assert not m.is_error(), m.get_error()
        return m

    def accept(m: Any, t: int) -> None:
        assert m.consume_token(t), m.get_error()

    c.compile = compile_
    c.mask = lambda m, out: m.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
    c.accept = accept
    return c


def xgrammar_candidate(tokenizer: Any, vocab: int) -> Candidate:
    import xgrammar

    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
    c = Candidate()
    c.name = "xgrammar"
    import torch

    def mask(m: Any, out: np.ndarray) -> None:
        m.fill_next_token_bitmask(torch.from_numpy(out).view(1, -1))

    def accept(m: Any, t: int) -> None:
        assert m.accept_token(t)

    c.compile = lambda s: xgrammar.GrammarMatcher(compiler.compile_json_schema(s))
    c.mask = mask
    c.accept = accept
    return c


def outlines_candidate(tokenizer: Any, vocab: int) -> Candidate:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    # GPT-2's byte-to-character table, which byte-level BPE vocabularies are written in.
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = printable + [256 + i for i, b in enumerate(sorted(set(range(256)) - set(printable)))]
    byte_of = {
        chr(c): b
        for b, c in zip(printable + sorted(set(range(256)) - set(printable)), chars, strict=True)
    }
    special = set(tokenizer.all_special_ids)
    tokens: dict[bytes, list[int]] = {}
    for text, tid in tokenizer.get_vocab().items():
        if tid in special or tid >= vocab:
            continue
        tokens.setdefault(bytes(byte_of[ch] for ch in text), []).append(tid)
    vocabulary = Vocabulary(tokenizer.eos_token_id, tokens)
    c = Candidate()
    c.name = "outlines-core"
    c.compile = lambda s: Guide(Index(build_regex_from_schema(s), vocabulary))
    c.mask = lambda g, out: g.write_mask_into(out.ctypes.data, out.size, 4)
    c.accept = lambda g, t: g.advance(t)
    return c


def bench_masks(args: argparse.Namespace) -> int:
    from pagedkv.model import load_model

    tokenizer = load_model(args.model).tokenizer
    vocab = len(tokenizer)
    print(f"model {args.model}: vocabulary {vocab} tokens")
    cands = []
    for make in (xgrammar_candidate, llguidance_candidate, outlines_candidate):
        try:
            cands.append(make(tokenizer, vocab))
        except ImportError as exc:
            print(f"  skipped ({exc})")
    for name, (schema, instance) in SCHEMAS.items():
        text = json.dumps(instance, separators=(",", ":"))
        ids = tokenizer.encode(text, add_special_tokens=False)
        schema_s = json.dumps(schema)
        rows = {}
        for c in cands:
            t0 = time.perf_counter()
            c.compile(schema_s)
            compile_ms = (time.perf_counter() - t0) * 1e3
            out = np.zeros((vocab + 31) // 32, dtype=np.int32)
            mask_us, step_us = [], []
            for _ in range(args.repeats):
                state = c.compile(schema_s)
                for t in ids:
                    t0 = time.perf_counter()
                    c.mask(state, out)
                    t1 = time.perf_counter()
                    assert out[t // 32] >> (t % 32) & 1, f"{c.name} masked a valid token"
                    t2 = time.perf_counter()
                    c.accept(state, t)
                    t3 = time.perf_counter()
                    mask_us.append((t1 - t0) * 1e6)
                    step_us.append((t1 - t0 + t3 - t2) * 1e6)
            step = statistics.median(step_us)
            p95 = statistics.quantiles(mask_us, n=20)[-1]
            request_ms = compile_ms + step * len(ids) / 1e3
            rows[c.name] = (compile_ms, statistics.median(mask_us), step, p95, request_ms)
        best = min(r[1] for r in rows.values())
        print(f"\nschema {name}: {len(schema_s)} bytes, walk of {len(ids)} tokens x {args.repeats}")
        print(f"  {'library':<14} {'compile ms':>10} {'mask us':>9} {'p95 us':>8} "
              f"{'mask+accept us':>14} {'mask vs best':>12} {'request ms':>10}")  # fmt: skip
        for lib, (comp, mask, step, p95, total) in rows.items():
            print(f"  {lib:<14} {comp:>10.1f} {mask:>9.1f} {p95:>8.1f} {step:>14.1f} "
                  f"{mask / best:>11.1f}x {total:>10.2f}")  # fmt: skip
    return 0


def bench_engine(args: argparse.Namespace) -> int:
    from pagedkv.engine import Engine, SamplingParams
    from pagedkv.engine.grammar import ResponseFormat

    schema = SCHEMAS["person_record"][0]
    engine = Engine.from_pretrained(args.model)
    prompt = engine.adapter.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Describe a famous scientist as a JSON record."}],
        add_generation_prompt=True,
        tokenize=False,
    )
    fmt = ResponseFormat.json_schema(schema)

    def run(structured: bool) -> float:
        params = SamplingParams(max_tokens=args.tokens, ignore_eos=not structured,
                                response_format=fmt if structured else None)  # fmt: skip
        steps0 = engine._worker.steps
        t0 = time.perf_counter()
        streams = [engine.stream(prompt, params) for _ in range(args.streams)]
        for s in streams:
            for _ in s:
                pass
        return (time.perf_counter() - t0) / max(1, engine._worker.steps - steps0)

    run(False)  # warm up (and the prompt's KV for both)
    run(True)
    plain, constrained = [], []
    for _ in range(args.repeats):
        plain.append(run(False))
        constrained.append(run(True))
    p, c = min(plain) * 1e3, min(constrained) * 1e3
    print(f"{args.streams} streams x {args.tokens} tokens, best of {args.repeats}: "
          f"step {p:.2f} ms plain, {c:.2f} ms with a JSON schema: {c / p:.3f}x")  # fmt: skip
    engine.close()
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=["masks", "engine"])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=48)
    args = ap.parse_args()
    return bench_masks(args) if args.mode == "masks" else bench_engine(args)


if __name__ == "__main__":
    sys.exit(main())
