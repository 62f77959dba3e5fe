"""One mutation test per identity field: changing the field changes the block keys, and
keeping the old keys would have given a wrong answer.

Each test builds two tiny models (or one model run two ways) that differ in that field
alone, checks that their namespaces differ and that the field is the only namespace
field that does, then shows what reusing the other side's KV would do: the logits
after a prefix whose KV the other side computed differ from the logits after the
model's own KV, computed the same way (so the difference is the field's, never
chunking or rounding noise: the model's own run is repeated and must come out bit for
bit). Where the change is large, the greedy tokens differ too.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from fixtures_models import make_tiny_model

from pagedkv.cache.hashing import BlockHasher, ExtraKeys
from pagedkv.cache.identity import namespace_digest
from pagedkv.model import hf, load_model
from pagedkv.model.batch import DeterministicRows, SeqChunk, linear_layers
from pagedkv.model.hf import ModelAdapter

IDS = [(37 * i + 11) % 500 + 3 for i in range(40)]
SPLIT = 32  # the prefix whose KV is reused: two 16-token blocks
BLOCK = 16


@pytest.fixture(scope="module")
def build(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., ModelAdapter]:
    """Load a tiny model (seed 0 unless told) with config overrides; same arguments,
    same adapter. Models of one arch and seed have byte-identical weights."""
    root = tmp_path_factory.mktemp("mutations")
    loaded: dict[str, ModelAdapter] = {}

    def get(arch: str = "llama", dtype: str = "auto", seed: int = 0, **over: Any) -> ModelAdapter:
        key = repr((arch, dtype, seed, sorted(over.items())))
        if key not in loaded:
            path = root / hashlib.sha256(key.encode()).hexdigest()[:16]
            if not path.exists():
                make_tiny_model(path, arch=arch, seed=seed, **over)
            loaded[key] = load_model(path, device="cpu", dtype=dtype)
        return loaded[key]

    return get


def changed_fields(a: ModelAdapter, b: ModelAdapter, **kw: Any) -> list[str]:
    ia, ib = a.identity(BLOCK, **kw), b.identity(BLOCK, **kw)
    return [name for name in ia if ia[name] != ib[name]]


def logits_after(model: ModelAdapter, donor: ModelAdapter) -> torch.Tensor:
    """`model`'s logits for IDS[SPLIT:] after the KV `donor` computed for IDS[:SPLIT]:
    what `model` answers when its cache hands it `donor`'s blocks."""
    _, cache = donor.forward(IDS[:SPLIT])
    layers = [(k.clone(), v.clone()) for k, v in donor.cache_layers(cache)]
    return model.forward(IDS[SPLIT:], model.build_cache(layers))[0]


def greedy_after(model: ModelAdapter, donor: ModelAdapter, n: int = 12) -> list[int]:
    _, cache = donor.forward(IDS[:SPLIT])
    cache = model.build_cache([(k.clone(), v.clone()) for k, v in donor.cache_layers(cache)])
    logits, cache = model.forward(IDS[SPLIT:], cache)
    out = []
    for _ in range(n):
        out.append(int(logits.argmax()))
        logits, cache = model.forward(out[-1:], cache)
    return out


def assert_reuse_is_wrong(model: ModelAdapter, old: ModelAdapter, min_diff: float) -> None:
    own = logits_after(model, model)
    assert torch.equal(own, logits_after(model, model)), "the baseline must be exact"
    borrowed = logits_after(model, old)
    assert float((borrowed - own).abs().max()) > min_diff


# (arch, the field's old value, its new value): models that differ in that config field
CONFIG_MUTATIONS = {
    "rope_theta": ("llama", {}, {"rope_parameters": {"rope_type": "default",
                                                     "rope_theta": 500000.0}}),
    "rope_scaling": ("llama", {}, {"rope_parameters": {"rope_type": "linear",
                                                       "rope_theta": 10000.0, "factor": 4.0}}),
    "rms_norm_eps": ("llama", {}, {"rms_norm_eps": 1e-6}),
    "hidden_act": ("llama", {}, {"hidden_act": "gelu"}),
    "sliding_window": ("gemma3_text", {}, {"sliding_window": 8}),
    "layer_types": ("gemma3_text", {}, {"layer_types": ["sliding_attention",
                                                        "full_attention"] * 2}),
    "attention_scaling": ("gemma3_text", {}, {"query_pre_attn_scalar": 32}),
    "attn_logit_softcapping": ("gemma2", {}, {"attn_logit_softcapping": 5.0}),
}  # fmt: skip
# Changes large enough that the greedy answer itself changes within 12 tokens.
GREEDY_FLIPS = {"rope_theta", "rope_scaling", "sliding_window", "layer_types"}


@pytest.mark.parametrize("field", sorted(CONFIG_MUTATIONS))
def test_config_field(build: Callable[..., ModelAdapter], field: str) -> None:
    arch, old_over, new_over = CONFIG_MUTATIONS[field]
    old, new = build(arch, **old_over), build(arch, **new_over)
    assert old.identity(BLOCK)["weights"] == new.identity(BLOCK)["weights"]
    assert changed_fields(old, new) == ["config"]
    assert old.fingerprint(BLOCK) != new.fingerprint(BLOCK)
    # 1e-5: above float32 noise, below the smallest of these changes (eps: ~5e-5)
    assert_reuse_is_wrong(new, old, min_diff=1e-5)
    if field in GREEDY_FLIPS:
        assert greedy_after(new, old) != greedy_after(new, new)


def test_weights(build: Callable[..., ModelAdapter]) -> None:
    old, new = build(seed=0), build(seed=1)
    assert changed_fields(old, new) == ["weights"]
    assert old.fingerprint(BLOCK) != new.fingerprint(BLOCK)
    assert_reuse_is_wrong(new, old, min_diff=1e-2)
    assert greedy_after(new, old) != greedy_after(new, new)


def test_dtype(build: Callable[..., ModelAdapter]) -> None:
    old, new = build(dtype="bfloat16"), build()
    assert changed_fields(old, new) == ["dtype", "kv_dtype"]  # auto KV is the model's dtype
    assert old.fingerprint(BLOCK) != new.fingerprint(BLOCK)
    assert_reuse_is_wrong(new, old, min_diff=1e-3)


def test_linear_kernel(build: Callable[..., ModelAdapter]) -> None:
    old, new = build(dtype="int8"), build()
    assert changed_fields(old, new) == ["linear"]
    assert old.fingerprint(BLOCK) != new.fingerprint(BLOCK)
    assert_reuse_is_wrong(new, old, min_diff=1e-3)


def test_kv_dtype(build: Callable[..., ModelAdapter]) -> None:
    """KV an int8-KV engine stored (each row rounded to int8 and a scale) is not what an
    engine that keeps float32 KV computed."""
    model = build()
    before = model.fingerprint(BLOCK)
    model.set_kv_dtype("int8")
    try:
        stored = model.kv_format
        assert model.fingerprint(BLOCK) != before
    finally:
        model.set_kv_dtype("auto")
    assert model.fingerprint(BLOCK) == before
    _, cache = model.forward(IDS[:SPLIT])
    as_int8 = []
    for k, v in model.cache_layers(cache):
        pair = []
        for t in (k, v):
            buf = torch.empty((*t.shape[:-1], stored.row_width), dtype=stored.storage_dtype)
            stored.write(buf, t)
            pair.append(stored.read(buf, model.dtype))
        as_int8.append((pair[0], pair[1]))
    own = logits_after(model, model)
    borrowed = model.forward(IDS[SPLIT:], model.build_cache(as_int8))[0]
    assert float((borrowed - own).abs().max()) > 1e-4


def _ragged_kv(model: ModelAdapter, ids: list[int]) -> torch.Tensor:
    kv = model.new_kv_buffer(64)
    model.forward_batch([SeqChunk(kv, 0, ids, True)])
    return kv


def test_attention_kernel(build: Callable[..., ModelAdapter], tmp_path: Path) -> None:
    """The ragged batch's attention and transformers' sdpa store other KV bits for the
    same prompt: blocks one wrote are not what the other computes fresh."""
    ragged = build()
    assert ragged.batched and ragged.attention_kernel.startswith("pagedkv_ragged:")
    plain = load_model(make_tiny_model(tmp_path / "m", seed=0), device="cpu")
    plain.model.set_attn_implementation("sdpa")
    plain.batched = False
    assert plain.attention_kernel == "transformers:sdpa"
    assert "attention" in changed_fields(ragged, plain)
    assert ragged.fingerprint(BLOCK) != plain.fingerprint(BLOCK)
    # attention-only: the same fields but the kernel give another namespace
    fields = ragged.identity(BLOCK)
    assert namespace_digest({**fields, "attention": plain.attention_kernel}) != namespace_digest(
        fields
    )
    # sdpa's query blocks split a 16-row multiple as the ragged family does: the rows
    # then sum alike (measured); other lengths do not
    ids = [(37 * i + 11) % 500 + 3 for i in range(48)]
    differ = []
    for n in (36, 40, 44):
        own = _ragged_kv(ragged, ids[:n])
        _, cache = plain.forward(ids[:n])
        borrowed = own.clone()
        for i, (k, v) in enumerate(plain.cache_layers(cache)):
            borrowed[i, 0, :, :n], borrowed[i, 1, :, :n] = k[0], v[0]
        if torch.equal(borrowed[:, :, :, :n], own[:, :, :, :n]):
            continue
        differ.append(n)
        after = [SeqChunk(kv, n, ids[n:], True) for kv in (own, borrowed)]
        own_logits, borrowed_logits = (ragged.forward_batch([c]) for c in after)
        assert not torch.equal(own_logits, borrowed_logits)
    assert differ, "sdpa stored the ragged kernel's KV bit for bit at every length"


def test_batching_mode(build: Callable[..., ModelAdapter]) -> None:
    """Decode rows attended together with another sequence's (grouped) round otherwise
    than the padded rows of deterministic batching: a generated token's stored KV
    differs, so a deterministic engine must not read a grouped engine's blocks."""
    model = build()
    assert changed_fields(model, model) == []
    grouped, padded = model.fingerprint(BLOCK), model.fingerprint(BLOCK, deterministic=True)
    assert grouped != padded
    rows = DeterministicRows(linear_layers(model.model))
    other = [(53 * i + 7) % 500 + 3 for i in range(300)]
    kvs = []
    for deterministic in (False, True):
        kv, kv2 = model.new_kv_buffer(64), model.new_kv_buffer(320)
        model.forward_batch([SeqChunk(kv, 0, IDS[:20], True)], rows)
        model.forward_batch([SeqChunk(kv2, 0, other[:250], True)], rows)
        for t in range(20, SPLIT):
            step = [SeqChunk(kv, t, [IDS[t]], True), SeqChunk(kv2, 250 + t, [other[t]], True)]
            model.forward_batch(step, rows if deterministic else None, not deterministic)
        kvs.append(kv)
    assert not torch.equal(kvs[0][:, :, :, :SPLIT], kvs[1][:, :, :, :SPLIT])
    logits = [model.forward_batch([SeqChunk(kv, SPLIT, IDS[SPLIT:], True)]) for kv in kvs]
    assert not torch.equal(logits[0], logits[1])


def test_adapter(build: Callable[..., ModelAdapter], tmp_path: Path) -> None:
    """A LoRA adapter (here its weight delta merged into q and v) changes the KV; its
    digest in the root changes every block key, the base's and another adapter's."""
    base = build()
    tuned = load_model(make_tiny_model(tmp_path / "m", seed=0), device="cpu")
    gen = torch.Generator().manual_seed(5)
    digest = hashlib.sha256()
    with torch.no_grad():
        for name, module in sorted(tuned.model.named_modules()):
            if name.endswith(("q_proj", "v_proj")):
                lora_a = torch.randn(2, module.in_features, generator=gen) * 0.3
                lora_b = torch.randn(module.out_features, 2, generator=gen) * 0.3
                weight = module.weight.to_dense() if module.weight.is_mkldnn else module.weight
                module.weight = torch.nn.Parameter(weight + lora_b @ lora_a, requires_grad=False)
                digest.update(lora_a.numpy().tobytes() + lora_b.numpy().tobytes())
    hasher = BlockHasher(BLOCK, namespace=base.fingerprint(BLOCK), seed=b"s")
    keys = {
        adapter: tuple(hasher.hash_blocks(IDS[:SPLIT], ExtraKeys(adapter=adapter)))
        for adapter in (None, digest.hexdigest(), hashlib.sha256(b"other").hexdigest())
    }
    assert len({k for ks in keys.values() for k in ks}) == 3 * (SPLIT // BLOCK)
    # the salt of the same bytes is another key too (tagged fields)
    salted = hasher.hash_blocks(IDS[:SPLIT], ExtraKeys(cache_salt=digest.hexdigest()))
    assert set(salted).isdisjoint(keys[digest.hexdigest()])
    assert_reuse_is_wrong(tuned, base, min_diff=1e-2)
    assert_reuse_is_wrong(base, tuned, min_diff=1e-2)


def test_layout_version(build: Callable[..., ModelAdapter], tmp_path: Path) -> None:
    """A new KV layout (`KV_LAYOUT_VERSION`) is a new namespace. No second layout exists
    in the code to show the wrong answer with; the version is bumped when one does."""
    path = make_tiny_model(tmp_path / "m", seed=0)
    before = load_model(path, device="cpu").fingerprint(BLOCK)
    assert before == build().fingerprint(BLOCK)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hf, "KV_LAYOUT_VERSION", hf.KV_LAYOUT_VERSION + 1)
        assert load_model(path, device="cpu").fingerprint(BLOCK) != before


@pytest.mark.parametrize(("field", "other"), [("backend", "mlx"), ("device", "cuda")])
def test_backend_and_device(build: Callable[..., ModelAdapter], field: str, other: str) -> None:
    """Another compute library or device type rounds otherwise (another namespace). Only
    torch on the CPU runs here, so the wrong answer is not shown, only the key."""
    fields = build().identity(BLOCK)
    assert (fields["backend"], fields["device"]) == ("torch", "cpu")
    assert namespace_digest({**fields, field: other}) != namespace_digest(fields)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_kv_differs_on_cuda(tmp_path: Path) -> None:
    """Where a GPU is present: its KV for the same ids is not the CPU's, bit for bit."""
    path = make_tiny_model(tmp_path / "m", seed=0)
    cpu = load_model(path, device="cpu", dtype="float32")
    gpu = load_model(path, device="cuda", dtype="float32")
    assert changed_fields(cpu, gpu) == ["device"]
    cpu_kv = _ragged_kv(cpu, IDS[:SPLIT])
    gpu_kv = _ragged_kv(gpu, IDS[:SPLIT]).cpu()
    assert not torch.equal(cpu_kv[:, :, :, :SPLIT], gpu_kv[:, :, :, :SPLIT])
