"""Grammar-constrained decoding: the output forced into a JSON schema or a grammar.

A request's `SamplingParams.response_format` is a `ResponseFormat` (a grammar in
llguidance's form). The engine compiles it once per request against the model's
tokenizer (`GrammarCompiler`, one per engine) when the request is submitted, so
a schema that cannot be compiled is refused before anything runs
(`GrammarError`, a `ValueError`: the server answers 400). Each sample then
carries its own `TokenConstraint`, a matcher copied from the request's compiled
one: it follows the sample's generated tokens only, so preemption, a cache
restore or a fork of `n` samples never disturb it (a fork starts a fresh copy,
which is at the fork point: samples fork before their first token).

Per token, the mask of allowed tokens is computed right after the previous
token is accepted (in the same call, so the next step's sample finds it ready)
and applied to the logits before sampling; end-of-sequence tokens are allowed
only where the grammar accepts, and are the only tokens allowed once it is
complete. Library choice, by measurement (`benchmarks/bench_grammar.py masks`,
docs/benchmarks.md): llguidance compiles a schema in ~1 ms against xgrammar's
10-20 ms and outlines-core's 70-700 ms, and its masks take microseconds, so it
has the lowest cost per request. Rejected: computing masks on a helper thread
during the forward; a mask takes ~10 us against a step's tens of milliseconds,
and a second busy thread competes with the forward's OpenMP threads.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

# JSON as models write it (`json.dumps`' separators) and no free whitespace: a model
# allowed any whitespace can pad forever, and JSON objects' own grammar stays unchanged.
JSON_OPTIONS: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


class GrammarError(ValueError):
    """A response format that cannot be compiled; the message names the problem."""


# Compiling costs time in proportion to the schema, before the request's first token
# and outside the engine's queue (the hostile soak's 1.4 MB schema took seconds each,
# and tripled other keys' latency). OpenAI's structured outputs take at most 120,000
# characters of names and values; this bounds the whole schema's JSON a little above.
MAX_SCHEMA_CHARS = 131_072


def check_schema_size(text: str, what: str) -> None:
    """Refuse a schema whose JSON text is longer than MAX_SCHEMA_CHARS."""
    if len(text) > MAX_SCHEMA_CHARS:
        raise GrammarError(
            f"{what} is {len(text)} characters of JSON; this server compiles at most "
            f"{MAX_SCHEMA_CHARS}: send a smaller schema"
        )


@dataclass(frozen=True, slots=True)
class ResponseFormat:
    """What the output must match: `grammar` is llguidance's grammar text, built by
    the constructors below; `what` names it in error messages."""

    grammar: str
    what: str

    @classmethod
    def json_object(cls) -> ResponseFormat:
        """Any JSON object (OpenAI's `{"type": "json_object"}`)."""
        return cls.json_schema({"type": "object"}, what="a JSON object")

    @classmethod
    def json_schema(cls, schema: Any, what: str = "the JSON schema") -> ResponseFormat:
        if not isinstance(schema, dict | bool):
            raise GrammarError(f"{what} must be a JSON object, got {type(schema).__name__}")
        text = json.dumps(schema)
        check_schema_size(text, what)
        try:
            grammar = _llguidance().LLMatcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS)
        except (ValueError, TypeError) as exc:
            raise GrammarError(f"{what} cannot be compiled: {exc}") from exc
        return cls._checked(grammar, what)

    @classmethod
    def lark(cls, grammar: str, what: str) -> ResponseFormat:
        """A Lark grammar in llguidance's dialect (`%json {...}` embeds a schema)."""
        return cls._checked(_llguidance().LLMatcher.grammar_from_lark(grammar), what)

    @classmethod
    def _checked(cls, grammar: str, what: str) -> ResponseFormat:
        """Refused here, before any tokenizer is involved, when the grammar itself is
        wrong (an unknown type, a bad `$ref` or regex): the caller can name the field."""
        problem = _llguidance().LLMatcher.validate_grammar(grammar)
        if problem:
            raise GrammarError(f"{what} cannot be compiled: {problem}")
        return cls(grammar, what)


class CompiledGrammar:
    """A request's grammar compiled for the model's tokenizer: a matcher at the start,
    copied for each sample."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self._start = matcher
        self.vocab_size = vocab_size

    def constraint(self) -> TokenConstraint:
        return TokenConstraint(self._start.deep_copy(), self.vocab_size)


class GrammarCompiler:
    """Compiles response formats for one tokenizer. The tokenizer's llguidance form
    takes about a second to build, so it is built on first use and kept."""

    def __init__(self, hf_tokenizer: Any, eos_token_ids: Sequence[int], vocab_size: int) -> None:
        self._hf_tokenizer = hf_tokenizer
        self._eos = list(eos_token_ids)
        self.vocab_size = vocab_size
        self._tokenizer: Any = None
        self._lock = threading.Lock()

    def _llg_tokenizer(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf

                try:
                    self._tokenizer = llguidance.hf.from_tokenizer(
                        self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self._eos
                    )
                except ValueError as exc:  # a slow (Python) tokenizer
                    raise GrammarError(
                        f"structured output needs the model's fast tokenizer: {exc}"
                    ) from exc
            return self._tokenizer

    def compile(self, fmt: ResponseFormat) -> CompiledGrammar:
        llg = _llguidance()
        tokenizer = self._llg_tokenizer()
        problem = llg.LLMatcher.validate_grammar(fmt.grammar, tokenizer)
        if problem:
            raise GrammarError(f"{fmt.what} cannot be compiled: {problem}")
        matcher = llg.LLMatcher(tokenizer, fmt.grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"{fmt.what} cannot be compiled: {matcher.get_error()}")
        return CompiledGrammar(matcher, self.vocab_size)


class TokenConstraint:
    """One sample's matcher and the mask of the tokens allowed next.

    Invariant: `_mask` is the mask for the state after every accepted token; it is
    computed in `accept`, right after the token, so `apply` only reads it.
    """

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self._matcher = matcher
        self._vocab_size = vocab_size
        self._mask = np.zeros((vocab_size + 31) // 32, dtype=np.int32)
        self._fill()

    def _fill(self) -> None:
        self._matcher.unsafe_compute_mask_ptr(self._mask.ctypes.data, self._mask.nbytes)
        if self._matcher.is_error():
            raise GrammarError(f"the grammar failed: {self._matcher.get_error()}")

    def allows(self, token: int) -> bool:
        return bool((int(self._mask[token >> 5]) >> (token & 31)) & 1)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` with every token the grammar forbids at -inf (a new tensor)."""
        bits = np.unpackbits(self._mask.view(np.uint8), bitorder="little")
        allowed = torch.from_numpy(bits[: logits.shape[-1]].view(np.bool_))
        if logits.shape[-1] > allowed.shape[0]:  # logits wider than the tokenizer's view
            allowed = torch.cat((allowed, allowed.new_zeros(logits.shape[-1] - allowed.shape[0])))
        return logits.masked_fill(~allowed, float("-inf"))

    def accept(self, token: int) -> None:
        if not self._matcher.consume_token(token):
            raise GrammarError(
                f"token {token} broke the grammar: {self._matcher.get_error() or 'not allowed'}"
            )
        self._fill()

    @property
    def is_accepting(self) -> bool:
        return bool(self._matcher.is_accepting())


def _llguidance() -> Any:
    import llguidance

    return llguidance
