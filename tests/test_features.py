"""Drafter training on what the rollout computed: the layer tap, the engine's feature record, the buffer's staleness
and memory rules, head-only spot steps, the time budget's trend, and the warm start's budgets."""

import random

import pytest
import torch

from trl_tlt.drafters.eagle3 import Eagle3Drafter, Eagle3Model
from trl_tlt.engine import FixedSpeculation, SamplingParams, SpeculativeEngine
from trl_tlt.engine.features import FeatureRecorder
from trl_tlt.engine.kv_cache import LayerTap, RaggedKVModel
from trl_tlt.tooling.tiny import build_tiny_model
from trl_tlt.training.distillation import DistillConfig, DrafterSample, policy_features, recorded_features
from trl_tlt.training.spot import DataBuffer, SpotBudget, SpotSchedule, SpotTrainer
from trl_tlt.training.warm_start import generate_samples, train_drafter


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def policy(request, tokenizer):
    return build_tiny_model(tokenizer, arch=request.param, hidden_size=64, num_hidden_layers=4, num_attention_heads=2)


def test_the_tap_keeps_exactly_the_hidden_states_transformers_reports(policy):
    """Layer id i < L is decoder layer i's input, L the final norm's output: as `output_hidden_states` numbers them.
    Mutation: tap each layer's output instead of its input and ids 1..3 differ."""
    ids = torch.tensor([[5, 9, 17, 3, 40, 2]])
    reference = policy(ids, output_hidden_states=True).hidden_states
    layers = [0, 1, 3, 4]
    tap = LayerTap(policy, layers)
    assert tap.supported
    with tap.capture() as states:
        policy(ids)
    assert sorted(states) == layers
    for i in layers:
        torch.testing.assert_close(states[i], reference[i], rtol=0, atol=0)
    runner = RaggedKVModel(policy, hidden_layers=[1, 4])
    runner.prefill([[5, 9, 17], [3, 40]])
    assert sorted(runner.hidden_states) == [1, 4]  # only those kept
    with pytest.raises(ValueError, match="num_hidden_layers"):
        LayerTap(policy, [5])


def test_a_model_whose_hooks_disagree_is_read_through_output_hidden_states(policy, monkeypatch):
    """A decoder that scales the stream outside its layers (the hooks would see other states): found by the one-time
    check, and the runner falls back to every layer's states, keeping those asked for."""
    monkeypatch.setattr(LayerTap, "_checked", type(LayerTap._checked)())
    monkeypatch.setattr(LayerTap, "_matches", lambda self, model: False)
    runner = RaggedKVModel(policy, hidden_layers=[1, 4])
    assert runner.output_hidden_states and not runner.tap.supported
    runner.prefill([[5, 9, 17]])
    reference = policy(torch.tensor([[5, 9, 17]]), output_hidden_states=True).hidden_states
    torch.testing.assert_close(runner.hidden_states[1], reference[1])


@pytest.mark.parametrize("arm", ["chain", "tree"])
def test_recorded_features_equal_a_forward_over_the_finished_sequences(policy, arm):
    """Every position of every row, prompt and completion (a sampled rollout with an EAGLE-3 head drafting k = 3:
    rows accept different numbers of drafts, some end at EOS mid-step, a tree walk reorders its path), holds the
    states a plain forward over the whole sequence gives. Mutation: record every verified position instead of the
    kept ones, and rows drift out of alignment."""
    torch.manual_seed(0)
    head = Eagle3Model.for_policy(policy)
    speculation = FixedSpeculation(3, "default") if arm == "chain" else FixedSpeculation(3, "default", 2, 6)
    engine = SpeculativeEngine(policy, drafter=Eagle3Drafter(head), speculation=speculation)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randint(2, 9))] for _ in range(6)]
    params = SamplingParams(max_new_tokens=24, temperature=1.0, do_sample=True, eos_token_ids=(7,))
    layers = [*head.aux_layer_ids, 4]
    out = engine.generate(prompts, params, generator=torch.Generator().manual_seed(1), record_layers=layers)
    assert out.stats.num_drafts > 0
    for prompt, completion, states in zip(prompts, out.completion_ids, out.features, strict=True):
        sample = DrafterSample(prompt + completion, len(prompt))
        assert states.shape == (len(sample.token_ids) - 1, len(layers), 64)
        assert states.untyped_storage().nbytes() == states.nbytes  # its own memory: dropping it frees it
        (expected,) = policy_features(policy, [sample], head.aux_layer_ids)
        got = recorded_features(DrafterSample(sample.token_ids, len(prompt), states, 0), True, "cpu")
        torch.testing.assert_close(got.aux, expected.aux[:-1], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got.last[:-1], expected.last[:-1], rtol=1e-4, atol=1e-4)


def test_keeping_only_the_heads_layers_changes_nothing_sampled(policy):
    """Same completions and acceptance whether the engine keeps every layer's states (as before) or only the head's."""

    class EveryLayer(Eagle3Drafter):
        hidden_layers = None

    torch.manual_seed(0)
    head = Eagle3Model.for_policy(policy)
    params = SamplingParams(max_new_tokens=16, temperature=1.0, do_sample=True)
    prompts = [[5, 9, 17], [3, 40, 41, 42], [8]]
    outs = [
        SpeculativeEngine(policy, drafter=cls(head), num_speculative_tokens=3).generate(
            prompts, params, generator=torch.Generator().manual_seed(0)
        )
        for cls in (EveryLayer, Eagle3Drafter)
    ]
    assert outs[0].completion_ids == outs[1].completion_ids
    assert outs[0].stats.num_accepted_tokens == outs[1].stats.num_accepted_tokens


def test_features_from_a_padded_forward_are_each_sequences_own(policy):
    """`SequenceFeatures` records, from one forward over left- and right-padded rows (the layout of GRPOTrainer's
    batch, which the check of vLLM's samples runs over), each row's states at every position but the last: equal to
    a forward over the row alone. A row is claimed by its tokens or by a prefix (a tool turn's row); a row with a hole
    in its mask, or past the memory bound, is not recorded. Mutation: keep the positions the mask leaves out (the
    padding) and the states misalign."""
    from trl_tlt.engine.features import SequenceFeatures

    rows = [[5, 9, 17, 3, 40], [8, 21, 22], [30, 31, 32, 33]]
    prompt_width, completion_width = 3, 3
    ids = torch.zeros((4, prompt_width + completion_width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    split = [3, 1, 2]  # each row's prompt length: prompts left-padded, completions right-padded
    for i, (row, p) in enumerate(zip(rows, split, strict=True)):
        ids[i, prompt_width - p : prompt_width + len(row) - p] = torch.tensor(row)
        mask[i, prompt_width - p : prompt_width + len(row) - p] = 1
    ids[3], mask[3] = torch.tensor([4, 5, 6, 7, 8, 9]), torch.tensor([1, 1, 0, 1, 1, 1])  # a hole
    layers = [1, 3, 4]
    sink = SequenceFeatures(layers)
    with torch.no_grad(), sink.recording(policy):
        policy(input_ids=ids, attention_mask=mask)
    for row in rows:
        reference = policy(torch.tensor([row]), output_hidden_states=True).hidden_states
        expected = torch.stack([reference[i][0, :-1] for i in layers], dim=1)
        torch.testing.assert_close(sink.claim(row), expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(sink.claim(rows[0][:3]), sink.claim(rows[0])[:2])  # a prefix: its own positions
    assert sink.claim([4, 5, 6, 7, 8, 9]) is None and sink.claim([7, 8, 9]) is None  # the row with a hole
    assert sink.claim([5, 9, 18]) is None
    bounded = SequenceFeatures(layers, max_bytes=sink.claim(rows[0]).nbytes)
    with torch.no_grad(), bounded.recording(policy):
        policy(input_ids=ids, attention_mask=mask)
    assert (
        bounded.claim(rows[0]) is not None
        and bounded.claim(rows[1]) is None
        and bounded.num_bytes <= bounded.max_bytes
    )


def test_padding_a_packed_row_changes_no_loss_or_gradient(policy):
    """`pack(pad_to_multiple_of=)` (what a bf16 drafter step uses, so that oneDNN meets few shapes): the padding is
    attended by no sample and in no loss. Mutation: give padding a sample id and the loss changes."""
    from trl_tlt.training.distillation import eagle3_loss, pack

    torch.manual_seed(0)
    head = Eagle3Model.for_policy(policy)
    prompts, completions, features = recorded_rollout(policy, head, rows=3)
    samples = [DrafterSample(p + c, len(p), f, 0) for p, c, f in zip(prompts, completions, features, strict=True)]
    views = [recorded_features(s, True, "cpu") for s in samples]
    weight = policy.get_output_embeddings().weight
    results = []
    for multiple in (1, 64):
        (row,) = pack(views, 1 << 20, pad_to_multiple_of=multiple)
        assert row.input_ids.size(1) % multiple == 0
        head.zero_grad()
        loss, _ = eagle3_loss(head, weight, row, DistillConfig(ttt_length=3), agreement=False)
        loss.backward()
        results.append((loss.detach(), head.fc.weight.grad.clone()))
    assert results[1][0] == pytest.approx(float(results[0][0]), rel=1e-5)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=1e-4, atol=1e-6)


def test_a_bf16_drafter_step_trains_float32_weights_to_the_same_loss(policy):
    """`autocast_dtype=torch.bfloat16` (`spot_precision`): the weights and optimizer stay float32, the losses follow
    float32's within bf16's rounding, and the head learns. Mutation: cast the head to bf16 instead and its weights'
    dtype changes."""
    torch.manual_seed(0)
    head = Eagle3Model.for_policy(policy)
    prompts, completions, features = recorded_rollout(policy, head)
    losses = {}
    for dtype in (None, torch.bfloat16):
        spot = SpotTrainer(
            Eagle3Model.for_policy(policy), DataBuffer(window=1), schedule=SpotSchedule(learning_rate=1e-3), seed=0,
            autocast_dtype=dtype,
        )  # fmt: skip
        spot.drafter.load_state_dict(head.state_dict())
        spot.observe_rollout(prompts, completions, features, version=0)
        losses[dtype] = [spot.step(policy) for _ in range(12)]
        assert all(p.dtype == torch.float32 for p in spot.drafter.parameters())
    assert losses[torch.bfloat16] == pytest.approx(losses[None], abs=0.1 * losses[None][0])
    assert losses[torch.bfloat16][-1] < losses[torch.bfloat16][0]


def test_bf16_matrix_units_are_detected_per_device(monkeypatch):
    """`spot_precision="auto"`: bf16 where the device multiplies bf16 natively, float32 elsewhere."""
    from trl_tlt.trainer.build import has_bf16_matrix_units

    for name in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"):
        monkeypatch.setattr(torch.cpu, name, lambda: False, raising=False)
    assert not has_bf16_matrix_units(torch.device("cpu"))
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True, raising=False)
    assert has_bf16_matrix_units(torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for capability, expected in (((7, 5), False), ((8, 0), True), ((9, 0), True)):  # T4 emulates bf16; A100, H100
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert has_bf16_matrix_units(torch.device("cuda")) is expected
    assert not has_bf16_matrix_units(torch.device("meta"))


# ------------------------------------------------------------------------------------------ spot training
def recorded_rollout(policy, head, rows=8, seed=0):
    prompts = [[3 + (seed + i) % 50, 9, 17 + i] for i in range(rows)]
    params = SamplingParams(max_new_tokens=20, temperature=1.0, do_sample=True)
    layers = [*head.aux_layer_ids, policy.config.num_hidden_layers]
    out = SpeculativeEngine(policy).generate(
        prompts, params, generator=torch.Generator().manual_seed(seed), record_layers=layers
    )
    return prompts, out.completion_ids, out.features


def test_a_spot_step_on_recorded_features_never_runs_the_policy_and_learns_the_same(policy, monkeypatch):
    """The same samples give the same loss from the rollout's features as from a forward of the policy, and a step on
    them makes no policy forward. Mutation: ignore `DrafterSample.features` and the forward guard raises."""
    torch.manual_seed(0)
    head = Eagle3Model.for_policy(policy)
    prompts, completions, features = recorded_rollout(policy, head)
    schedule = SpotSchedule(learning_rate=1e-3, warmup_steps=1)
    losses = {}
    for name, recorded in (("rerun", None), ("recorded", features)):
        spot = SpotTrainer(Eagle3Model.for_policy(policy), DataBuffer(window=1), schedule=schedule, seed=0)
        spot.drafter.load_state_dict(head.state_dict())
        spot.observe_rollout(prompts, completions, recorded, version=None if recorded is None else 3)
        if recorded is not None:
            monkeypatch.setattr(policy, "forward", lambda *a, **k: pytest.fail("a forward of the policy"))
            monkeypatch.setattr(policy.get_decoder(), "forward", lambda *a, **k: pytest.fail("a forward"))
        losses[name] = [spot.step(policy) for _ in range(3)]
        assert spot.rerun_samples == (0 if recorded is not None else spot.rerun_samples)
    assert losses["rerun"] == pytest.approx(losses["recorded"], rel=1e-4)


def test_features_stay_for_the_window_s_updates_and_no_longer():
    """TLT's one-step offset (`window=2`): a rollout at a newer policy version keeps the previous rollout's samples,
    their features one update old; a version two updates newer drops them (never trained on older features); samples
    without features (rerun at training time) stay; a saved buffer restores versions, and the features the next rollout
    keeps (a resumed run trains on them as the uninterrupted one does). Mutations: drop
    every older version (the previous rollout never reaches training, #61's first defect) or keep every version."""
    buffer = DataBuffer(window=2)
    states = [torch.zeros(9, 2, 4) for _ in range(4)]

    def tokens():
        return {s.token_ids[2] for s in [*buffer.samples, *buffer.held_out]}

    buffer.add([[1, 2]] * 4, [[3] * 8] * 4, states, version=0)
    buffer.add([[1, 2]] * 4, [[6] * 8] * 4, states, version=1)
    assert tokens() == {3, 6}  # the previous rollout, one update old, stays
    buffer.drop_stale(2)
    assert tokens() == {6}
    buffer.add([[1, 2]] * 2, [[4] * 8] * 2)  # no features (e.g. vLLM's rollout)
    buffer.drop_stale(5)
    assert tokens() == {4}
    restored = DataBuffer(window=2)
    buffer.add([[1, 2]] * 2, [[5] * 8] * 2, states[:2], version=5)
    restored.load_state_dict(buffer.state_dict())
    assert [s.version for s in restored.samples] == [s.version for s in buffer.samples]
    # the newest rollout's features are saved (the next rollout keeps it), the featureless stay featureless
    assert [s.features is not None for s in restored.samples] == [s.version == 5 for s in restored.samples]
    restored.add([[1, 2]], [[7] * 8], [torch.zeros(9, 2, 4)], version=7)
    assert {s.token_ids[2] for s in restored.samples} <= {4, 7}
    # two optimizer steps a rollout (num_iterations=2, or two per generation batch): the window counts rollouts
    per_two = DataBuffer(window=2, updates_per_rollout=2)
    per_two.add([[1, 2]] * 4, [[3] * 8] * 4, states, version=0)
    per_two.add([[1, 2]] * 4, [[6] * 8] * 4, states, version=2)
    assert {s.token_ids[2] for s in [*per_two.samples, *per_two.held_out]} == {3, 6}


def test_a_phase_the_budget_skips_buffers_nothing_and_stale_features_go_without_a_new_rollout(policy):
    """One process, a phase the time budget will skip: no features recorded for it (`wants_features`), nothing added
    (its features would be stale by the next phase); a rollout with no turn of the engine still drops what is stale.
    Mutations: buffer a skipped phase's rollout, or filter versions only inside `add`."""
    torch.manual_seed(0)
    head = Eagle3Model.for_policy(policy)
    spot = SpotTrainer(head, DataBuffer(window=2), seed=0)
    prompts, completions, features = recorded_rollout(policy, head)
    spot.observe_rollout(prompts, completions, features, version=0)
    assert spot.buffer.samples
    buffered = len(spot.buffer.samples) + len(spot.buffer.held_out)
    spot.budget.skip = 1
    assert not spot.wants_features
    spot.observe_rollout(prompts, completions, None, version=2)  # two updates on: version 0's features are stale
    assert not spot.buffer.samples and not spot.buffer.held_out
    spot.budget.skip = 0
    spot.observe_rollout(prompts, completions, features, version=2)
    assert len(spot.buffer.samples) + len(spot.buffer.held_out) == buffered
    spot.buffer.drop_stale(4)  # the stack's call for a rollout without turns of ours
    assert not spot.buffer.samples and not spot.buffer.held_out


def test_the_feature_memory_cap_drops_the_oldest_sequences():
    buffer = DataBuffer(window=2, max_feature_bytes=3 * 9 * 2 * 4 * 4)  # three samples' features
    buffer.add([[1, 2]] * 2, [[3] * 8] * 2, [torch.zeros(9, 2, 4)] * 2, version=0)
    buffer.add([[1, 2]] * 2, [[4] * 8] * 2, [torch.zeros(9, 2, 4)] * 2, version=0)
    assert buffer.feature_bytes <= buffer.max_feature_bytes
    assert [s.token_ids[2] for s in buffer.samples] == [3, 4, 4]


def test_a_steadily_improving_head_keeps_its_budget():
    """The issue's new head on a real model (1.00, 1.08, 1.17, 1.15 after its warm-up): improving, it keeps the full
    share; flat below min_acceptance, it is left idle; measurements that scatter around a level are not a trend.
    Mutations: judge by the gap of two moving averages (the old rule) and it is left idle at 1.15; drop the standard
    error and the scattered plateau trains at the full share."""
    budget = SpotBudget(time_budget=1.0, warmup_phases=0)
    for value in (1.0, 1.08, 1.17, 1.15):
        budget.observe(value)
    assert budget.trend > budget.tolerance and budget.share == 1.0
    for _ in range(6):
        budget.observe(1.15)
    assert budget.share == 0.0
    noisy = SpotBudget(time_budget=1.0)  # the real model's measurements on a plateau: scatter, not a trend
    for value in (1.48, 1.12, 1.19, 1.14, 1.51, 1.19):
        noisy.observe(value)
    assert abs(noisy.trend) < 0.05 < 2 * noisy._line()[1] and noisy.share == 0.0
    scattered = SpotBudget(time_budget=1.0)
    for value in (1.63, 1.31, 1.41, 1.25, 1.02, 1.63):  # |trend| 0.15 > tolerance, within twice its error
        scattered.observe(value)
    assert abs(scattered.trend) > scattered.tolerance and scattered.share == scattered.plateau_share
    restored = SpotBudget()
    restored.load_state_dict({**budget.state_dict(), "slow_mean": 1.0})  # an older checkpoint's field is ignored
    assert restored.recent == budget.recent and restored.share == 0.0


# ------------------------------------------------------------------------------------------ warm start
def test_train_drafter_stops_at_its_budgets_and_records_acceptance(policy):
    """`max_tokens` and `max_seconds` end training; the samples' recorded features are used (no policy forward);
    `evaluate` runs periodically and at the end, each run recorded with tokens and seconds trained."""
    torch.manual_seed(0)
    head = Eagle3Model.for_policy(policy)
    params = SamplingParams(max_new_tokens=16, temperature=1.0, do_sample=True)
    prompts = [[3 + i, 9, 17] for i in range(24)]
    samples = generate_samples(policy, prompts, params, record_layers=[*head.aux_layer_ids, 4])
    assert all(s.features is not None for s in samples)
    calls = []
    history = train_drafter(
        policy, head, samples, epochs=50, config=DistillConfig(max_tokens_per_batch=64), progress=False, max_tokens=200,
        evaluate=lambda m: calls.append(1) or 1.5, eval_every_seconds=0.0,
    )  # fmt: skip
    assert history[-1]["tokens"] >= 200 > history[-2]["tokens"]
    assert len(calls) == len(history) and history[-1]["acceptance"] == 1.5
    timed = train_drafter(policy, head, samples, epochs=1000, progress=False, max_seconds=0.5)
    assert 3 <= len(timed) < 1000 and timed[-2]["seconds"] < 0.5  # the budget in steps, from the first steps' cost


def test_recording_stops_at_the_budget(policy):
    """`record_max_bytes`: the recorder never holds more (mutation caught: the cap applied after the whole rollout was
    recorded, at about twice the cap); rows finished before it stopped keep their whole features, the others get none,
    and nothing sampled changes."""
    engine = SpeculativeEngine(policy)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 300) for _ in range(4)] for _ in range(6)]
    params = SamplingParams(max_new_tokens=16, temperature=1.0, do_sample=True, eos_token_ids=tuple(range(8, 48)))

    def run(max_bytes):
        generator = torch.Generator().manual_seed(3)
        return engine.generate(prompts, params, generator=generator, record_layers=[1, 4], record_max_bytes=max_bytes)

    whole = run(None)
    total = sum(f.nbytes for f in whole.features)
    lengths = sorted(len(c) for c in whole.completion_ids)
    assert lengths[0] < lengths[-1]  # rows end at different steps
    capped = run(total // 2)
    assert capped.completion_ids == whole.completion_ids
    kept = [f for f in capped.features if f is not None]
    assert 0 < len(kept) < len(prompts) and sum(f.nbytes for f in kept) <= total // 2
    for got, expected in zip(capped.features, whole.features, strict=True):
        assert got is None or torch.equal(got, expected)


def test_a_forward_past_the_budget_allocates_nothing_and_one_copy_moves_a_forward():
    """#61's third defect: the recorder sizes a forward's states before it stacks any (a budget of 0 records and
    allocates nothing: the states here refuse to be sliced), and moves the kept positions of a forward in one copy, not
    one per row. Mutations caught: stack first, then check the size (the slice raises); a copy per row (3 copies)."""

    class Unsliceable:  # what a forward's states look like to the size check, and nothing more
        def __init__(self, tensor):
            self.tensor = tensor

        def size(self, dim):
            return self.tensor.size(dim)

        def element_size(self):
            return self.tensor.element_size()

        def __getitem__(self, index):
            raise AssertionError("the states were read past the budget")

    states = {0: torch.randn(3, 5, 8), 2: torch.randn(3, 5, 8)}
    kept = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    empty = FeatureRecorder([0, 2], num_rows=3, max_bytes=0)
    empty.record({i: Unsliceable(t) for i, t in states.items()}, torch.arange(3), kept)
    assert empty.stopped and empty.num_bytes == 0

    copies = []
    to = torch.Tensor.to

    def counting_to(self, *args, **kwargs):
        copies.append(self.shape)
        return to(self, *args, **kwargs)

    recorder = FeatureRecorder([0, 2], num_rows=3)
    torch.Tensor.to = counting_to
    try:
        recorder.record(states, torch.arange(3), kept)
    finally:
        torch.Tensor.to = to
    assert len(copies) == 1
    rows = recorder.rows([3, 2, 5])
    for row, n in zip(rows, [3, 2, 5], strict=True):
        assert row.shape == (n, 2, 8)
    torch.testing.assert_close(rows[2], torch.stack([states[0][2], states[2][2]], dim=1))
