"""Tiny randomly initialised Hugging Face models, built in the test run (no network).

`make_tiny_model(path, arch="llama", seed=0, **config_overrides)` writes a
2-layer, hidden-64, 4-head / 2-KV-head (GQA) float32 causal LM with a
byte-level BPE tokenizer (~500 tokens, trained in milliseconds on the text
below), a ChatML chat template and a generation config to `path`.

The random weights are scaled up from transformers' default init (std 0.02
gives near-uniform logits, so greedy decoding repeats one token and nearly
tied logits would let float32 rounding flip it). With unit-scale embeddings
and 1/sqrt(fan_in) projections the logits have a spread of ~4: greedy
decoding yields varied tokens (30+ distinct in 40) and a near-tie that
float32 rounding could flip (gap below ~1e-5) is a ~1e-5 event per token.

Flavours: `llama` (tokenizer adds a BOS, like Llama), `qwen2` (no BOS, like
Qwen), `qwen3` (no BOS, q/k norms), `mistral` (no sliding window unless
overridden), and the other entries of `_ARCH_DEFAULTS`.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest

__all__ = [
    "REASONING_CHAT_TEMPLATE",
    "TINY_CHAT_TEMPLATE",
    "TOOLS_CHAT_TEMPLATE",
    "make_tiny_model",
    "make_tiny_tokenizer",
    "tiny_llama_dir",
    "tiny_qwen2_dir",
    "tiny_reasoning_dir",
    "tiny_sliding_dir",
]

TINY_VOCAB_SIZE = 512
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

TINY_CHAT_TEMPLATE = (
    "{{ bos_token if bos_token and add_bos else '' }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# A Hermes-style template written for the tests: tool definitions in the system turn,
# earlier calls as <tool_call> elements, tool results as their own turns.
TOOLS_CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>"
    "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n"
    'Call a tool with <tool_call>{"name": ..., "arguments": {...}}</tool_call><|im_end|>\n'
    "{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') }}"
    "{% for call in message.get('tool_calls', []) %}"
    "{{ '<tool_call>' + (call['function'] | tojson) + '</tool_call>' }}{% endfor %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Strips reasoning from earlier assistant turns the way Qwen3's template does (ours).
from pagedkv.bench.reasoning_template import REASONING_CHAT_TEMPLATE  # noqa: E402

_CORPUS = """\
A cache keeps the answers to questions that were asked before, so that asking
again costs almost nothing. Large language models read a prompt token by token
and compute keys and values for every layer; the second time the same prefix
arrives, those keys and values can be read back instead of computed again.
Blocks of sixty-four tokens are hashed together with the hash of the block in
front of them, so one hash names the whole prefix up to its end. The pool keeps
blocks in memory, the disk keeps them after a restart, and a shared server lets
several machines reuse each other's work. System prompts, long documents, chat
histories and agent transcripts all begin with text that was seen before.
The quick brown fox jumps over the lazy dog; pack my box with five dozen liquor
jugs. Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 64 128 256 512 1024 2048 4096 8192.
Punctuation: ( ) [ ] { } < > , . ; : ! ? - _ + = * / \\ | @ # $ % ^ & ~ ` ' ".
def hello(name):\n    return f"hello, {name}!"\n\nfor i in range(10):\n    print(i)
Once upon a time there was a small model that wrote haiku about caches:
memory of words / the same beginning returns / already computed.
Caf\u00e9, na\u00efve, \u00fcber, \u00e5ngstr\u00f6m, \u65e5\u672c\u8a9e, emoji \U0001f600.
"""


@functools.cache
def _tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    return str(tok.to_str())


def make_tiny_tokenizer(add_bos: bool = False, chat_template: str | None = None) -> Any:
    """A PreTrainedTokenizerFast over a byte-level BPE (any text encodes, nothing is UNK).

    `add_bos=True` makes plain-text encoding start with `<|endoftext|>` as BOS,
    like Llama tokenizers; the chat template then starts with it too.
    """
    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer.from_str(_tokenizer_json())
    bos = SPECIAL_TOKENS[0]
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A",
            pair=f"{bos} $A $B",
            special_tokens=[(bos, tok.token_to_id(bos))],
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    template = (chat_template or TINY_CHAT_TEMPLATE).replace(
        "add_bos", "true" if add_bos else "false"
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token="<|im_end|>",
        pad_token=bos,
        unk_token=None,
        chat_template=template,
        model_max_length=4096,
    )


_ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {},
    "qwen2": {"use_sliding_window": False},
    "mistral": {"sliding_window": None},
    # q/k norms, no biases, an explicit head_dim
    "qwen3": {"head_dim": 16, "use_sliding_window": False},
    # sliding / global alternation: 3 layers sliding, the 4th global
    "gemma3_text": {"num_hidden_layers": 4, "sliding_window_pattern": 4, "head_dim": 16,
                    "query_pre_attn_scalar": 16, "sliding_window": 16},
    # sliding / global alternation with attention-logit and final-logit soft-capping
    "gemma2": {"num_hidden_layers": 2, "head_dim": 16, "query_pre_attn_scalar": 16,
               "sliding_window": 16, "attn_logit_softcapping": 50.0,
               "final_logit_softcapping": 30.0},
    # alternation with attention sinks and a tiny MoE
    "gpt_oss": {"num_hidden_layers": 2, "head_dim": 16, "sliding_window": 16,
                "num_local_experts": 4, "num_experts_per_tok": 2},
    # short convolutions, attention in layer 1
    "lfm2": {"num_hidden_layers": 3, "layer_types": ["conv", "full_attention", "conv"],
             "conv_L_cache": 3},
    # gated delta rule linear attention, attention in layer 2, a tiny MoE
    "qwen3_next": {"num_hidden_layers": 3, "head_dim": 16, "layer_types":
                   ["linear_attention", "linear_attention", "full_attention"],
                   "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                   "linear_key_head_dim": 16, "linear_value_head_dim": 16,
                   "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                   "shared_expert_intermediate_size": 32},
    # attention and a Mamba-2 mixer side by side in every layer: not cacheable yet
    "falcon_h1": {"num_hidden_layers": 2, "head_dim": 16, "mamba_d_ssm": 64,
                  "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_state": 8,
                  "mamba_chunk_size": 8, "mamba_expand": 1},
}  # fmt: skip


def _config(arch: str, vocab_size: int, bos: int, eos: int, **overrides: Any) -> Any:
    from transformers import AutoConfig

    if arch not in _ARCH_DEFAULTS:
        raise ValueError(f"arch must be one of {sorted(_ARCH_DEFAULTS)}, got {arch!r}")
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=bos,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
    )
    kwargs.update(_ARCH_DEFAULTS[arch])
    kwargs.update(overrides)
    return AutoConfig.for_model(arch, **kwargs)


def _scale_init(model: Any, seed: int) -> None:
    """Re-draw weights at scales that give well separated logits (see module doc).

    Measured on these models: chunked-with-cache vs one-shot forward differ by
    at most ~1e-5 in any logit, while top-2 gaps below 1e-2 occur at ~1% of
    positions. Projection std 1/sqrt(fan_in) was chosen over 1.5-2.5 (more
    varied text but 2-8x more float32 noise) and 0.5 (repetitive text).
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if param.dim() < 2:
                if name.endswith("bias"):
                    param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
                continue  # norm weights stay at 1
            fan_in = param.shape[1]
            if "embed_tokens" in name:
                std = 1.0
            elif "lm_head" in name:
                std = 4.0 / fan_in**0.5
            else:
                std = 1.0 / fan_in**0.5
            param.copy_(torch.randn(param.shape, generator=gen) * std)


def make_tiny_model(
    path: str | Path,
    arch: str = "llama",
    seed: int = 0,
    chat_template: str | None = None,
    **overrides: Any,
) -> Path:
    """Write a tiny random model with tokenizer to `path` and return it.

    `overrides` go into the transformers config (e.g. `num_hidden_layers=3`,
    `sliding_window=16`, `max_position_embeddings=256`). The same arguments
    always produce byte-identical weights.
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tiny_tokenizer(add_bos=(arch == "llama"), chat_template=chat_template)
    bos = tokenizer.convert_tokens_to_ids(SPECIAL_TOKENS[0])
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = _config(arch, len(tokenizer), bos, eos, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _scale_init(model, seed)
    model.generation_config = GenerationConfig(bos_token_id=bos, eos_token_id=eos, pad_token_id=bos)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama (GQA, float32) whose tokenizer adds a BOS."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama") / "model", arch="llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2 (GQA, float32, q/k/v biases) whose tokenizer adds no BOS."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2") / "model", arch="qwen2", seed=1)


@pytest.fixture(scope="session")
def tiny_sliding_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Mistral with an active 16-token sliding window: prefix caching must be off."""
    return make_tiny_model(
        tmp_path_factory.mktemp("tiny-sliding") / "model",
        arch="mistral",
        seed=2,
        sliding_window=16,
    )


@pytest.fixture(scope="session")
def tiny_reasoning_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2 whose chat template strips earlier turns' reasoning, Qwen3-style."""
    path = tmp_path_factory.mktemp("tiny-reasoning") / "model"
    return make_tiny_model(path, arch="qwen2", seed=1, chat_template=REASONING_CHAT_TEMPLATE)
