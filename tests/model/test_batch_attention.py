"""The ragged batch's attention: decode rows attended in one call agree with each
sequence attended alone, and the cases that must not group do not."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import pagedkv.model.batch as batch
from pagedkv.model import ModelAdapter, load_model
from pagedkv.model.batch import DeterministicRows, SeqChunk, linear_layers


@pytest.fixture(scope="module")
def llama(tiny_llama_dir: Path) -> ModelAdapter:
    return load_model(tiny_llama_dir)


def _decoding(adapter: ModelAdapter, lengths: list[int]) -> list[SeqChunk]:
    """One decode chunk per length, after a prefill of that many tokens."""
    gen = torch.Generator().manual_seed(0)
    chunks = []
    for i, n in enumerate(lengths):
        kv = adapter.new_kv_buffer(max(lengths) + 8)
        prompt = torch.randint(3, 200, (n,), generator=gen).tolist()
        adapter.forward_batch([SeqChunk(kv, 0, prompt, True)])
        chunks.append(SeqChunk(kv, n, [5 + i], True))
    return chunks


def _grouped_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the calls of `_attend_together` (one per layer when decode rows group)."""
    calls = [0]
    real = batch._attend_together

    def counting(*args: object, **kwargs: object) -> None:
        calls[0] += 1
        real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(batch, "_attend_together", counting)
    return calls


def test_decode_rows_attended_together_match_each_alone(
    llama: ModelAdapter, monkeypatch: pytest.MonkeyPatch
) -> None:
    chunks = _decoding(llama, [9, 17, 30, 12, 25])
    alone = torch.cat([llama.forward_batch([c]) for c in chunks])
    calls = _grouped_calls(monkeypatch)
    together = llama.forward_batch(chunks)
    assert calls[0] == llama.num_kv_layers  # one grouped call per layer
    assert (together - alone).abs().max().item() < 1e-4
    assert torch.equal(together.argmax(-1), alone.argmax(-1))


def test_a_prefill_among_decode_rows_keeps_both_right(
    llama: ModelAdapter, monkeypatch: pytest.MonkeyPatch
) -> None:
    decoding = _decoding(llama, [11, 20, 14])
    alone = torch.cat([llama.forward_batch([c]) for c in decoding])
    fresh = SeqChunk(llama.new_kv_buffer(64), 0, list(range(40, 70)), True)
    fresh_alone = llama.forward_batch([SeqChunk(llama.new_kv_buffer(64), 0, fresh.token_ids, True)])
    calls = _grouped_calls(monkeypatch)
    mixed = llama.forward_batch([decoding[0], fresh, *decoding[1:]])
    assert calls[0] == llama.num_kv_layers
    decode_rows = torch.cat([mixed[:1], mixed[2:]])
    assert (decode_rows - alone).abs().max().item() < 1e-4
    assert (mixed[1] - fresh_alone[0]).abs().max().item() < 1e-4
    assert torch.equal(mixed[1].argmax(), fresh_alone[0].argmax())


def test_deterministic_batches_and_long_rows_attend_one_by_one(
    llama: ModelAdapter, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _grouped_calls(monkeypatch)
    chunks = _decoding(llama, [9, 17, 30])
    pad = DeterministicRows(linear_layers(llama.model))
    alone = [llama.forward_batch([c], pad, group_decode=False) for c in chunks]
    together = llama.forward_batch(chunks, pad, group_decode=False)
    assert calls[0] == 0
    assert torch.equal(together, torch.cat(alone))  # each row as it is alone, bit for bit

    # Past the grouping limit a padded copy costs more than it saves.
    long = _decoding(llama, [batch._GROUP_MAX_KEYS + 1, 20])
    llama.forward_batch(long)
    assert calls[0] == 0
    # So do rows whose lengths differ so much that padding would double the work.
    uneven = _decoding(llama, [4, 4, 4, 200])
    llama.forward_batch(uneven)
    assert calls[0] == 0
