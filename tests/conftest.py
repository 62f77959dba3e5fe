"""Shared fixtures; each lives in the module named after what it provides."""

from fixtures_models import *  # noqa: F403
from fixtures_redis import *  # noqa: F403
