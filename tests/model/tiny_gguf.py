"""A tiny llama GGUF written with the `gguf` package from a tiny Hugging Face model.

`write_tiny_gguf(model_dir, path)` stores the model's float32 tensors under
llama.cpp's names, with Q and K rows in llama.cpp's rotary order (transformers
undoes that order when it reads a llama GGUF), and its byte-level BPE tokenizer
as `tokenizer.ggml.*` metadata. Loaded back through transformers' GGUF support
it computes what the directory model computes, so a test can compare the two.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

# Hugging Face parameter name (after `model.layers.N.`) → llama.cpp tensor name (after `blk.N.`)
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_CONTROL, _NORMAL = 3, 1  # llama.cpp token types


def _rotary_to_gguf(weight: np.ndarray, heads: int) -> np.ndarray:
    """Within each head, interleave the two rotary halves (llama.cpp's order for Q and K)."""
    rows = weight.shape[0] // heads // 2
    return weight.reshape(heads, 2, rows, -1).swapaxes(1, 2).reshape(weight.shape)


def write_tiny_gguf(model_dir: Path, path: Path, name: str = "tiny") -> Path:
    import gguf

    config = json.loads((model_dir / "config.json").read_text())
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    hidden = config["hidden_size"]

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(name)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(hidden)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(float(config.get("rope_theta") or 10000.0))
    writer.add_rope_dimension_count(hidden // heads)

    vocab: dict[str, int] = dict(tok["model"]["vocab"])
    special = {t["content"]: t["id"] for t in tok["added_tokens"]}
    vocab.update(special)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    assert [vocab[t] for t in tokens] == list(range(len(tokens))), "ids must be dense"
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([_CONTROL if t in special else _NORMAL for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_pad_token_id(config["pad_token_id"])
    writer.add_add_bos_token(True)
    writer.add_chat_template((model_dir / "chat_template.jinja").read_text())

    weights = load_file(str(model_dir / "model.safetensors"))
    writer.add_tensor("token_embd.weight", weights["model.embed_tokens.weight"])
    for i in range(config["num_hidden_layers"]):
        for hf_name, gguf_name in _LAYER_NAMES.items():
            tensor = weights[f"model.layers.{i}.{hf_name}"]
            if gguf_name == "attn_q.weight":
                tensor = _rotary_to_gguf(tensor, heads)
            elif gguf_name == "attn_k.weight":
                tensor = _rotary_to_gguf(tensor, kv_heads)
            writer.add_tensor(f"blk.{i}.{gguf_name}", np.ascontiguousarray(tensor))
    writer.add_tensor("output_norm.weight", weights["model.norm.weight"])
    writer.add_tensor("output.weight", weights["lm_head.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
