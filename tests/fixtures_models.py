"""Tiny randomly initialised models for tests (filled in by the model adapter work)."""
