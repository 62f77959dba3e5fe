"""The interpreter running the tests imports this checkout's pagedkv, not another copy.

A `.venv` made for another clone (or a stale non-editable install) would test
that copy's code while the tests come from here, and every result would be about
the wrong sources.
"""

from __future__ import annotations

from pathlib import Path

import pagedkv

REPOSITORY = Path(__file__).resolve().parent.parent  # the directory holding tests/


def test_pagedkv_is_imported_from_this_checkout() -> None:
    imported = Path(pagedkv.__file__).resolve()
    assert imported.is_relative_to(REPOSITORY / "src"), (
        f"pagedkv was imported from {imported}, not from this checkout ({REPOSITORY}/src): "
        f"reinstall with `pip install -e {REPOSITORY}` in this checkout's virtualenv, "
        "or run with PYTHONPATH=src"
    )
