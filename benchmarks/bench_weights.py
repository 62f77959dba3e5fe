"""Single-stream decode speed of compact weights on this CPU, against float32.

    .venv/bin/python benchmarks/bench_weights.py [--model smollm2-135m] [--steps 32]

Candidates for a compact `--dtype` (issue 13): bfloat16 weights, and int8
dynamic quantization of every linear layer (torch.ao `quantize_dynamic`,
fbgemm/x86 kernels). Each is the plain transformers model decoding greedily on
its own DynamicCache after a 128-token prompt, interleaved round by round,
best of `--repeats`; the figure is tokens/s and its ratio to float32 in the
same run. A candidate only becomes a `--dtype` if it beats float32 here.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
import warnings

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from pagedkv.model.bundled import BUNDLED_MODEL_NAME, ensure_bundled_model


def decode_rate(model: torch.nn.Module, prompt: torch.Tensor, steps: int) -> float:
    with torch.inference_mode():
        cache = DynamicCache()
        out = model(input_ids=prompt, past_key_values=cache, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        t = time.perf_counter()
        for _ in range(steps):
            out = model(input_ids=token, past_key_values=cache, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
        return steps / (time.perf_counter() - t)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=BUNDLED_MODEL_NAME)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    path = ensure_bundled_model() if args.model == BUNDLED_MODEL_NAME else args.model
    f32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True)
    f32.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization's deprecation notice
        int8 = torch.ao.quantization.quantize_dynamic(
            copy.deepcopy(f32), {torch.nn.Linear}, dtype=torch.qint8
        )
    models = {"float32": f32, "bfloat16": copy.deepcopy(f32).to(torch.bfloat16), "int8": int8}
    prompt = torch.arange(100, 228).unsqueeze(0)
    best = dict.fromkeys(models, 0.0)
    for _ in range(args.repeats):
        for name, model in models.items():
            best[name] = max(best[name], decode_rate(model, prompt, args.steps))
    print(f"torch {torch.__version__}, cpu capability {torch.backends.cpu.get_cpu_capability()}, "
          f"quantized engine {torch.backends.quantized.engine}")  # fmt: skip
    for name, rate in best.items():
        print(f"{name:9} {rate:7.1f} tok/s  {rate / best['float32']:5.2f}x float32")
    return 0


if __name__ == "__main__":
    sys.exit(main())
