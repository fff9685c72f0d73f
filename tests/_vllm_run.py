"""Helper of tests/test_vllm_colocate.py and test_vllm_server.py (not a test): TLT GRPO with vLLM and spot training,
per rank.

torchrun --nproc_per_node 2 tests/_vllm_run.py POLICY_DIR DRAFTER_DIR OUTPUT_DIR [fsdp2 | server=URL]

With `fsdp2`, the trainer's policy is sharded by FSDP2 (`sharded_at_the_seam`) beside each rank's whole vLLM copy.
With `server=URL`, vLLM server mode against that server (`trl-tlt vllm-serve` with DRAFTER_DIR), every default.
"""

import functools
import json
import os
import sys
from unittest import mock


for _var, _value in {
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}.items():
    os.environ.setdefault(_var, _value)

import torch  # noqa: E402
import vllm  # noqa: E402
from datasets import Dataset  # noqa: E402
from testing_utils import assert_draft_model_equals, rule_sequences  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from trl_tlt import TLTConfig, TLTGRPOTrainer  # noqa: E402
from trl_tlt.engine.sharding import policy_is_sharded  # noqa: E402
from trl_tlt.tooling.sharding import sharded_at_the_seam  # noqa: E402


def main(policy_dir: str, drafter_dir: str, output_dir: str, sharding: str | None = None) -> None:
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    g = torch.Generator().manual_seed(1)
    dataset = Dataset.from_dict({"prompt": [tokenizer.decode(p) for p in rule_sequences(16, 4, g).tolist()]})
    config = dict(
        output_dir=output_dir, use_vllm=True, vllm_mode="colocate", vllm_max_model_length=128,
        per_device_train_batch_size=4, num_generations=4, max_completion_length=12, max_steps=2, temperature=1.0,
        drafter_model_name_or_path=drafter_dir, num_speculative_tokens=3, spot_training=True,
        spot_learning_rate=1e-3, report_to="none", logging_steps=1, save_strategy="no", use_cpu=True, bf16=False,
        seed=0, disable_tqdm=True,
    )  # fmt: skip
    server = sharding.removeprefix("server=") if sharding and sharding.startswith("server=") else None
    if server is not None:
        del config["vllm_max_model_length"], config["spot_training"], config["spot_learning_rate"]
        # 2 waits that train, each as long as 48 tokens take the server: drafter steps on each rank, even on a busy CPU
        config.update(vllm_mode="server", vllm_server_base_url=server, max_steps=3, max_completion_length=48)
    elif sharding is not None:
        sharded_at_the_seam(sharding, config)
    args = TLTConfig(**config)
    with mock.patch("trl.generation.vllm_generation.LLM", functools.partial(vllm.LLM, dtype="float32")):
        trainer = TLTGRPOTrainer(
            model=policy_dir,
            reward_funcs=lambda completions, **kw: [len(c) / 40 for c in completions],
            args=args,
            train_dataset=dataset,
            processing_class=tokenizer,
        )
    trainer.train()
    trainer.vllm_generation.sync_weights()  # the next policy sync pushes the drafter trained beside the last step
    if server is None:
        assert_draft_model_equals(trainer.vllm_generation.model_runner.get_draft_model(), trainer.tlt_drafter.model)
    elif trainer.accelerator.is_main_process:  # what the server loaded, read back, is what was pushed last
        client = trainer.vllm_generation.vllm_client
        assert {w.get("draft") for w in client.loaded_weights()} == {client.last_update_sha256}
    flat = torch.cat([p.detach().reshape(-1) for p in trainer.tlt_spot.params]).double()
    report = {
        "push_failures": trainer.vllm_generation.push_failures,
        "world_size": trainer.accelerator.num_processes,
        "distributed_type": str(trainer.accelerator.distributed_type),
        "policy_sharded": policy_is_sharded(trainer.model_wrapped),
        "global_step": trainer.state.global_step,
        "drafter_sum": float(flat.sum()),
        "spot_steps": trainer.tlt_spot.total_steps,
        "rerun_samples": trainer.tlt_spot.rerun_samples,
        "verify_steps": (trainer.tlt_last_vllm_stats or {}).get("verify_steps", 0),  # a server's: the main process's
    }
    with open(os.path.join(output_dir, f"report-{trainer.accelerator.process_index}.json"), "w") as f:
        json.dump(report, f)
    # vLLM tears its own process groups down at exit (destroying them here first makes that fail)


if __name__ == "__main__":
    main(*sys.argv[1:5])
