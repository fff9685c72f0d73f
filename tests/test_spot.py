"""Spot training: the data buffer's window and budget, drafter steps, preemption, and the 2-rank idle/merge protocol."""

import os
import random
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import Qwen2Config, Qwen2ForCausalLM

from trl_tlt.drafters.draft_vocab import DraftVocabulary
from trl_tlt.drafters.eagle3 import Eagle3Model
from trl_tlt.tooling.tiny import build_tiny_model, build_tokenizer
from trl_tlt.training.distillation import PolicyView
from trl_tlt.training.spot import HELD_OUT_EVERY, DataBuffer, SpotBudget, SpotSchedule, SpotTrainer
from trl_tlt.training.spot import trainer as spot_trainer_module
from trl_tlt.training.spot.schedule import acceptance_length, expected_speedup


def rollout(n, length, offset=0):
    prompts = [[1, 2, 3] for _ in range(n)]
    completions = [[4 + (offset + i + t) % 50 for t in range(length)] for i in range(n)]
    return prompts, completions


def test_buffer_keeps_the_last_rollouts_and_holds_out_every_eighth():
    buffer = DataBuffer(window=2, max_tokens=10**6)
    for step in range(3):
        buffer.add(*rollout(8, 5 + step))
    assert len(buffer.rollouts) == 2  # the current and the previous rollout
    lengths = {len(s.token_ids) - s.prompt_length for s in buffer.samples}
    assert lengths == {6, 7}
    assert len(buffer.held_out) == 8 // HELD_OUT_EVERY
    assert len(buffer.samples) == 2 * (8 - 8 // HELD_OUT_EVERY)
    assert not any(s in buffer.samples for s in buffer.held_out)


def test_buffer_budget_drops_the_oldest_and_skips_empty_completions():
    buffer = DataBuffer(window=4, max_tokens=60)
    buffer.add([[1, 2]] * 4, [[3] * 8, [], [3] * 8, [3] * 8])  # 3 samples of 10 tokens
    buffer.add(*rollout(4, 7))  # 4 more of 10 tokens: 70 > 60
    assert buffer.num_tokens == 60
    assert [len(r) for r in buffer.rollouts] == [2, 4]  # one of the first rollout's samples went
    batch = buffer.sample(25, random.Random(0))
    assert 1 <= len(batch) and sum(len(s.token_ids) for s in batch) <= 25
    with pytest.raises(ValueError, match="window"):
        DataBuffer(window=0)


@pytest.fixture(scope="module")
def policy():
    tokenizer = build_tokenizer(["12+34=46 the quick brown fox 1 2 3 4 5"] * 10, vocab_size=120)
    torch.manual_seed(0)
    return build_tiny_model(tokenizer, arch="qwen2", hidden_size=64, num_hidden_layers=3, num_attention_heads=2).eval()


def spot_trainer(policy, **kwargs):
    torch.manual_seed(0)
    buffer = DataBuffer(window=2)
    prompts, completions = rollout(16, 20)
    buffer.add(prompts, completions)
    schedule = SpotSchedule(learning_rate=3e-3, warmup_steps=1)
    return SpotTrainer(Eagle3Model.for_policy(policy), buffer, schedule=schedule, **kwargs)


def test_drafter_steps_lower_the_loss_and_leave_the_policy_alone(policy):
    spot = spot_trainer(policy, tokens_per_step=256)
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    losses = [spot.step(policy) for _ in range(30)]
    assert all(loss is not None for loss in losses)
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5
    assert all(torch.equal(v, policy.state_dict()[k]) for k, v in before.items())
    # no gradient reaches the policy's (trainable) parameters, its shared embedding included: the policy's own
    # optimizer step would apply it
    assert all(p.requires_grad and p.grad is None for p in policy.parameters())
    assert spot.total_steps == 30
    assert spot.evaluate(policy) > 1.0  # held-out top-1 agreement now non-zero


def test_a_preempted_step_changes_nothing(policy):
    spot = spot_trainer(policy)
    before = [p.clone() for p in spot.params]
    assert spot.step(policy, preempt=lambda: True) is None
    assert all(torch.equal(a, b) for a, b in zip(before, spot.params, strict=True))
    assert spot.total_steps == 0


def test_single_process_fixed_steps(policy):
    spot = spot_trainer(policy, steps_per_phase=3)
    stats = spot.run_between_rollouts(policy)
    assert stats.steps == 3 and stats.summary["steps"] == 3 and stats.seconds_used > 0
    assert stats.idle_seconds == 0 and stats.summary["loss"] is not None


def test_single_process_time_budget(policy, monkeypatch):
    """A phase spends time_budget x rollout seconds: on a fake clock (a drafter step takes 1 s, the held-out evaluation
    0.5 s), a budget of 0.5 x 10 s buys the evaluation and 4 steps (a fifth would overdraw by more than the 0.5 s
    left); no rollout time, no step. The clock is the test's: the machine's load cannot move it."""
    import types

    from trl_tlt.training.spot import trainer as trainer_module

    clock = [0.0]
    monkeypatch.setattr(trainer_module, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    spot = spot_trainer(policy, budget=SpotBudget(time_budget=0.5, warmup_phases=5))
    step, evaluate = spot.step, spot.evaluate

    def timed(function, seconds):
        def run(*args, **kwargs):
            clock[0] += seconds
            return function(*args, **kwargs)

        return run

    monkeypatch.setattr(spot, "step", timed(step, 1.0))
    monkeypatch.setattr(spot, "evaluate", timed(evaluate, 0.5))
    stats = spot.run_between_rollouts(policy, rollout_seconds=10.0)
    assert stats.budget_seconds == 5.0 and stats.steps == 4 and stats.seconds_used == 4.5
    assert spot.budget.credit == 0.5  # left to the next phase
    assert spot.run_between_rollouts(policy, rollout_seconds=0.0).steps == 0


def test_budget_follows_acceptance():
    """Full share while a new head warms up and while acceptance moves; a quarter on a plateau; nothing (then a
    probe after 1, 2, 4 skipped phases) for a drafter below min_acceptance. Mutation: drop the trend rule in
    `SpotBudget.share` and the falling case gets the plateau share."""
    budget = SpotBudget(time_budget=1.0, warmup_phases=2)
    for value in (1.0, 1.0):  # warm-up: full share whatever it measures
        budget.observe(value)
        assert budget.share == 1.0
    budget.observe(1.0)  # flat and below min_acceptance: does not pay
    assert budget.share == 0.0 and budget.seconds(10.0) <= 0
    assert [budget.skips_phase() for _ in range(2)] == [True, False]  # skip 1, then probe
    budget.observe(1.0)
    budget.seconds(10.0)
    assert [budget.skips_phase() for _ in range(3)] == [True, True, False]  # skip 2, then probe
    rising = SpotBudget(time_budget=1.0)
    for value in (2.0, 3.0, 4.0):
        rising.observe(value)
    assert rising.share == 1.0
    for _ in range(60):
        rising.observe(4.0)
    assert rising.share == rising.plateau_share
    assert rising.seconds(8.0) == pytest.approx(8.0 * rising.plateau_share)
    rising.observe(2.5)  # one low measurement: within the scatter a single point may have
    assert rising.share == rising.plateau_share
    rising.observe(2.5)  # the policy drifted: acceptance falls, and stays down
    assert rising.share == 1.0


def test_the_budget_weighs_agreement_against_the_measured_cost_of_a_verify_step():
    """With the verify step's cost measured, a drafter pays when its expected speed-up (its agreement's tokens per step
    over the best k's cost) is 1.05 or more; a plateau then spends at most half of what it saves. Mutation: drop the
    speed-up from `SpotBudget.share` and the non-paying drafter gets the plateau share (min_acceptance alone)."""
    agreement = [0.5, 0.5, 0.5]
    assert acceptance_length(agreement) == 1.875 and acceptance_length(agreement, 1) == 1.5
    assert expected_speedup(agreement, {}) is None  # nothing measured
    assert expected_speedup(agreement, {1: 1.2, 2: 2.0, 8: 1.0}) == pytest.approx(1.5 / 1.2)  # k = 8: uncovered
    assert expected_speedup(agreement, {1: 1.6, 2: 2.0}) == pytest.approx(1.5 / 1.6)  # below 1: it slows the rollout
    assert expected_speedup([0.0], {1: 0.9}) == 1.0  # a measured cost below a plain step's is noise: at least 1
    # k = 2 and 3 not played yet: 1 + k x 0.1 (the measured cost per draft token), so k = 3 is the best
    assert expected_speedup([0.9, 0.9, 0.9], {1: 1.1}) == pytest.approx(acceptance_length([0.9] * 3) / 1.3)
    budgets = {}
    for speedup in (None, 0.8, 1.04, 1.1, 3.0):
        budget = budgets[speedup] = SpotBudget(time_budget=0.5)
        for _ in range(6):  # flat at 1.6: above min_acceptance
            budget.observe(1.6, speedup)
    assert budgets[None].share == 0.25  # no costs: min_acceptance decides, a plateau
    assert budgets[0.8].share == budgets[1.04].share == 0.0  # it does not pay: left idle, probed later
    assert budgets[1.1].share == pytest.approx(0.1)  # saves 10% of the rollout: spends at most 5% (0.1 x 0.5)
    assert budgets[3.0].share == 0.25
    once = SpotBudget(time_budget=0.5)  # one reading above, then below: the average is not held up by a floor
    for speedup in (1.3, 0.7, 0.7, 0.7, 0.7, 0.7):
        once.observe(1.6, speedup)
    assert once.share == 0.0
    budgets[1.1].observe(1.6, None)  # costs no longer measured: min_acceptance decides again
    assert budgets[1.1].speedup is None and budgets[1.1].share == 0.25
    rising = SpotBudget(time_budget=0.5)
    for value in (1.2, 1.4, 1.6):  # still learning: full share, whatever it pays yet
        rising.observe(value, 1.0)
    assert rising.share == 1.0


def test_evaluation_reads_the_latest_rollout_before_any_step_draws_from_it(policy, monkeypatch):
    """The held-out estimate reads the latest rollout's sequences no step trained on (held out, then the training ones
    until a step draws), up to `EVAL_STEPS` steps' worth of tokens; after a step, the held-out ones alone. A resumed
    buffer counts nothing as unseen. Mutation: `DataBuffer.sample` leaving `unseen` alone fails the second read."""
    spot = spot_trainer(policy, tokens_per_step=64)
    read = []
    features = spot._features
    monkeypatch.setattr(spot, "_features", lambda view, samples: read.append(list(samples)) or features(view, samples))
    buffer = spot.buffer
    assert len(buffer.unseen) == 14 and len(buffer.held_out) == 2
    assert spot.evaluate(policy) is not None
    assert read[-1][:2] == buffer.held_out and read[-1][2:] == buffer.unseen[: len(read[-1]) - 2]
    assert sum(len(s.token_ids) for s in read[-1]) <= spot_trainer_module.EVAL_STEPS * 64 < 16 * 23
    assert len(spot.agreement) == spot.config.ttt_length
    spot.step(policy)
    assert buffer.unseen == []
    spot.evaluate(policy)
    assert read[-1] == buffer.held_out
    buffer.add(*rollout(16, 20, offset=1))
    assert len(buffer.unseen) == 14
    resumed = DataBuffer(window=2)
    resumed.load_state_dict(buffer.state_dict())
    assert resumed.unseen == [] and len(resumed.samples) == len(buffer.samples)


def _join_with_policy(rank, init_file, policy_state):
    """This rank of 2 in a gloo group, with the test's tiny policy (`policy_state`)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    tokenizer = build_tokenizer(["12+34=46 the quick brown fox 1 2 3 4 5"] * 10, vocab_size=120)
    policy = build_tiny_model(tokenizer, arch="qwen2", hidden_size=64, num_hidden_layers=3, num_attention_heads=2)
    policy.load_state_dict(policy_state)
    return policy


def _two_ranks(rank, init_file, results, policy_state):
    os.environ["OMP_NUM_THREADS"] = "1"
    policy = _join_with_policy(rank, init_file, policy_state)
    policy.eval()
    torch.manual_seed(rank)  # different initial heads: the first-rank broadcast must make them equal
    buffer = DataBuffer(window=2)
    buffer.add(*rollout(16, 20, offset=rank))
    group = dist.new_group(backend="gloo")
    spot = SpotTrainer(Eagle3Model.for_policy(policy), buffer, tokens_per_step=128, group=group, seed=rank)
    start = [p.detach().clone() for p in spot.params]
    if rank == 1:
        time.sleep(1.5)  # rank 1 is still "generating"
    stats = spot.run_while_idle(policy)
    flat = torch.cat([p.detach().reshape(-1) for p in spot.params]).clone()
    results[rank] = {
        "steps": stats.steps,
        "idle": stats.idle_seconds,
        "summary": stats.summary,
        "flat": flat,
        "start": torch.cat([p.detach().reshape(-1) for p in start]),
    }
    dist.destroy_process_group()


def test_two_ranks_train_while_idle_and_merge():
    policy = build_tiny_model(
        build_tokenizer(["12+34=46 the quick brown fox 1 2 3 4 5"] * 10, vocab_size=120),
        arch="qwen2",
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=2,
    )
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            mp.start_processes(
                _two_ranks,
                args=(os.path.join(tmp, "init"), results, policy.state_dict()),
                nprocs=2,
                join=True,
                start_method="spawn",
            )
        first, second = results[0], results[1]
    assert torch.equal(first["start"], second["start"])  # broadcast from the first rank
    assert first["steps"] > 0 and second["steps"] == 0  # the rank done first trains, the other does not wait
    assert first["idle"] > 1.0 and second["idle"] < 0.5
    assert torch.equal(first["flat"], second["flat"])  # merged: both ranks hold the same drafter
    assert not torch.equal(first["flat"], first["start"])  # ... the one the idle rank trained
    assert first["summary"]["steps"] == first["steps"] and first["summary"]["loss"] is not None


def _two_ranks_fitted_vocab(rank, init_file, results, silent_rank=None):
    """Two rollouts with a new head whose draft vocabulary is fitted at the first: rank 0 trains while rank 1 is still
    "generating", rank 1 does not. `silent_rank` sees no rollout at the first (a rank with no turn of its own)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    config = Qwen2Config(
        vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=2, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    policy = Qwen2ForCausalLM(config).eval()
    head = Eagle3Model.for_policy(policy, draft_vocab_size=4096)
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=20))
    spot = SpotTrainer(
        head, DataBuffer(window=2), tokens_per_step=64, group=group, seed=rank,
        vocab=DraftVocabulary(4096, 4096), fit_vocab=True,
    )  # fmt: skip
    sizes = []
    for step in range(2):
        if not (step == 0 and rank == silent_rank):
            spot.observe_rollout(*rollout(16, 20, offset=rank + step))
        if rank == 1:
            time.sleep(1.5)
        stats = spot.run_while_idle(policy)
        sizes.append(head.config.draft_vocab_size)
    results[rank] = {
        "steps": stats.steps,
        "sizes": sizes,
        "flat": torch.cat([p.detach().reshape(-1) for p in spot.params]),
    }
    dist.destroy_process_group()


@pytest.mark.slow  # two spawned processes, about 8 s: CI's second stage (the default run keeps one 2-rank test)
def test_two_ranks_fit_the_draft_vocabulary_alike(tmp_path):
    """Mutation caught: the one-time fit of the draft vocabulary decided by a per-rank count (`total_steps == 0`):
    the rank that trained while waiting kept its 4096 rows, the other fitted 1024, and the next merge all-reduced
    vectors of different lengths (gloo aborted both ranks: the process died with SIGABRT)."""
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        mp.start_processes(
            _two_ranks_fitted_vocab, args=(str(tmp_path / "init"), results), nprocs=2, join=True, start_method="spawn"
        )
        first, second = results[0], results[1]
    assert first["sizes"] == second["sizes"] == [1024, 1024]  # fitted at the first rollout, on both ranks
    assert first["steps"] > 0 and torch.equal(first["flat"], second["flat"])


@pytest.mark.slow  # two spawned processes, about 8 s: CI's second stage (the default run keeps one 2-rank test)
def test_a_rank_that_saw_no_rollout_still_sums_the_token_counts(tmp_path):
    """Mutation caught: `revise_vocab` returning early on a rank with no token counts of its own (a rollout with no
    turn of ours on that rank) while the others all-reduce theirs: the others waited until the group's timeout."""
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        mp.start_processes(
            _two_ranks_fitted_vocab, args=(str(tmp_path / "init"), results, 1), nprocs=2, join=True,
            start_method="spawn",
        )  # fmt: skip
        first, second = results[0], results[1]
    assert first["sizes"] == second["sizes"] and torch.equal(first["flat"], second["flat"])


def _rank_fails(rank, init_file, results, policy_state, failure):
    """Rank 1 dies (exits) or hangs (past the group's 3 s timeout) while rank 0 waits for it in spot training."""
    policy = _join_with_policy(rank, init_file, policy_state)
    buffer = DataBuffer(window=2)
    buffer.add(*rollout(16, 20, offset=rank))
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=3))
    spot = SpotTrainer(Eagle3Model.for_policy(policy), buffer, tokens_per_step=128, group=group)
    if rank == 1:
        if failure == "dies":
            os._exit(1)
        time.sleep(12)  # hangs in its rollout
        os._exit(0)
    start = time.perf_counter()
    try:
        spot.run_while_idle(policy)
        results[0] = ("no error", time.perf_counter() - start)
    except RuntimeError as error:
        results[0] = (str(error), time.perf_counter() - start)
    os._exit(0)  # no teardown with a dead peer


@pytest.mark.slow
@pytest.mark.parametrize("failure", ["dies", "hangs"])
def test_a_dead_or_hung_rank_is_an_error_naming_rank_and_phase(policy, failure, tmp_path):
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        context = mp.start_processes(
            _rank_fails,
            args=(str(tmp_path / "init"), results, policy.state_dict(), failure),
            nprocs=2,
            join=False,
            start_method="spawn",
        )
        for process in context.processes:
            process.join(timeout=120)
        message, seconds = results[0]
    assert "rank 0" in message and "idle barrier" in message and "ddp_timeout" in message
    assert seconds < 60  # bounded by the group's timeout (3 s here), not forever


def test_cold_start_schedule():
    """A new head starts at a high learning rate and settles into the warm regime."""
    warm = SpotSchedule(learning_rate=3e-5, warmup_steps=1)
    assert warm.learning_rate_at(0) == warm.learning_rate_at(500) == 3e-5
    cold = SpotSchedule(learning_rate=3e-5, cold_steps=100, warmup_steps=1)
    assert cold.learning_rate_at(0) == pytest.approx(2e-3)
    assert 3e-5 < cold.learning_rate_at(50) < 2e-3  # halfway
    assert cold.learning_rate_at(100) == cold.learning_rate_at(400) == pytest.approx(3e-5)
    rates = [cold.learning_rate_at(s) for s in range(101)]
    assert all(a >= b for a, b in zip(rates, rates[1:]))  # monotone cosine
    # the optimizer follows the schedule, and a resumed trainer continues it
    tokenizer = build_tokenizer(["12+34=46 the quick brown fox 1 2 3 4 5"] * 10, vocab_size=120)
    head = Eagle3Model.for_policy(build_tiny_model(tokenizer, hidden_size=64, num_hidden_layers=3))
    spot = SpotTrainer(head, DataBuffer(), schedule=cold)
    assert spot.optimizer.param_groups[0]["lr"] == pytest.approx(2e-3)


def _one_rank_refuses(rank, init_file, results, policy_state, sharded):
    """Rank 1 went through GRPOTrainer's generation this rollout (`refuse=True`); rank 0 trains while it waits. With
    `sharded`, rank 0 trains on a `PolicyView` (the LM head copied, no policy to run) and rank 1 has none (None)."""
    policy = _join_with_policy(rank, init_file, policy_state)
    buffer = DataBuffer(window=2)
    prompts, completions = rollout(16, 20, offset=rank)
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=20))
    spot = SpotTrainer(Eagle3Model.for_policy(policy), buffer, tokens_per_step=128, group=group)
    start = torch.cat([p.detach().reshape(-1) for p in spot.params]).clone()
    view = policy
    if sharded:  # features recorded for half the rows (as a rollout records them); the others can only be dropped
        layers = spot.feature_layers(policy)
        features = []
        for i, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
            states = policy(torch.tensor([prompt + completion]), output_hidden_states=True).hidden_states
            features.append(torch.stack([states[j][0, :-1] for j in layers], dim=1).detach() if i % 2 == 0 else None)
        buffer.add(prompts, completions, features, version=0)
        head = policy.get_output_embeddings().weight.detach().clone()
        view = PolicyView(head, policy.config) if rank == 0 else None
    else:
        buffer.add(prompts, completions)
    if rank == 1:
        time.sleep(1.5)
    stats = spot.run_while_idle(view, refuse=(rank == 1 and not sharded))
    results[rank] = {
        "refused": stats.refused,
        "steps": stats.steps,
        "dropped": spot.dropped_samples,
        "rerun": spot.rerun_samples,
        "start": start,
        "flat": torch.cat([p.detach().reshape(-1) for p in spot.params]),
    }
    dist.destroy_process_group()


@pytest.mark.slow  # two spawned processes, about 25 s: CI's second stage
@pytest.mark.parametrize("sharded", [False, True])
def test_a_decision_one_rank_takes_reaches_every_rank_at_the_idle_barrier(tmp_path, policy, sharded):
    """Refusal: rank 1's rollout went through GRPOTrainer's generation; both ranks learn it at the idle barrier and end
    the phase alike, each drafter back to the last merged one (rank 0 had trained while waiting). Mutation caught: the
    refusal taken by rank 1 alone (it left spot training; rank 0 waited at the barrier until the group's timeout).
    Sharded: rank 0 trains on recorded features only, never running the policy (feature-less samples dropped); rank 1
    has no LM head copy, so the merge runs and the draft vocabulary waits."""
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        mp.start_processes(
            _one_rank_refuses, args=(str(tmp_path / "init"), results, policy.state_dict(), sharded), nprocs=2,
            join=True, start_method="spawn",
        )  # fmt: skip
        first, second = results[0], results[1]
    assert first["refused"] == second["refused"] == (not sharded)
    assert first["steps"] > 0 and second["steps"] == 0
    if sharded:  # merged: the same drafter, trained
        assert torch.equal(first["flat"], second["flat"]) and not torch.equal(first["flat"], first["start"])
        assert first["dropped"] == 8 and first["rerun"] == 0  # each feature-less sample once; the policy never ran
    else:  # back to the drafter both held at the start
        assert torch.equal(first["flat"], first["start"]) and torch.equal(second["flat"], second["start"])


def test_the_buffer_cap_holds_out_rows_inside_it_and_drops_them_too():
    """A cap of 16 rows' features, 64 rows offered (8 held out): the held-out rows count and go down to their share.
    Mutation caught: only training rows dropped (all of them went, and the 8 held-out rows alone passed the cap, as
    the buffer held 421,888 bytes against a cap of 210,944 with no training row left)."""
    row = torch.zeros(20, 2, 16)  # one row's features: (positions, layers, H)
    cap = 16 * row.nbytes
    buffer = DataBuffer(window=2, max_feature_bytes=cap)
    for step in range(2):
        prompts, completions = rollout(64, 18)
        buffer.add(prompts, completions, [row.clone() for _ in range(64)], version=step)
        assert buffer.feature_bytes <= cap
        assert len(buffer.samples) >= 12 and 1 <= len(buffer.held_out) <= 2


def test_a_sample_shorter_than_the_training_time_test_trains(policy):
    """A packed row shorter than `ttt_length` (a 2-token prompt and a 1-token completion: 2 positions, 4 TTT steps):
    `shift_left` past the row's end kept the row's length. Mutation caught: it grew the row (a 3- vs 2-position
    `torch.cat` error in the head's attention; seen on a rank whose completions were one token long)."""
    buffer = DataBuffer(window=2)
    buffer.add([[1, 2]] * 8, [[5]] * 8)
    spot = SpotTrainer(Eagle3Model.for_policy(policy), buffer, tokens_per_step=2)
    assert spot.step(policy) is not None and spot.evaluate(policy) is not None


def test_the_budget_reads_the_costs_of_the_rollouts_own_engine_steps_for_the_learned_drafters_k():
    """`RolloutStack.verify_costs`: the bandit's measured costs at the bucket most of the rollout's engine steps ran in
    (every turn's), only for k the learned drafter drafts (hybrid lookups draft past it), and none where nothing was
    measured: no engine turn (vLLM's rollout), modelled costs (`selector_deterministic`)."""
    from types import SimpleNamespace

    from trl_tlt.engine.speculation import Arm, BanditSpeculation
    from trl_tlt.trainer.stack import RolloutStack, RolloutTurn

    bandit = BanditSpeculation(arms=[Arm("default", k) for k in (1, 2, 8)])
    for bucket, scale in ((2, 1.0), (8, 3.0)):
        for arm, seconds in ((Arm(None, 0), 1.0), (Arm("default", 1), 1.2), (Arm("default", 2), 1.5)):
            bandit.update(bucket, arm, 1, seconds * scale)
        bandit.update(bucket, Arm("default", 8), 1, 2.5 * scale)
    stack = RolloutStack(None, None, bandit, bandit, None, torch.Generator())
    turns = [RolloutTurn([], [], 1.0, batch_sizes=[8, 7, 2]), RolloutTurn([], [], 1.0, batch_sizes=[2, 2])]
    assert stack.verify_costs(turns) == pytest.approx({1: 1.2, 2: 1.5, 8: 2.5})  # bucket 2: 3 of 5 steps
    assert stack.verify_costs([RolloutTurn([], [], 1.0)]) == {}  # no engine turn
    stack.hybrid = SimpleNamespace(learned_tokens=2)
    assert set(stack.verify_costs(turns)) == {1, 2}
    stack.speculation = BanditSpeculation(arms=[Arm("default", 1)], cost_model=lambda arm: 1.0 + arm.k)
    assert stack.verify_costs(turns) == {}


def test_an_evaluation_computes_the_agreement_alone_and_the_same_agreement(policy):
    """`eagle3_loss(loss=False)` (what `SpotTrainer.evaluate` runs): no loss, the same per-position agreement as with
    the loss, and that agreement is the drafter's and the policy's top token compared at every position."""
    from trl_tlt.drafters.eagle3.model import shift_left
    from trl_tlt.training.distillation import eagle3_loss, pack, top1_agreement

    spot = spot_trainer(policy, tokens_per_step=256)
    for _ in range(10):
        spot.step(policy)
    view = PolicyView.of(policy)
    row = pack(spot._features(view, spot.buffer.samples[:6]), 1 << 62)[0]
    head = spot.drafter
    with torch.no_grad():
        loss, with_loss = eagle3_loss(head, view.head_weight, row, spot.config)
        zero, alone = eagle3_loss(head, view.head_weight, row, spot.config, loss=False)
        outputs = head.ttt_forward(row.input_ids, head.fc(row.aux), row.position_ids, row.seq_ids, 2)
    assert loss > 0 and zero == 0 and not any(key.startswith("kl") for key in alone)
    accs = {key: value for key, value in with_loss.items() if key.startswith("acc")}
    assert accs == alone and len(accs) == spot.config.ttt_length and 0 < accs["acc_0"] < 1
    mask = shift_left(row.loss_mask, 1, False) & (shift_left(row.seq_ids, 1, -1) == row.seq_ids) & (row.seq_ids > 0)
    teacher_weight = view.head_weight[head.draft_ids]
    student, teacher = head.norm(outputs[1])[mask], shift_left(row.teacher, 1, 0.0)[mask]
    assert alone["acc_1"] == pytest.approx(top1_agreement(student, head.lm_head.weight, teacher, teacher_weight))
