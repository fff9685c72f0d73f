"""Sharded training where it really runs: the policy sharded over 2 CPU processes (gloo) by torch's FSDP2 and by
DeepSpeed ZeRO-3 (its CPU accelerator), ranks whose rollouts end at different lengths; resume at another number of
processes; a trainer built without `__init__`.

Each multi-process case holds: the run finishes (a rank left waiting at a collective would time out instead); greedy
completions equal GRPOTrainer's under the same launch; every rank ends with the same drafter. Slow (CI's second stage),
except the last test.
"""

import contextlib
import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace
from unittest.mock import MagicMock

import pytest
import torch
from testing_utils import assert_same_training

from trl_tlt import TLTGRPOTrainer
from trl_tlt.tooling.tiny import build_tiny_model


HERE = Path(__file__).parent
PROMPTS = ["12+34=", "The quick", "1 2 3", "hello world"]
GREEDY = {"generation_kwargs": {"do_sample": False}}
SPOT = {"spot_training": True, "spot_steps_per_rollout": 2, "spot_tokens_per_step": 64, "spot_cold_start_steps": 0}
_ports = iter(range(29750, 29850))


def torchrun(script: str, *args: str, nproc: int = 2, timeout: int = 600) -> subprocess.CompletedProcess:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
        str(next(_ports)), str(HERE / script), *args,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE)}
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)


def run_matrix(tmp_path: Path, tag: str, nproc: int = 2, **spec) -> list[dict]:
    """One launch of tests/_matrix_run.py under torchrun; each rank's report."""
    spec = {"trainer": "tlt", "output_dir": str(tmp_path), "tag": tag, "prompts": PROMPTS * 4, **spec}
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / f"{tag}.json"
    path.write_text(json.dumps(spec))
    result = torchrun("_matrix_run.py", str(path), nproc=nproc)
    assert result.returncode == 0, result.stderr[-6000:]
    if spec.get("kill_after") is not None:
        return []
    return [json.loads((tmp_path / f"{tag}-rank{rank}.json").read_text()) for rank in range(nproc)]


@pytest.fixture(scope="module")
def policy_dir(tokenizer, tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("sharded-policy")
    torch.manual_seed(0)
    build_tiny_model(tokenizer, hidden_size=64, num_hidden_layers=3, num_attention_heads=2).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def assert_same_run(tlt: list[dict], grpo: list[dict], tmp_path: Path) -> None:
    """Greedy: GRPOTrainer's completions and policy on every rank (`assert_same_training`), every rank holding the same
    drafter, trained on recorded features only (no policy rerun)."""
    assert_same_training(tlt, grpo, tmp_path, "tlt", "grpo")
    assert tlt[0]["drafter_sha256"] == tlt[1]["drafter_sha256"] is not None
    assert tlt[0]["drafter_steps"] > 0
    assert all(report["drafter_rerun_samples"] == 0 for report in tlt)


def grpo_then_tlt(tmp_path: Path, common: dict) -> list[dict]:
    """GRPOTrainer, then TLTGRPOTrainer with spot training, under the same launch (`common`); TLT's reports, the two
    runs checked alike (`assert_same_run`)."""
    grpo = run_matrix(tmp_path, "grpo", trainer="grpo", **common)
    tlt = run_matrix(tmp_path, "tlt", **{**common, "config": {**common["config"], **SPOT}})
    assert_same_run(tlt, grpo, tmp_path)
    return tlt


def deepspeed_runs() -> bool:
    try:
        import deepspeed  # noqa: F401
    except Exception:
        return False
    return True


NEEDS_DEEPSPEED = pytest.mark.skipif(not deepspeed_runs(), reason="needs deepspeed (the `deepspeed` extra, in `dev`)")
SHARDINGS = ["fsdp2", pytest.param("zero3", marks=NEEDS_DEEPSPEED)]


# --------------------------------------------------------------------------------------------------- the engine
@pytest.mark.slow
@pytest.mark.parametrize("sharding", SHARDINGS)
def test_engine_keeps_the_ranks_of_a_sharded_policy_in_lockstep(tmp_path, sharding):
    """FSDP2, and ZeRO-3 not gathered for generation (`ds3_gather_for_generation=False`, for policies too large to
    gather): every forward gathers parameters. Rank 0's rows end after 4 tokens, rank 1's after 16: with no drafter,
    the n-gram drafter and an EAGLE-3 head the engine's greedy completions equal the unsharded policy's, rank 0 runs
    placeholder forwards until rank 1 is done, and the next all-reduce pairs; so does a rank on the engine beside one
    on transformers' `generate`. The EAGLE-3 head embedded with a whole copy of the policy's embedding (the module's
    weight is a shard between forwards)."""
    result = torchrun("_sharded_engine_run.py", str(tmp_path), sharding, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    first, second = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    for report in (first, second):
        assert report["sharded"] == report["unsharded"]
        assert all(report[key] for key in ("paired_none", "paired_ngram", "paired_eagle3", "paired_mixed"))
        assert report["embedding_copy_shape"] == [report["vocab_size"], 64]
    for name in ("none", "ngram", "eagle3"):
        placeholders, forwards = first["placeholders"][name]
        assert placeholders > 0 and placeholders + forwards == sum(second["placeholders"][name])
        assert second["placeholders"][name][0] == 0
    assert first["mixed"] == first["sharded"]["none"] and second["mixed"] == second["sharded"]["none"][:1]


@pytest.mark.slow
@pytest.mark.parametrize("sharding", SHARDINGS)
def test_engine_without_lockstep_deadlocks(tmp_path, sharding):
    """The negative control (the engine before lockstep, `synced=False`): the rank done first leaves the decode loop,
    its next collective pairs with the other's parameter all-gather, and both time out."""
    result = torchrun("_sharded_engine_run.py", str(tmp_path), sharding, "--no-sync", timeout=300)
    assert result.returncode != 0
    assert "Timed out" in result.stderr


# -------------------------------------------------------------------------------------------------- the trainer
@pytest.mark.slow
def test_fsdp2_trainer_runs_in_lockstep_with_spot_training(policy_dir, tmp_path):
    """TLTGRPOTrainer under FSDP2, 3 steps, spot training on, the ranks' completions ending at 6 and 12 tokens:
    GRPOTrainer's completions and policy, the same trained drafter on both ranks, drafter training on recorded
    features only (no policy forward), placeholder forwards on the rank done first."""
    common = {
        "model_dir": policy_dir, "sharding": "fsdp2", "max_completion_length_by_rank": [6, 12],
        "config": {"max_steps": 3, **GREEDY},
    }  # fmt: skip
    tlt = grpo_then_tlt(tmp_path, common)
    assert max(tlt[0]["placeholder_shares"]) > 0 and max(tlt[1]["placeholder_shares"]) == 0


@pytest.mark.slow
@pytest.mark.parametrize("sharding", SHARDINGS)
def test_training_phase_cuts_each_rank_s_rows_into_as_many_forwards(policy_dir, tmp_path, sharding):
    """The training phase under FSDP2 and ZeRO-3 (each forward gathers parameters): rank 0's rows all 12 tokens long (one forward
    would do), rank 1's long-tailed (its rows cut into length-sorted sub-chunks): the ranks agree on the count of
    forwards per call, the run finishes, and the policy is GRPOTrainer's. Mutation caught (by review, scripted): each
    rank cutting on its own (no agreement) leaves rank 0 waiting in a parameter all-gather rank 1 never pairs (the
    run hangs until pytest-timeout ends it)."""
    # SGD: Adam's first step divides each gradient by its own size, which turns the round-off of a near-zero gradient
    # (another layout, other sums) into a full step; SGD keeps the comparison on the training phase's gradients.
    config = {"max_steps": 3, "max_completion_length": 12, "optim": "sgd"}
    common = {"model_dir": policy_dir, "sharding": sharding, "completion_lengths_by_rank": [[12], [2, 3, 4, 12]]}
    grpo = run_matrix(tmp_path, "grpo", trainer="grpo", config=config, **common)
    # The drafter's data from the training step (the default under lockstep), and drafter steps in each phase (a
    # policy gathered for each, after DeepSpeed's optimizer step). Before #61's fix, the check of the layer tap ran its
    # two forwards inside the first loss computation, and under ZeRO-3 that first backward failed ("The size of tensor
    # a (0) must match the size of tensor b (64)").
    tlt = run_matrix(tmp_path, "tlt", config={**config, **SPOT, "micro_batching_split_tokens": 0}, **common)
    assert_same_training(tlt, grpo, tmp_path, "tlt", "grpo")
    assert all(r["drafter_steps"] > 0 and r["drafter_rerun_samples"] == 0 for r in tlt)


@pytest.mark.slow
@NEEDS_DEEPSPEED
def test_zero3_trainer_trains_the_drafter_without_gathering_the_policy_again(policy_dir, tmp_path):
    """ZeRO-3 under DeepSpeed's CPU accelerator with `ds3_gather_for_generation` (TRL's default: the policy gathered
    once per rollout), the config made before the policy is loaded (so it loads partitioned, as transformers documents),
    rank 0's completions one token long (its rows end at the prefill): GRPOTrainer's completions and policy, the same
    trained drafter on both ranks, never a policy rerun. The engine keeps the ranks in lockstep there too, as `generate`
    does: DeepSpeed's root hook still broadcasts in the first forwards after each gather. Spot training never enters the
    gathered context (a collective: the rank done first would wait there for the slowest); it reads the LM head the
    rollout copied. Mutations caught (by review, scripted): lockstep only while the parameters are partitioned (from
    the second rollout both ranks time out in DeepSpeed's broadcast); the new head built from the partitioned LM head
    at construction (`IndexError`). Without gathering, GRPOTrainer itself fails at its first backward on this CPU
    accelerator (`The size of tensor a (0) must match the size of tensor b (64)`): that case is the engine test above."""
    common = {
        "model_dir": policy_dir, "sharding": "zero3", "max_completion_length_by_rank": [1, 12],
        "config": {"max_steps": 3, **GREEDY},
    }  # fmt: skip
    tlt = grpo_then_tlt(tmp_path, common)
    assert max(tlt[0]["placeholder_shares"]) > 0 and max(tlt[1]["placeholder_shares"]) == 0


@pytest.mark.slow
@pytest.mark.parametrize("sharding", SHARDINGS)
def test_the_drafter_learns_under_sharding_with_every_default(rule_policy, tmp_path, sharding):
    """#61: every TLTConfig default (only `max_steps` and the learning rate set), a policy whose tokens a new head can
    learn (the rule policy: a random one's are noise, and the time budget rightly stops paying for a head that would
    never pay), the ranks' completions ending at 8 and 48 tokens, 6 steps. DDP trains the drafter in rank 0's idle
    time; under FSDP2 and ZeRO-3 (TRL's gathering for generation) lockstep leaves no idle time, and the drafter trains
    beside the training step, within the time budget, on the states its loss forward recorded: about as many drafter
    steps as DDP's (at least half: both counts come from timed budgets, and on a shared 2-core machine a run read 40
    against DDP's 41), every rank the same drafter, no policy rerun. Mutation caught: the idle-time phase under
    lockstep (before #61: 1 drafter step in 6 rollouts under FSDP2, against DDP's 26)."""
    common = {"model_dir": rule_policy[0], "max_completion_length_by_rank": [8, 48], "config": {"max_steps": 6}}
    ddp = run_matrix(tmp_path, "ddp", **common)
    sharded = run_matrix(tmp_path, sharding, sharding=sharding, **common)
    ddp_steps, sharded_steps = (sum(r["drafter_steps"] for r in reports) for reports in (ddp, sharded))
    assert ddp_steps > 0 and 2 * sharded_steps >= ddp_steps, (ddp_steps, sharded_steps)
    assert sharded[0]["drafter_sha256"] == sharded[1]["drafter_sha256"]
    assert all(r["drafter_rerun_samples"] == 0 for r in sharded)


# ------------------------------------------------------------------------------------------------------ resume
@pytest.mark.slow
@NEEDS_DEEPSPEED
def test_zero3_resume_is_the_same_run(policy_dir, tmp_path):
    """Under DeepSpeed transformers resumes through `deepspeed_load_checkpoint`, never `_load_from_checkpoint`: the
    rollout state is restored at `_load_optimizer_and_scheduler`, which every backend runs. Killed after step 2's
    checkpoint, then resumed: the same completions and the same drafter as the uninterrupted run. Mutation caught:
    the restore in `_load_from_checkpoint` (measured: half the drafter steps, another drafter, other completions)."""
    common = {
        "model_dir": policy_dir, "sharding": "zero3", "max_completion_length_by_rank": [6, 12],
        "config": {"max_steps": 4, "save_strategy": "steps", "save_steps": 2, "selector_deterministic": True, **SPOT},
    }  # fmt: skip
    whole = run_matrix(tmp_path / "whole", "whole", **common)
    run_matrix(tmp_path / "cut", "cut", kill_after=2, **common)
    resumed = run_matrix(tmp_path / "cut", "resumed", resume=str(tmp_path / "cut" / "checkpoint-2"), **common)
    for rank in (0, 1):
        assert resumed[rank]["completions"] == whole[rank]["completions"][2:]
        assert resumed[rank]["drafter_sha256"] == whole[rank]["drafter_sha256"]
        assert resumed[rank]["drafter_steps"] == whole[rank]["drafter_steps"]
    assert resumed[0]["policy_sha256"] == whole[0]["policy_sha256"]


@pytest.mark.slow
@pytest.mark.parametrize("before, after", [(1, 2), (2, 1)])
def test_resume_at_another_world_size_gives_every_rank_the_same_drafter(policy_dir, tmp_path, before, after):
    """A checkpoint written by `before` processes, resumed by `after`: every rank takes the first rank's drafter and
    spot state (the draft vocabulary fitted at the first rollout included), the merge pairs (a rank with a fresh,
    unfitted head would all-reduce a head of another size: the abort of #45), and every rank ends with the same
    drafter, trained."""
    common = {"model_dir": policy_dir, "config": {"max_steps": 4, "save_strategy": "steps", "save_steps": 2, **SPOT}}
    run_matrix(tmp_path, "first", nproc=before, kill_after=2, **common)
    reports = run_matrix(tmp_path, "second", nproc=after, resume=str(tmp_path / "checkpoint-2"), **common)
    assert len({report["drafter_sha256"] for report in reports}) == 1
    assert len({report["draft_vocab_size"] for report in reports}) == 1
    assert all(report["global_step"] == 4 for report in reports)


# ------------------------------------------------------------------------------ a trainer built without __init__
def test_a_trainer_built_without_init_runs_grpotrainers_code():
    """TRL's dispatch tests build a trainer with `object.__new__` and a few attributes: TLTGRPOTrainer's hooks run
    GRPOTrainer's there. Mutation caught: `AttributeError: 'TLTGRPOTrainer' object has no attribute 'tlt'`."""
    trainer = object.__new__(TLTGRPOTrainer)
    trainer.accelerator = SimpleNamespace(
        device=torch.device("cpu"), is_main_process=True, process_index=0, num_processes=1, gather=lambda t: t
    )
    trainer.args = SimpleNamespace(report_to=[])
    trainer.model = SimpleNamespace(training=True)
    trainer.state = SimpleNamespace(global_step=0, num_input_tokens_seen=0)
    trainer._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    trainer.use_vllm = False
    trainer.rollout_func = MagicMock(return_value={"prompt_ids": [[1]], "completion_ids": [[2]]})
    with pytest.raises(ValueError, match="rollout_func must return keys"):
        trainer._generate(["prompt"])
    trainer.rollout_func.assert_called_once()


# ------------------------------------------------------------------------- the copies of a sharded policy's weights
@pytest.mark.parametrize(
    "drafter_type, source, copied",
    [
        ("none", "auto", ()),
        ("ngram", "auto", ()),
        ("eagle3", "training_step", ("input_embedding",)),  # the head drafts; its training reads the step's copy
        ("eagle3", "rollout", ("input_embedding", "output_embedding")),  # and trains on the rollout's states
    ],
)
def test_a_sharded_rollout_copies_only_what_is_read_and_lets_the_last_copies_go_first(
    tiny_model_dirs, tmp_path, monkeypatch, drafter_type, source, copied
):
    """#61's second defect: a rollout of a policy sharded across processes copied its embedding and LM head whole
    (V x H each, untied) whatever read them, and held the previous copies through the next rollout's (the peak: 2 x,
    up to 4 x V x H). Now: only what the drafter reads, and the previous copies let go before the next are taken.
    Measured here (the tiny untied policy, V = 320, H = 64, float32: 80 KiB a copy), the copies alive when the second
    rollout copies: none; with the previous copies kept (the mutation) 160 KiB with the rollout's source, 80 KiB with
    the training step's, beside the new ones (before #61 both were always copied: 160 KiB alive + 160 KiB new, the
    4 x V x H peak). Mutations caught: copy both always (`copied` differs), keep the previous copies."""
    import weakref

    from testing_utils import train_one_step

    from trl_tlt import TLTConfig
    from trl_tlt.engine import SamplingParams
    from trl_tlt.engine import generate as generate_module

    trainer = train_one_step(
        TLTGRPOTrainer, TLTConfig, tiny_model_dirs["qwen2"], tmp_path, drafter_type=drafter_type,
        spot_feature_source=source, max_steps=1,
    )  # fmt: skip
    policy = trainer.accelerator.unwrap_model(trainer.model)
    alive, seen = [], []
    copying = generate_module.copying_policy_weights

    def watching(model, names):
        seen.append(tuple(names))
        in_use = sum(copy().nbytes for copy in alive if copy() is not None)
        seen.append(in_use)
        with copying(model, names) as copies:
            yield copies
        alive.extend(weakref.ref(t) for t in copies.values())

    monkeypatch.setattr(generate_module, "copying_policy_weights", contextlib.contextmanager(watching))
    trainer.tlt.open_rollout()
    params = SamplingParams(max_new_tokens=4, temperature=1.0, eos_token_ids=())
    for _ in range(2):
        trainer.tlt.generate(policy, [[5, 9, 17], [3, 40]], params, 0, 3, training=True, version=1, sharded=True,
                             record=source != "training_step")  # fmt: skip
    if not copied:
        assert seen == []
        return
    copy_bytes = policy.get_input_embeddings().weight.nbytes  # 80 KiB
    assert seen[0] == copied and seen[2] == copied
    assert seen[3] == 0, seen[3] / copy_bytes  # the previous copies are gone


@NEEDS_DEEPSPEED
def test_a_drafter_lm_loads_whole_under_an_active_zero3_config(tiny_model_dirs, tokenizer):
    """#61's fourth defect: with the shipped `zero3` config active (transformers' `HfDeepSpeedConfig`, as a ZeRO-3
    TrainingArguments sets it), `drafter_type="model"` loaded the drafter LM inside `deepspeed.zero.Init`: partitioned,
    and nothing gathered it before its first draft. It loads whole now, and the config stays active for the policy.
    Mutation caught: load without `without_zero3_init` (DeepSpeed's partitioning needs a process group it has not got
    here, or leaves empty shards)."""
    from transformers.integrations import HfDeepSpeedConfig, is_deepspeed_zero3_enabled

    from trl_tlt.trainer.build import load_drafter_lm

    config = HfDeepSpeedConfig({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1})
    assert is_deepspeed_zero3_enabled()
    try:
        drafter = load_drafter_lm(tiny_model_dirs["llama"], tokenizer)
        assert is_deepspeed_zero3_enabled()  # restored for the policy
    finally:
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()
    del config
    assert not any(hasattr(p, "ds_id") for p in drafter.parameters())
    assert all(p.numel() > 0 for p in drafter.parameters())
