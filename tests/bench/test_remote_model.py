"""`served_model`: which listed model id `pagedkv bench --url` sends."""

from __future__ import annotations

from pathlib import Path

from pagedkv.bench.remote import served_model


def test_the_asked_id_when_listed() -> None:
    assert served_model(["other/model", "mine"], "mine") == "mine"


def test_a_directory_by_its_resolved_path(tmp_path: Path) -> None:
    # mlx_lm.server lists the mlx models of the Hugging Face cache first, then its
    # --model directory by resolved path; the first id would load another model.
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    unresolved = str(tmp_path / "." / "model")
    ids = ["mlx-community/Other-4bit", str(model_dir.resolve())]
    assert served_model(ids, unresolved) == str(model_dir.resolve())


def test_the_first_listed_when_the_asked_is_not() -> None:
    # pagedkv serve lists the model under its short name while --model is a path
    assert served_model(["smollm2-135m"], "/no/such/dir") == "smollm2-135m"
