"""The OpenAI-compatible HTTP server."""

from .app import create_app
from .serve import run_server

__all__ = ["create_app", "run_server"]
