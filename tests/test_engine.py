"""The speculative engine is lossless: greedy equality with `generate`, a chi-square test for sampling, exact
logprobs, full acceptance for a self-drafter, and clear errors on bad input."""

import pytest
import torch
from scipy.stats import chisquare
from testing_utils import (
    EOS,
    NUM_SAMPLES,
    SAMPLED_PROMPT,
    LyingDrafter,
    chi_square_pvalue,
    hf_greedy,
    make_drafter,
    peaked_model,
    random_prompts,
    sampling_case,
)

from trl_tlt.drafters import Draft, ModelDrafter, NgramDrafter
from trl_tlt.engine.generate import SpeculativeEngine
from trl_tlt.engine.sampling import SamplingParams, process_logits
from trl_tlt.tooling.tiny import build_tiny_model


@pytest.mark.parametrize("drafter_name", ["none", "ngram", "model", "eagle3"])
def test_greedy_matches_generate(tiny_model_f64, tokenizer, drafter_name):
    model = tiny_model_f64
    # Repeated prompts give the n-gram drafter siblings to copy from.
    prompts = random_prompts(8, model.config.vocab_size) * 2
    expected = hf_greedy(model, prompts, max_new_tokens=24)
    params = SamplingParams(do_sample=False, max_new_tokens=24, eos_token_ids=(EOS,))
    for batch in (1, 5, 16):
        for k in (1, 3, 7):
            engine = SpeculativeEngine(
                model, drafter=make_drafter(drafter_name, model, tokenizer), num_speculative_tokens=k
            )
            out = engine.generate(prompts[:batch], params)
            assert out.completion_ids == expected[:batch], (drafter_name, batch, k)
            if drafter_name == "none":
                break


def test_greedy_with_repetition_penalty_matches_generate(tokenizer):
    model = build_tiny_model(tokenizer, hidden_size=64, num_hidden_layers=2, dtype=torch.float64)
    prompts = random_prompts(4, model.config.vocab_size, seed=3)
    expected = hf_greedy(model, prompts, max_new_tokens=16, repetition_penalty=1.3)
    params = SamplingParams(do_sample=False, max_new_tokens=16, eos_token_ids=(EOS,), repetition_penalty=1.3)
    drafter = ModelDrafter(model, model.config.vocab_size)
    out = SpeculativeEngine(model, drafter=drafter, num_speculative_tokens=3).generate(prompts, params)
    assert out.completion_ids == expected


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7, top_k=6, max_new_tokens=3),
        SamplingParams(temperature=1.3, top_p=0.8, max_new_tokens=3, repetition_penalty=1.2),
        SamplingParams(temperature=1.0, min_p=0.05, max_new_tokens=3),
    ],
)
def test_logprobs_equal_plain_forward(tiny_model_f64, tokenizer, params):
    model = tiny_model_f64
    prompts = random_prompts(6, model.config.vocab_size, seed=1)
    drafter = make_drafter("model", model, tokenizer)
    out = SpeculativeEngine(model, drafter=drafter, num_speculative_tokens=2).generate(
        prompts, params, generator=torch.Generator().manual_seed(0)
    )
    for prompt, completion, logprobs in zip(prompts, out.completion_ids, out.logprobs, strict=True):
        ids = torch.tensor([prompt + completion])
        logits = model(ids).logits[0, len(prompt) - 1 : -1]  # (T, V)
        seen = torch.zeros_like(logits, dtype=torch.bool)
        for t in range(len(completion)):
            seen[t, ids[0, : len(prompt) + t]] = True
        expected = process_logits(logits, params, seen).gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(logprobs, dtype=torch.float64), expected)


def test_self_drafter_accepts_everything(tokenizer):
    model = build_tiny_model(tokenizer, hidden_size=64, num_hidden_layers=2, dtype=torch.float64)
    prompts = random_prompts(6, model.config.vocab_size, seed=2)
    k = 4
    for params in (
        SamplingParams(do_sample=False, max_new_tokens=23),
        SamplingParams(temperature=0.8, top_k=20, max_new_tokens=23),
    ):
        engine = SpeculativeEngine(
            model, drafter=ModelDrafter(model, model.config.vocab_size), num_speculative_tokens=k
        )
        out = engine.generate(prompts, params, generator=torch.Generator().manual_seed(0))
        stats = out.stats
        assert stats.num_accepted_tokens == stats.num_draft_tokens
        # 1 prefill token + 22 left: steps of k+1 = 5 tokens, the budget cuts the last draft to 1 token.
        assert all(len(c) == 23 for c in out.completion_ids)
        assert stats.num_target_forwards == 5
        assert stats.mean_acceptance_length == pytest.approx(1 + stats.num_accepted_tokens / stats.num_drafts)
        assert stats.num_accepted_tokens_per_pos[0] == stats.num_drafts


TOPK = SamplingParams(temperature=0.7, top_k=5, max_new_tokens=3)
TOPP_PENALTY = SamplingParams(temperature=1.3, top_p=0.6, max_new_tokens=3, repetition_penalty=1.3)
SLOW = (
    pytest.mark.slow
)  # the rest of the grid: CI's second stage (each drafter and each setting stays in the default run)


@pytest.mark.parametrize(
    ("drafter_name", "params"),
    [
        pytest.param("model", TOPK, id="model-temp0.7-topk5"),  # with the negative control
        pytest.param("model", TOPP_PENALTY, id="model-temp1.3-topp0.6-rep1.3", marks=SLOW),
        pytest.param("deterministic", TOPK, id="deterministic-temp0.7-topk5"),
        pytest.param("deterministic", TOPP_PENALTY, id="deterministic-temp1.3-topp0.6-rep1.3", marks=SLOW),
        pytest.param("eagle3", TOPK, id="eagle3-temp0.7-topk5", marks=SLOW),
        pytest.param("eagle3", TOPP_PENALTY, id="eagle3-temp1.3-topp0.6-rep1.3"),
    ],
)
def test_speculative_sampling_reproduces_policy_distribution(tokenizer, params, drafter_name):
    # Token 1 comes from the prefill; tokens 2-3 from one speculative step (the budget leaves room for 1 draft).
    model, expected, drafter = sampling_case(tokenizer, params, drafter_name, length=3)
    prompt, num_samples = SAMPLED_PROMPT, NUM_SAMPLES
    engine = SpeculativeEngine(model, drafter=drafter, num_speculative_tokens=3)
    out = engine.generate([prompt] * num_samples, params, generator=torch.Generator().manual_seed(1234))
    samples = [tuple(c) for c in out.completion_ids]
    assert 0 < out.stats.num_accepted_tokens < out.stats.num_draft_tokens  # both branches exercised
    assert chi_square_pvalue(samples, expected) > 1e-3

    if drafter_name == "model":  # the test has power: a drafter that misreports q is caught
        liar = LyingDrafter(peaked_model(tokenizer, noise=0.3), model.config.vocab_size)
        bad = SpeculativeEngine(model, drafter=liar, num_speculative_tokens=3).generate(
            [prompt] * num_samples, params, generator=torch.Generator().manual_seed(1234)
        )
        assert chi_square_pvalue([tuple(c) for c in bad.completion_ids], expected) < 1e-6


def test_edges(tiny_model_f64, tokenizer):
    model = tiny_model_f64
    prompts = random_prompts(4, model.config.vocab_size, seed=5)
    first = hf_greedy(model, prompts[:1], max_new_tokens=1)[0][0]
    drafter = ModelDrafter(model, model.config.vocab_size)
    engine = SpeculativeEngine(model, drafter=drafter, num_speculative_tokens=7)
    # EOS as the very first token.
    out = engine.generate(prompts[:1], SamplingParams(do_sample=False, max_new_tokens=10, eos_token_ids=(first,)))
    assert out.completion_ids == [[first]] and out.stats.num_target_forwards == 0
    # k beyond the remaining budget, and the budget ending inside an accepted run.
    for budget in (1, 2, 5):
        out = engine.generate(prompts, SamplingParams(do_sample=False, max_new_tokens=budget))
        assert [len(c) for c in out.completion_ids] == [budget] * len(prompts)
        assert out.completion_ids == [c[:budget] for c in hf_greedy(model, prompts, budget, min_new_tokens=budget)]
    with pytest.raises(ValueError, match="Prompt 1 is empty"):
        engine.generate([[5], []], SamplingParams(max_new_tokens=4))
    # Past max_position_embeddings, as `generate` does (rotary positions extrapolate).
    at_limit = prompts[0] * (model.config.max_position_embeddings // len(prompts[0]))
    out = engine.generate([at_limit], SamplingParams(do_sample=False, max_new_tokens=6))
    assert out.completion_ids == hf_greedy(model, [at_limit], 6, min_new_tokens=6)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=0.0)


def test_process_logits_matches_transformers_warpers():
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    g = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(4, 50, generator=g, dtype=torch.float64)
    input_ids = torch.randint(0, 50, (4, 7), generator=g)
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.85, min_p=0.02, repetition_penalty=1.2)
    seen = torch.zeros(4, 50, dtype=torch.bool).scatter_(1, input_ids, True)
    expected = logits.clone()
    for proc in (
        RepetitionPenaltyLogitsProcessor(1.2),
        TemperatureLogitsWarper(0.8),
        TopKLogitsWarper(20),
        TopPLogitsWarper(0.85),
        MinPLogitsWarper(0.02),
    ):
        expected = proc(input_ids, expected)
    torch.testing.assert_close(process_logits(logits, params, seen), torch.log_softmax(expected, -1))


def test_ngram_drafter_copies_from_prompt_and_siblings():
    from trl_tlt.drafters import DraftContext

    params = SamplingParams(max_new_tokens=8)
    prompt = [5, 6, 7, 8, 9]
    # Row 0 is ahead: its completion continues 5 6 7 8 9 -> 40 41 42; row 1 has just emitted 9.
    sequences = [prompt + [40, 41, 42, 43], prompt + [40]]
    ctx = DraftContext(sequences=sequences, row_ids=torch.tensor([0, 1]), group_ids=[0, 0], params=params)
    drafter = NgramDrafter(max_n=3, min_n=1)
    drafter.start(ctx)
    draft = drafter.propose(ctx, k=3)
    # Row 1's suffix (9, 40) was followed by 41 42 43 in its sibling; row 0's suffix (43) was never seen.
    assert draft.num_tokens.tolist() == [0, 3]
    assert draft.token_ids[1].tolist() == [41, 42, 43]
    assert draft.probs is None
    sequences[0].extend([5, 6])  # row 0 now repeats the prompt's start: the prompt continues it
    draft = drafter.propose(ctx, k=2)
    assert draft.num_tokens.tolist() == [2, 2] and draft.token_ids[0].tolist() == [7, 8]
    with pytest.raises(ValueError, match="min_n"):
        NgramDrafter(max_n=1, min_n=2)


def test_bandit_over_several_drafters_stays_lossless(tiny_model_f64, tokenizer):
    from trl_tlt.engine.speculation import BanditSpeculation

    model = tiny_model_f64
    prompts = random_prompts(6, model.config.vocab_size, seed=9) * 2
    expected = hf_greedy(model, prompts, max_new_tokens=20)
    drafters = {"ngram": make_drafter("ngram", model, tokenizer), "lm": make_drafter("model", model, tokenizer)}
    # A modelled cost (not wall time): the arms played, and so this test, are the same on every machine.
    selector = BanditSpeculation(
        arms=[("ngram", 2), ("lm", 1), ("lm", 3)], epsilon=0.5, seed=0, cost_model=lambda arm: 1.0 + arm.k
    )
    engine = SpeculativeEngine(model, drafter=drafters, speculation=selector)
    out = engine.generate(prompts, SamplingParams(do_sample=False, max_new_tokens=20, eos_token_ids=(EOS,)))
    assert out.completion_ids == expected
    assert {"ngram", "lm", None} <= set(out.stats.drafter_names)  # every kind of arm was played
    with pytest.raises(ValueError, match="speculation"):
        SpeculativeEngine(model, drafter=drafters)


def test_emitted_token_count_matches_completions(tiny_model_f64, tokenizer):
    model = tiny_model_f64
    prompts = random_prompts(6, model.config.vocab_size, seed=4)
    first = hf_greedy(model, prompts, max_new_tokens=3)
    eos = tuple({c[1] for c in first})  # an EOS inside accepted runs for some rows
    drafter = ModelDrafter(model, model.config.vocab_size)
    out = SpeculativeEngine(model, drafter=drafter, num_speculative_tokens=4).generate(
        prompts, SamplingParams(do_sample=False, max_new_tokens=12, eos_token_ids=eos)
    )
    # Tokens an accepted run held after EOS are not emitted, and not counted.
    assert out.stats.num_emitted_tokens == sum(len(c) for c in out.completion_ids)


class ShortDrafter(ModelDrafter):
    """Drafts k tokens but offers only the first one of each row (as the n-gram drafter does without a match)."""

    def propose(self, ctx, k):
        draft = super().propose(ctx, k)
        return Draft(draft.token_ids, draft.num_tokens.clamp(max=1), draft.probs)


def test_verification_covers_only_the_longest_draft(tiny_model_f64, tokenizer, monkeypatch):
    from trl_tlt.engine.kv_cache import RaggedKVModel

    model = tiny_model_f64
    prompts = random_prompts(5, model.config.vocab_size, seed=6)
    widths = []
    extend = RaggedKVModel.extend

    def spy(self, input_ids, valid, **kwargs):
        if self.model is model:  # the policy's verification forwards, not the drafter's own
            widths.append(input_ids.size(1))
        return extend(self, input_ids, valid, **kwargs)

    monkeypatch.setattr(RaggedKVModel, "extend", spy)
    drafter = ShortDrafter(make_drafter("model", model, tokenizer).model, model.config.vocab_size)
    params = SamplingParams(do_sample=False, max_new_tokens=16, eos_token_ids=(EOS,))
    out = SpeculativeEngine(model, drafter=drafter, num_speculative_tokens=4).generate(prompts, params)
    assert out.completion_ids == hf_greedy(model, prompts, max_new_tokens=16)
    assert widths and max(widths) == 2  # the last token and one draft, not k + 1 = 5 positions


def test_growing_cache_layer_appends_in_place_and_equals_concatenation():
    """`GrowingLayer` (the engine's cache) holds what `DynamicLayer` holds after appends, batch selections and
    crops, and writes appends into its spare room (no copy of the cache) until the room runs out."""
    from transformers.cache_utils import DynamicLayer

    from trl_tlt.engine.kv_cache import GrowingLayer

    g = torch.Generator().manual_seed(0)
    grow, plain = GrowingLayer(), DynamicLayer()

    def append(n, batch=3):
        k, v = torch.randn(batch, 2, n, 4, generator=g), torch.randn(batch, 2, n, 4, generator=g)
        out = grow.update(k, v)
        ref = plain.update(k, v)
        assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])

    append(10)
    storage = grow.keys.data_ptr()
    for _ in range(20):
        append(1)
    assert grow.keys.data_ptr() == storage  # 30 positions fit the room of the first allocation: written in place
    append(100)  # past the room: one larger buffer
    rows = torch.tensor([2, 0])
    grow.batch_select_indices(rows)
    plain.batch_select_indices(rows)
    append(2, batch=2)  # after a selection the new tensors are adopted into a fresh buffer
    grow.crop(-5)
    plain.crop(-5)
    append(3, batch=2)  # a crop keeps the buffer; the next append overwrites the dropped positions
    assert grow.get_seq_length() == plain.get_seq_length() == 130 + 2 - 5 + 3
    # `reserve` (the EAGLE-3 draft session's scratch room): past the room it moves the cache into a larger buffer
    # once; scratch written past the cache is not part of it and the next append does not move it again.
    cached = grow.keys.clone()
    keys, _ = grow.reserve(500)
    assert torch.equal(grow.keys, cached) and grow.keys.data_ptr() == keys.data_ptr()
    keys[:, :, grow.get_seq_length() :] = float("nan")
    append(1, batch=2)
    assert grow.keys.data_ptr() == keys.data_ptr()


def test_sample_categorical_draws_from_the_distribution():
    """The drafters' sampler (inverse CDF, one uniform per row) is exact: chi-square against the distribution, never
    a zero-probability token (first or last), unnormalised rows fine."""
    from trl_tlt.engine.sampling import sample_categorical

    g = torch.Generator().manual_seed(0)
    probs = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.3, 0.0], dtype=torch.float64)
    n = 20000
    draws = sample_categorical((3.0 * probs).expand(n, -1), g)  # unnormalised: sums to 3
    counts = torch.bincount(draws, minlength=probs.numel())
    assert counts[probs == 0].sum() == 0
    keep = probs > 0
    assert chisquare(counts[keep].numpy(), (n * probs[keep]).numpy()).pvalue > 1e-3
    one_hot = torch.zeros(4, 6)
    one_hot[:, 5] = 1.0
    assert sample_categorical(one_hot, g).tolist() == [5, 5, 5, 5]
