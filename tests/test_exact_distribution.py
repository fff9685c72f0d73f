"""Exact distribution at every draft position: whole completions of a tiny policy, against their enumerated law.

The chi-square tests of test_engine.py, test_tree.py and test_hybrid.py generate 3 or 4 tokens, so at most one sampled
draft is ever verified in a step: an indexing error in q, p or the residual at draft positions >= 1 passes them. Here a
policy over an 8-token vocabulary completes a prompt with 6 tokens (the first from the prefill, then a step that
verifies up to 4 drafts), so the law of whole completions can be enumerated exactly (`exact_completions`, the
processed distribution applied token by token) and every emitted token at every draft position is in the test. The
drafter is a perturbed twin of the policy: drafts are accepted, and rejected, at every position (counted per position
by `PositionCounts`).

Covered: chains of 4 sampled drafts under each sampling setting GRPOConfig exposes (temperature, top-k, top-p, min-p,
the repetition penalty on a left-padded batch, suppressed tokens, with an EOS in the mix), draft trees and hybrid rows
(sampled learned drafts and one-hot lookups in the same step, in the same row) under two settings each; and mutation
controls that each must fail: q taken from the previous position, the residual one position off, the left-padded row's
padding rule flipped, the penalty's seen set one position late, a tree backbone's q taken from the depth above.
"""

import dataclasses
import functools
import inspect

import pytest
import torch
from scipy.stats import chisquare
from transformers import Qwen2Config, Qwen2ForCausalLM

import trl_tlt.engine.generate as engine_module
import trl_tlt.engine.rejection_sampler as rejection_module
from trl_tlt.drafters import HybridDrafter, ModelDrafter, PromptHistory
from trl_tlt.engine.draft import DRAFT_SOURCES
from trl_tlt.engine.generate import GENERATE_PENALISES_PADDING, SpeculativeEngine
from trl_tlt.engine.sampling import SamplingParams, process_logits
from trl_tlt.engine.speculation import FixedSpeculation


VOCAB = 8
PROMPT = [3, 5, 6, 3, 7]
SHORT_PROMPT = [6, 1, 5]  # left-padded to len(PROMPT) in the padded cases
LENGTH = 6  # tokens per completion: 1 from the prefill, then a step verifying up to K drafts
K = 4
NUM_SAMPLES = 4000
SEED = 1234
EOS = 4  # EOS in some cases: completions end inside accepted runs, at every position
FILL = VOCAB  # fills the positions after an EOS (a code outside the vocabulary)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Run this module's tiny models on one thread: as fast, and robust to a busy machine (with 2 threads on 2 cores
    shared with other processes, the threads' barriers stalled this file from ~20 s to over 200 s). The models and
    enumerated laws cached for the module are released after it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    for cached in (policy, twin, pad_token, exact_completions):
        cached.cache_clear()


def tiny_lm(noise: float = 0.0) -> Qwen2ForCausalLM:
    """The policy (noise = 0) or its perturbed twin: a random 2-layer Qwen2 over VOCAB tokens, float64, with its
    LM head scaled so that its next-token distributions are peaked, never one-hot, and change along the sequence."""
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=64, bos_token_id=None, eos_token_id=None, pad_token_id=None,
        tie_word_embeddings=False,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config).to(torch.float64).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)
        if noise:
            g = torch.Generator().manual_seed(100)
            model.lm_head.weight.add_(
                noise * torch.randn(model.lm_head.weight.shape, generator=g, dtype=torch.float64)
            )
    return model


@functools.cache
def policy() -> Qwen2ForCausalLM:
    return tiny_lm()


@functools.cache
def twin() -> Qwen2ForCausalLM:
    """The drafter's model: close enough that 4 drafts in a row are often accepted, far enough that each position
    also rejects."""
    return tiny_lm(noise=0.3)


@functools.cache
def pad_token() -> int:
    """The policy's favourite first token after SHORT_PROMPT, not in it: the pad token, so that whether the padded
    row's penalty counts it moves much probability."""
    with torch.no_grad():
        logits = policy()(torch.tensor([SHORT_PROMPT])).logits[0, -1]
    return int(logits.index_fill(0, torch.tensor(SHORT_PROMPT), float("-inf")).argmax())


@functools.cache
@torch.no_grad()
def exact_completions(
    prompt: tuple, params: SamplingParams, seen_extra: tuple = ()
) -> tuple[torch.Tensor, torch.Tensor]:
    """The law of the policy's completions of `prompt`, by enumerating its support: (sequences (N, max_new_tokens),
    FILL after an EOS; probabilities (N,)), the processed distribution applied token by token, with `seen_extra`
    counted as seen by the repetition penalty (the pad token of a left-padded row)."""
    model, length = policy(), params.max_new_tokens
    eos = torch.tensor(params.eos_token_ids or [-1])
    prefixes, probs = torch.zeros((1, 0), dtype=torch.long), torch.ones(1, dtype=torch.float64)
    done_sequences, done_probs = [], []
    for t in range(length):
        ids = torch.cat([torch.tensor(prompt).expand(len(prefixes), -1), prefixes], dim=1)
        seen = torch.zeros((len(ids), VOCAB), dtype=torch.bool).scatter_(1, ids, True)
        seen[:, list(seen_extra)] = True
        p = process_logits(model(ids, logits_to_keep=1).logits[:, -1], params, seen).exp()  # (P, V)
        joint = probs[:, None] * p
        rows, tokens = (joint > 0).nonzero(as_tuple=True)
        prefixes, probs = torch.cat([prefixes[rows], tokens[:, None]], dim=1), joint[rows, tokens]
        ended = torch.isin(tokens, eos) | (t == length - 1)
        done_sequences.append(torch.nn.functional.pad(prefixes[ended], (0, length - 1 - t), value=FILL))
        done_probs.append(probs[ended])
        prefixes, probs = prefixes[~ended], probs[~ended]
    sequences, probs = torch.cat(done_sequences), torch.cat(done_probs)
    assert abs(float(probs.sum()) - 1.0) < 1e-9
    return sequences, probs


def _codes(sequences: torch.Tensor) -> torch.Tensor:
    return (sequences * (VOCAB + 1) ** torch.arange(sequences.size(1))).sum(dim=1)


def chi_square_pvalue(completions: list[list[int]], law: tuple[torch.Tensor, torch.Tensor]) -> float:
    """Goodness of fit of whole completions to their exact law (`exact_completions`); cells with an expected count
    below 5 are pooled into one. A completion outside the support fails at once."""
    support, probs = law
    n, length = len(completions), support.size(1)
    samples = torch.tensor([c + [FILL] * (length - len(c)) for c in completions])
    counts = torch.bincount(_codes(samples), minlength=(VOCAB + 1) ** length)
    expected = torch.zeros(len(counts), dtype=torch.float64).index_put_((_codes(support),), n * probs)
    outside = (counts > 0) & (expected == 0)
    assert not outside.any(), f"completions of probability 0: {outside.nonzero().squeeze(1)[:5].tolist()}"
    big = expected >= 5
    observed, expected = counts[big].double(), expected[big]
    pooled = (n - observed.sum(), n - expected.sum())
    if pooled[1] > 1e-9 * n:  # the cells below 5, in one
        observed, expected = torch.cat([observed, pooled[0][None]]), torch.cat([expected, pooled[1][None]])
    return float(chisquare(observed.numpy(), expected.numpy()).pvalue)


class PositionCounts:
    """Per draft position j (0-based), the row-steps that accepted the draft at j and those that rejected it (chains:
    a draft at j verified and not accepted; trees: the walk stopped at depth j at a node with children), read by
    wrapping the engine's verification."""

    def __init__(self, monkeypatch):
        self.accepted, self.rejected = [], []
        chain, walk = engine_module.verify_drafts, engine_module.verify_tree

        def chain_spy(target_logprobs, draft_ids, num_drafts, *args, **kwargs):
            out = chain(target_logprobs, draft_ids, num_drafts, *args, **kwargs)
            self._count(out[0], lambda j: num_drafts > j, draft_ids.size(1))
            return out

        def tree_spy(target_logprobs, tree, depths, max_depth, *args, **kwargs):
            path, num_accepted, *rest = walk(target_logprobs, tree, depths, max_depth, *args, **kwargs)
            at = path.gather(1, (num_accepted - 1).clamp(min=0)[:, None]).squeeze(1) if max_depth else num_accepted
            node = torch.where(num_accepted > 0, at, 0)  # index of the node the walk stopped at (0: the root)
            has_children = (tree.valid & (tree.parents == node[:, None])).any(dim=1)
            self._count(num_accepted, lambda j: has_children, max_depth)
            return path, num_accepted, *rest

        monkeypatch.setattr(engine_module, "verify_drafts", chain_spy)
        monkeypatch.setattr(engine_module, "verify_tree", tree_spy)

    def _count(self, num_accepted, offered, width):
        for counts in (self.accepted, self.rejected):
            counts += [0] * (width - len(counts))
        for j in range(width):
            self.accepted[j] += int((num_accepted > j).sum())
            self.rejected[j] += int(((num_accepted == j) & offered(j)).sum())

    def check_later_positions(self, stats, last: int = K - 1):
        """Draft positions 1..last each accepted and rejected drafts (at least 20 row-steps each), as the engine's
        own per-position counter says too."""
        for j in range(1, last + 1):
            assert self.accepted[j] >= 20 and self.rejected[j] >= 20, (j, self.accepted, self.rejected)
            assert stats.num_accepted_tokens_per_pos[j] == self.accepted[j], (stats.num_accepted_tokens_per_pos, j)


def chain_engine(**kwargs) -> SpeculativeEngine:
    return SpeculativeEngine(policy(), drafter=ModelDrafter(twin(), VOCAB), num_speculative_tokens=K, **kwargs)


def tree_engine(depth: int, topk: int, verify: int, **kwargs) -> SpeculativeEngine:
    speculation = FixedSpeculation(depth, "default", topk, verify)
    return SpeculativeEngine(policy(), drafter=ModelDrafter(twin(), VOCAB), speculation=speculation, **kwargs)


def sample(engine, params, prompts, num_samples=NUM_SAMPLES, padded=False):
    """Completions of each prompt in `prompts` (num_samples in all, rows of one prompt side by side, one batch):
    (per prompt its completions, the call's stats). `padded`: the batch is GRPOTrainer's, left-padded to
    len(PROMPT) (shorter rows have seen the pad token)."""
    rows = [list(p) for p in prompts for _ in range(num_samples // len(prompts))]
    out = engine.generate(
        rows, params, generator=torch.Generator().manual_seed(SEED), padded_width=len(PROMPT) if padded else None
    )
    per_prompt = {tuple(p): [] for p in prompts}
    for row, completion in zip(rows, out.completion_ids, strict=True):
        per_prompt[tuple(row)].append(completion)
    return per_prompt, out.stats


def law(prompt, params, padded=False):
    """The exact law of `prompt`'s completions; a row shorter than the padded width has seen the pad token where the
    installed transformers' `generate` counts the padding (`GENERATE_PENALISES_PADDING`)."""
    pads = padded and len(prompt) < len(PROMPT) and params.uses_repetition_penalty and GENERATE_PENALISES_PADDING
    seen_extra = (pad_token(),) if pads else ()
    return exact_completions(tuple(prompt), params, seen_extra)


def check_fit(per_prompt, params, padded=False) -> dict:
    """Every prompt's completions fit its exact law (chi-square p > 1e-3); returns the p-values."""
    pvalues = {
        prompt: chi_square_pvalue(completions, law(prompt, params, padded))
        for prompt, completions in per_prompt.items()
    }
    assert all(p > 1e-3 for p in pvalues.values()), pvalues
    return pvalues


def completion_params(**kwargs) -> SamplingParams:
    return SamplingParams(max_new_tokens=LENGTH, **kwargs)


# The default run's sample size has power for errors at any draft position (the mutations below read p < 1e-40); the
# slow variants (`-m slow`) take 10 times more, for smaller biases.
SAMPLE_SIZES = [NUM_SAMPLES, pytest.param(10 * NUM_SAMPLES, marks=pytest.mark.slow, id="slow")]


CHAIN_PARAMS = {
    "temperature-eos": completion_params(temperature=0.8, eos_token_ids=(EOS,)),
    "top_k": completion_params(temperature=1.2, top_k=3),
    "top_p": completion_params(top_p=0.7),
    "min_p": completion_params(temperature=1.3, min_p=0.15),
    "suppress": completion_params(suppress_token_ids=(1, 6)),
}


@pytest.mark.parametrize("num_samples", SAMPLE_SIZES)
@pytest.mark.parametrize("params", list(CHAIN_PARAMS.values()), ids=list(CHAIN_PARAMS))
def test_chains_reproduce_the_policy_at_every_draft_position(params, num_samples, monkeypatch):
    """Chains of 4 sampled drafts (a `ModelDrafter`, q sampled) under each sampling setting: whole 6-token completions
    are distributed as the policy's. Guards against any indexing error in q, p, the acceptance test or the residual
    at draft positions >= 1 (the step after the prefill verifies drafts at positions 0-3; each position accepts and
    rejects), against the filters (top-k, top-p, min-p, suppressed tokens) applied differently at later positions,
    and against an EOS inside an accepted run."""
    counts = PositionCounts(monkeypatch)
    per_prompt, stats = sample(chain_engine(), params, [PROMPT], num_samples)
    counts.check_later_positions(stats)
    check_fit(per_prompt, params)
    if params.eos_token_ids:  # completions end at every position, and run to the budget too
        lengths = {len(c) for c in per_prompt[tuple(PROMPT)]}
        assert lengths == set(range(1, LENGTH + 1)), lengths


PENALTY = completion_params(repetition_penalty=2.0)


@pytest.mark.parametrize("num_samples", SAMPLE_SIZES)
def test_chains_under_the_repetition_penalty_on_left_padded_rows(num_samples, monkeypatch):
    """The repetition penalty on GRPOTrainer's left-padded batch: the short row (padded to len(PROMPT)) has seen the
    pad token where `generate` counts the padding (transformers < 5.23), at the prefill and at every draft position;
    the full-width row has not. Both
    rows' completions fit their exact laws (the short row's with the pad token seen; that law's first token is
    checked against transformers' `generate` on the padded batch). Guards against the seen set at draft position j
    (context + d_1..d_{j-1}) being built one position off or without the pad."""
    params, pad = PENALTY, pad_token()
    assert pad not in SHORT_PROMPT
    # The expected law's first token is `generate`'s on the left-padded batch (its logits processors, its padding).
    width = len(PROMPT)
    ids = torch.tensor([[pad] * (width - len(SHORT_PROMPT)) + SHORT_PROMPT, PROMPT])
    mask = torch.tensor([[0] * (width - len(SHORT_PROMPT)) + [1] * len(SHORT_PROMPT), [1] * width])
    out = policy().generate(
        input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=1,
        repetition_penalty=params.repetition_penalty, pad_token_id=pad, eos_token_id=None, output_scores=True,
        return_dict_in_generate=True,
    )  # fmt: skip
    for row, prompt in enumerate((SHORT_PROMPT, PROMPT)):
        support, probs = law(prompt, params, padded=True)
        first = torch.zeros(VOCAB, dtype=torch.float64).index_add_(0, support[:, 0], probs)
        torch.testing.assert_close(out.scores[0][row].double().softmax(-1), first, rtol=0, atol=1e-6)

    counts = PositionCounts(monkeypatch)
    per_prompt, stats = sample(chain_engine(pad_token_id=pad), params, [SHORT_PROMPT, PROMPT], num_samples, True)
    counts.check_later_positions(stats)
    check_fit(per_prompt, params, padded=True)


TREE_PARAMS = {
    "top_k-penalty-padded": completion_params(temperature=1.2, top_k=4, repetition_penalty=1.3),
    "top_p-min_p-eos": completion_params(top_p=0.9, min_p=0.05, eos_token_ids=(EOS,)),
}


@pytest.mark.parametrize("num_samples", SAMPLE_SIZES)
@pytest.mark.parametrize("params", list(TREE_PARAMS.values()), ids=list(TREE_PARAMS))
def test_trees_reproduce_the_policy_at_every_depth(params, num_samples, monkeypatch):
    """Draft trees 4 deep (a sampled backbone and top-2 side branches, 8 nodes verified): whole completions are
    distributed as the policy's, with paths accepted and walks stopped at depths 1-3. Guards against the backbone's
    q, the residual or p read at the wrong depth or node, and (penalty case, left-padded) against a node's seen set
    (context, pad, its own path) built wrong."""
    padded = params.uses_repetition_penalty
    prompts = [SHORT_PROMPT, PROMPT] if padded else [PROMPT]
    counts = PositionCounts(monkeypatch)
    engine = tree_engine(K, 2, 8, pad_token_id=pad_token())
    per_prompt, stats = sample(engine, params, prompts, num_samples, padded)
    assert stats.num_tree_steps == stats.num_target_forwards
    counts.check_later_positions(stats)
    check_fit(per_prompt, params, padded=padded)


class MixRecorder(HybridDrafter):
    """A `HybridDrafter` that records how its drafts mixed sources: rows drafting learned tokens only, lookups only,
    and both (a learned chain a lookup extends: sampled q then one-hot q in the same row)."""

    def propose(self, ctx, k):
        draft = super().propose(ctx, k)
        used = torch.arange(draft.source.size(1))[None] < draft.num_tokens[:, None]
        learned = ((draft.source == 0) & used).any(dim=1)
        lookup = ((draft.source != 0) & used).any(dim=1)
        for kind, rows in (("learned", learned & ~lookup), ("lookup", lookup & ~learned), ("mixed", learned & lookup)):
            self.mix[kind] = self.mix.get(kind, 0) + int(rows.sum())
        return draft


def hybrid_engine(params, prompts, pad_token_id=None) -> tuple[SpeculativeEngine, MixRecorder]:
    """A hybrid drafter: the twin drafts 2 sampled tokens, lookups (the prompt's history, 64 earlier completions, and
    the siblings) draft whole drafts or extend the learned chain to k = 4. Its running means start where a row whose
    siblings match 3 tokens drafts from that lookup; the others draft the learned chain, which a lookup matching 3
    tokens after it extends (one matching 2 does not: its means say it does not pay)."""
    history = PromptHistory(max_tokens=1 << 20)
    earlier = SpeculativeEngine(policy()).generate(
        [list(p) for p in prompts for _ in range(64)],
        dataclasses.replace(params, max_new_tokens=8, eos_token_ids=()),
        generator=torch.Generator().manual_seed(5),
    )
    history.add([list(p) for p in prompts for _ in range(64)], earlier.completion_ids)
    drafter = MixRecorder(ModelDrafter(twin(), VOCAB), history, min_match=2, learned_tokens=2, max_n=3, min_n=2)
    drafter.mix = {}
    siblings, history_source = DRAFT_SOURCES.index("siblings"), DRAFT_SOURCES.index("history")
    lookup_means = {(siblings, 3): 2.5, (history_source, 3): 1.5, (siblings, 2): 0.5, (history_source, 2): 0.5}
    drafter.values = {}
    for (source, n), mean in lookup_means.items():
        drafter.values[((source, n, K), "lookup")] = mean
        drafter.values[((source, n, K), "learned")] = 2.0
    drafter._steps = 1  # not an exploring step
    engine = SpeculativeEngine(policy(), drafter=drafter, num_speculative_tokens=K, pad_token_id=pad_token_id)
    return engine, drafter


HYBRID_PARAMS = {
    "temperature-suppress": completion_params(temperature=0.9, suppress_token_ids=(2,)),
    "penalty-top_p-padded": completion_params(top_p=0.85, repetition_penalty=1.4),
}


@pytest.mark.parametrize("num_samples", SAMPLE_SIZES)
@pytest.mark.parametrize("params", list(HYBRID_PARAMS.values()), ids=list(HYBRID_PARAMS))
def test_hybrid_rows_reproduce_the_policy_at_every_position(params, num_samples, monkeypatch):
    """Hybrid drafting: in one verification, rows with 2 sampled learned drafts then one-hot lookups (q sampled at
    positions 0-1, one-hot at 2-3), rows of lookups only and rows of learned drafts only; whole completions are
    distributed as the policy's. Guards against q, the residual or the one-hot mask read at the wrong position where
    sampled and one-hot drafts meet (past q's length in particular)."""
    padded = params.uses_repetition_penalty
    prompts = [SHORT_PROMPT, PROMPT] if padded else [PROMPT]
    counts = PositionCounts(monkeypatch)
    engine, drafter = hybrid_engine(params, prompts, pad_token_id=pad_token())
    per_prompt, stats = sample(engine, params, prompts, num_samples, padded)
    assert min(drafter.mix.values()) >= 100, drafter.mix  # every kind of row, in the same steps
    for source in ("learned", "siblings", "history"):
        assert stats.num_accepted_tokens_by_source[source] > 0, stats.num_accepted_tokens_by_source
    counts.check_later_positions(stats)
    check_fit(per_prompt, params, padded=padded)


# Mutation controls: each set-up is a positive test's above (same policy, drafter, seed, setting), which passes;
# with the mutation patched in, the same chi-square must fail.
MUTATION_PARAMS = CHAIN_PARAMS["temperature-eos"]


def test_mutation_q_from_the_previous_position_is_caught(monkeypatch):
    """Mutation caught: the draft at position j >= 1 verified against q_{j-1} (draft_probs shifted by one position
    along dim 1, in acceptance and residual). The first draft is untouched, so the 3-token tests miss it."""
    verify = engine_module.verify_drafts

    def q_shifted(target_logprobs, draft_ids, num_drafts, draft_probs, *args, **kwargs):
        if draft_probs is not None and draft_probs.size(1) > 1:
            draft_probs = torch.cat([draft_probs[:, :1], draft_probs[:, :-1]], dim=1)
        return verify(target_logprobs, draft_ids, num_drafts, draft_probs, *args, **kwargs)

    monkeypatch.setattr(engine_module, "verify_drafts", q_shifted)
    per_prompt, _ = sample(chain_engine(), MUTATION_PARAMS, [PROMPT])
    pvalue = chi_square_pvalue(per_prompt[tuple(PROMPT)], law(PROMPT, MUTATION_PARAMS))
    assert pvalue < 1e-6, pvalue


def mutant(module, name: str, old: str, new: str):
    """`module.name` (a function) with one line of its source replaced: the mutant runs the current code, mutated."""
    source = inspect.getsource(getattr(module, name))
    assert source.count(old) == 1, f"the line to mutate is gone from {name}: {old!r}"
    namespace = dict(vars(module))
    exec(compile(source.replace(old, new), module.__file__, "exec"), namespace)
    return namespace[name]


def test_mutation_residual_one_position_off_is_caught(monkeypatch):
    """Mutation caught: the corrected token after a rejection at position n sampled from max(p_{n+1} - q_{n+2}, 0)
    (in `verify_reference`, the residual's index `at` replaced by `at + 1`, clamped): a rejection at position 0 of 4
    drafts already reads q at position 1."""
    old, new = "at = num_accepted.clamp(max=max(k - 1, 0))", "at = (num_accepted + 1).clamp(max=max(k - 1, 0))"
    monkeypatch.setattr(rejection_module, "verify_reference", mutant(rejection_module, "verify_reference", old, new))
    monkeypatch.setenv("TRL_TLT_KERNELS", "torch")  # the reference runs, never the Triton kernel
    per_prompt, _ = sample(chain_engine(), MUTATION_PARAMS, [PROMPT])
    pvalue = chi_square_pvalue(per_prompt[tuple(PROMPT)], law(PROMPT, MUTATION_PARAMS))
    assert pvalue < 1e-6, pvalue


def test_mutation_padded_rows_penalty_rule_flipped_is_caught(monkeypatch):
    """Mutation caught: the engine applying the other padding rule than the installed transformers' `generate`
    (counting a short row's left padding as seen where `generate` skips it, or skipping it where `generate` counts it:
    `GENERATE_PENALISES_PADDING` flipped): the short row's pad token is penalised unlike with `generate`."""
    monkeypatch.setattr(engine_module, "GENERATE_PENALISES_PADDING", not GENERATE_PENALISES_PADDING)
    per_prompt, _ = sample(chain_engine(pad_token_id=pad_token()), PENALTY, [SHORT_PROMPT, PROMPT], padded=True)
    pvalue = chi_square_pvalue(per_prompt[tuple(SHORT_PROMPT)], law(SHORT_PROMPT, PENALTY, padded=True))
    assert pvalue < 1e-6, pvalue
    pvalue = chi_square_pvalue(per_prompt[tuple(PROMPT)], law(PROMPT, PENALTY, padded=True))
    assert pvalue > 1e-3, pvalue  # the full-width row is not padded: it fits as before


def test_mutation_penalty_seen_set_one_position_late_is_caught(monkeypatch):
    """Mutation caught: under the repetition penalty, the draft d_j counted as seen from position j + 2 on instead of
    j + 1 (`_seen_per_position`): p at every verified position after the first misses the draft just before it."""
    old = "out[:, j + 1 :].scatter_(2, draft_ids[:, j, None, None].expand(batch, k - j, 1), True)"
    new = "out[:, j + 2 :].scatter_(2, draft_ids[:, j, None, None].expand(batch, k - j - 1, 1), True)"
    monkeypatch.setattr(engine_module, "_seen_per_position", mutant(engine_module, "_seen_per_position", old, new))
    per_prompt, _ = sample(chain_engine(pad_token_id=pad_token()), PENALTY, [SHORT_PROMPT, PROMPT], padded=True)
    pvalues = [chi_square_pvalue(c, law(prompt, PENALTY, padded=True)) for prompt, c in per_prompt.items()]
    assert min(pvalues) < 1e-6, pvalues  # the short row fails by far (p ~ 1e-59), the full-width row too


def test_mutation_tree_backbone_q_from_the_depth_above_is_caught(monkeypatch):
    """Mutation caught: a tree's backbone node at depth d >= 2 tested against q of depth d - 1 (`DraftTree.probs`
    shifted by one depth), here at depths 2-4 (test_tree.py's 4-token completions reach depth 2 at most)."""
    walk = engine_module.verify_tree

    def q_shifted(target_logprobs, tree, *args, **kwargs):
        if tree.probs is not None and tree.probs.size(1) > 1:
            tree = dataclasses.replace(tree, probs=torch.cat([tree.probs[:, :1], tree.probs[:, :-1]], dim=1))
        return walk(target_logprobs, tree, *args, **kwargs)

    monkeypatch.setattr(engine_module, "verify_tree", q_shifted)
    params = TREE_PARAMS["top_p-min_p-eos"]
    per_prompt, _ = sample(tree_engine(K, 2, 8), params, [PROMPT])
    pvalue = chi_square_pvalue(per_prompt[tuple(PROMPT)], law(PROMPT, params))
    assert pvalue < 1e-6, pvalue
