"""KV formats: what a stored row holds, and the adapter's use of them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedkv.model import load_model
from pagedkv.model.kv_format import kv_format


def _rows(*shape: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(*shape, generator=g) * torch.rand(*shape[:-1], 1, generator=g) * 8


@pytest.mark.parametrize(
    ("name", "width", "dtype", "rel_err"),
    [("auto", 64, torch.float32, 0.0), ("bfloat16", 64, torch.bfloat16, 4e-3),
     ("float16", 64, torch.float16, 5e-4), ("int8", 68, torch.uint8, 1e-2)],
)  # fmt: skip
def test_round_trip_error_and_size(
    name: str, width: int, dtype: torch.dtype, rel_err: float
) -> None:
    fmt = kv_format(name, torch.float32, 64)
    assert (fmt.row_width, fmt.storage_dtype) == (width, dtype)
    x = _rows(2, 3, 50, 64)
    out = torch.empty((2, 3, 50, fmt.row_width), dtype=fmt.storage_dtype)
    fmt.write(out, x)
    back = fmt.read(out, torch.float32)
    assert back.shape == x.shape and back.dtype == torch.float32
    err = float((back - x).norm() / x.norm())
    assert err <= rel_err
    if name != "auto":
        assert err > 0, "a compact format that loses nothing is not compact"


def test_int8_row_bytes_depend_on_that_row_alone() -> None:
    """Writing tokens one at a time (decode) gives the bytes a whole prefill writes:
    the scale is per row, fixed when the row is written."""
    fmt = kv_format("int8", torch.float32, 64)
    x = _rows(3, 40, 64)
    x[1, 7] = 0  # a zero row: scale 1, no NaN
    whole = torch.empty((3, 40, fmt.row_width), dtype=torch.uint8)
    fmt.write(whole, x)
    one_by_one = torch.empty_like(whole)
    for t in range(40):
        fmt.write(one_by_one[:, t : t + 1], x[:, t : t + 1])
    assert torch.equal(whole, one_by_one)
    back = fmt.read(whole, torch.float32)
    assert torch.isfinite(back).all() and bool((back[1, 7] == 0).all())
    # the largest magnitude of each row is stored exactly (up to the scale's rounding)
    torch.testing.assert_close(back.abs().amax(-1), x.abs().amax(-1), rtol=1e-6, atol=0)


def test_int8_pads_odd_head_dims_so_the_scale_stays_aligned() -> None:
    fmt = kv_format("int8", torch.float32, 18)
    assert fmt.row_width == 24 and fmt.bytes_per_row == 24
    x = _rows(2, 5, 18)
    buf = torch.full((2, 9, fmt.row_width), 255, dtype=torch.uint8)
    fmt.write(buf[:, 2:7], x)  # a strided view at an offset, like a buffer slice
    torch.testing.assert_close(fmt.read(buf[:, 2:7], torch.float32), x, rtol=0.02, atol=0.05)
    assert bool((buf[:, 2:7, 18:20] == 0).all())


def test_same_dtype_as_the_model_is_auto_and_unknown_names_are_refused() -> None:
    assert kv_format("bfloat16", torch.bfloat16, 64).name == "auto"
    assert kv_format("float16", torch.float32, 64).name == "float16"
    with pytest.raises(ValueError, match="kv_dtype must be one of"):
        kv_format("int4", torch.float32, 64)


def test_fingerprint_names_the_kv_dtype_and_auto_keeps_the_old_one(tiny_llama_dir: Path) -> None:
    adapter = load_model(tiny_llama_dir)
    before = adapter.fingerprint(8)
    seen = set()
    for name in ("bfloat16", "float16", "int8", "auto"):
        adapter.set_kv_dtype(name)
        seen.add(adapter.fingerprint(8))
        assert adapter.new_kv_buffer(4).dtype == adapter.kv_format.storage_dtype
    assert len(seen) == 4 and adapter.fingerprint(8) == before
