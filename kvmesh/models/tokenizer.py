"""Byte-level tokenizer built locally: one token per byte plus three special tokens.

Id layout (identical for every tiny checkpoint; ids at or above `BYTE_VOCAB_SIZE` that the
model's vocabulary has beyond it are never produced by the tokenizer and decode to nothing):

| ids | tokens |
|---|---|
| 0..255 | the bytes 0x00..0xFF (GPT-2 byte-to-unicode alphabet) |
| 256 / 257 / 258 | `<bos>` / `<eos>` / `<pad>` |

Encoding prepends `<bos>` (as Llama tokenizers do). Decoding round-trips any UTF-8 text.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

NUM_BYTES = 256
BOS_TOKEN, EOS_TOKEN, PAD_TOKEN = "<bos>", "<eos>", "<pad>"
BOS_TOKEN_ID, EOS_TOKEN_ID, PAD_TOKEN_ID = 256, 257, 258
BYTE_VOCAB_SIZE = 259


def byte_alphabet() -> list[str]:
    """The printable character standing for each byte value, indexed by the byte (GPT-2 map)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars: dict[int, int] = {b: b for b in printable}
    extra = 0
    for b in range(NUM_BYTES):
        if b not in chars:
            chars[b] = NUM_BYTES + extra
            extra += 1
    return [chr(chars[b]) for b in range(NUM_BYTES)]


def build_byte_tokenizer() -> Any:
    """A `tokenizers.Tokenizer` with the id layout above (no merges, no unknown tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {char: byte for byte, char in enumerate(byte_alphabet())}
    vocab.update({BOS_TOKEN: BOS_TOKEN_ID, EOS_TOKEN: EOS_TOKEN_ID, PAD_TOKEN: PAD_TOKEN_ID})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([BOS_TOKEN, EOS_TOKEN, PAD_TOKEN])
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A $B",
        special_tokens=[(BOS_TOKEN, BOS_TOKEN_ID)],
    )
    return tokenizer


def save_byte_tokenizer(out_dir: Path, model_max_length: int) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into `out_dir`."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=build_byte_tokenizer(),
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    fast.save_pretrained(str(out_dir))
    # Older transformers releases know only the class name below; both resolve to the same backend.
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    special = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


# A minimal chat template for the byte-level tokenizer (it has none by default): BOS, then each
# message as `<|role|>\ncontent\n` (`<|role:name|>` for a message with a name), then
# `<|assistant|>\n` when the generation prompt is asked.
SIMPLE_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}"
    "{% if m.get('name') %}:{{ m['name'] }}{% endif %}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def set_chat_template(model_dir: Path, template: str = SIMPLE_CHAT_TEMPLATE) -> None:
    """Give a checkpoint's tokenizer a chat template (written into tokenizer_config.json)."""
    config_path = Path(model_dir) / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = template
    config_path.write_text(json.dumps(config, indent=2) + "\n")
