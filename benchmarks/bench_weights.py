"""Single-stream decode speed of compact weights on this CPU, against float32.

    .venv/bin/python benchmarks/bench_weights.py [--model smollm2-135m] [--steps 32]
    .venv/bin/python benchmarks/bench_weights.py \
        --dtypes float32,float32+compiled,bfloat16,bfloat16+compiled

A `+compiled` dtype is that dtype with the decode step compiled
(`ModelAdapter.compile_decode`, `--compile-decode`); its compile time is printed.
Each `--dtype` the engine offers, loaded by `load_model` as the server does
(float32: linear layers packed for oneDNN; int8: int8 weights, `model/linear.py`;
int4: 4-bit weights over bfloat16 activations, `model/int4.py`; bfloat16: packed
where the CPU has it natively), decoding greedily through the ragged batch
after a `--context`-token prompt, interleaved round by round, best of
`--repeats`. The figure is tokens/s and its ratio to float32 in the same run.
Their quality (KL divergence, greedy agreement against float32) is
`bench_kv_quality.py --weights float32,int4,int8,bfloat16 --kv-dtypes auto`.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from bench_kv_quality import decode_rate

from pagedkv.config import DTYPES
from pagedkv.model import load_model


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument(
        "--dtypes",
        default="float32,int8,bfloat16",
        help=f"--dtype values ({', '.join(DTYPES[1:])}), each optionally +compiled",
    )
    ap.add_argument("--context", default="128,1024", help="prompt lengths before decoding")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    dtypes = args.dtypes.split(",")
    if unknown := [d for d in dtypes if d.removesuffix("+compiled") not in DTYPES]:
        ap.error(f"--dtypes: {', '.join(unknown)} not among {', '.join(DTYPES)}")
    if dtypes[0] != "float32":
        dtypes.insert(0, "float32")
    adapters = {d: load_model(args.model, dtype=d.removesuffix("+compiled")) for d in dtypes}
    for d, adapter in adapters.items():
        if d.endswith("+compiled"):
            started = time.perf_counter()
            adapter.compile_decode()
            print(f"{d}: {adapter.decode_path}; {time.perf_counter() - started:.1f} s")
    cpu = torch.backends.cpu.get_cpu_capability()
    print(f"torch {torch.__version__}, cpu capability {cpu}, {torch.get_num_threads()} threads; "
          f"best of {args.repeats}, {args.steps} steps")  # fmt: skip
    print(f"{'context':>7}  " + "  ".join(f"{d:>16}" for d in dtypes))
    for context in (int(c) for c in args.context.split(",")):
        ids = [100 + i % 30000 for i in range(context)]
        best = dict.fromkeys(dtypes, 0.0)
        for _ in range(args.repeats):
            for d in dtypes:
                best[d] = max(best[d], decode_rate(adapters[d], ids, args.steps))
        cells = [f"{best[d]:6.1f} t/s {best[d] / best['float32']:4.2f}x" for d in dtypes]
        print(f"{context:>7}  " + "  ".join(f"{c:>16}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
