"""Shared fixtures; each lives in the module named after what it provides."""

from fixtures_models import *  # noqa: F403
from fixtures_redis import *  # noqa: F403
from fixtures_vision import *  # noqa: F403

import pagedkv  # noqa: F401  first: it caps oneDNN's ISA before any test's product runs
