"""How many characters of input one token can cover at most, so that a text far
longer than the context is refused before the tokenizer runs.

Tokenizing costs time and memory in proportion to the text (a 2-million
character prompt: about a second of CPU and 50-300 MiB of tokenizer objects),
and the server tokenizes every prompt before it can compare it with the
model's context. A prompt of `n` characters needs at least `n / M` tokens when
no token covers more than `M` characters of input, so past `M * context`
characters the answer is known without tokenizing.

`M` is only trusted where it is provable from the tokenizer's own description
(its `tokenizer.json`), and is None otherwise, and then nothing is refused
early:
- the model is BPE, with byte-level pre-tokenizing or byte fallback, and no
  fused unknown token: every input character becomes at least one byte of some
  token, so a token covers at most as many characters as its string has
  (`Ġthe`, `▁the`, `<0x41>` each cover at most their length); added tokens cover
  their own content. Rejected: Unigram and WordPiece, whose unknown token can
  stand for a whole word;
- the normalizer and the pre-tokenizer delete nothing: NFC and NFKC compose at
  most 4 code points into 1 (Greek with three marks), so `M` is multiplied by 4
  when one is present; Lowercase, Prepend, NFD, NFKD and single-character
  replacements by non-empty text never shorten the text; a pre-tokenizer that
  removes what it splits on (BERT's Whitespace), Strip, StripAccents or any
  other normalizer makes the bound unknown.
"""

from __future__ import annotations

import json
import math
from typing import Any

NFC_SHRINK = 4  # code points NFC / NFKC may compose into one
_KEEPING = frozenset({"Lowercase", "Prepend", "NFD", "NFKD"})
_COMPOSING = frozenset({"NFC", "NFKC"})
_PRE_KEEPING = frozenset({"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts"})


def max_chars_per_token(tokenizer: Any) -> int | None:
    """The most input characters one token of `tokenizer` (a transformers fast
    tokenizer) can cover, or None when that is not provable (see the module doc)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        spec = json.loads(backend.to_str())
    except (ValueError, TypeError, AttributeError):
        return None
    model = spec.get("model") or {}
    pre = spec.get("pre_tokenizer")
    byte_level = _has_type(pre, "ByteLevel")
    if model.get("type") != "BPE" or model.get("fuse_unk"):
        return None
    if not (byte_level or model.get("byte_fallback")):
        return None
    shrink = _normalizer_shrink(spec.get("normalizer"))
    if shrink is None or not _pre_keeps(pre):
        return None
    vocab = model.get("vocab") or {}
    longest = max((len(token) for token in vocab), default=1)
    added = [len(a.get("content", "")) for a in spec.get("added_tokens") or []]
    return max(longest, *added, 1) * shrink


def fewest_tokens(num_chars: int, max_chars: int) -> int:
    """The fewest tokens `num_chars` characters can make, for `max_chars` per token."""
    return math.ceil(num_chars / max_chars)


def _normalizer_shrink(spec: Any) -> int | None:
    """1 when the normalizer never shortens a text, NFC_SHRINK when it may compose,
    None when it may delete."""
    if spec is None:
        return 1
    kind = spec.get("type")
    if kind == "Sequence":
        shrink = 1
        for inner in spec.get("normalizers") or []:
            one = _normalizer_shrink(inner)
            if one is None:
                return None
            shrink *= one
        return shrink
    if kind in _KEEPING:
        return 1
    if kind in _COMPOSING:
        return NFC_SHRINK
    if kind == "Replace":
        pattern = spec.get("pattern") or {}
        literal = pattern.get("String")
        if isinstance(literal, str) and len(literal) == 1 and spec.get("content"):
            return 1
    return None


def _pre_keeps(spec: Any) -> bool:
    """Whether the pre-tokenizer keeps every character (splits without removing)."""
    if spec is None:
        return True
    kind = spec.get("type")
    if kind == "Sequence":
        return all(_pre_keeps(inner) for inner in spec.get("pretokenizers") or [])
    if kind == "Split":
        return spec.get("behavior") != "Removed"
    return kind in _PRE_KEEPING


def _has_type(spec: Any, kind: str) -> bool:
    if spec is None:
        return False
    if spec.get("type") == kind:
        return True
    return any(_has_type(inner, kind) for inner in spec.get("pretokenizers") or [])
