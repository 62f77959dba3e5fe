"""Upgrading to identity v2: the SSD and Redis blocks an engine wrote under the format-1
namespace are misses for the new engine, never errors or reuses, and `cache stats`
still names the model of both namespaces."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import redis as redis_py
from engine_helpers import BS, GREEDY, random_prompt, reference_outputs

from pagedkv import CacheConfig, Engine
from pagedkv.model.fingerprint import weights_digest
from pagedkv.model.hf import KV_LAYOUT_VERSION, ModelAdapter
from pagedkv.storage.ssd import cache_stats

_FORMAT1_DROPPED = {"name_or_path", "transformers_version", "dtype", "torch_dtype", "use_cache",
                    "output_attentions", "output_hidden_states", "return_dict",
                    "attn_implementation"}  # fmt: skip


def _format1_config(value: Any) -> Any:
    if isinstance(value, dict):
        return {
            k: _format1_config(v)
            for k, v in value.items()
            if not k.startswith("_") and k not in _FORMAT1_DROPPED
        }
    if isinstance(value, list):
        return [_format1_config(v) for v in value]
    return value


def format1_fingerprint(adapter: ModelAdapter, block_size: int, deterministic: bool = False) -> str:
    """`ModelAdapter.fingerprint` as pagedkv computed it before identity v2."""
    config = json.loads(json.dumps(adapter.config.to_dict(), sort_keys=True, default=str))
    identity = json.dumps(
        {
            "config": _format1_config(config),
            "weights": weights_digest(adapter.model, adapter.model_dir),
            "dtype": str(adapter.dtype).removeprefix("torch."),
            "kv_layout": KV_LAYOUT_VERSION,
            "linear": adapter.linear_kernel,
        },
        sort_keys=True,
    )
    return hashlib.sha256(f"{identity}|block_size={block_size}".encode()).hexdigest()[:32]


def _redis_namespaces(url: str) -> set[str]:
    client = redis_py.Redis.from_url(url)
    return {key.decode().split(":")[1] for key in client.scan_iter(match="pagedkv:*")}


def test_blocks_of_the_format1_namespace_are_misses_and_stats_name_both(
    tiny_llama_dir: Path, tmp_path: Path, redis_url: str, monkeypatch: Any
) -> None:
    ssd = tmp_path / "kv"
    cfg = CacheConfig(
        block_size=BS, ssd_cache_dir=ssd, ssd_cache_bytes=64 * 2**20, redis_url=redis_url
    )
    prompt = random_prompt(7, 40)
    want = reference_outputs(tiny_llama_dir, [prompt])[0]
    with monkeypatch.context() as mp:
        mp.setattr(ModelAdapter, "fingerprint", format1_fingerprint)
        with Engine.from_pretrained(str(tiny_llama_dir), config=cfg) as old:
            assert old.generate(prompt, GREEDY).token_ids == want
            assert old.prefix is not None
            old.prefix.lower.flush(10.0)
            old_ns = old.prefix.namespace
    assert cache_stats(ssd).namespaces[old_ns].num_blocks > 0
    assert old_ns in _redis_namespaces(redis_url)

    with Engine.from_pretrained(str(tiny_llama_dir), config=cfg) as new:
        assert new.prefix is not None
        new_ns = new.prefix.namespace
        assert new_ns != old_ns
        first = new.generate(prompt, GREEDY)
        assert first.token_ids == want
        assert first.cached_tokens == 0 and not first.tier_hits
        new.prefix.lower.flush(10.0)
    with Engine.from_pretrained(str(tiny_llama_dir), config=cfg) as again:
        second = again.generate(prompt, GREEDY)  # the new namespace is warm after a restart
        assert second.token_ids == want and second.cached_tokens == len(prompt) - 1

    stats = cache_stats(ssd)
    assert stats.namespaces[old_ns].num_blocks > 0 and stats.namespaces[new_ns].num_blocks > 0
    for ns in (old_ns, new_ns):
        info = stats.descriptions[ns]
        assert info is not None and info.model == tiny_llama_dir.name
    assert {old_ns, new_ns} <= _redis_namespaces(redis_url)
