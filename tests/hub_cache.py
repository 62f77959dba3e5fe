"""A fake local Hugging Face cache, laid out as huggingface_hub lays out its own."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def add_to_hub_cache(cache: Path, repo_id: str, model_dir: Path, commit: str = COMMIT) -> Path:
    """Put `model_dir`'s files in `cache` as `hf download repo_id` would (blobs named by
    content, a snapshot of relative links to them, refs/main naming the commit); returns
    the snapshot directory."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True)
    for f in sorted(model_dir.iterdir()):
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot
