"""The MLX backend (`model.mlx.backend`): mlx-lm models on Apple Silicon, and on Linux
through mlx-cpu. Importing this package imports MLX; `model.mlx_available` asks
whether it can be imported without doing so."""

from pagedkv.model.mlx.backend import MlxBackend, load_mlx_model
from pagedkv.model.mlx.seq_kv import MlxSeqKV

__all__ = ["MlxBackend", "MlxSeqKV", "load_mlx_model"]
