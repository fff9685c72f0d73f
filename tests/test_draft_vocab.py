"""A new EAGLE-3 head's draft vocabulary: chosen from the policy's tokens, revised as it moves, fitted in size,
carried through training, checkpoints and export; drafting with it stays lossless."""

import pytest
import torch
from datasets import Dataset

from trl_tlt import TLTConfig, TLTGRPOTrainer
from trl_tlt.drafters.draft_vocab import (
    MIN_DRAFT_VOCAB_SIZE,
    REVISE_BELOW_COVERAGE,
    DraftVocabulary,
    fitted_size,
    prior_draft_ids,
)
from trl_tlt.drafters.eagle3 import Eagle3Drafter, Eagle3Model
from trl_tlt.engine.generate import SpeculativeEngine
from trl_tlt.engine.sampling import SamplingParams
from trl_tlt.tooling.tiny import build_tiny_model, build_tokenizer, extend_vocabulary
from trl_tlt.training.spot import DataBuffer, SpotSchedule, SpotTrainer


BIG_VOCAB = 40_000  # above DEFAULT_DRAFT_VOCAB_SIZE (32,768): a new head drafts over a reduced vocabulary


@pytest.fixture(scope="module")
def big_tokenizer():
    return extend_vocabulary(build_tokenizer(["12+34=46 the quick brown fox 1 2 3 4 5"] * 10, 120), BIG_VOCAB)


@pytest.fixture(scope="module")
def big_policy(big_tokenizer):
    return build_tiny_model(big_tokenizer, hidden_size=32, num_hidden_layers=3, num_attention_heads=1).eval()


def test_extended_tokenizer_keeps_ascii_ids(big_tokenizer):
    small = build_tokenizer(["12+34=46 the quick brown fox 1 2 3 4 5"] * 10, 120)
    text = "12+34=46 the quick fox"
    assert len(big_tokenizer) == BIG_VOCAB and big_tokenizer(text)["input_ids"] == small(text)["input_ids"]


def test_prior_and_fitted_sizes():
    ids = prior_draft_ids(1000, 10, special_ids=[999, 500])
    assert ids.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 500, 999]
    counts = torch.zeros(100_000)
    counts[:300] = 1
    assert fitted_size(counts, 32_768) == MIN_DRAFT_VOCAB_SIZE  # 2 x 300, rounded up to 1024
    counts[:5000] = 1
    assert fitted_size(counts, 32_768) == 10_240 and fitted_size(counts, 8192) == 8192


def test_revision_follows_the_emitted_tokens_and_does_not_churn():
    vocab = DraftVocabulary(vocab_size=50, draft_vocab_size=4)
    current = torch.tensor([0, 1, 2, 3])
    vocab.observe(torch.bincount(torch.tensor([0, 1, 2, 3, 0]), minlength=50).double())
    assert vocab.coverage(current) == 1.0 and vocab.revised(current) is None
    vocab.observe(torch.bincount(torch.tensor([10, 11, 10, 11, 0]), minlength=50).double())
    assert vocab.coverage(current) < REVISE_BELOW_COVERAGE
    new = vocab.revised(current)
    assert new.tolist() == [0, 1, 10, 11]  # 10 and 11 in; of the old ones, the most counted (ties: lower id) stay
    assert vocab.num_revisions == 1
    vocab.observe(torch.bincount(torch.tensor([0] * 300 + [45]), minlength=50).double())
    assert vocab.revised(new) is None and vocab.num_revisions == 1  # covers 300 of 301 tokens: no churn
    vocab.observe(torch.bincount(torch.tensor([40, 41, 42, 43, 44]), minlength=50).double())
    newer = vocab.revised(new)  # 5 fresh tokens outweigh token 1's faded counts: they take rows, 0 stays
    assert 0 in newer.tolist() and 1 not in newer.tolist() and set(newer.tolist()) & {40, 41, 42, 43, 44}


def test_remap_keeps_trained_rows(big_policy):
    head = Eagle3Model.for_policy(big_policy, draft_vocab_size=64)
    assert head.draft_ids.tolist() == prior_draft_ids(BIG_VOCAB, 64, [0, 2]).tolist()
    with torch.no_grad():
        head.lm_head.weight.add_(1.0)  # "trained" rows
    old_ids, old_rows = head.draft_ids.clone(), head.lm_head.weight.clone()
    new_ids = torch.cat([old_ids[:32], torch.arange(30_000, 30_032)])
    source = head.remap_vocab(new_ids, big_policy.get_output_embeddings().weight)
    assert torch.equal(head.draft_ids, new_ids) and bool(head.t2d[new_ids].all()) and int(head.t2d.sum()) == 64
    assert torch.equal(source[:32], torch.arange(32)) and bool((source[32:] == -1).all())
    assert torch.equal(head.lm_head.weight[:32], old_rows[:32])
    assert torch.equal(head.lm_head.weight[32:], big_policy.get_output_embeddings().weight[30_000:30_032])


def test_spot_training_fits_and_revises_the_vocabulary(big_policy, tmp_path):
    torch.manual_seed(0)
    head = Eagle3Model.for_policy(big_policy, draft_vocab_size=2048)
    vocab = DraftVocabulary(BIG_VOCAB, 2048)
    spot = SpotTrainer(head, DataBuffer(), schedule=SpotSchedule(learning_rate=3e-3), tokens_per_step=64,
                       steps_per_phase=2, vocab=vocab, fit_vocab=True)  # fmt: skip
    prompts = [[5, 6, 7]] * 8
    completions = [[30_000 + i, 30_001 + i, 200, 201, 202, 203] for i in range(8)]  # tokens the prior lacks
    spot.observe_rollout(prompts, completions)
    stats = spot.run_between_rollouts(big_policy)
    assert head.config.draft_vocab_size == MIN_DRAFT_VOCAB_SIZE and head.lm_head.weight.shape[0] == 1024
    assert stats.draft_vocab_revised and stats.draft_vocab_coverage == 1.0 and stats.steps == 2
    assert bool(head.t2d[30_000:30_009].all())
    assert spot.params[-1] is head.lm_head.weight or any(p is head.lm_head.weight for p in spot.params)
    # a later rollout with new tokens: rows remapped, the kept rows' optimizer moments carried along
    row = int((head.draft_ids == 200).nonzero())
    moment = spot.optimizer.state[head.lm_head.weight]["exp_avg"][row].clone()
    spot.observe_rollout(prompts, [[35_000 + i, 200, 201] for i in range(8)])
    stats = spot.run_between_rollouts(big_policy)
    assert stats.draft_vocab_revised and bool(head.t2d[35_000:35_008].all())
    new_row = int((head.draft_ids == 200).nonzero())
    state = spot.optimizer.state[head.lm_head.weight]["exp_avg"]
    assert state.shape == head.lm_head.weight.shape
    # the kept row's moment moved only by this phase's 2 steps: not reset to zero
    assert state[new_row].abs().sum() > 0 and moment.abs().sum() > 0
    # exported in the layout vLLM loads (d2t/t2d), and loaded back identical
    head.save_pretrained(tmp_path / "drafter", engine="trl-tlt")
    loaded = Eagle3Model.from_pretrained(tmp_path / "drafter", big_policy)
    assert torch.equal(loaded.draft_ids, head.draft_ids) and loaded.config.draft_vocab_size == 1024


def test_reduced_vocabulary_drafts_stay_lossless(big_tokenizer):
    """Greedy identity against `generate` in float64 with a head whose draft vocabulary lacks most tokens.
    Mutation: make `to_policy_vocab` put draft logits at the wrong ids (e.g. drop `+ d2t`) and drafts are
    rejected (acceptance near 1) while the output must stay identical."""
    policy = build_tiny_model(big_tokenizer, hidden_size=32, num_hidden_layers=3, num_attention_heads=1,
                              dtype=torch.float64).eval()  # fmt: skip
    head = Eagle3Model.for_policy(policy, draft_vocab_size=1024).to(torch.float64)
    engine = SpeculativeEngine(policy, drafter=Eagle3Drafter(head), num_speculative_tokens=4)
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    params = SamplingParams(do_sample=False, max_new_tokens=12, eos_token_ids=())
    out = engine.generate(prompts, params)
    for prompt, completion in zip(prompts, out.completion_ids, strict=True):
        expected = policy.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12, eos_token_id=None)
        assert completion == expected[0, len(prompt) :].tolist()


def test_trainer_fits_the_vocabulary_of_a_new_head_and_resumes(big_tokenizer, big_policy, tmp_path):
    def make(max_steps, out):
        config = TLTConfig(
            output_dir=str(out), use_cpu=True, bf16=False, report_to="none", per_device_train_batch_size=8,
            num_generations=4, max_completion_length=8, max_steps=max_steps, logging_steps=1, save_strategy="steps",
            save_steps=2, seed=0, disable_tqdm=True, spot_steps_per_rollout=2, spot_tokens_per_step=64,
        )  # fmt: skip
        policy = build_tiny_model(big_tokenizer, hidden_size=32, num_hidden_layers=3, num_attention_heads=1)
        return TLTGRPOTrainer(
            model=policy, reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions], args=config,
            train_dataset=Dataset.from_dict({"prompt": ["12+34=", "the quick"] * 20}), processing_class=big_tokenizer,
        )  # fmt: skip

    trainer = make(2, tmp_path / "run")
    assert trainer.tlt_drafter.model.config.draft_vocab_size == 32_768  # before any rollout: the prior
    trainer.train()
    head = trainer.tlt_drafter.model
    assert head.config.draft_vocab_size == MIN_DRAFT_VOCAB_SIZE  # fitted at the first rollout
    logs = [h for h in trainer.state.log_history if "tlt/draft_vocab_coverage" in h]
    assert len(logs) == 2 and all(0 < h["tlt/draft_vocab_coverage"] <= 1 for h in logs)
    resumed = make(3, tmp_path / "resumed")
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    assert resumed.tlt_drafter.model.config.draft_vocab_size == MIN_DRAFT_VOCAB_SIZE
    assert resumed.tlt_spot.total_steps == 3 * 2
