"""Hybrid drafting is lossless: greedy token identity with `generate` (float64) and a chi-square test of sampled
completions (with negative controls) with every source drafting (learned drafter, siblings and own text, prompt
history) and their mix in one verification; drafter faults cost speed only; the prompt history is bounded, aged and
saved."""

import dataclasses

import pytest
import torch
from testing_utils import (
    EOS,
    NUM_SAMPLES,
    SAMPLED_PROMPT,
    chi_square_pvalue,
    hf_greedy,
    make_drafter,
    random_prompts,
    sampling_case,
)

from trl_tlt.drafters import Draft
from trl_tlt.drafters.history import PromptHistory
from trl_tlt.drafters.hybrid import EXPLORE_EVERY, HybridDrafter
from trl_tlt.engine.generate import SpeculativeEngine
from trl_tlt.engine.sampling import SamplingParams


def primed_history(prompts, completions, corrupt_every=0):
    """A history holding `completions` of `prompts`, every `corrupt_every`-th token changed (drafts then get
    rejected part way)."""
    history = PromptHistory(max_tokens=1 << 20)
    stored = [
        [t if not corrupt_every or i % corrupt_every else 3 + (t + 1) % 50 for i, t in enumerate(c)]
        for c in completions
    ]
    history.add(prompts, stored)
    return history


@pytest.mark.parametrize("learned_name", ["none", "model", "eagle3"])
def test_hybrid_greedy_matches_generate(tiny_model_f64, tokenizer, learned_name):
    model = tiny_model_f64
    prompts = random_prompts(16, model.config.vocab_size, seed=11)
    prompts = prompts[:8] + prompts[:8]  # siblings: two rows per prompt
    expected = hf_greedy(model, prompts, max_new_tokens=24)
    params = SamplingParams(do_sample=False, max_new_tokens=24, eos_token_ids=(EOS,))
    for corrupt_every in (0, 5):
        drafter = HybridDrafter(
            make_drafter(learned_name, model, tokenizer),
            primed_history(prompts, expected, corrupt_every),
            learned_tokens=3,
        )
        engine = SpeculativeEngine(model, drafter=drafter, num_speculative_tokens=10)
        drafted = dict.fromkeys(("learned", "history"), 0)
        accepted_from_history = 0
        for batch in (1, 5, 16):
            out = engine.generate(prompts[:batch], params)
            assert out.completion_ids == expected[:batch], (learned_name, corrupt_every, batch)
            for source in drafted:
                drafted[source] += out.stats.num_draft_tokens_by_source[source]
            accepted_from_history += out.stats.num_accepted_tokens_by_source["history"]
        assert accepted_from_history > 0
        if not corrupt_every:  # a lookup drafted past the learned drafter's 3 tokens, and was accepted
            assert out.stats.num_accepted_tokens_per_pos[3] > 0
        assert drafted["history"] > 0 and (drafted["learned"] > 0 or learned_name == "none"), drafted


def mixed_case(tokenizer, params, learned_name):
    """The chi-square set-up with a hybrid drafter: the learned drafter of `sampling_case`, and a history of 64
    completions the policy sampled for SAMPLED_PROMPT (drafts the policy often, not always, accepts)."""
    model, expected, learned = sampling_case(tokenizer, params, learned_name, length=4)
    earlier = SpeculativeEngine(model).generate(
        [SAMPLED_PROMPT] * 64,
        dataclasses.replace(params, max_new_tokens=8),
        generator=torch.Generator().manual_seed(5),
    )
    history = primed_history([SAMPLED_PROMPT] * 64, earlier.completion_ids)
    drafter = HybridDrafter(learned, history, min_match=2, learned_tokens=1, max_n=3, min_n=2)
    return model, expected, favouring_lookups(drafter)


def favouring_lookups(drafter):
    """The drafter with running means that send every matched row to its lookup (3 tokens), the others to the
    learned drafter: every source drafts in the first step."""
    drafter.values = {
        ((source, n, k), choice): value
        for source in (1, 2)
        for n in (2, 3)
        for k in (1, 2, 3)
        for choice, value in (("lookup", 1.0), ("learned", 0.0))
    }
    drafter._steps = 1
    return drafter


PARAMS = [
    SamplingParams(temperature=0.7, top_k=5, max_new_tokens=4),
    SamplingParams(temperature=1.3, top_p=0.6, max_new_tokens=4, repetition_penalty=1.3),
]


@pytest.mark.parametrize(
    ("learned_name", "params", "sources"),
    [
        pytest.param("model", PARAMS[0], ("learned", "siblings", "history"), id="model-temp0.7-topk5"),
        # the default run's other setting is test_exact_distribution.py's hybrid rows; this one in CI's second stage
        pytest.param(
            "model", PARAMS[1], ("learned", "history"), id="model-temp1.3-topp0.6-rep1.3", marks=pytest.mark.slow
        ),
        pytest.param("eagle3", PARAMS[0], ("learned", "history"), id="eagle3-temp0.7-topk5"),
    ],
)
def test_hybrid_sampling_reproduces_policy_distribution(tokenizer, params, learned_name, sources, monkeypatch):
    # Token 1 comes from the prefill; tokens 2-4 from steps in which rows draft from the learned drafter (1 token),
    # the history (up to 3 tokens: past k) or, where the first token is 13, the prompt's own text, verified together.
    model, expected, drafter = mixed_case(tokenizer, params, learned_name)
    prompt, num_samples = SAMPLED_PROMPT, NUM_SAMPLES
    engine = SpeculativeEngine(model, drafter=drafter, num_speculative_tokens=3)
    out = engine.generate([prompt] * num_samples, params, generator=torch.Generator().manual_seed(1234))
    stats = out.stats
    for source in sources:  # every source drafted, and was accepted, in the same steps
        assert stats.num_accepted_tokens_by_source[source] > 0, (source, stats.num_accepted_tokens_by_source)
    assert stats.num_accepted_tokens < stats.num_draft_tokens  # rejections too
    assert stats.num_accepted_tokens_per_pos[1] > 0  # past the learned drafter's k
    assert chi_square_pvalue([tuple(c) for c in out.completion_ids], expected) > 1e-3

    # The test has power: lookup drafts verified against a q that is not one-hot (uniform: nearly always accepted)
    # are caught. (The learned drafter's misreported q is test_engine's control.)
    propose = drafter.propose

    def lookups_misverified(ctx, k):
        draft = propose(ctx, k)
        vocab = draft.probs.size(-1)
        probs = torch.full((*draft.token_ids.shape, vocab), 1.0 / vocab, dtype=draft.probs.dtype)
        probs[:, :k] = torch.where(draft.source[:, :k, None] == 0, draft.probs, probs[:, :k])
        return Draft(draft.token_ids, draft.num_tokens, probs, torch.zeros_like(draft.source))

    monkeypatch.setattr(drafter, "propose", lookups_misverified)
    favouring_lookups(drafter)
    bad = engine.generate([prompt] * num_samples, params, generator=torch.Generator().manual_seed(1234))
    assert chi_square_pvalue([tuple(c) for c in bad.completion_ids], expected) < 1e-6


class BrokenHybrid(HybridDrafter):
    """Drafts well, then breaks one row per fault: a source `DRAFT_SOURCES` does not name, a sampled draft past the
    learned drafter's q."""

    def propose(self, ctx, k):
        draft = super().propose(ctx, k)
        source = draft.source.clone()
        source[0, 0] = 7
        wide = torch.cat([draft.token_ids, draft.token_ids[:, :1]], dim=1)
        source = torch.cat([source, torch.zeros_like(source[:, :1])], dim=1)
        num_tokens = draft.num_tokens.clone()
        if num_tokens.numel() > 1:
            num_tokens[1] = wide.size(1)  # row 1's last draft claims to be sampled, beyond q's k positions
        return Draft(wide, num_tokens, draft.probs, source)


def test_hybrid_drafter_faults_cost_speed_not_correctness(tiny_model_f64, tokenizer):
    model = tiny_model_f64
    prompts = random_prompts(5, model.config.vocab_size, seed=6)
    expected = hf_greedy(model, prompts, max_new_tokens=12)
    params = SamplingParams(do_sample=False, max_new_tokens=12, eos_token_ids=(EOS,))
    drafter = BrokenHybrid(make_drafter("model", model, tokenizer), primed_history(prompts, expected))
    out = SpeculativeEngine(model, drafter=drafter, num_speculative_tokens=2).generate(prompts, params)
    assert out.completion_ids == expected
    # rows 0 and 1 at every step (row 0 alone once one row is left), cut at their fault, the drafts before it verified
    assert out.stats.num_invalid_drafts == sum(min(size, 2) for size in out.stats.active_batch_sizes)
    assert out.stats.num_accepted_tokens > 0  # the rows left intact still speculate


def test_hybrid_picks_the_source_that_accepts_more():
    """The running means decide, like for like: a lookup that accepts less than the learned drafter on the same rows
    is not used, one that accepts more is, except at exploring steps (where the learned drafter is scored again)."""
    drafter = HybridDrafter(learned=object())
    weak, strong, new = (2, 4, 6), (1, 4, 6), (1, 3, 6)  # (source, match length, k)
    drafter.values = {(weak, "lookup"): 2.0, (weak, "learned"): 4.0, (strong, "lookup"): 6.0, (strong, "learned"): 1.0}
    drafter._steps = 1
    assert not drafter._use_lookup(weak) and drafter._use_lookup(strong)
    assert not drafter._use_lookup(new)  # unscored: the learned drafter drafts, the lookup is scored in its shadow
    drafter._steps = EXPLORE_EVERY  # an exploring step: the learned drafter is scored where the lookup wins
    assert not drafter._use_lookup(weak) and not drafter._use_lookup(strong)
    assert drafter._lookup_length(strong) == 14 and drafter._lookup_length(new) == 2  # unscored: 2
    lookups = drafter.lookups_only()
    assert lookups.learned is None and lookups.history is drafter.history and lookups is drafter.lookups_only()
    lookups.values = {(strong, "lookup"): 0.5, (weak, "lookup"): 3.0}
    lookups._steps = 1  # without a learned drafter a lookup must beat drafting nothing; an untried one is tried
    assert not lookups._use_lookup(strong) and lookups._use_lookup(weak) and lookups._use_lookup(new)
    lookups._steps = EXPLORE_EVERY
    assert lookups._use_lookup(strong) and not lookups._use_lookup(weak)


def test_lookups_are_scored_in_the_learned_drafters_shadow(tiny_model_f64, tokenizer):
    """Where the learned drafter drafts, each matched lookup is scored against the tokens the row emitted: a history
    holding the greedy completions scores high and takes over from a random drafter (greedy, so exactly)."""
    model = tiny_model_f64
    prompts = random_prompts(4, model.config.vocab_size, seed=2)
    expected = hf_greedy(model, prompts, max_new_tokens=24)
    drafter = HybridDrafter(make_drafter("model", model, tokenizer), primed_history(prompts, expected))
    params = SamplingParams(do_sample=False, max_new_tokens=24, eos_token_ids=(EOS,))
    out = SpeculativeEngine(model, drafter=drafter, num_speculative_tokens=4).generate(prompts, params)
    assert out.completion_ids == expected
    history = {key: v for key, v in drafter.values.items() if key[0][0] == 2}  # source 2: the history
    assert any(choice == "lookup" and v > 1.0 for (_, choice), v in history.items()), drafter.values
    assert out.stats.num_accepted_tokens_by_source["history"] > out.stats.num_accepted_tokens_by_source["learned"]


def test_prompt_history_is_bounded_aged_and_saved():
    history = PromptHistory(max_tokens=30)
    history.add([[1, 2], [1, 2], [3]], [[5, 6, 7], [8], [9, 9]])
    assert history.get([1, 2]) == [[5, 6, 7], [8]] and history.get([3]) == [[9, 9]]
    assert history.num_tokens == 2 + 4 + 1 + 2
    history.add([[1, 2]], [[4, 4]])  # a new rollout of a prompt replaces its old one
    assert history.get([1, 2]) == [[4, 4]] and history.num_tokens == 4 + 3
    history.add([[7] * 10], [[1] * 14])  # over budget: the prompt seen longest ago goes first
    assert history.get([3]) == [] and history.get([1, 2]) == [[4, 4]] and history.num_tokens == 4 + 24
    history.add([[8]], [[2] * 10])
    assert len(history) == 1 and history.num_tokens <= 30
    restored = PromptHistory(max_tokens=30)
    restored.load_state_dict(history.state_dict())
    assert restored.state_dict() == history.state_dict() and restored.num_tokens == history.num_tokens
    history.add([[9]], [[]])  # an empty completion keeps nothing
    assert history.get([9]) == []
    empty = PromptHistory(max_tokens=0)
    empty.add([[1]], [[2]])
    assert len(empty) == 0
    with pytest.raises(ValueError, match="max_tokens"):
        PromptHistory(max_tokens=-1)
    with pytest.raises(ValueError, match="min_match"):
        HybridDrafter(None, min_match=9)


def test_hybrid_trees_run_on_when_the_head_is_left_idle(tiny_model_dirs, tmp_path):
    """Mutation caught: the lookups alone (the learned head left idle by the time budget) drafting with the bandit of
    tree arms, which `HybridDrafter.lookups_only()` refuses: hybrid_drafting with speculative_trees crashed mid-run
    with a ValueError. The idle rollouts play the chain arms, with statistics of their own."""
    from datasets import Dataset
    from testing_utils import PROMPTS, config_kwargs, reward_len
    from transformers import AutoModelForCausalLM

    from trl_tlt import TLTConfig, TLTGRPOTrainer

    args = TLTConfig(**config_kwargs(tmp_path, max_steps=2), hybrid_drafting=True, speculative_trees=True)
    trainer = TLTGRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(tiny_model_dirs["qwen2"]),
        reward_funcs=reward_len,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS * 2}),
    )
    bandit = trainer.tlt_speculation
    tree = next(arm for arm in bandit.arms if arm.is_tree)
    for bucket in (1, 2, 4, 8, 16):  # every arm tried, a tree arm the best at every batch size
        for arm, stats in bandit._stats[bucket].items():
            stats.count, stats.tokens, stats.seconds = 1, 1e9 if arm == tree else 1.0, 1.0
    trainer.tlt_spot.budget.skip = 100  # the time budget leaves the head idle from the first rollout on
    trainer.tlt_spot.budget.fast_mean, trainer.tlt_spot.budget.recent = 1.0, [1.0] * 6
    trainer.tlt_spot.budget.phases = 100
    assert not trainer.tlt_spot.drafter_pays
    trainer.train()
    assert trainer.tlt_last_stats.num_tree_steps == 0 and trainer.tlt_last_stats.num_target_forwards > 0


def test_the_hybrid_drafters_state_round_trips():
    """Resume: the running means and step counts (its own and its lookups-only twin's) are restored as saved."""
    drafter = HybridDrafter(learned=object())
    drafter.values = {((1, 4, 6), "lookup"): 2.5, ((2, 3, 6), "learned"): 1.5}
    drafter._steps = 7
    lookups = drafter.lookups_only()
    lookups.values, lookups._steps = {((1, 2, 6), "lookup"): 0.5}, 3
    restored = HybridDrafter(learned=object())
    restored.load_state_dict(drafter.state_dict())
    assert restored.values == drafter.values and restored._steps == 7
    assert restored.lookups_only().values == lookups.values and restored.lookups_only()._steps == 3
