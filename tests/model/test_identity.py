"""What the namespace leaves out: the tokenizer, the chat template and the generation
settings (pagedkv hashes token ids, so they cannot change a block's KV); what it keeps
of a config (everything else, sub-configs' fields included)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from pagedkv.cache.identity import NAMESPACE_FIELDS
from pagedkv.model import load_model
from pagedkv.model.fingerprint import NOT_IN_FORWARD, canonical_config, config_identity


def _edit_json(path: Path, **changes: Any) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def test_tokenizer_template_and_generation_settings_keep_the_namespace(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    base = load_model(tiny_llama_dir, device="cpu")
    copy = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, copy)
    (copy / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    _edit_json(copy / "tokenizer_config.json", model_max_length=128)
    _edit_json(copy / "config.json", eos_token_id=[2, 3], pad_token_id=5, bos_token_id=4)
    _edit_json(copy / "generation_config.json", eos_token_id=[2, 3], temperature=0.3)
    edited = load_model(copy, device="cpu")
    assert edited.tokenizer.chat_template != base.tokenizer.chat_template
    assert edited.tokenizer.model_max_length == 128 and edited.config.eos_token_id == [2, 3]
    assert edited.identity(16) == base.identity(16)
    assert edited.fingerprint(16) == base.fingerprint(16)


def test_every_namespace_field_is_reported(tiny_llama_dir: Path) -> None:
    fields = load_model(tiny_llama_dir, device="cpu").identity(16)
    assert tuple(fields) == NAMESPACE_FIELDS
    assert fields["backend"] == "torch" and fields["layout"] == "2"
    assert fields["block_size"] == "16" and fields["mode"] == "grouped"
    config = json.loads(fields["config"])
    assert config["rope_parameters"] == {"rope_theta": 10000.0, "rope_type": "default"}
    assert config["rms_norm_eps"] == 1e-05 and "eos_token_id" not in config


class _Config(SimpleNamespace):
    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))


def test_sub_configs_drop_their_own_tokenizer_fields_and_other_dicts_keep_all() -> None:
    config = _Config(
        model_type="outer",
        eos_token_id=1,
        _sliding_window_pattern=4,  # private, yet read by some models' layer setup
        text_config={"model_type": "inner", "eos_token_id": 1, "rms_norm_eps": 1e-6},
        rope_parameters={"rope_type": "yarn", "temperature": 0.1},  # not a sampling field
    )
    assert config_identity(config) == {
        "model_type": "outer",
        "_sliding_window_pattern": 4,
        "text_config": {"model_type": "inner", "rms_norm_eps": 1e-6},
        "rope_parameters": {"rope_type": "yarn", "temperature": 0.1},
    }
    assert " " not in canonical_config(config)
    assert {"eos_token_id", "chat_template", "_name_or_path", "temperature"} <= set(NOT_IN_FORWARD)
