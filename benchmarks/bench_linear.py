"""The linear layers of one forward: MKL's `F.linear` against oneDNN over packed weights.

    .venv/bin/python benchmarks/bench_linear.py [--rows 1,2,8,16,512] [--repeats 4]

The bundled model's weight shapes (30 layers of q, k, v, o, gate, up and down,
then the output layer), each a distinct random float32 tensor so that the
products read their weights from memory as a forward does, not from cache. One
product per weight, timed as a whole; best of `--repeats`, the two ways
interleaved. The last column is MKL's time over oneDNN's; the first line gives
the memory's read bandwidth, the limit of a product this size.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from pagedkv.model.linear import PackedLinear, pack_linears

HIDDEN, KV, FFN, VOCAB, LAYERS = 576, 192, 1536, 49152, 30


def layers() -> list[torch.nn.Linear]:
    per_layer = [(HIDDEN, HIDDEN), (HIDDEN, KV), (HIDDEN, KV), (HIDDEN, HIDDEN)]
    per_layer += [(HIDDEN, FFN), (HIDDEN, FFN), (FFN, HIDDEN)]
    shapes = per_layer * LAYERS + [(HIDDEN, VOCAB)]
    return [torch.nn.Linear(i, o, bias=False) for i, o in shapes]


def forward_ms(linears: list[torch.nn.Linear], rows: int) -> float:
    inputs = {n: torch.randn(rows, n) for n in (HIDDEN, FFN)}
    with torch.inference_mode():
        start = time.perf_counter()
        for layer in linears:
            layer(inputs[layer.in_features])
        return (time.perf_counter() - start) * 1000


def read_bandwidth() -> float:
    big = torch.randn(2**27)  # 512 MiB
    big.sum()
    start = time.perf_counter()
    big.sum()
    return big.numel() * 4 / (time.perf_counter() - start) / 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,8,16,512")
    ap.add_argument("--repeats", type=int, default=4)
    args = ap.parse_args()
    plain = layers()
    packed = layers()
    if pack_linears(torch.nn.ModuleList(packed)) != len(packed):
        print("torch has no oneDNN here: nothing to compare", file=sys.stderr)
        return 1
    assert all(type(m) is PackedLinear for m in packed)
    weights = sum(m.in_features * m.out_features for m in plain) * 4
    print(f"torch {torch.__version__}, cpu capability {torch.backends.cpu.get_cpu_capability()}, "
          f"{torch.get_num_threads()} threads, memory read {read_bandwidth():.1f} GB/s, "
          f"weights {weights / 1e6:.0f} MB")  # fmt: skip
    print("rows   F.linear (MKL)   oneDNN, packed   x")
    for rows in (int(r) for r in args.rows.split(",")):
        mkl = packed_ms = float("inf")
        for _ in range(args.repeats):
            mkl = min(mkl, forward_ms(plain, rows))
            packed_ms = min(packed_ms, forward_ms(packed, rows))
        print(f"{rows:4d}   {mkl:10.1f} ms    {packed_ms:10.1f} ms    {mkl / packed_ms:5.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
