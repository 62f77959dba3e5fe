"""pagedkv's MLX backend against mlx-lm's own server and generate, in one run.

(a) `mlx_lm.server` (its in-memory LRU prompt cache, default flags) on
127.0.0.1: the chat and agent workloads through `pagedkv bench --url`'s remote
bench (`pagedkv.bench.remote.run_remote`). mlx_lm.server reports
`cached_tokens` but ignores `cache_salt`, so that bench's cold pass is served
from its cache; the cold TTFT is therefore measured again on a second
mlx_lm.server started with `--prompt-cache-size 0` (nothing kept), whose
cached pass is the cold one. Then the restart probe: one chat prompt sent
twice (the second is the warm figure), the server restarted, the same prompt
sent again: what it reuses then is what survives a restart.
(b) the same for `pagedkv serve --backend mlx --ssd-cache-dir D` (its own cold
pass is honest: it honours `cache_salt`), restarted on the same D; skipped,
saying why, while `pagedkv serve --help` lacks `--backend` or `--ssd-cache-dir`.
(c) decode tokens/s at one stream: mlx-lm's `generate_step` (the loop under
its `generate`, without the end-of-text stop, so both sides decode the same
number of tokens) in this process, against pagedkv's server streaming the same
prompt with `ignore_eos`, in A B A B order, medians of `--repeats`, and the
ratio. Decode rate = (tokens - 1) / (last token time - first token time).

Everything runs on 127.0.0.1, one server at a time, each stopped at the end
(also on error); every wait is bounded.

    .venv/bin/python benchmarks/bench_mlx_peers.py [--model smollm2-135m] \
        [--size quick] [--decode-tokens 64] [--repeats 3] [--out mlx_peers.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from pagedkv.bench.remote import run_remote
from pagedkv.bench.workloads import Message, build_workload
from pagedkv.model.resolve import resolve_model

WORKLOADS = ("chat", "agent")
START_TIMEOUT_S = 180.0
REQUEST_TIMEOUT_S = 600.0


class Server:
    """One server process on 127.0.0.1 with its log in a temporary file."""

    def __init__(self, name: str, cmd: list[str], port: int) -> None:
        self.name, self.cmd, self.port = name, cmd, port
        self.url = f"http://127.0.0.1:{port}"
        self.log = Path(tempfile.mkstemp(prefix=f"{name}-", suffix=".log")[1])
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> float:
        """Start and wait until /v1/models answers; the seconds it took."""
        t0 = time.perf_counter()
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.proc.returncode}:\n{self.tail()}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/v1/models", timeout=5.0).status_code == 200:
                    return time.perf_counter() - t0
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{self.name} did not answer in {START_TIMEOUT_S:.0f} s:\n{self.tail()}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:]


@contextlib.contextmanager
def running(server: Server) -> Iterator[Server]:
    server.start()
    try:
        yield server
    finally:
        server.stop()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def mlx_server(model_dir: Path, port: int, cache_size: int | None = None) -> Server:
    cmd = [sys.executable, "-m", "mlx_lm", "server", "--model", str(model_dir)]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "WARNING"]
    if cache_size is not None:
        cmd += ["--prompt-cache-size", str(cache_size)]
    return Server("mlx_lm.server", cmd, port)


def pagedkv_cmd() -> list[str]:
    script = Path(sys.executable).parent / "pagedkv"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "import sys; from pagedkv.cli import main; sys.exit(main())"]


def pagedkv_missing_flags() -> list[str]:
    """The flags this bench needs that `pagedkv serve --help` does not list."""
    out = subprocess.run(
        [*pagedkv_cmd(), "serve", "--help"], capture_output=True, text=True, timeout=120
    ).stdout
    return [flag for flag in ("--backend", "--ssd-cache-dir") if flag not in out]


def pagedkv_server(model_dir: Path, port: int, ssd_dir: Path) -> Server:
    cmd = [*pagedkv_cmd(), "serve", "--backend", "mlx", "--model", str(model_dir)]
    cmd += ["--ssd-cache-dir", str(ssd_dir), "--host", "127.0.0.1", "--port", str(port)]
    return Server("pagedkv serve", cmd, port)


def stream_chat(url: str, messages: list[Message], max_tokens: int, **extra: Any) -> dict[str, Any]:
    """One streamed greedy chat request: TTFT, the decode rate, and the usage it reports."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "stream": True}
    body |= {"stream_options": {"include_usage": True}, **extra}
    t0 = time.perf_counter()
    first: float | None = None
    last = t0
    usage: dict[str, Any] = {}
    with httpx.stream(
        "POST", url + "/v1/chat/completions", json=body, timeout=REQUEST_TIMEOUT_S
    ) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url} answered {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            if any((c.get("delta") or {}).get("content") for c in chunk.get("choices", [])):
                last = time.perf_counter()
                first = first if first is not None else last
    generated = int(usage.get("completion_tokens") or 0)
    decode = (generated - 1) / (last - first) if first is not None and last > first else None
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return {
        "ttft_s": (first if first is not None else last) - t0,
        "prompt_tokens": usage.get("prompt_tokens"),
        "cached_tokens": cached,  # None: the server did not report it
        "completion_tokens": generated,
        "decode_tokens_per_s": decode,
    }


def bench_args(url: str, model_dir: Path) -> argparse.Namespace:
    return argparse.Namespace(url=url, model=str(model_dir), api="openai", concurrency=1, seed=0)


def workloads(server: Server, model_dir: Path, names: list[str], size: str) -> list[dict[str, Any]]:
    results = run_remote(bench_args(server.url, model_dir), names, size)
    for result in results:
        # The median TTFT counts every request, first turns (nothing to reuse) included;
        # this one only the requests that reused something.
        hits = [r["ttft_cached_s"] for r in result.pop("per_request") if r["cached_tokens"] > 0]
        result["ttft_hit_median_s"] = statistics.median(hits) if hits else None
    return results


def restart_probe(server: Server, size: str, **extra: Any) -> dict[str, Any]:
    """The first chat prompt sent twice, the server restarted, the prompt sent again."""
    messages = list(build_workload("chat", size, 0).steps[0].messages)
    stream_chat(server.url, messages, 8, **extra)
    warm = stream_chat(server.url, messages, 8, **extra)
    server.stop()
    restart_s = server.start()
    after = stream_chat(server.url, messages, 8, **extra)
    return {"before_restart": warm, "after_restart": after, "restart_s": restart_s}


def run_mlx_side(model_dir: Path, args: argparse.Namespace, out: dict[str, Any], save: Any) -> None:
    """Fills `out` phase by phase, calling `save()` after each (a timeout keeps the rest)."""
    out["flags"] = "defaults (--prompt-cache-size 10)"
    server = mlx_server(model_dir, free_port())
    with running(server):
        out["workloads"] = workloads(server, model_dir, args.workload, args.size)
        save()
        out["restart"] = restart_probe(server, args.size)
        out["server_stream_decode"] = stream_chat(server.url, decode_messages(), args.decode_tokens)
        save()
    for warm in out["workloads"]:  # its own cold pass was served from the cache
        warm["cold_pass_reused_tokens"] = warm.pop("cold_reused_tokens")
        warm["ttft_cold_median_s"] = warm["ttft_cold_p90_s"] = warm["speedup"] = None
        warm["cold_from"] = "not measured (--cold-workload)"
    save()
    cold_names = [w for w in args.workload if w in args.cold_workload]
    if not cold_names:
        return
    cold_server = mlx_server(model_dir, free_port(), cache_size=0)
    with running(cold_server):
        cold = {w["workload"]: w for w in workloads(cold_server, model_dir, cold_names, args.size)}
    for warm in out["workloads"]:
        fresh = cold.get(warm["workload"])
        if fresh is None:
            continue
        warm["cold_from"] = "a second mlx_lm.server with --prompt-cache-size 0 (its cached pass)"
        warm["ttft_cold_median_s"] = fresh["ttft_cached_median_s"]
        warm["ttft_cold_p90_s"] = fresh["ttft_cached_p90_s"]
        warm["cold_server_reused_tokens"] = fresh["reused_tokens"]
        cached = warm["ttft_cached_median_s"]
        warm["speedup"] = fresh["ttft_cached_median_s"] / cached if cached else None
    save()


def decode_messages() -> list[Message]:
    return [{"role": "user", "content": "Write a long story about a cache that remembers."}]


def mlx_generate_decode(model_dir: Path, tokens: int, repeats: int) -> Iterator[float]:
    """mlx-lm's decode tokens/s, one figure per `next()` (the model is loaded once)."""
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    loaded = mlx_lm.load(str(model_dir))  # annotated as 2 or 3 values
    model, tokenizer = loaded[0], loaded[1]
    ids = tokenizer.apply_chat_template(
        decode_messages(), add_generation_prompt=True, tokenize=True, return_dict=False
    )
    for _ in range(repeats):
        stamps = []
        steps = generate_step(mx.array(ids), model, max_tokens=tokens, sampler=make_sampler(0.0))
        for _token, _ in steps:
            stamps.append(time.perf_counter())
        yield (len(stamps) - 1) / (stamps[-1] - stamps[0])


def run_pagedkv_side(
    model_dir: Path, args: argparse.Namespace, out: dict[str, Any], save: Any
) -> dict[str, Any]:
    """Fills `out` like `run_mlx_side`; returns the A B A B decode figures."""
    ssd_dir = Path(tempfile.mkdtemp(prefix="pagedkv-mlx-peers-ssd-"))
    server = pagedkv_server(model_dir, free_port(), ssd_dir)
    try:
        with running(server):
            out["workloads"] = workloads(server, model_dir, args.workload, args.size)
            save()
            mlx_rates = mlx_generate_decode(model_dir, args.decode_tokens, args.repeats)
            a: list[float] = []
            b: list[float] = []
            for _ in range(args.repeats):  # A B A B: both sides see the same drift in load
                a.append(next(mlx_rates))
                messages = decode_messages()
                reply = stream_chat(server.url, messages, args.decode_tokens, ignore_eos=True)
                b.append(reply["decode_tokens_per_s"] or 0.0)
            out["restart"] = restart_probe(server, args.size)
            save()
            return decode_summary(a, b)
    finally:
        shutil.rmtree(ssd_dir, ignore_errors=True)


def decode_summary(mlx: list[float], pagedkv: list[float] | None) -> dict[str, Any]:
    out: dict[str, Any] = {"mlx_lm_generate_tokens_per_s": mlx}
    out["mlx_lm_generate_median"] = statistics.median(mlx)
    if pagedkv:
        out["pagedkv_tokens_per_s"] = pagedkv
        out["pagedkv_median"] = statistics.median(pagedkv)
        out["ratio"] = out["pagedkv_median"] / out["mlx_lm_generate_median"]
    return out


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.0f}"


def _reuse(w: dict[str, Any]) -> str:
    ratio = w.get("reuse_ratio")
    reused = f"{w['reused_tokens']}/{w.get('ideal_reused_tokens') or '?'}"
    return f"{ratio:.3f} ({reused})" if ratio is not None else f"- ({reused})"


def _row(cells: list[str], widths: tuple[int, ...]) -> str:
    rest = zip(cells[1:], widths[1:], strict=True)
    return cells[0].ljust(widths[0]) + "".join(c.rjust(w) for c, w in rest)


def _counts(reply: dict[str, Any]) -> str:
    return f"{reply['cached_tokens']}/{reply['prompt_tokens']}"


def print_table(results: dict[str, Any]) -> None:
    widths = (16, 10, 22, 16, 14, 14)
    header = ["server", "workload", "reuse of ideal", "cached TTFT ms", "hits TTFT ms"]
    print("\n" + _row([*header, "cold TTFT ms"], widths))
    for side in ("mlx_lm_server", "pagedkv"):
        for w in results.get(side, {}).get("workloads", []):
            cells = [side, w["workload"], _reuse(w), _ms(w["ttft_cached_median_s"])]
            cells += [_ms(w.get("ttft_hit_median_s")), _ms(w["ttft_cold_median_s"])]
            print(_row(cells, widths))
    restart_widths = (16, 24, 12, 16)
    header = ["restart", "reused/prompt before", "after", "TTFT ms after"]
    print("\n" + _row(header, restart_widths))
    for side in ("mlx_lm_server", "pagedkv"):
        probe = results.get(side, {}).get("restart")
        if probe:
            before, after = probe["before_restart"], probe["after_restart"]
            cells = [side, _counts(before), _counts(after), _ms(after["ttft_s"])]
            print(_row(cells, restart_widths))
    decode = results.get("decode", {})
    if decode:
        line = (
            f"\ndecode at one stream: mlx-lm generate {decode['mlx_lm_generate_median']:.1f} tok/s"
        )
        if decode.get("ratio") is not None:
            line += f", pagedkv {decode['pagedkv_median']:.1f} tok/s, ratio {decode['ratio']:.2f}"
        print(line + ("" if decode.get("ratio") is not None else ", pagedkv: not measured"))
    if "skipped" in results.get("pagedkv", {}):
        print(f"\npagedkv's side skipped: {results['pagedkv']['skipped']}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", help="a model directory or the bundled name")
    ap.add_argument("--size", default="quick", choices=("tiny", "quick", "full"))
    ap.add_argument("--workload", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    ap.add_argument(
        "--cold-workload",
        nargs="*",
        default=list(WORKLOADS),
        choices=WORKLOADS,
        help="workloads replayed on mlx_lm.server without a cache for the cold TTFT",
    )
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-mlx-server", action="store_true", help="only pagedkv's side and decode")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = ap.parse_args()
    import mlx_lm

    model_dir = resolve_model(args.model).directory.resolve()
    results: dict[str, Any] = {
        "model": str(model_dir),
        "size": args.size,
        "mlx_lm_version": mlx_lm.__version__,
        "cpu_count": os.cpu_count(),
        "load_average": os.getloadavg(),
    }

    def save() -> None:
        if args.out is not None:
            args.out.write_text(json.dumps(results, indent=2))

    if not args.skip_mlx_server:
        results["mlx_lm_server"] = {}
        run_mlx_side(model_dir, args, results["mlx_lm_server"], save)
    missing = pagedkv_missing_flags()
    if missing:
        results["pagedkv"] = {
            "skipped": f"`pagedkv serve --help` has no {', '.join(missing)} (the MLX backend "
            "is not in this checkout): rerun this bench once it is"
        }
        rates = list(mlx_generate_decode(model_dir, args.decode_tokens, args.repeats))
        results["decode"] = decode_summary(rates, None)
    else:
        results["pagedkv"] = {}
        results["decode"] = run_pagedkv_side(model_dir, args, results["pagedkv"], save)
    results["load_average_after"] = os.getloadavg()
    save()
    print_table(results)
    if args.out is not None:
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
