"""What compact KV and compact weights cost in quality and speed, on the bundled model.

    .venv/bin/python benchmarks/bench_kv_quality.py [--model smollm2-135m]
        [--kv-dtypes auto,bfloat16,float16,int8] [--weights float32,int8,int4] [--chunk 512]

The text is tests/data/public_domain_text.txt (Lincoln, Dickens, Austen, Melville,
the Declaration of Independence, Carroll, Genesis in the King James Version; all
public domain), read teacher-forced through the ragged batch in prefill chunks,
as the engine computes a prompt: every position's next-token distribution comes
from attention over the KV as the format stores it. Against the reference
(float32 weights, `auto` = float32 KV) each configuration reports
- KL: the mean over positions of KL(reference || config), in nats;
- agree: the share of positions whose argmax (greedy next token) is the reference's;
- bytes/token of KV as stored (live buffers, RAM, SSD, Redis alike);
- decode tok/s: single-stream greedy decode of 32 tokens after `--decode-context`
  tokens of the text (attention reads back, upcast, the whole context every step).
Configurations run interleaved, best of `--repeats`, in one process, so the ratios
are comparable within the run.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from pagedkv.config import DTYPES
from pagedkv.model import load_model
from pagedkv.model.batch import SeqChunk, plan_batch
from pagedkv.model.hf import ModelAdapter

TEXT = Path(__file__).resolve().parents[1] / "tests" / "data" / "public_domain_text.txt"


def all_logits(adapter: ModelAdapter, ids: list[int], chunk: int) -> torch.Tensor:
    """Log-probabilities `[len(ids), vocab]` of every position, prefilled in chunks."""
    kv = adapter.new_kv_buffer(len(ids))
    out = []
    with torch.inference_mode():
        for start in range(0, len(ids), chunk):
            part = ids[start : start + chunk]
            seq = SeqChunk(kv, start, part, True)
            plan, x, pos, _ = plan_batch([seq], None, adapter.device, adapter.kv_format)
            keep = torch.arange(len(part))
            logits = adapter.model(
                input_ids=x, position_ids=pos, use_cache=False, logits_to_keep=keep,
                pagedkv_plan=plan,
            ).logits[0]  # fmt: skip
            out.append(torch.log_softmax(logits.float(), dim=-1))
    return torch.cat(out)


def decode_rate(adapter: ModelAdapter, ids: list[int], steps: int = 32) -> float:
    """Greedy single-stream decode tokens/s after prefilling `ids`."""
    kv = adapter.new_kv_buffer(len(ids) + steps)
    logits = adapter.forward_batch([SeqChunk(kv, 0, ids, True)])[0]
    token, n = int(logits.argmax()), len(ids)
    t = time.perf_counter()
    for _ in range(steps):
        logits = adapter.forward_batch([SeqChunk(kv, n, [token], True)])[0]
        token, n = int(logits.argmax()), n + 1
    return steps / (time.perf_counter() - t)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--kv-dtypes", default="auto,bfloat16,float16,int8")
    ap.add_argument(
        "--weights",
        default="float32,int8",
        help=f"--dtype values to compare, of {', '.join(DTYPES[1:])}",
    )
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--decode-context", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--skip-quality", action="store_true", help="decode speed only")
    args = ap.parse_args()
    if unknown := [w for w in args.weights.split(",") if w not in DTYPES]:
        ap.error(f"--weights: {', '.join(unknown)} not among {', '.join(DTYPES)}")
    adapters = {w: load_model(args.model, dtype=w) for w in args.weights.split(",")}
    base = adapters[args.weights.split(",")[0]]
    ids = base.encode(TEXT.read_text())
    configs = [(w, k) for w in adapters for k in args.kv_dtypes.split(",")]
    if "auto" not in args.kv_dtypes.split(","):
        configs.insert(0, (next(iter(adapters)), "auto"))
    results: dict[tuple[str, str], dict[str, float]] = {}
    reference: torch.Tensor | None = None
    for w, k in configs:
        adapter = adapters[w]
        adapter.set_kv_dtype(k)
        if args.skip_quality:
            results[(w, k)] = {"kl": float("nan"), "agree": float("nan"),
                               "bytes": adapter.kv_bytes_per_token, "tps": 0.0}  # fmt: skip
            continue
        logp = all_logits(adapter, ids, args.chunk)
        if reference is None:
            reference = logp
        kl = (reference.exp() * (reference - logp)).sum(-1).mean()
        agree = (reference.argmax(-1) == logp.argmax(-1)).float().mean()
        results[(w, k)] = {"kl": float(kl), "agree": float(agree),
                           "bytes": adapter.kv_bytes_per_token, "tps": 0.0}  # fmt: skip
    if not args.skip_decode:
        context = ids[: args.decode_context]
        for _ in range(args.repeats):  # interleaved: every config once per round
            for w, k in configs:
                adapters[w].set_kv_dtype(k)
                rate = decode_rate(adapters[w], context)
                results[(w, k)]["tps"] = max(results[(w, k)]["tps"], rate)
    ref_key = configs[0]
    ref = results[ref_key]
    print(f"model {args.model}; {len(ids)} tokens of {TEXT.name}, prefill chunks of {args.chunk}; "
          f"decode after {args.decode_context} tokens, best of {args.repeats}")  # fmt: skip
    print(f"reference: weights {ref_key[0]}, kv {ref_key[1]}")
    print(f"{'weights':8} {'kv':9} {'bytes/tok':>9} {'x ref':>6} {'KL nats':>10} {'agree':>7} "
          f"{'decode t/s':>10} {'x ref':>6}")  # fmt: skip
    for (w, k), r in results.items():
        speed = r["tps"] / ref["tps"] if ref["tps"] else float("nan")
        print(f"{w:8} {k:9} {r['bytes']:>9} {r['bytes'] / ref['bytes']:>6.3f} "
              f"{r['kl']:>10.2e} {r['agree']:>7.4f} {r['tps']:>10.1f} {speed:>6.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
