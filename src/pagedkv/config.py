"""Cache configuration and size parsing."""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import psutil

GiB = 1024**3

# How KV is held in the live buffers, RAM and every tier (see `model.kv_format`).
KV_DTYPES = ("auto", "bfloat16", "float16", "int8")
# `--dtype`: the model's weights and activations; int8 is int8 weights with float32
# activations and KV (`model.linear.quantize_linears`), int4 4-bit weights in groups
# of 32 with bfloat16 activations and KV (`model.int4.quantize_linears_int4`), CPU only.
DTYPES = ("auto", "float32", "bfloat16", "float16", "int8", "int4")
# What computes the model (`--backend`, `model.choose`).
BACKENDS = ("auto", "torch", "mlx")

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "kib": 1024, "ki": 1024,
    "m": 1000**2, "mb": 1000**2, "mib": 1024**2, "mi": 1024**2,
    "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "gi": 1024**3,
    "t": 1000**4, "tb": 1000**4, "tib": 1024**4, "ti": 1024**4,
}  # fmt: skip


def parse_size(text: str | int) -> int:
    """Parse `512MB`, `4GiB`, `1.5G` or a plain byte count into bytes."""
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size must be >= 0, got {text}")
        return text
    match = _SIZE_RE.match(text)
    unit = (match.group(2) or "").lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"cannot read size {text!r}: use a number with a unit like 512MB or 4GiB")
    return int(float(match.group(1)) * _UNITS[unit])


def default_ram_cache_bytes() -> int:
    """A quarter of the memory available now, at most 8 GiB."""
    return int(min(psutil.virtual_memory().available * 0.25, 8 * GiB))


def default_kv_budget_bytes() -> int:
    """KV of running requests: a fifth of the memory available now, at most 4 GiB. With
    the RAM tier's default (a quarter, at most 8 GiB) that leaves over half the
    memory for the model, its activations and everything else."""
    return int(min(psutil.virtual_memory().available * 0.20, 4 * GiB))


def cache_home() -> Path:
    """Root of pagedkv's user cache: $PAGEDKV_CACHE_HOME, else $XDG_CACHE_HOME/pagedkv,
    else ~/.cache/pagedkv. Tests point PAGEDKV_CACHE_HOME at a temporary directory."""
    explicit = os.environ.get("PAGEDKV_CACHE_HOME")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "pagedkv"
    return Path.home() / ".cache" / "pagedkv"


def default_ssd_cache_dir() -> Path:
    """Where the CLI keeps the SSD tier unless told otherwise: <cache home>/kv."""
    return cache_home() / "kv"


def default_ssd_cache_bytes(directory: Path) -> int:
    """min(20 GiB, 10% of the free space on the disk holding `directory`)."""
    probe = directory
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return int(min(20 * GiB, shutil.disk_usage(probe).free * 0.10))


# What `--vision-cache-bytes` defaults to: a few hundred images of a 7B LLaVA
# (576 encoder rows of 4096 float32s, 9 MiB each).
DEFAULT_VISION_CACHE_BYTES = 256 * 2**20


@dataclass
class CacheConfig:
    """How the prefix cache is laid out and where its tiers live, and how much memory the
    KV of running requests may take (`kv_budget_bytes`; a request is admitted when its
    KV fits, and the newest is preempted when decoding outgrows it).

    The library writes nothing to disk unless `ssd_cache_dir` is given; the CLI
    turns the SSD tier on by default.
    """

    block_size: int = 64
    ram_cache_bytes: int | None = None  # None: default_ram_cache_bytes()
    kv_budget_bytes: int | None = None  # running requests' KV; None: default_kv_budget_bytes()
    ssd_cache_dir: str | Path | None = None
    ssd_cache_bytes: int | None = None  # None: default_ssd_cache_bytes(dir)
    ssd_namespace_quota_bytes: int | None = None
    ssd_write_buffer_bytes: int = 256 * 1024**2
    redis_url: str | None = None
    redis_cluster: bool = False  # redis_url names a node of a Redis Cluster
    hash_algorithm: str = "xxh3_128"
    hash_seed: bytes | str | None = None
    # Authenticates stored blocks on SSD and Redis (see `storage.secret`); None: the
    # file `cache_secret_file`, else $PAGEDKV_CACHE_SECRET, else no secret.
    cache_secret: bytes | str | None = None
    cache_secret_file: str | Path | None = None
    enable_prefix_caching: bool = True
    # Models with recurrent layers: snapshot the state every this many blocks.
    snapshot_interval_blocks: int = 1
    kv_dtype: str = "auto"  # one of KV_DTYPES; part of the namespace
    # What computes the model (`model.choose`): "auto", "torch" or "mlx"; the backend is
    # part of the namespace, so torch and MLX KV never mix in a tier.
    backend: str = "auto"
    # Compile the decode step (`model.compiled`, the torch backend): the first start builds
    # a package (10-30 s for the bundled model on 2 cores) that later starts load from disk.
    compile_decode: bool = False
    # Store each finished turn in the next prompt's form too when the chat template strips
    # reasoning: "auto" (a render test decides), "on", "off" (`engine.reasoning`).
    reasoning_cache: str = "auto"
    # At most this fraction of each tier may be held by leases (`cache.leases`).
    max_leased_fraction: float = 0.5
    # A VLM's image encoder rows kept in RAM by image key (`model.vision_cache`); 0: none.
    vision_cache_bytes: int = DEFAULT_VISION_CACHE_BYTES

    def __post_init__(self) -> None:
        bs = self.block_size
        if not isinstance(bs, int) or bs < 1 or bs > 1024 or bs & (bs - 1):
            raise ValueError(f"block_size must be a power of two from 1 to 1024, got {bs!r}")
        k = self.snapshot_interval_blocks
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"snapshot_interval_blocks must be an integer >= 1, got {k!r}")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(
                f"kv_dtype must be one of {', '.join(KV_DTYPES)}; got {self.kv_dtype!r}"
            )
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}; got {self.backend!r}")
        if self.reasoning_cache not in ("auto", "on", "off"):
            raise ValueError(
                f"reasoning_cache must be 'auto', 'on' or 'off'; got {self.reasoning_cache!r}"
            )
        f = self.max_leased_fraction
        if isinstance(f, bool) or not isinstance(f, int | float) or not 0.0 <= f <= 1.0:
            raise ValueError(f"max_leased_fraction must be a number from 0 to 1, got {f!r}")
        if self.redis_cluster and not self.redis_url:
            raise ValueError(
                "redis_cluster needs redis_url: the URL of any node of the cluster "
                "(--redis-url redis://host:port/0 with --redis-cluster)"
            )
        if self.hash_algorithm not in ("xxh3_128", "sha256"):
            raise ValueError(
                f"hash_algorithm must be 'xxh3_128' or 'sha256', got {self.hash_algorithm!r}"
            )
        for name in (
            "ram_cache_bytes",
            "kv_budget_bytes",
            "ssd_cache_bytes",
            "ssd_namespace_quota_bytes",
            "vision_cache_bytes",
        ):
            value = getattr(self, name)
            if isinstance(value, str):
                setattr(self, name, parse_size(value))
        v = self.vision_cache_bytes
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"vision_cache_bytes must be a size >= 0, got {v!r}")
        if self.ssd_cache_dir is not None:
            self.ssd_cache_dir = Path(self.ssd_cache_dir).expanduser()
