"""The compiled decode step (`model.compiled`, `--compile-decode`) on tiny random models:
its greedy tokens and logits match the eager step's at one row and at several through
one package, a second load reads the package from disk, the namespace names it, and
where it cannot be compiled (a compiler failure, a decoder it does not describe)
decoding stays eager with the reason said. The engine with it: cached == fresh over a chat,
and its refusal next to the deterministic option.

A llama (the bundled model's architecture) and a qwen3 with attention biases (q/k
norms and biases: the other paths `DecodeStep` has)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from engine_helpers import BS
from fixtures_models import make_tiny_model

from pagedkv import CacheConfig, Engine, ModelNotSupportedError, SamplingParams
from pagedkv.engine import SchedulerConfig
from pagedkv.model.batch import SeqChunk
from pagedkv.model.compiled import CompiledDecode
from pagedkv.model.hf import ModelAdapter, load_model
from pagedkv.model.linear import Int8Linear
from pagedkv.server.metrics import stats_json

ARCHS = {"llama": {}, "qwen3": {"attention_bias": True}}
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module", params=list(ARCHS))
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    arch = request.param
    path = tmp_path_factory.mktemp(f"compiled-{arch}") / "model"
    return make_tiny_model(path, arch=arch, seed=1, **ARCHS[arch])


@pytest.fixture(scope="module", autouse=True)
def cache_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A user cache of this module's own: every package is built here first."""
    home = tmp_path_factory.mktemp("home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDKV_CACHE_HOME", str(home))
        yield home


@pytest.fixture(scope="module")
def compiled(model_dir: Path) -> ModelAdapter:
    adapter = load_model(str(model_dir))
    adapter.compile_decode()
    assert adapter.compiled is not None, adapter.decode_path
    return adapter


def _decode(
    adapter: ModelAdapter, kvs: list[torch.Tensor], starts: list[int], tokens: list[int], steps: int
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy decode steps over every sequence at once; each row's tokens and logits."""
    out: list[list[int]] = [[] for _ in kvs]
    logits_seen = []
    for step in range(steps):
        chunks = [
            SeqChunk(kv, start + step, [t], True)
            for kv, start, t in zip(kvs, starts, tokens, strict=True)
        ]
        logits = adapter.forward_batch(chunks)
        logits_seen.append(logits)
        tokens = [int(x) for x in logits.argmax(-1)]
        for row, t in zip(out, tokens, strict=True):
            row.append(t)
    return out, logits_seen


@pytest.mark.parametrize("rows", [1, 3])
def test_compiled_decode_matches_the_eager_step(compiled: ModelAdapter, rows: int) -> None:
    adapter, step = compiled, compiled.compiled
    assert step is not None
    prompts = [[(11 * r + 7 * i + 3) % 400 + 5 for i in range(20 + 9 * r)] for r in range(rows)]
    kvs, firsts = [], []
    for p in prompts:
        kv = adapter.new_kv_buffer(len(p) + 16)
        logits = adapter.forward_batch([SeqChunk(kv, 0, p, True)])  # a prompt: eager
        kvs.append(kv)
        firsts.append(int(logits[0].argmax()))
    twins = [kv.clone() for kv in kvs]
    starts = [len(p) for p in prompts]
    steps_before = step.steps
    got, got_logits = _decode(adapter, kvs, starts, firsts, 8)
    assert step.steps == steps_before + 8  # every step went through the compiled graph
    adapter.compiled = None  # the eager step, on the same weights
    try:
        want, want_logits = _decode(adapter, twins, starts, firsts, 8)
    finally:
        adapter.compiled = step
    assert got == want
    for g, w in zip(got_logits, want_logits, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-3 * float(w.abs().max()))
    for kv, twin, start in zip(kvs, twins, starts, strict=True):  # the KV each row wrote
        torch.testing.assert_close(kv[:, :, :, : start + 8], twin[:, :, :, : start + 8])
    assert step.active  # every row count went through the one exported layer


def test_a_second_start_loads_the_package_and_a_damaged_one_is_built_again(
    compiled: ModelAdapter, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    step = compiled.compiled
    assert step is not None and not step.loaded and step.path.is_file()
    again = load_model(str(model_dir))
    again.compile_decode()
    assert again.compiled is not None and again.compiled.loaded
    assert again.compiled.path == step.path
    assert "loaded in" in again.decode_path
    # A package that does not load is built again (here: the good bytes put back, as a
    # build would write them, without the build's ~10 s).
    good = step.path.read_bytes()
    step.path.write_bytes(b"damaged")
    built = []

    def build(self: CompiledDecode) -> None:
        built.append(self.path.read_bytes() if self.path.exists() else None)
        self.path.write_bytes(good)

    monkeypatch.setattr(CompiledDecode, "build", build)
    third = load_model(str(model_dir))
    third.compile_decode()
    assert built == [None]  # the damaged file was removed before the build
    assert third.compiled is not None and not third.compiled.loaded
    assert "built in" in third.decode_path


def test_the_namespace_names_the_compiled_step(compiled: ModelAdapter) -> None:
    assert compiled.decode_path.startswith("compiled (aotinductor:torch-")
    mode = compiled.identity(BS)["mode"]
    assert mode.startswith("grouped+decode=aotinductor:torch-")
    assert compiled.identity(BS, deterministic=True)["mode"] == "deterministic"


def test_a_failure_while_serving_falls_back_to_the_eager_step(compiled: ModelAdapter) -> None:
    step = compiled.compiled
    assert step is not None
    mode, path, package = compiled.identity(BS)["mode"], compiled.decode_path, step._step.package

    class Failing:
        def boxed_run(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
            raise RuntimeError("an op inductor cannot lower")

    kv = compiled.new_kv_buffer(16)
    prompt = [5, 6, 7, 8, 9]
    compiled.forward_batch([SeqChunk(kv, 0, prompt, True)])
    twin = kv.clone()
    step._step.package = Failing()
    try:
        got = compiled.forward_batch([SeqChunk(kv, len(prompt), [10], True)])
        assert not step.active and "an op inductor cannot lower" in compiled.decode_path
        assert compiled.identity(BS)["mode"] == mode  # the namespace the cache was built on
    finally:
        step._step.package, step.reason, compiled.decode_path = package, None, path
    compiled.compiled = None
    try:
        want = compiled.forward_batch([SeqChunk(twin, len(prompt), [10], True)])
    finally:
        compiled.compiled = step
    assert torch.equal(got, want)  # the step was computed eagerly, in full


def test_a_compiler_failure_leaves_decoding_eager(
    model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    def no_compiler(*args: object, **kwargs: object) -> None:
        raise RuntimeError("no C++ compiler found")

    adapter = load_model(str(model_dir))
    monkeypatch.setenv("PAGEDKV_CACHE_HOME", str(tmp_path))  # no package on disk
    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", no_compiler)
    with caplog.at_level(logging.WARNING, logger="pagedkv.model.compiled"):
        adapter.compile_decode()
    assert adapter.compiled is None
    assert "no C++ compiler found" in adapter.decode_path
    assert adapter.decode_path.startswith("eager (not compiled: compiling failed")
    assert "stays eager" in caplog.text
    assert adapter.identity(BS)["mode"] == "grouped"
    kv = adapter.new_kv_buffer(8)
    assert adapter.forward_batch([SeqChunk(kv, 0, [5, 6, 7], True)]).shape[0] == 1


def test_a_decoder_it_does_not_describe_stays_eager(tmp_path: Path) -> None:
    gemma = make_tiny_model(tmp_path / "gemma", arch="gemma3_text", seed=1)
    adapter = load_model(str(gemma))
    adapter.compile_decode()
    assert adapter.compiled is None
    assert "not gemma3_text" in adapter.decode_path


def _engine(model: Path, dtype: str = "auto", **cache: object) -> Engine:
    config = CacheConfig(block_size=BS, ram_cache_bytes=64 * 2**20, compile_decode=True, **cache)  # type: ignore[arg-type]
    return Engine.from_pretrained(str(model), config=config, dtype=dtype)


def _cached_equals_fresh(model: Path, dtype: str = "auto") -> None:
    turn1 = [(5 * i + 1) % 400 + 5 for i in range(37)]
    with _engine(model, dtype) as eng:
        runtime = stats_json(eng.cache_stats())["runtime"]
        assert runtime["decode"].startswith("compiled (aotinductor:")
        first = eng.generate(turn1, GREEDY)
        again = eng.generate(turn1, GREEDY)
        turn2 = turn1 + first.token_ids + [(3 * i + 2) % 400 + 5 for i in range(11)]
        second = eng.generate(turn2, GREEDY)
    assert again.cached_tokens == len(turn1) - 1
    assert again.token_ids == first.token_ids
    assert second.cached_tokens >= len(turn1) // BS * BS
    with _engine(model, dtype, enable_prefix_caching=False) as fresh:
        assert fresh.generate(turn1, GREEDY).token_ids == first.token_ids
        assert fresh.generate(turn2, GREEDY).token_ids == second.token_ids


def test_engine_cached_equals_fresh_with_the_compiled_step(model_dir: Path) -> None:
    _cached_equals_fresh(model_dir)


def test_engine_refuses_it_with_deterministic(model_dir: Path) -> None:
    config = CacheConfig(block_size=BS, compile_decode=True, enable_prefix_caching=False)
    with pytest.raises(ModelNotSupportedError, match="deterministic"):
        Engine.from_pretrained(
            str(model_dir), config=config, scheduling=SchedulerConfig(deterministic=True)
        )


@pytest.mark.parametrize("dtype", ["int4", "int8"])
def test_compact_weights_through_the_compiled_layer(tmp_path: Path, dtype: str) -> None:
    """4-bit layers (`--dtype int4`) are the package's own inputs, q/k/v and gate/up side
    by side, over bfloat16 rows; int8 ones (`--dtype int8`) are registered layers whose
    inputs are coded afresh every call (the generated code reuses buffers). Greedy
    tokens and logits as the eager step's, within the rows' rounding; cached == fresh
    through the engine."""
    adapter = load_model(str(make_tiny_model(tmp_path / "llama", seed=1)), dtype=dtype)
    adapter.compile_decode()
    step = adapter.compiled
    assert step is not None, adapter.decode_path
    layer = step._step.layers[0]
    if dtype == "int4":  # tensors, not a registered layer
        assert len(layer.qkv) == 3 and len(layer.gate_up) == 3
        assert layer.qkv[0].dtype == torch.uint8
    else:
        assert len(layer.qkv) == 1 and any(type(m) is Int8Linear for m in step._step.kept)
    prompts = [[(13 * r + 5 * i + 2) % 400 + 5 for i in range(18 + 7 * r)] for r in range(2)]
    kvs, firsts = [], []
    for p in prompts:
        kv = adapter.new_kv_buffer(len(p) + 8)
        kvs.append(kv)
        firsts.append(int(adapter.forward_batch([SeqChunk(kv, 0, p, True)])[0].argmax()))
    twins = [kv.clone() for kv in kvs]
    starts = [len(p) for p in prompts]
    got, got_logits = _decode(adapter, kvs, starts, firsts, 4)
    adapter.compiled = None
    want, want_logits = _decode(adapter, twins, starts, firsts, 4)
    assert got == want
    rounding = 16 * torch.finfo(torch.bfloat16).eps if dtype == "int4" else 1e-3
    for g, w in zip(got_logits, want_logits, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=rounding * float(w.abs().max()))
    _cached_equals_fresh(tmp_path / "llama", dtype)  # int4: the mode the docs recommend


def test_a_package_folder_others_may_write_is_never_loaded(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A package is code the server runs: its folder is the user's own, or decoding
    stays eager."""
    monkeypatch.setenv("PAGEDKV_CACHE_HOME", str(tmp_path))
    folder = tmp_path / "compiled"
    folder.mkdir()
    folder.chmod(0o777)
    adapter = load_model(str(model_dir))
    adapter.compile_decode()
    assert adapter.compiled is None
    assert "writable by group or others" in adapter.decode_path
    assert "run code in the server" in adapter.decode_path
    assert not any(folder.iterdir())  # nothing built there either
