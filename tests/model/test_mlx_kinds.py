"""The MLX backend at the seam with sliding-window models (Gemma 3 text, Mistral with
`layer_types`; 16-token windows) and two hybrids (LFM2: short convolutions beside
attention; Qwen3-Next: gated delta rule beside attention), bit for bit
(`torch.equal` on logits): a windowed restore (only the window's rows written, zeros
before them) and a restored recurrent snapshot continue as the fresh sequence; decode
rows of windowed sequences batched equal alone; the growing sliding cache gives
mlx-lm's own RotatingKVCache greedy tokens; Falcon-H1's Mamba-2 stays uncached, its
reason measured (`model.mlx.layers`)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("mlx.core", reason="MLX is not installed: pip install 'pagedkv[mlx]'")
pytest.importorskip("mlx_lm", reason="mlx-lm is not installed: pip install 'pagedkv[mlx]'")

from fixtures_models import make_tiny_model

from pagedkv.errors import ModelNotSupportedError
from pagedkv.model.batch import SeqChunk
from pagedkv.model.mlx import MlxBackend, MlxSeqKV, load_mlx_model

IDS = [(37 * i + 11) % 180 + 3 for i in range(45)]  # longer than the window, three times over


# Gemma 3 text: three sliding layers, one global; Mistral with `layer_types`, which
# mlx-lm's llama code builds with a sliding layer (tests/model/test_mlx_agreement.py)
SLIDING = {
    "gemma3_text": ("gemma3_text", {}, (16, 16, 16, None)),
    "mistral": ("mistral", {"sliding_window": 16, "layer_types": ["sliding_attention",
                                                                  "full_attention"]},
                (16, None)),
}  # fmt: skip


@pytest.fixture(scope="module", params=list(SLIDING))
def sliding(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> MlxBackend:
    arch, overrides, _ = SLIDING[request.param]
    path = make_tiny_model(tmp_path_factory.mktemp(arch) / "m", arch=arch, seed=3, **overrides)
    return load_mlx_model(path, request.param)


# mlx-lm ties LFM2's head and needs `block_dim`; it places Qwen3-Next's attention by
# `full_attention_interval` (tests/model/test_mlx_agreement.py)
HYBRIDS = {
    "lfm2": {"tie_word_embeddings": True, "block_dim": 64},
    "qwen3_next": {"full_attention_interval": 3},
}


@pytest.fixture(scope="module", params=list(HYBRIDS))
def hybrid(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> MlxBackend:
    arch = request.param
    path = make_tiny_model(tmp_path_factory.mktemp(arch) / "m", arch=arch, seed=4, **HYBRIDS[arch])
    return load_mlx_model(path, arch)


def _prefill(b: MlxBackend, ids: list[int], cuts: list[int]) -> tuple[MlxSeqKV, torch.Tensor]:
    kv = b.new_kv(len(ids) + 32)
    start, logits = 0, torch.empty(0)
    for end in [*cuts, len(ids)]:
        logits = b.forward_step([SeqChunk(kv, start, ids[start:end], True)])[0]
        start = end
    return kv, logits


def _greedy(b: MlxBackend, kv: Any, logits: torch.Tensor, steps: int) -> list[torch.Tensor]:
    out = []
    for _ in range(steps):
        logits = b.forward_step([SeqChunk(kv, kv.num_tokens, [int(logits.argmax())], True)])[0]
        out.append(logits)
    return out


def test_sliding_layers_are_cached_with_their_windows(sliding: MlxBackend) -> None:
    assert sliding.prefix_caching_supported and sliding.batched, sliding.unsupported_reason
    assert sliding.kv_windows == SLIDING[sliding.name][2] and sliding.state_layout is None
    sliding.set_kv_dtype("bfloat16")  # every layer's KV is stored in the KV format
    sliding.set_kv_dtype("auto")


def test_windowed_restore_continues_as_fresh(sliding: MlxBackend) -> None:
    """Sliding layers get only their window's rows, zeros before (as `cache.window`)."""
    fresh, want = _prefill(sliding, IDS, [])
    tail = _greedy(sliding, fresh, want, 6)
    stored = fresh.kv_of(0, len(IDS))
    for n in (len(IDS) - 1, 33, 20, 8):
        kv = sliding.new_kv(len(IDS) + 16)
        target = kv.restore_target()
        for row, window in enumerate(sliding.kv_windows):
            first = 0 if window is None else max(0, n - window + 1)
            target[row, :, :, first:n] = stored[row, :, :, first:n]
        kv.set_restored(n, None)
        got = sliding.forward_step([SeqChunk(kv, n, IDS[n:], True)])[0]
        assert torch.equal(got, want), n
        assert all(
            torch.equal(a, b) for a, b in zip(_greedy(sliding, kv, got, 6), tail, strict=True)
        )


def test_windowed_decode_batched_equals_alone(sliding: MlxBackend) -> None:
    prompts = [IDS[:9], IDS[:30], IDS[5:], IDS[2:20]]
    alone = []
    for p in prompts:
        kv, _ = _prefill(sliding, p, [])
        alone.append([sliding.forward_step([SeqChunk(kv, len(p) + s, [11 + s], True)])[0]
                      for s in range(20)])  # fmt: skip
    kvs = [_prefill(sliding, p, [])[0] for p in prompts]
    for s in range(20):  # the shorter ones cross the window too
        chunks = [
            SeqChunk(kv, len(p) + s, [11 + s], True) for kv, p in zip(kvs, prompts, strict=True)
        ]
        out = sliding.forward_step(chunks)
        for i in range(len(prompts)):
            assert torch.equal(out[i], alone[i][s]), (i, s)


def test_greedy_equals_mlx_lms_rotating_cache(sliding: MlxBackend) -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache

    caches = make_prompt_cache(sliding.model)
    assert isinstance(caches[0], RotatingKVCache)
    logits, theirs = sliding.model(mx.array([IDS]), cache=caches)[0, -1], []
    for _ in range(16):
        theirs.append(int(mx.argmax(logits).item()))
        logits = sliding.model(mx.array([[theirs[-1]]]), cache=caches)[0, -1]
    kv, first = _prefill(sliding, IDS, [])
    ours = [int(first.argmax())] + [int(x.argmax()) for x in _greedy(sliding, kv, first, 15)]
    assert ours == theirs


def test_recurrent_snapshot_restores_as_fresh(hybrid: MlxBackend) -> None:
    """A snapshot after n tokens (the worker ends a chunk there) and the KV before n in a
    new sequence: the rest of the prompt and the greedy tail equal the fresh run."""
    layout = hybrid.state_layout
    assert hybrid.prefix_caching_supported and not hybrid.batched and layout is not None
    fresh, want = _prefill(hybrid, IDS, [])
    tail = _greedy(hybrid, fresh, want, 6)
    for n in (8, 24, len(IDS) - 1):
        source, _ = _prefill(hybrid, IDS[:n], [])
        state = source.snapshot()
        assert state.dtype == torch.float32 and state.shape == (layout.numel,)
        kv = hybrid.new_kv(len(IDS) + 16)
        kv.restore_target()[:, :, :, :n] = source.kv_of(0, n)
        kv.set_restored(n, state)
        got = hybrid.forward_step([SeqChunk(kv, n, IDS[n:], True)])[0]
        assert torch.equal(got, want), n
        assert all(
            torch.equal(a, b) for a, b in zip(_greedy(hybrid, kv, got, 6), tail, strict=True)
        )
        assert torch.equal(kv.snapshot(), fresh.snapshot()), n  # both after prompt + tail
    with pytest.raises(ValueError, match="without the recurrent state"):
        hybrid.new_kv(8).set_restored(4, None)


def test_recurrent_prompt_in_chunks_equals_whole(hybrid: MlxBackend) -> None:
    _, want = _prefill(hybrid, IDS, [])
    for cuts in ([1], [8, 16, 24], list(range(5, len(IDS), 7))):
        _, got = _prefill(hybrid, IDS, cuts)
        assert torch.equal(got, want), cuts


def test_falcon_h1_is_refused_with_the_measured_reason(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """mlx-lm's Mamba-2 scan computes a prompt otherwise whole than cut into chunks, so
    a restored snapshot could not continue bit for bit: caching off, saying so."""
    path = make_tiny_model(tmp_path_factory.mktemp("falcon") / "m", arch="falcon_h1", seed=3)
    b = load_mlx_model(path, "falcon")
    assert not b.prefix_caching_supported and not b.batched and b.state_layout is None
    assert b.unsupported_reason is not None and "cut into chunks" in b.unsupported_reason
    with pytest.raises(ModelNotSupportedError, match="kv_dtype 'auto'"):
        b.set_kv_dtype("bfloat16")


def test_a_window_the_model_never_masks_is_not_cached(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Model code that leaves its window to RotatingKVCache (asks no window mask) would
    attend past the window over a growing cache: the probe keeps mlx-lm's caches."""
    from pagedkv.model.mlx.layers import probe

    path = make_tiny_model(tmp_path_factory.mktemp("g") / "m", arch="gemma3_text", seed=3)
    model = load_mlx_model(path, "gemma").model
    assert probe(model).stored
    model.model.window_size = None  # gemma3_text's mask then has no window
    found = probe(model)
    assert not found.stored and found.state_layout is None
    assert found.kinds.unsupported is not None
    assert "sliding window of 16" in found.kinds.unsupported and found.kinds.unbatched
