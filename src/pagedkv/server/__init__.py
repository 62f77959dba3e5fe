"""The OpenAI-compatible HTTP server."""

from pagedkv.server.app import create_app
from pagedkv.server.serve import run_server

__all__ = ["create_app", "run_server"]
