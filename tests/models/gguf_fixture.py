"""Write a tiny random Llama as a GGUF file with the `gguf` package, as llama.cpp lays it out.

Tensors are named and shaped like llama.cpp's converter writes them (q/k rows permuted for its
rotary layout, which transformers undoes at load); the matmul weights are Q8_0-quantized, the
norms stay float32. The tokenizer is a byte-level BPE (`gpt2` in GGUF terms): the 256 byte
symbols, one merge, and `<|im_start|>`, `<|im_end|>` as control tokens, with a chat template.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ("<|im_start|>", "<|im_end|>")


def _byte_symbols() -> list[str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    spelling = bytes_to_unicode()
    return [spelling[b] for b in range(256)]


def _permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order: each head's rotary halves interleaved."""
    rows = weight.shape[0]
    return (
        weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def tiny_llama(seed: int = 0) -> Any:
    """A random float32 Llama small enough to write in a fraction of a second."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256 + 1 + len(SPECIALS),  # bytes, one merge, the special tokens
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
        tie_word_embeddings=False, initializer_range=0.2, bos_token_id=257, eos_token_id=258,
    )  # fmt: skip
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def write_tiny_gguf(path: Path, seed: int = 0) -> Any:
    """Write `tiny_llama(seed)` to `path` as GGUF; returns the model it wrote."""
    import gguf

    model = tiny_llama(seed)
    c = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(c.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    symbols = _byte_symbols()
    tokens = [*symbols, "Ġ t", *SPECIALS]
    tokens[256] = "Ġt"
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 257 + [3] * len(SPECIALS))
    writer.add_token_merges(["Ġ t"])
    writer.add_bos_token_id(c.bos_token_id)
    writer.add_eos_token_id(c.eos_token_id)
    writer.add_chat_template(CHAT_TEMPLATE)
    for name, array in _gguf_tensors(model):
        if array.ndim == 2:
            quantized = gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(name, quantized, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model


def _gguf_tensors(model: Any) -> list[tuple[str, np.ndarray]]:
    c = model.config
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    out = [("token_embd.weight", state["model.embed_tokens.weight"])]
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        out += [
            (f"blk.{i}.attn_norm.weight", state[p + "input_layernorm.weight"]),
            (f"blk.{i}.attn_q.weight",
             _permute(state[p + "self_attn.q_proj.weight"], c.num_attention_heads)),
            (f"blk.{i}.attn_k.weight",
             _permute(state[p + "self_attn.k_proj.weight"], c.num_key_value_heads)),
            (f"blk.{i}.attn_v.weight", state[p + "self_attn.v_proj.weight"]),
            (f"blk.{i}.attn_output.weight", state[p + "self_attn.o_proj.weight"]),
            (f"blk.{i}.ffn_norm.weight", state[p + "post_attention_layernorm.weight"]),
            (f"blk.{i}.ffn_gate.weight", state[p + "mlp.gate_proj.weight"]),
            (f"blk.{i}.ffn_up.weight", state[p + "mlp.up_proj.weight"]),
            (f"blk.{i}.ffn_down.weight", state[p + "mlp.down_proj.weight"]),
        ]  # fmt: skip
    out += [("output_norm.weight", state["model.norm.weight"]),
            ("output.weight", state["lm_head.weight"])]  # fmt: skip
    return out
