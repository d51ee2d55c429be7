"""A byte-level tokenizer built in code, so toy checkpoints load offline with `AutoTokenizer`.

Every byte is one token (id = byte value), so digits tokenize one character at a time, which is what the toy
arithmetic model is trained on. The special tokens follow the byte ids.
"""

from __future__ import annotations

import json
from pathlib import Path

BYTE_TOKENS = 256
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = (EOS_TOKEN, PAD_TOKEN)
VOCAB_SIZE = BYTE_TOKENS + len(SPECIAL_TOKENS)
MODEL_MAX_LENGTH = 2048


def toy_tokenizer():
    """A `PreTrainedTokenizerFast` over 256 byte tokens plus `<|endoftext|>` (bos/eos) and `<|pad|>`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    # GPT-2's printable stand-in character for each byte; ordering by byte value makes id == byte.
    byte_chars = bytes_to_unicode()
    vocab = {byte_chars[b]: b for b in range(BYTE_TOKENS)}
    # No merges: BPE over the byte alphabet never joins bytes, so every byte stays its own token.
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])

    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=MODEL_MAX_LENGTH,
        clean_up_tokenization_spaces=False,
    )


def save_toy_tokenizer(directory) -> None:
    """Write tokenizer.json and tokenizer_config.json into `directory`."""

    toy_tokenizer().save_pretrained(directory)
    # transformers 5 records its own class name; engines that run transformers 4.x only know the old name,
    # which transformers 5 still maps to the same class.
    config_path = Path(directory) / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
