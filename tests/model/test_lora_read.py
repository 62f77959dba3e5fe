"""Reading PEFT LoRA adapters: every bad adapter is refused with a message naming what is
wrong, and the digest follows the weights and config, never the name or the path."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from fixtures_lora import base_model, make_lora
from fixtures_models import make_tiny_model
from safetensors.torch import load_file, save_file

from pagedkv.errors import AdapterError
from pagedkv.model.linear import pack_linears
from pagedkv.model.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, read_lora
from pagedkv.model.lora_layers import LoraLayers, lora_groups


@pytest.fixture(scope="module")
def adapter(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_lora(tiny_llama_dir, tmp_path_factory.mktemp("lora") / "a1", seed=1)


def read(directory: Path, base: Path, name: str = "a1", max_rank: int = 64):
    return read_lora(name, directory, base_model(base), base_names=(base.name,), max_rank=max_rank)


def copy(adapter: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(adapter, tmp_path / "copy"))


def edit_config(directory: Path, **changes: object) -> None:
    path = directory / ADAPTER_CONFIG
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def test_reads_a_peft_adapter(adapter: Path, tiny_llama_dir: Path) -> None:
    lora = read(adapter, tiny_llama_dir)
    assert lora.rank == 4 and lora.scale == 2.0
    assert sorted(lora.modules) == [
        f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("q_proj", "v_proj")
    ]
    a, b = lora.modules["model.layers.0.self_attn.v_proj"]
    assert a.shape == (4, 64) and b.shape == (32, 4) and b.abs().sum() > 0


def test_digest_is_the_content_not_the_name_or_path(
    adapter: Path, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    first = read(adapter, tiny_llama_dir)
    moved = read(copy(adapter, tmp_path), tiny_llama_dir, name="other-name")
    assert moved.digest == first.digest, "a copy under another name keeps its cache"
    other = make_lora(tiny_llama_dir, tmp_path / "a2", seed=2)
    assert read(other, tiny_llama_dir).digest != first.digest
    edit_config(tmp_path / "copy", lora_alpha=16)  # same weights, another scale
    assert read(tmp_path / "copy", tiny_llama_dir).digest != first.digest


def test_one_changed_weight_changes_the_digest(
    adapter: Path, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    changed = copy(adapter, tmp_path)
    tensors = load_file(changed / ADAPTER_WEIGHTS)
    key = sorted(tensors)[0]
    tensors[key] = tensors[key].clone()
    tensors[key][0, 0] += 1e-3
    save_file(tensors, changed / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    assert read(changed, tiny_llama_dir).digest != read(adapter, tiny_llama_dir).digest


def test_missing_directory_and_files(adapter: Path, tiny_llama_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(AdapterError, match="is not a directory"):
        read(tmp_path / "nowhere", tiny_llama_dir)
    no_weights = copy(adapter, tmp_path)
    (no_weights / ADAPTER_WEIGHTS).unlink()
    with pytest.raises(AdapterError, match=r"adapter_model\.safetensors does not exist"):
        read(no_weights, tiny_llama_dir)
    (no_weights / ADAPTER_CONFIG).unlink()
    with pytest.raises(AdapterError, match=r"adapter_config\.json does not exist"):
        read(no_weights, tiny_llama_dir)


def test_rank_above_the_limit(adapter: Path, tiny_llama_dir: Path) -> None:
    with pytest.raises(AdapterError, match=r"rank r=4 is above --max-lora-rank 2"):
        read(adapter, tiny_llama_dir, max_rank=2)


def test_target_module_that_does_not_exist(
    adapter: Path, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    bad = copy(adapter, tmp_path)
    edit_config(bad, target_modules=["q_proj", "c_attn"])
    with pytest.raises(AdapterError, match="target module 'c_attn' is not a linear layer"):
        read(bad, tiny_llama_dir)
    # weights for a layer the model does not have
    tensors = load_file(adapter / ADAPTER_WEIGHTS)
    renamed = {k.replace("layers.1.", "layers.7."): v for k, v in tensors.items()}
    save_file(renamed, bad / ADAPTER_WEIGHTS)
    edit_config(bad, target_modules=["q_proj", "v_proj"])
    with pytest.raises(AdapterError, match=r"layers\.7\.self_attn\.\w_proj' does not exist"):
        read(bad, tiny_llama_dir)


def test_adapter_for_another_base_model(
    adapter: Path, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    wider = make_tiny_model(tmp_path / "wider", arch="llama", hidden_size=128)
    other = make_lora(wider, tmp_path / "for-wider", seed=3)
    edit_config(other, base_model_name_or_path=str(tiny_llama_dir))  # names this one
    with pytest.raises(AdapterError, match="trained on another base model"):
        read(other, tiny_llama_dir)
    named = copy(adapter, tmp_path)
    edit_config(named, base_model_name_or_path="meta-llama/Llama-3.1-8B")
    with pytest.raises(AdapterError, match=r"was trained on base model 'meta-llama/Llama-3\.1-8B'"):
        read(named, tiny_llama_dir)


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("use_dora", True, "DoRA"),
        ("bias", "all", "bias is 'all'"),
        ("modules_to_save", ["lm_head"], "extra trained modules"),
        ("rank_pattern", {"q_proj": 8}, "per-layer ranks"),
        ("peft_type", "IA3", "only LORA"),
    ],
)
def test_features_not_applied_are_refused(
    adapter: Path, tiny_llama_dir: Path, tmp_path: Path, field: str, value: object, words: str
) -> None:
    bad = copy(adapter, tmp_path)
    edit_config(bad, **{field: value})
    with pytest.raises(AdapterError, match=words):
        read(bad, tiny_llama_dir)


def test_a_rows_delta_does_not_depend_on_its_group(adapter: Path, tiny_llama_dir: Path) -> None:
    """Over packed layers, a row's output is bit-identical in groups of 1 to 40 rows:
    what lets an adapter's answer in a batch equal its answer alone."""
    import copy as copying

    model = copying.deepcopy(base_model(tiny_llama_dir))
    if not pack_linears(model):
        pytest.skip("torch has no oneDNN here")
    layers = LoraLayers(model)
    lora = read(adapter, tiny_llama_dir)
    layers.install(layers.prepare(lora))
    q = dict(model.named_modules())["model.layers.0.self_attn.q_proj"]
    x = torch.randn(1, 40, 64, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        with layers.route(lora_groups([lora], [0], [1], torch.device("cpu"))):
            alone = q(x[:, :1])[0, 0]
        for n in range(2, 41):
            with layers.route(lora_groups([lora], [0], [n], torch.device("cpu"))):
                assert torch.equal(q(x[:, :n])[0, 0], alone), n
        base = q(x[:, :1])[0, 0]
    assert not torch.equal(base, alone), "the adapter changed the output"


def test_chunks_are_ordered_by_adapter_and_logits_put_back() -> None:
    from pagedkv.model.lora_layers import adapter_order, unpermute_wanted

    a, b = object(), object()
    loras: list[Any] = [None, a, b, a, None, b]
    order = adapter_order(loras)
    assert order == [0, 4, 1, 3, 2, 5]
    assert adapter_order([None, a, a, b]) is None and adapter_order([None, None]) is None
    wanted_original = [True, False, True, True, True, False]
    wanted = [wanted_original[i] for i in order]
    computed = [i for i in order if wanted_original[i]]  # chunk ids, in computed order
    rows = unpermute_wanted(order, wanted)
    assert [computed[r] for r in rows] == [i for i, w in enumerate(wanted_original) if w]
