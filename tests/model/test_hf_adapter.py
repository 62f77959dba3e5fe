"""The Hugging Face model adapter: identity, KV round trips, detection, text helpers."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch
from fixtures_models import make_tiny_model
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from pagedkv.errors import ModelNotSupportedError
from pagedkv.model import BUNDLED_MODEL_NAME, ModelAdapter, bundled, fingerprint, load_model
from pagedkv.model import gguf as gguf_conversion
from pagedkv.model.hf import resolve_dtype
from pagedkv.model.kinds import prefix_caching_unsupported_reason, read_layer_kinds

PROMPT = (
    "Tokens flow through two tiny layers; keys and values pile up, block after block, "
    "until somebody asks the same question twice."
)


@pytest.fixture(autouse=True)
def _private_cache_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> Path:
    """Every test but the bundled-model smoke test writes its digests and conversions
    to a temporary cache home, never to the user's."""
    home = tmp_path / "cache-home"
    if request.node.get_closest_marker("slow") is None:
        monkeypatch.setenv("PAGEDKV_CACHE_HOME", str(home))
    return home


@pytest.fixture(scope="module")
def llama(tiny_llama_dir: Path) -> ModelAdapter:
    return load_model(tiny_llama_dir)


@pytest.fixture(scope="module")
def qwen2(tiny_qwen2_dir: Path) -> ModelAdapter:
    return load_model(tiny_qwen2_dir)


@pytest.fixture(scope="module")
def wide_window(tmp_path_factory: pytest.TempPathFactory) -> ModelAdapter:
    """Mistral whose sliding window (8192) exceeds its context (4096): full attention in effect."""
    path = tmp_path_factory.mktemp("wide-window") / "model"
    return load_model(make_tiny_model(path, arch="mistral", seed=3, sliding_window=8192))


# ---- fingerprint ------------------------------------------------------------


def test_fingerprint_survives_copy_and_move(tiny_llama_dir: Path, tmp_path: Path) -> None:
    original = load_model(tiny_llama_dir).fingerprint(64)
    copied = tmp_path / "copy"
    shutil.copytree(tiny_llama_dir, copied)
    assert load_model(copied).fingerprint(64) == original
    moved = tmp_path / "elsewhere" / "renamed"
    moved.parent.mkdir()
    copied.rename(moved)
    assert load_model(moved).fingerprint(64) == original


def test_fingerprint_changes_with_weights_dtype_and_block_size(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    base = load_model(tiny_llama_dir)
    assert base.fingerprint(64) != base.fingerprint(32)
    assert load_model(tiny_llama_dir, dtype="bfloat16").fingerprint(64) != base.fingerprint(64)
    other_seed = make_tiny_model(tmp_path / "seed1", arch="llama", seed=1)
    assert load_model(other_seed).fingerprint(64) != base.fingerprint(64)


def test_fingerprint_sees_weights_replaced_in_place(tiny_llama_dir: Path, tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model_dir)
    before = load_model(model_dir).fingerprint(64)
    weights = model_dir / "model.safetensors"
    tensors = load_file(weights)
    tensors["model.norm.weight"] = tensors["model.norm.weight"] * 1.001  # same size, same name
    save_file(tensors, weights, metadata={"format": "pt"})
    assert load_model(model_dir).fingerprint(64) != before


def test_weight_digest_is_remembered_between_loads(
    tiny_llama_dir: Path, _private_cache_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = load_model(tiny_llama_dir).fingerprint(64)
    assert (_private_cache_home / fingerprint.DIGEST_CACHE_NAME).is_file()

    def no_rehash(path: Path) -> str:
        raise AssertionError(f"{path} was hashed again although it did not change")

    monkeypatch.setattr(fingerprint, "_hash_file", no_rehash)
    assert load_model(tiny_llama_dir).fingerprint(64) == first


def test_fingerprint_of_in_memory_model_hashes_tensors(llama: ModelAdapter) -> None:
    detached = ModelAdapter(llama.model, llama.tokenizer, name="in-memory")
    assert len(detached.fingerprint(64)) == 32
    assert detached.fingerprint(64) == detached.fingerprint(64)
    assert detached.fingerprint(64) != detached.fingerprint(16)


# ---- KV cache plumbing --------------------------------------------------------


def test_cache_layers_build_cache_round_trip(llama: ModelAdapter) -> None:
    ids = llama.encode(PROMPT)
    _, cache = llama.forward(ids, None)
    layers = llama.cache_layers(cache)
    assert len(layers) == llama.num_layers == 2
    for keys, values in layers:
        assert keys.shape == values.shape == (1, llama.num_kv_heads, len(ids), llama.head_dim)
        assert keys.dtype == torch.float32
    rebuilt = llama.cache_layers(llama.build_cache([(k.clone(), v.clone()) for k, v in layers]))
    assert llama.cache_length(llama.build_cache(layers)) == len(ids)
    for (k0, v0), (k1, v1) in zip(layers, rebuilt, strict=True):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)


def test_build_cache_does_not_modify_the_restored_tensors(llama: ModelAdapter) -> None:
    ids = llama.encode(PROMPT)
    _, cache = llama.forward(ids, None)
    restored = [(k.clone(), v.clone()) for k, v in llama.cache_layers(cache)]
    snapshot = [(k.clone(), v.clone()) for k, v in restored]
    llama.forward(llama.encode(" and again"), llama.build_cache(restored))
    for (k0, v0), (k1, v1) in zip(snapshot, restored, strict=True):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)


def test_empty_cache_has_empty_layers(llama: ModelAdapter) -> None:
    layers = llama.cache_layers(llama.new_cache())
    assert [k.shape for k, _ in layers] == [(1, 2, 0, 16)] * 2


@pytest.mark.parametrize("adapter_name", ["llama", "qwen2", "wide_window"])
@pytest.mark.parametrize("restored_tokens", [1, 16, 23])
def test_restored_prefix_gives_full_forward_logits(
    adapter_name: str, restored_tokens: int, request: pytest.FixtureRequest
) -> None:
    adapter: ModelAdapter = request.getfixturevalue(adapter_name)
    ids = adapter.encode(PROMPT)
    assert len(ids) > restored_tokens + 4
    full_logits, _ = adapter.forward(ids, None)
    with torch.inference_mode():
        reference = adapter.model(input_ids=torch.tensor([ids])).logits[0, -1].float()
    torch.testing.assert_close(full_logits, reference, atol=1e-4, rtol=1e-4)

    # Compute a longer prompt, keep only the first `restored_tokens` tokens of its
    # KV (as a restore from blocks does), then prefill the rest on top of them.
    _, cache = adapter.forward(ids, None)
    prefix = [
        (k[:, :, :restored_tokens].clone(), v[:, :, :restored_tokens].clone())
        for k, v in adapter.cache_layers(cache)
    ]
    logits, _ = adapter.forward(ids[restored_tokens:], adapter.build_cache(prefix))
    torch.testing.assert_close(logits, full_logits, atol=1e-4, rtol=1e-4)
    assert logits.shape == (adapter.vocab_size,) and logits.dtype == torch.float32
    assert int(logits.argmax()) == int(full_logits.argmax())


@pytest.mark.parametrize("adapter_name", ["llama", "qwen2", "wide_window"])
def test_greedy_continuation_identical_after_restore(
    adapter_name: str, request: pytest.FixtureRequest
) -> None:
    adapter: ModelAdapter = request.getfixturevalue(adapter_name)
    ids = adapter.encode(PROMPT)

    def greedy(logits: torch.Tensor, cache: object, n: int = 32) -> list[int]:
        out = []
        for _ in range(n):
            out.append(int(logits.argmax()))
            logits, cache = adapter.forward([out[-1]], cache)
        return out

    cold = greedy(*adapter.forward(ids, None))
    _, cache = adapter.forward(ids[:-1], None)
    restored = adapter.build_cache([(k.clone(), v.clone()) for k, v in adapter.cache_layers(cache)])
    warm = greedy(*adapter.forward(ids[-1:], restored))
    assert warm == cold
    assert len(set(cold)) > 8, "tiny models must not collapse into repeating one token"


def test_warmup_leaves_no_state_behind(llama: ModelAdapter) -> None:
    ids = llama.encode(PROMPT)
    before, _ = llama.forward(ids, None)
    llama.warmup()
    after, _ = llama.forward(ids, None)
    assert torch.equal(before, after)


def test_forward_accepts_tensor_and_rejects_empty(llama: ModelAdapter) -> None:
    ids = llama.encode(PROMPT)
    from_list, _ = llama.forward(ids, None)
    from_tensor, _ = llama.forward(torch.tensor(ids), None)
    assert torch.equal(from_list, from_tensor)
    with pytest.raises(ValueError, match="at least one"):
        llama.forward([], None)


def test_build_cache_rejects_wrong_shapes(llama: ModelAdapter) -> None:
    good = torch.zeros(1, llama.num_kv_heads, 4, llama.head_dim)
    with pytest.raises(ValueError, match="layers"):
        llama.build_cache([(good, good)])
    bad = torch.zeros(1, llama.num_kv_heads + 1, 4, llama.head_dim)
    with pytest.raises(ValueError, match="shape"):
        llama.build_cache([(good, good), (bad, bad)])


# ---- unsupported layer types ------------------------------------------------------


def test_sliding_window_model_keeps_prefix_caching_on(tiny_sliding_dir: Path) -> None:
    adapter = load_model(tiny_sliding_dir)
    assert adapter.prefix_caching_supported, adapter.unsupported_reason
    assert adapter.batched, adapter.unbatched_reason
    assert adapter.kv_windows == (16, 16)
    assert adapter.kinds.describe() == "sliding(16) x2"


@pytest.mark.parametrize(
    ("arch", "kwargs", "kinds", "unsupported"),
    [
        ("llama", {}, "full x2", False),
        ("mistral", {"sliding_window": None}, "full x2", False),
        ("mistral", {"sliding_window": 8192, "max_position_embeddings": 8192}, "full x2",
         False),  # a window as long as the context never drops a token
        ("mistral", {"sliding_window": 8191, "max_position_embeddings": 8192},
         "sliding(8191) x2", False),
        ("qwen2", {"use_sliding_window": False, "sliding_window": 4096}, "full x2", False),
        # qwen2 slides only in layers >= max_window_layers
        ("qwen2", {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1},
         "full x1, sliding(64) x1", False),
        ("gemma2", {"sliding_window": 64}, "sliding(64) x1, full x1", False),
        ("gpt_oss", {"sliding_window": 64}, "sliding(64) x1, full x1", False),
        ("lfm2", {"layer_types": ["conv", "full_attention"]}, "state x1, full x1", False),
        ("qwen3_next", {"layer_types": ["linear_attention", "full_attention"]},
         "state x1, full x1", False),
        ("bamba", {"attn_layer_indices": [1]}, "state x1, full x1", False),
        ("falcon_h1", {}, "state+full x2", False),  # the config is fine; the cache class not
        ("mamba", {}, "state x2", True),  # no layer keeps per-token KV
    ],
)  # fmt: skip
def test_layer_kinds_come_from_the_config(
    arch: str, kwargs: dict[str, object], kinds: str, unsupported: bool
) -> None:
    config = AutoConfig.for_model(arch, num_hidden_layers=2, **kwargs)
    assert read_layer_kinds(config).describe() == kinds
    reason = prefix_caching_unsupported_reason(config)
    assert (reason is not None) == unsupported, reason


# ---- text, dtype, loading -----------------------------------------------------------


def test_encode_follows_tokenizer_default(llama: ModelAdapter, qwen2: ModelAdapter) -> None:
    text = "hello, café 日本 😀"
    bos = llama.tokenizer.bos_token_id
    assert llama.encode(text)[0] == bos and llama.encode(text).count(bos) == 1
    assert bos not in qwen2.encode(text)
    assert llama.decode(llama.encode(text)) == text
    assert qwen2.decode(qwen2.encode(text)) == text


def test_chat_template_adds_generation_prompt(llama: ModelAdapter, qwen2: ModelAdapter) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    for adapter in (llama, qwen2):
        ids = adapter.apply_chat_template(messages)
        assert all(isinstance(i, int) for i in ids)
        text = adapter.decode(ids, skip_special_tokens=False)
        assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
        assert "<|im_start|>system\nbe brief<|im_end|>" in text
    assert llama.apply_chat_template(messages)[0] == llama.tokenizer.bos_token_id
    assert llama.apply_chat_template(messages).count(llama.tokenizer.bos_token_id) == 1


def test_model_shape_and_stop_tokens(llama: ModelAdapter) -> None:
    assert (llama.num_layers, llama.num_kv_heads, llama.head_dim) == (2, 2, 16)
    assert llama.max_context == 4096
    assert llama.eos_token_ids == (llama.tokenizer.convert_tokens_to_ids("<|im_end|>"),)
    assert llama.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4
    assert llama.name == "model" and llama.prefix_caching_supported


def test_dtype_auto_is_float32_on_cpu(llama: ModelAdapter) -> None:
    assert llama.device.type == "cpu" and llama.dtype == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("float16", torch.device("cpu")) == torch.float16
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("float8", torch.device("cpu"))


def test_bfloat16_cache_round_trip(tiny_qwen2_dir: Path) -> None:
    adapter = load_model(tiny_qwen2_dir, dtype="bfloat16")
    _, cache = adapter.forward(adapter.encode(PROMPT), None)
    layers = adapter.cache_layers(cache)
    assert layers[0][0].dtype == torch.bfloat16
    logits, _ = adapter.forward([5], adapter.build_cache(layers))
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


def test_unknown_model_names_are_refused_with_what_is_accepted(tmp_path: Path) -> None:
    with pytest.raises(ModelNotSupportedError, match=BUNDLED_MODEL_NAME) as err:
        load_model("meta-llama/Llama-3.2-1B")
    assert "local directory" in str(err.value)
    with pytest.raises(ModelNotSupportedError, match=r"config\.json"):
        load_model(tmp_path)


# ---- bundled model conversion (fake GGUF; the real one is the slow smoke test) -----


def _fake_convert(gguf: Path, target: Path, record: dict[str, object], progress: bool) -> None:
    tmp = target.parent / f".{target.name}.tmp-fake"
    tmp.mkdir()
    (tmp / "config.json").write_text("{}")
    (tmp / "model.safetensors").write_bytes(b"weights")
    (tmp / fingerprint.SOURCE_MARKER).write_text(json.dumps(record))
    gguf_conversion._replace_dir(tmp, target)


def test_bundled_conversion_runs_once_and_redoes_on_new_gguf(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gguf = tmp_path / bundled.BUNDLED_GGUF_NAME
    gguf.write_bytes(b"v1")
    monkeypatch.setattr(bundled, "find_bundled_gguf", lambda: gguf)
    calls: list[Path] = []

    def convert(g: Path, target: Path, record: dict[str, object], progress: bool) -> None:
        calls.append(g)
        _fake_convert(g, target, record, progress)

    monkeypatch.setattr(gguf_conversion, "_convert", convert)
    leftover = bundled.bundled_model_dir().parent / f".{BUNDLED_MODEL_NAME}.tmp-crashed"
    leftover.mkdir(parents=True)
    target = bundled.ensure_bundled_model(progress=False)
    assert target == bundled.bundled_model_dir() and (target / "config.json").is_file()
    assert not leftover.exists(), "a crashed conversion's temporary dir is cleaned up"
    assert bundled.ensure_bundled_model(progress=False) == target
    assert len(calls) == 1
    gguf.write_bytes(b"version 2")  # the package was upgraded
    bundled.ensure_bundled_model(progress=False)
    assert len(calls) == 2


def test_failed_conversion_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gguf = tmp_path / bundled.BUNDLED_GGUF_NAME
    gguf.write_bytes(b"not a gguf file")
    monkeypatch.setattr(bundled, "find_bundled_gguf", lambda: gguf)
    with pytest.raises(Exception):  # noqa: B017 - whatever the GGUF reader raises
        bundled.ensure_bundled_model(progress=False)
    models = bundled.bundled_model_dir().parent
    assert [p.name for p in models.iterdir() if not p.name.endswith(".lock")] == []


def test_cache_home_respects_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PAGEDKV_CACHE_HOME", str(tmp_path / "explicit"))
    assert bundled.bundled_model_dir() == tmp_path / "explicit" / "models" / BUNDLED_MODEL_NAME
    monkeypatch.delenv("PAGEDKV_CACHE_HOME")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert bundled.cache_home() == tmp_path / "xdg" / "pagedkv"


@pytest.mark.slow
def test_bundled_model_smoke() -> None:
    # The real user cache (or the caller's PAGEDKV_CACHE_HOME), so the one-time
    # conversion is shared with later runs and with other bundled-model tests.
    bundled.ensure_bundled_model()
    started = time.perf_counter()
    adapter = load_model(BUNDLED_MODEL_NAME)
    load_s = time.perf_counter() - started
    assert adapter.name == BUNDLED_MODEL_NAME and adapter.prefix_caching_supported
    assert (adapter.num_layers, adapter.num_kv_heads, adapter.head_dim) == (30, 3, 64)
    assert adapter.max_context == 8192 and adapter.dtype == torch.float32
    question = [{"role": "user", "content": "What is the capital of France?"}]
    ids = adapter.apply_chat_template(question)
    logits, cache = adapter.forward(ids, None)
    out: list[int] = []
    while len(out) < 12 and (not out or out[-1] not in adapter.eos_token_ids):
        out.append(int(logits.argmax()))
        logits, cache = adapter.forward([out[-1]], cache)
    assert "Paris" in adapter.decode(out)
    assert adapter.fingerprint(64) == load_model(BUNDLED_MODEL_NAME).fingerprint(64)
    assert load_s < 30, f"loading the converted model took {load_s:.1f} s"
