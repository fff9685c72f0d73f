"""Statistical drop-in test: on a random large-vocabulary model, TLTGRPOTrainer's rollouts end in EOS, in the pad token
or truncated as often as GRPOTrainer's, for every drafter type, in a fresh process and after other trainers ran.

The model is random (TRL's tiny test models are) with the vocabulary of Qwen2.5 (151,665 tokens, <|im_end|> = 151645,
<|endoftext|> = 151643), except that one embedding dimension is constant and carries a logit bias, so that EOS has
probability ~3% and pad ~1% at every position: rates a sampler bug would shift are measurable in a few thousand
tokens (a uniform random model ends a completion once in ~75,000 tokens).
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from scipy.stats import chi2_contingency
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM


# Slow (a 151,665-token policy, thousands of sampled tokens per drafter): CI's second stage.
pytestmark = pytest.mark.slow

HERE = Path(__file__).parent
VOCAB, PAD, EOS = 151_665, 151_643, 151_645
EOS_PROB, PAD_PROB = 0.03, 0.01
ALPHA = 1e-3  # every comparison below; the negative control must fall under it


def large_vocab_tokenizer() -> PreTrainedTokenizerFast:
    """Characters, filler tokens, and Qwen2.5's special tokens at their ids."""
    vocab = {"<unk>": 0, **{chr(c): c - 31 for c in range(32, 127)}}
    fillers = (f"<w{i}>" for i in range(VOCAB))
    while len(vocab) < PAD:
        vocab[next(fillers)] = len(vocab)
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        vocab[special] = len(vocab)
    while len(vocab) < VOCAB:
        vocab[next(fillers)] = len(vocab)
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token="<unk>"
    )


def biased_random_model(seed: int, eos_prob: float, pad_prob: float) -> Qwen2ForCausalLM:
    """A random 2-layer Qwen2 (hidden 8, TRL's tiny-model shape) whose EOS / pad logits carry a constant bias."""
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=8,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        eos_token_id=EOS,
        pad_token_id=PAD,
        bos_token_id=None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        # Dimension 0 of every embedding is 1, 50x the rest: after the final RMSNorm it is ~sqrt(8) at every position.
        model.model.embed_tokens.weight[:, 0] = 1.0
        # Biases b with softmax mass p at a near-uniform rest: e^b = p * V / (1 - eos_prob - pad_prob)
        for token, prob in ((EOS, eos_prob), (PAD, pad_prob)):
            bias = math.log(prob * VOCAB / (1 - eos_prob - pad_prob))
            model.lm_head.weight[token, 0] = bias / math.sqrt(config.hidden_size)
    model.generation_config.eos_token_id = [EOS, PAD]  # as Qwen2.5-Instruct's: both end a completion
    model.generation_config.pad_token_id = PAD
    return model


@pytest.fixture(scope="module")
def rates(tmp_path_factory):
    work = tmp_path_factory.mktemp("eos-rates")
    tokenizer = large_vocab_tokenizer()
    for name, (seed, eos_prob, pad_prob) in {"policy": (0, EOS_PROB, PAD_PROB), "drafter": (1, 0.01, 0.02)}.items():
        biased_random_model(seed, eos_prob, pad_prob).save_pretrained(work / name)
        tokenizer.save_pretrained(work / name)
    # Two processes at once (one core each): the fresh one, and the one where other trainers run first.
    runs = {
        phase: subprocess.Popen(
            [
                sys.executable,
                str(HERE / "_eos_rates.py"),
                str(work / "policy"),
                str(work / "drafter"),
                str(work / phase),
                phase,
                str(work / f"{phase}.json"),
            ],  # fmt: skip
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        for phase in ("fresh", "after_other_trainers")
    }
    for phase, process in runs.items():
        assert process.wait(timeout=900) == 0, phase
    return {phase: json.loads((work / f"{phase}.json").read_text()) for phase in runs}


def p_value(a: dict, b: dict) -> float:
    """Chi-square test of independence on the 2x3 table (ended in EOS, in pad, truncated) of two trainers."""
    table = [[counts[k] for k in ("eos", "pad", "truncated")] for counts in (a, b)]
    return chi2_contingency(table).pvalue


@pytest.mark.parametrize("phase", ["fresh", "after_other_trainers"])
@pytest.mark.parametrize("drafter", ["eagle3", "model", "ngram", "none"])
def test_rollouts_end_as_grpo_trainer_s(rates, phase, drafter):
    grpo, tlt = rates["fresh"]["grpo"], rates[phase][f"tlt_{drafter}"]
    assert tlt["tokens"] >= 2000 and grpo["tokens"] >= 2000
    assert tlt["eos"] > 0 and tlt["pad"] > 0 and tlt["truncated"] > 0
    p = p_value(grpo, tlt)
    print(f"{phase} {drafter}: GRPOTrainer {grpo} TLTGRPOTrainer {tlt} chi-square p = {p:.3g}")
    assert p > ALPHA


def test_the_comparison_has_power(rates):
    """Negative control: GRPOTrainer at temperature 0.8 instead of 1 ends its rollouts differently, and is caught."""
    assert p_value(rates["fresh"]["grpo"], rates["fresh"]["grpo_temperature_0.8"]) < ALPHA


def test_no_state_carries_over_between_trainers(rates):
    """With a seeded (deterministic) selector the rollouts after other trainers ran are the fresh process's exactly."""
    for drafter in ("eagle3", "model", "ngram", "none"):
        assert rates["after_other_trainers"][f"tlt_{drafter}"] == rates["fresh"][f"tlt_{drafter}"], drafter
