"""Shared fixtures; each lives in the module named after what it provides."""

from fixtures_models import *  # noqa: F403
from fixtures_redis import *  # noqa: F403
from fixtures_vision import *  # noqa: F403

import pagedkv  # noqa: F401  first: it caps oneDNN's ISA before any test's product runs


def pytest_sessionstart(session: object) -> None:
    """The MLX tests skip where mlx or mlx-lm does not import (an Intel Mac, Windows,
    an install without the `mlx` extra); under PAGEDKV_REQUIRE_MLX=1, which CI sets
    (`.ci/run`), the run stops instead: a skip there would hide that the MLX backend
    went untested."""
    import os

    if os.environ.get("PAGEDKV_REQUIRE_MLX") != "1":
        return
    try:
        import mlx.core  # noqa: F401
        import mlx_lm  # noqa: F401
    except ImportError as exc:
        import pytest

        raise pytest.UsageError(
            f"PAGEDKV_REQUIRE_MLX=1 but MLX does not import ({exc}): pip install 'pagedkv[mlx]'"
        ) from exc
