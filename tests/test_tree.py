"""Tree speculation is lossless: greedy token identity with `generate` (float64) and a chi-square test of sampled
completions (with a negative control) for each drafter that drafts trees, at batch sizes 1, 5 and 16; drafter faults
cost speed only; tree arms mix with chain arms under the bandit."""

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
    peaked_model,
    random_prompts,
    sampling_case,
)

import trl_tlt.engine.generate as engine_module
from trl_tlt.drafters import ModelDrafter
from trl_tlt.engine.generate import SpeculativeEngine
from trl_tlt.engine.sampling import SamplingParams
from trl_tlt.engine.speculation import FixedSpeculation, tree_arm
from trl_tlt.engine.tree import DraftTree, checked_tree, depths_from_ancestors, tree_ancestors


# (depth, topk, verify): a deterministic chain, a narrow tree, a wide one that keeps every node it drafts.
TREES = [(3, 1, 3), (3, 2, 5), (4, 3, 21)]


def tree_engine(model, drafter, shape):
    return SpeculativeEngine(model, drafter=drafter, speculation=FixedSpeculation(shape[0], "default", *shape[1:]))


def tree_drafter(name, model, tokenizer):
    if name == "self":  # the policy drafting for itself: deep paths are accepted
        return ModelDrafter(model, model.config.vocab_size)
    return make_drafter(name, model, tokenizer)


@pytest.mark.parametrize("drafter_name", ["model", "eagle3", "self"])
def test_tree_greedy_matches_generate(tiny_model_f64, tokenizer, drafter_name):
    model = tiny_model_f64
    prompts = random_prompts(16, model.config.vocab_size, seed=11)
    expected = hf_greedy(model, prompts, max_new_tokens=20)
    params = SamplingParams(do_sample=False, max_new_tokens=20, eos_token_ids=(EOS,))
    for shape in TREES:
        engine = tree_engine(model, tree_drafter(drafter_name, model, tokenizer), shape)
        for batch in (1, 5, 16):
            out = engine.generate(prompts[:batch], params)
            assert out.completion_ids == expected[:batch], (drafter_name, shape, batch)
        if drafter_name == "self":  # paths deeper than one node were accepted
            assert out.stats.mean_acceptance_length > 2.0


def test_tree_greedy_with_repetition_penalty_matches_generate(tokenizer):
    model = peaked_model(tokenizer, scale=3.0)
    prompts = random_prompts(5, model.config.vocab_size, seed=3)
    expected = hf_greedy(model, prompts, max_new_tokens=16, repetition_penalty=1.3)
    params = SamplingParams(do_sample=False, max_new_tokens=16, eos_token_ids=(EOS,), repetition_penalty=1.3)
    out = tree_engine(model, ModelDrafter(model, model.config.vocab_size), (4, 2, 8)).generate(prompts, params)
    assert out.completion_ids == expected
    assert out.stats.num_accepted_tokens > 0


PARAMS = [
    SamplingParams(temperature=0.7, top_k=5, max_new_tokens=4),
    SamplingParams(temperature=1.3, top_p=0.6, max_new_tokens=4, repetition_penalty=1.3),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("drafter_name", "params"),
    [("model", PARAMS[0]), ("model", PARAMS[1]), ("eagle3", PARAMS[0])],
    ids=["model-temp0.7-topk5", "model-temp1.3-topp0.6-rep1.3", "eagle3-temp0.7-topk5"],
)
def test_tree_sampling_reproduces_policy_distribution(tokenizer, params, drafter_name, monkeypatch):
    # Token 1 comes from the prefill; tokens 2-4 from one tree step (the budget allows paths of depth 2).
    model, expected, drafter = sampling_case(tokenizer, params, drafter_name, length=4)
    prompt, num_samples = SAMPLED_PROMPT, NUM_SAMPLES
    engine = tree_engine(model, drafter, (3, 3, 8))
    out = engine.generate([prompt] * num_samples, params, generator=torch.Generator().manual_seed(1234))
    samples = [tuple(c) for c in out.completion_ids]
    assert 0 < out.stats.num_accepted_tokens and out.stats.mean_acceptance_length < 3  # acceptances and rejections
    assert out.stats.num_accepted_tokens_per_pos[1] > 0  # a close drafter: paths of depth 2 are accepted too
    assert chi_square_pvalue(samples, expected) > 1e-3

    # The test has power, for each drafter: a backbone whose q is misreported (uniform) is caught ...
    monkeypatch.setattr(drafter, "propose_tree", misreporting_q(drafter.propose_tree))
    bad = engine.generate([prompt] * num_samples, params, generator=torch.Generator().manual_seed(1234))
    assert chi_square_pvalue([tuple(c) for c in bad.completion_ids], expected) < 1e-6
    # ... and so is a walk against a flattened distribution.
    monkeypatch.undo()
    walk = engine_module.verify_tree
    monkeypatch.setattr(
        engine_module, "verify_tree", lambda logp, *args: walk(torch.log_softmax(0.8 * logp, dim=-1), *args)
    )
    bad = engine.generate([prompt] * num_samples, params, generator=torch.Generator().manual_seed(1234))
    assert chi_square_pvalue([tuple(c) for c in bad.completion_ids], expected) < 1e-6


def misreporting_q(propose_tree):
    """Negative control: the drafter's tree, sampled from q, with a uniform q reported, which breaks rejection
    sampling."""

    def lying(ctx, depth, topk, verify):
        tree = propose_tree(ctx, depth, topk, verify)
        return dataclasses.replace(tree, probs=torch.full_like(tree.probs, 1.0 / tree.probs.size(-1)))

    return lying


class BrokenTreeDrafter(ModelDrafter):
    """Drafts a good tree, then breaks one row per fault: a token outside the vocabulary, a parent that is not an
    earlier node, a node deeper than the arm allows."""

    def propose_tree(self, ctx, depth, topk, verify):
        tree = super().propose_tree(ctx, depth, topk, verify)
        ids, parents = tree.token_ids.clone(), tree.parents.clone()
        ids[0, 0] = 10**6
        if ids.size(0) > 1:
            parents[1, 0] = 3  # node 0 hangs from node 2
        if ids.size(0) > 2:
            parents[2] = torch.arange(parents.size(1))  # a chain as deep as the tree is wide
        return DraftTree(ids, parents, tree.valid)


def test_drafter_faults_cost_speed_not_correctness(tiny_model_f64):
    model = tiny_model_f64
    prompts = random_prompts(5, model.config.vocab_size, seed=6)
    expected = hf_greedy(model, prompts, max_new_tokens=12)
    params = SamplingParams(do_sample=False, max_new_tokens=12, eos_token_ids=(EOS,))
    out = tree_engine(model, BrokenTreeDrafter(model, model.config.vocab_size), (2, 2, 5)).generate(prompts, params)
    assert out.completion_ids == expected
    assert out.stats.num_invalid_drafts >= out.stats.num_target_forwards  # the first row is broken at every step
    assert out.stats.num_accepted_tokens > 0  # the rows left intact still speculate


def test_tree_helpers():
    # Root (0) -> node 0 (index 1) -> nodes 1, 2; node 3 under the root.
    parents = torch.tensor([[0, 1, 1, 0]])
    ancestors = tree_ancestors(parents, max_depth=2)
    assert depths_from_ancestors(ancestors).tolist() == [[1, 2, 2, 1]]
    assert ancestors[0, 3].nonzero().squeeze(1).tolist() == [0, 1, 3]
    tree = DraftTree(torch.tensor([[5, 6, 7, 8]]), parents, torch.ones(1, 4, dtype=torch.bool))
    _, _, rows_ok = checked_tree(tree, vocab=10, max_depth=1)  # node 1 is too deep
    assert rows_ok.tolist() == [False]
    _, _, rows_ok = checked_tree(tree, vocab=10, max_depth=2)
    assert rows_ok.tolist() == [True]
    for bad in [(0, 2, 3), (3, 0, 3), (3, 2, 0), (2, 2, 7)]:
        with pytest.raises(ValueError, match="tree"):
            tree_arm("default", *bad)
    with pytest.raises(ValueError, match="both"):
        FixedSpeculation(3, "default", topk=2)


def test_bandit_mixes_chain_and_tree_arms_losslessly(tiny_model_f64, tokenizer):
    from trl_tlt.drafters import NgramDrafter
    from trl_tlt.engine.speculation import BanditSpeculation

    model = tiny_model_f64
    prompts = random_prompts(6, model.config.vocab_size, seed=9) * 2
    expected = hf_greedy(model, prompts, max_new_tokens=20)
    drafters = {"lm": ModelDrafter(model, model.config.vocab_size), "ngram": NgramDrafter()}
    arms = [("lm", 2), tree_arm("lm", 3, 2, 5), ("ngram", 2)]
    # Every step costs the same (cost_model): the arms that emit more tokens win, so the bandit's local exploration
    # climbs from no speculation to the chain and on to its neighbour, the tree, whatever the machine's timing.
    selector = BanditSpeculation(arms=arms, epsilon=0.5, cost_model=lambda arm: 1.0)
    engine = SpeculativeEngine(model, drafter=drafters, speculation=selector)
    out = engine.generate(prompts, SamplingParams(do_sample=False, max_new_tokens=20, eos_token_ids=(EOS,)))
    assert out.completion_ids == expected
    assert {2, 3} <= set(out.stats.num_speculative_tokens)  # chain and tree steps both ran
    with pytest.raises(ValueError, match="chains only"):
        SpeculativeEngine(model, drafter=drafters, speculation=FixedSpeculation(3, "ngram", 2, 5)).generate(
            prompts, SamplingParams(max_new_tokens=4)
        )
