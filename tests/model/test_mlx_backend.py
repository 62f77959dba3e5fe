"""The MLX backend at the seam (`model.backend`), on tiny random models through mlx-cpu:
chunked prefill against one shot, restore against fresh, a mixed batch against each
sequence alone, kv_dtype, forks, identity, and what it refuses by name.

Exactness here is bit for bit (`torch.equal` on logits), not only greedy tokens: the
promise is cached == fresh within the backend, and a differing bit is where a differing
token starts. Runs where mlx imports (CI installs `.[dev,mlx]`, with mlx-cpu on Linux)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("mlx.core", reason="MLX is not installed: pip install 'pagedkv[mlx]'")
pytest.importorskip("mlx_lm", reason="mlx-lm is not installed: pip install 'pagedkv[mlx]'")

from fixtures_models import make_tiny_model

from pagedkv.errors import ModelNotSupportedError
from pagedkv.model.batch import SeqChunk
from pagedkv.model.mlx import MlxBackend, MlxSeqKV, load_mlx_model

TEXT = (
    "Blocks of sixty-four tokens are hashed together with the hash of the block in front "
    "of them, so one hash names the whole prefix up to its end. The pool keeps blocks in "
    "memory, the disk keeps them after a restart."
)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def backend(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    arch = request.param
    directory = make_tiny_model(tmp_path_factory.mktemp(f"mlx-{arch}") / "model", arch=arch)
    return load_mlx_model(directory, arch)


def _prefill(b: MlxBackend, ids: list[int], cuts: list[int]) -> tuple[MlxSeqKV, list[torch.Tensor]]:
    """Run `ids` in chunks ending at `cuts` (and the end); the logits at each chunk's end."""
    kv = b.new_kv(len(ids) + 32)
    out, start = [], 0
    for end in [*cuts, len(ids)]:
        out.append(b.forward_step([SeqChunk(kv, start, ids[start:end], True)])[0])
        start = end
    return kv, out


def _greedy(b: MlxBackend, kv: MlxSeqKV, logits: torch.Tensor, steps: int) -> list[int]:
    """Greedy tokens after `logits`, one decode step at a time."""
    tokens = []
    for _ in range(steps):
        token = int(logits.argmax())
        tokens.append(token)
        logits = b.forward_step([SeqChunk(kv, kv.num_tokens, [token], True)])[0]
    return tokens


def _restored(b: MlxBackend, source: MlxSeqKV, n: int, capacity: int) -> MlxSeqKV:
    """A new sequence holding `source`'s first `n` tokens, through the seam's format."""
    kv = b.new_kv(capacity)
    target = kv.restore_target()
    assert target.dtype == b.kv_format.storage_dtype
    assert target.shape == (b.num_kv_layers, 2, b.num_kv_heads, capacity, b.kv_format.row_width)
    target[:, :, :, :n] = source.kv_of(0, n)
    kv.set_restored(n, None)
    return kv


def test_chunked_prefill_equals_one_shot(backend: MlxBackend) -> None:
    ids = backend.encode(TEXT)
    assert len(ids) > 40
    one, [want] = _prefill(backend, ids, [])
    for cuts in ([1], [16, 17, 33], [len(ids) - 1], list(range(5, len(ids), 7))):
        kv, logits = _prefill(backend, ids, cuts)
        assert torch.equal(logits[-1], want), cuts
        assert torch.equal(kv.kv_of(0, len(ids)), one.kv_of(0, len(ids))), cuts


@pytest.mark.parametrize("kv_dtype", ["auto", "bfloat16", "float16"])
def test_restored_prefix_continues_as_fresh(backend: MlxBackend, kv_dtype: str) -> None:
    """kv_of -> a new sequence's restore_target -> set_restored -> the prompt's last token
    as a prompt chunk: the logits and 12 greedy tokens equal the fresh ones, in each
    kv_dtype (stored KV rounds alike fresh and restored: attention reads it back)."""
    backend.set_kv_dtype(kv_dtype)
    try:
        ids = backend.encode(TEXT)
        fresh, [logits] = _prefill(backend, ids, [])
        want = _greedy(backend, fresh, logits, 12)
        stored = fresh.kv_of(0, len(ids))
        assert stored.dtype == backend.kv_format.storage_dtype
        for n in (len(ids) - 1, 32, 16):
            kv = _restored(backend, fresh, n, len(ids) + 16)
            got = backend.forward_step([SeqChunk(kv, n, ids[n:], True, prompt=True)])[0]
            assert torch.equal(got, logits), n
            assert torch.equal(kv.kv_of(0, len(ids)), stored), n
            assert _greedy(backend, kv, got, 12) == want, n
    finally:
        backend.set_kv_dtype("auto")


def test_kv_dtype_rounds_the_stored_kv(backend: MlxBackend) -> None:
    """16-bit KV holds the float32 KV rounded to it, and the logits change with it (the
    option is honoured, not ignored)."""
    ids = backend.encode(TEXT)
    exact, [want] = _prefill(backend, ids, [])
    full = exact.kv_of(0, len(ids))
    for name, dtype in (("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        backend.set_kv_dtype(name)
        try:
            kv, [got] = _prefill(backend, ids, [])
        finally:
            backend.set_kv_dtype("auto")
        stored = kv.kv_of(0, len(ids))
        assert stored.dtype == dtype
        # Layer 0's KV comes from the embeddings alone: exactly the float32 KV, rounded.
        assert torch.equal(stored[0], full[0].to(dtype))
        assert not torch.equal(got, want)
        assert (got - want).abs().max() < 0.1 * want.abs().max()


def test_mixed_batch_equals_each_sequence_alone(backend: MlxBackend) -> None:
    """Decode rows of four sequences (different lengths) in one model call, with a prompt
    chunk in the same step: every sequence's logits equal its logits alone, bit for bit."""
    ids = backend.encode(TEXT)
    prompts = [ids[:9], ids[:30], ids[5:], ids[2:20]]
    steps = 5
    alone = []
    for p in prompts:
        kv, _ = _prefill(backend, p, [])
        rows = []
        for s in range(steps):
            rows.append(backend.forward_step([SeqChunk(kv, len(p) + s, [11 + s], True)])[0])
        alone.append(rows)
    kvs = [_prefill(backend, p, [])[0] for p in prompts]
    newcomer = backend.new_kv(64)
    for s in range(steps):
        chunks = [
            SeqChunk(kv, len(p) + s, [11 + s], True) for kv, p in zip(kvs, prompts, strict=True)
        ]
        # a prompt chunk rides along (its logits unwanted on even steps)
        chunks.insert(2, SeqChunk(newcomer, 4 * s, ids[4 * s : 4 * s + 4], s % 2 == 1))
        out = backend.forward_step(chunks)
        mine = [out[i] for i in range(len(out)) if not (s % 2 == 1 and i == 2)]
        for i in range(len(prompts)):
            assert torch.equal(mine[i], alone[i][s]), (i, s)


def test_fork_copies_and_diverges(backend: MlxBackend) -> None:
    """`copy` (n > 1): the fork continues as the original would, and neither sees the
    other's tokens."""
    ids = backend.encode(TEXT)
    kv, _ = _prefill(backend, ids, [])
    fork = kv.copy(len(ids), len(ids) + 16)
    a = backend.forward_step([SeqChunk(kv, len(ids), [7], True)])[0]
    b = backend.forward_step([SeqChunk(fork, len(ids), [9], True)])[0]
    solo, _ = _prefill(backend, ids, [])
    want_b = backend.forward_step([SeqChunk(solo, len(ids), [9], True)])[0]
    assert torch.equal(b, want_b)
    assert not torch.equal(a, b)
    assert torch.equal(kv.kv_of(0, len(ids)), fork.kv_of(0, len(ids)))
    assert not torch.equal(kv.kv_of(len(ids), len(ids) + 1), fork.kv_of(len(ids), len(ids) + 1))
    short = kv.copy(10, 32)
    assert short.num_tokens == 10 and short.grown(64, 10) is short and short.capacity == 64


def test_identity_names_the_backend_and_differs_from_torch(
    backend: MlxBackend, tmp_path: Path
) -> None:
    from pagedkv.model.hf import load_model

    directory = backend.model_dir
    assert directory is not None
    torch_adapter = load_model(directory, device="cpu")
    mine, theirs = backend.identity(16), torch_adapter.identity(16)
    assert mine["backend"] == "mlx" and theirs["backend"] == "torch"
    assert mine["weights"] == theirs["weights"]  # the same files
    assert "mlx" in mine["linear"] and "mlx" in mine["attention"]
    assert backend.fingerprint(16) != torch_adapter.fingerprint(16)
    assert backend.fingerprint(16) != backend.fingerprint(32)
    backend.set_kv_dtype("bfloat16")
    try:
        assert backend.identity(16)["kv_dtype"] == "bfloat16"
    finally:
        backend.set_kv_dtype("auto")


def test_refusals_are_named(backend: MlxBackend) -> None:
    with pytest.raises(ModelNotSupportedError, match=r"int8.*MLX"):
        backend.set_kv_dtype("int8")
    with pytest.raises(ModelNotSupportedError, match="deterministic"):
        backend.identity(16, deterministic=True)
    kv = backend.new_kv(8)
    with pytest.raises(ModelNotSupportedError, match="deterministic"):
        backend.forward_step([SeqChunk(kv, 0, [1, 2], True)], pad_rows=lambda n: n)
    with pytest.raises(ModelNotSupportedError, match="recurrent"):
        kv.snapshot()
    with pytest.raises(ValueError, match="holding 0"):
        backend.forward_step([SeqChunk(kv, 3, [1], True)])
    assert backend.lora_layers is None and backend.vision is None
    assert backend.state_layout is None and backend.stable_rows() is None


def test_text_matches_the_torch_backend(backend: MlxBackend) -> None:
    """The same tokenizer and chat template through the shared text methods."""
    from transformers import AutoTokenizer

    assert backend.model_dir is not None
    tok = AutoTokenizer.from_pretrained(backend.model_dir)
    assert backend.encode(TEXT) == list(tok.encode(TEXT))
    messages = [{"role": "user", "content": "hello"}]
    ids = backend.apply_chat_template(messages)
    assert backend.decode(ids, skip_special_tokens=False).endswith("<|im_start|>assistant\n")
    assert backend.eos_token_ids and backend.vocab_size == len(tok)


def test_quantized_model_loads_and_restores_exactly(backend: MlxBackend, tmp_path: Path) -> None:
    """A 4-bit model as mlx-community ships them (mlx_lm.convert): its linear kernel and
    weights digest name the quantized tensors as stored, and cached == fresh holds."""
    from mlx_lm import convert

    assert backend.model_dir is not None
    out = tmp_path / "q4"
    convert(str(backend.model_dir), mlx_path=str(out), quantize=True, q_bits=4, q_group_size=64)
    q4 = load_mlx_model(out, "q4")
    assert "quantized(bits=4,group_size=64" in q4.identity(16)["linear"]
    assert q4.identity(16)["weights"] != backend.identity(16)["weights"]
    ids = q4.encode(TEXT)
    fresh, [logits] = _prefill(q4, ids, [])
    kv = _restored(q4, fresh, 32, len(ids) + 8)
    got = q4.forward_step([SeqChunk(kv, 32, ids[32:], True)])[0]
    assert torch.equal(got, logits)


def test_prompt_chunks_compute_the_last_rows_logits_only(backend: MlxBackend) -> None:
    """The output layer runs on a prompt chunk's last row alone (`mlx/last_row.py`), and
    those logits equal the last row of the whole model's output, bit for bit."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from pagedkv.model.mlx.convert import to_torch

    assert backend._last_row is not None
    ids = backend.encode(TEXT)
    whole = backend.model(mx.array([ids]), cache=make_prompt_cache(backend.model))
    assert whole.shape[1] == len(ids)  # outside a step: every row, as mlx-lm computes
    _, [got] = _prefill(backend, ids, [])
    assert torch.equal(got, to_torch(whole[0, -1].astype(mx.float32)))


def test_rope_theta_of_a_transformers_5_config_reaches_mlx(tmp_path: Path) -> None:
    """transformers 5 writes RoPE under `rope_parameters`; mlx-lm's Llama reads only a
    top-level `rope_theta` (else 10000). With a theta of 500 the MLX logits must match
    torch's on the same weights (float32, the same sums up to rounding), which they
    do not at theta 10000."""
    from pagedkv.model.hf import load_model

    directory = make_tiny_model(
        tmp_path / "theta",
        arch="llama",
        rope_parameters={"rope_type": "default", "rope_theta": 500.0},
    )
    assert "rope_theta" not in (directory / "config.json").read_text().split("rope_parameters")[0]
    mlx = load_mlx_model(directory, "theta")
    torch_adapter = load_model(directory, device="cpu")
    ids = mlx.encode(TEXT)
    _, [got] = _prefill(mlx, ids, [])
    want, _ = torch_adapter.forward(ids)
    assert torch.allclose(got, want, atol=1e-3), float((got - want).abs().max())
