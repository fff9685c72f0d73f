"""Exactness at the edges: draws the tests rarely see, faults past the first draft position, the repetition penalty on
left-padded rows. Each test names the mutation it catches (run once against the mutated code: it failed)."""

import os

import pytest
import torch

from trl_tlt.drafters import Draft, ModelDrafter
from trl_tlt.engine.generate import GENERATE_PENALISES_PADDING, SpeculativeEngine
from trl_tlt.engine.rejection_sampler import verify_reference
from trl_tlt.engine.sampling import SamplingParams, process_logits
from trl_tlt.engine.tree import DraftTree, checked_tree, depths_from_ancestors, verify_tree


def impossible_draft_case(has_q: bool):
    """One row, two draft positions, the draft at position 0 has target probability 0 (outside top-k, say)."""
    logp = torch.log_softmax(torch.tensor([[[0.0, 1.0, 2.0, 3.0]] * 3]), dim=-1)
    logp[0, 0, 1] = float("-inf")
    drafts = torch.tensor([[1, 2]])
    q = torch.full((1, 2, 4), 0.25) if has_q else None
    zeros_accept, zeros_sample = torch.zeros(1, 2), torch.zeros(1)
    return logp, drafts, torch.tensor([2]), q, zeros_accept, zeros_sample


@pytest.mark.parametrize("has_q", [True, False], ids=["sampled", "one-hot"])
def test_a_zero_uniform_never_accepts_an_impossible_draft(has_q):
    """Mutation caught: the acceptance test written `u * q <= p` (torch.rand returns exactly 0.0 about once in 2^24
    float32 draws; then a draft with p = 0 was accepted and emitted with logprob -inf)."""
    case = impossible_draft_case(has_q)
    num_accepted, _, emitted = verify_reference(*case)
    assert num_accepted.tolist() == [0]
    assert torch.isfinite(emitted[0, 0])
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        from trl_tlt.kernels import verify_triton

        assert verify_triton(*case)[0].tolist() == [0]


def test_a_zero_uniform_never_accepts_an_impossible_tree_node(monkeypatch):
    """Mutation caught: the tree walk's backbone test written `u * q <= p`."""
    vocab = 4
    logp = torch.log_softmax(torch.tensor([[[0.0, 1.0, 2.0, 3.0]] * 2]), dim=-1)
    logp[0, 0, 1] = float("-inf")  # the backbone's token has p = 0 at the root
    tree = DraftTree(
        token_ids=torch.tensor([[1]]),
        parents=torch.tensor([[0]]),
        valid=torch.tensor([[True]]),
        sampled=torch.tensor([[True]]),
        probs=torch.full((1, 1, vocab), 0.25),
    )
    tree, ancestors, _ = checked_tree(tree, vocab, max_depth=1)
    monkeypatch.setattr(torch, "rand", lambda *shape, **kwargs: torch.zeros(*shape, dtype=kwargs.get("dtype")))
    _, num_accepted, next_tokens, emitted = verify_tree(logp, tree, depths_from_ancestors(ancestors), 1, True)
    assert num_accepted.tolist() == [0]
    assert next_tokens.tolist() != [1] and torch.isfinite(emitted[0, 0])


def test_a_fault_at_a_later_position_cuts_the_draft_there():
    """Mutation caught: `checked_draft` dropping a row's whole draft for a fault at a later position. A user drafter
    whose q at position 2 breaks whenever d_1 = 3: rows dropped whole are a biased selection of their first tokens
    (the first token then reads about .04/.28/.35/.33 against p = .1/.2/.3/.4); cut at position 2, d_1 is verified
    on every row and the first token is distributed as p."""
    from scipy.stats import chisquare

    from trl_tlt.engine.draft import checked_draft

    rows, vocab = 40_000, 4
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    q = torch.full((vocab,), 0.25, dtype=torch.float64)
    draft_ids = torch.multinomial(q, 2 * rows, replacement=True, generator=g).view(rows, 2)
    probs = q.expand(rows, 2, vocab).clone()
    probs[draft_ids[:, 0] == 3, 1] = float("nan")  # the fault at position 2 depends on d_1
    checked = checked_draft(Draft(draft_ids, torch.full((rows,), 2), probs), vocab)
    ids, q_safe, num_drafts = checked[0], checked[1], checked[3]
    logp = p.log().expand(rows, 3, vocab)
    uniforms = (
        torch.rand(rows, 2, generator=g, dtype=torch.float64),
        torch.rand(rows, generator=g, dtype=torch.float64),
    )
    num_accepted, next_tokens, _ = verify_reference(logp, ids, num_drafts, q_safe, *uniforms)
    first = torch.where(num_accepted > 0, ids[:, 0], next_tokens)
    observed = torch.bincount(first, minlength=vocab).double()
    assert chisquare(observed, p * rows).pvalue > 1e-3
    faulty = draft_ids[:, 0] == 3
    assert num_drafts[faulty].eq(1).all() and num_drafts[~faulty].eq(2).all()  # cut at the fault, d_1 kept


class LaterPositionFaultDrafter(ModelDrafter):
    """The policy drafting for itself (accepted in full under greedy decoding), with q NaN from position 2 on."""

    def propose(self, ctx, k):
        draft = super().propose(ctx, k)
        probs = draft.probs.clone()
        probs[:, 1:] = float("nan")
        return Draft(draft.token_ids, draft.num_tokens, probs)


def test_a_later_fault_keeps_the_drafts_before_it(tiny_model_f64):
    """Mutation caught: the whole draft dropped for a fault at position 2 (nothing was then ever accepted)."""
    from testing_utils import EOS, hf_greedy, random_prompts

    model = tiny_model_f64
    prompts = random_prompts(5, model.config.vocab_size, seed=6)
    params = SamplingParams(do_sample=False, max_new_tokens=12, eos_token_ids=(EOS,))
    drafter = LaterPositionFaultDrafter(model, model.config.vocab_size)
    out = SpeculativeEngine(model, drafter=drafter, num_speculative_tokens=3).generate(prompts, params)
    assert out.completion_ids == hf_greedy(model, prompts, max_new_tokens=12)
    assert out.stats.num_invalid_drafts > 0
    assert out.stats.num_accepted_tokens_per_pos[0] > 0 and out.stats.num_accepted_tokens_per_pos[1] == 0


def test_a_tree_backbone_is_cut_at_its_first_broken_depth():
    """Mutation caught: `checked_tree` demoting the whole backbone for a q that breaks at depth 2 (whether the depth-1
    node is tested against q would then depend on what the drafter did after sampling it, as for a chain)."""
    vocab = 5
    probs = torch.full((1, 2, vocab), 0.2)
    probs[0, 1] = float("nan")
    tree = DraftTree(
        token_ids=torch.tensor([[1, 2, 3]]),
        parents=torch.tensor([[0, 1, 0]]),  # backbone: node 0 (depth 1) -> node 1 (depth 2); node 2: a side branch
        valid=torch.tensor([[True, True, True]]),
        sampled=torch.tensor([[True, True, False]]),
        probs=probs,
    )
    safe, _, rows_ok = checked_tree(tree, vocab, max_depth=2)
    assert rows_ok.tolist() == [True] and safe.valid.all()
    assert safe.sampled.tolist() == [[True, False, False]]
    assert torch.isfinite(safe.probs).all() and safe.probs[0, 0].eq(0.2).all()


def test_the_repetition_penalty_sees_the_left_padding_as_generate_does(tiny_model_f64):
    """On GRPOTrainer's left-padded batch the engine's processed logprobs equal `generate`'s, whichever padding rule
    the installed transformers applies (`GENERATE_PENALISES_PADDING`). Mutation caught before 5.23: the engine's seen
    tokens built from the unpadded prompt (`padded_width` ignored)."""
    from testing_utils import random_prompts

    model = tiny_model_f64
    pad = 5
    prompts = random_prompts(6, model.config.vocab_size, seed=2)
    width = max(map(len, prompts)) + 2  # as with pad_to_multiple_of: every row padded
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = (torch.arange(width)[None] >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    out = model.generate(
        input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=6, repetition_penalty=1.3,
        pad_token_id=pad, eos_token_id=None, output_scores=True, return_dict_in_generate=True,
    )  # fmt: skip
    expected = torch.stack([torch.log_softmax(s.double(), -1) for s in out.scores], dim=1)  # (B, T, V)
    tokens = out.sequences[:, width:]
    expected = expected.gather(-1, tokens[..., None]).squeeze(-1)
    params = SamplingParams(do_sample=False, max_new_tokens=6, repetition_penalty=1.3)
    result = SpeculativeEngine(model, drafter=None, pad_token_id=pad).generate(prompts, params, padded_width=width)
    assert result.completion_ids == tokens.tolist()
    # generate processes float32 logits: agreement to float32 round-off (the unpadded penalty is ~1e-4 off)
    torch.testing.assert_close(torch.tensor(result.logprobs, dtype=torch.float64), expected, rtol=0, atol=1e-6)


def test_both_trainers_penalise_the_padding_of_short_prompts_alike(tiny_model_dirs, tmp_path):
    """Mutation caught: the trainer not passing GRPOTrainer's padded width to the engine. A policy whose pad token is
    as likely as its favourite first token; repetition_penalty=3.0 in the config: on the row GRPOTrainer left-pads,
    the pad token first is rare with `generate` (it is penalised), and was 1 in 2 with the engine before the fix.
    From transformers 5.23 `generate` skips the padding: both trainers then sample the pad token first alike, often."""
    from datasets import Dataset
    from scipy.stats import binomtest
    from testing_utils import config_kwargs, reward_len
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from trl_tlt import TLTConfig, TLTGRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dirs["qwen2"])
    pad = tokenizer.pad_token_id
    short, long = tokenizer("1 2")["input_ids"], tokenizer("The quick brown fox jumps")["input_ids"]
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dirs["qwen2"])
    with torch.no_grad():  # the favourite first token made likely, the pad token's LM-head row a copy of its row
        logits = policy(torch.tensor([short])).logits[0, -1]
        favourite = int(logits.argmax())
        policy.lm_head.weight[favourite] *= 6.0 / float(logits[favourite])  # its logit: 6
        policy.lm_head.weight[pad] = policy.lm_head.weight[favourite]
    policy.save_pretrained(tmp_path / "policy")
    tokenizer.save_pretrained(tmp_path / "policy")
    kwargs = config_kwargs(tmp_path, max_completion_length=1, repetition_penalty=3.0, seed=1)
    pad_first = {}
    for name, trainer_cls, config_cls, extra in (
        ("grpo", GRPOTrainer, GRPOConfig, {}),
        ("tlt", TLTGRPOTrainer, TLTConfig, {"drafter_type": "none"}),
    ):
        trainer = trainer_cls(
            model=AutoModelForCausalLM.from_pretrained(tmp_path / "policy"),
            reward_funcs=reward_len,
            args=config_cls(**kwargs, **extra),
            train_dataset=Dataset.from_dict({"prompt": ["1 2"] * 8}),
        )
        completions, _ = trainer._generate_single_turn([short, long] * 200, None, {}, 1)
        pad_first[name] = sum(c[:1] == [pad] for c in completions[0::2])
    # The exact probability on the padded row: the processed distribution after [pad] * (width - 2) + short.
    width = len(long)
    ids = torch.tensor([[pad] * (width - len(short)) + short])
    mask = (ids != pad).long()
    with torch.no_grad():
        logits = policy(input_ids=ids, attention_mask=mask).logits[:, -1].float()
    seen_ids = ids if GENERATE_PENALISES_PADDING else torch.tensor([short])  # transformers >= 5.23: padding skipped
    seen = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, seen_ids, True)
    expected = process_logits(logits, SamplingParams(repetition_penalty=3.0), seen)[0, pad].exp().item()
    if GENERATE_PENALISES_PADDING:
        assert expected < 0.05  # penalised: the unpadded long row keeps it near 1/2
    for name, count in pad_first.items():
        assert binomtest(count, 200, expected).pvalue > 1e-4, (name, count, expected)


def test_a_models_own_sampling_settings_merge_as_in_generate(tiny_model_dirs, tmp_path, monkeypatch):
    """Mutation caught: the engine taking the model's generation_config.json as it is (Qwen2.5-Instruct's carries a
    repetition penalty of 1.05). GRPOTrainer's `generate` merges it with the config's settings, which override it
    (here: no penalty, no top-k); the engine's `SamplingParams` must equal what `generate`'s processors apply."""
    from datasets import Dataset
    from testing_utils import config_kwargs, reward_len
    from transformers import AutoModelForCausalLM
    from transformers.generation import utils as generation_utils
    from trl import GRPOConfig, GRPOTrainer

    from trl_tlt import TLTConfig, TLTGRPOTrainer
    from trl_tlt.trainer.generation_settings import sampling_params

    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dirs["qwen2"])
    config = policy.generation_config
    config.do_sample, config.repetition_penalty, config.top_k = True, 1.05, 7
    policy.save_pretrained(tmp_path / "policy")
    built = []
    original = generation_utils.GenerationMixin._get_logits_processor

    def record(self, *args, **kwargs):
        processors = original(self, *args, **kwargs)
        built.append({type(p).__name__: p for p in processors})
        return processors

    monkeypatch.setattr(generation_utils.GenerationMixin, "_get_logits_processor", record)
    trainers = {}
    for name, trainer_cls, config_cls in (("grpo", GRPOTrainer, GRPOConfig), ("tlt", TLTGRPOTrainer, TLTConfig)):
        trainers[name] = trainer_cls(
            model=AutoModelForCausalLM.from_pretrained(tmp_path / "policy"),
            reward_funcs=reward_len,
            args=config_cls(**config_kwargs(tmp_path, max_completion_length=2)),
            train_dataset=Dataset.from_dict({"prompt": ["1 2"] * 8}),
        )
    trainers["grpo"]._generate_single_turn([[5, 6, 7]], None, {}, 1)
    processors = built[-1]
    with trainers["tlt"]._unwrapped_for_generation() as unwrapped:
        params = sampling_params(unwrapped, trainers["tlt"].generation_config)
    assert params.repetition_penalty == 1.0 and params.top_k is None  # TRL's own settings win over the model's
    penalty = processors.get("RepetitionPenaltyLogitsProcessor")
    assert params.repetition_penalty == (penalty.penalty if penalty is not None else 1.0)
    top_k = processors.get("TopKLogitsWarper")
    assert params.top_k == (top_k.top_k if top_k is not None else None)


def test_prompt_ids_the_lm_head_does_not_score_are_left_out_of_the_penalty():
    """An embedding larger than the LM head (prompt or pad ids at or above its width): `generate` drops them from the
    repetition penalty (they cannot be sampled); the engine's seen set did `seen[row, id]` and raised IndexError."""
    from trl_tlt.engine.generate import _prompt_tokens

    seen = _prompt_tokens([[1, 9, 3], [2]], 8, "cpu", 3, 9)
    assert seen[0].nonzero().flatten().tolist() == [1, 3]
    assert seen[1].nonzero().flatten().tolist() == [2]  # the pad id (9) is not scored either
