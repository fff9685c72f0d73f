"""The training phase's long tail (#63): GRPOTrainer against TLTGRPOTrainer on the real-regime policy
(SmolLM2-135M-Instruct after its short SFT, `trl_tlt.tooling.real_model.real_regime_policy_path`), where the
training phase pays for the padding of the longest completion. Each part writes its keys into one JSON (`--output`,
merged with what is there), on the same machine:

- `one`: both trainers (each in a process of its own), `--steps` steps of 8 prompts x 4 at T = 1, `--max-new-tokens`
  tokens at most, ONE micro-batch per optimizer step (`per_device_train_batch_size` = the generation batch, 32 rows): the training phase of a step (its
  seconds minus its rollout's) and its median ratio, GRPO's over TLT's (`training_phase_ratio`).
- `four`: the same with 4 micro-batches of 8 rows per optimizer step (`training_phase_ratio_4_micro_batches`).
- `memory`: one generation batch of the policy's samples (8 x 4 at T = 1), one loss forward and backward over it in
  TRL's layout (one padded forward) and in TLT's (length-sorted sub-chunks): the seconds (3 repeats each, alternated,
  medians) and the activations autograd keeps for the backward (bytes, every saved tensor's storage counted once, in
  a pass of its own).

    pip install -e ".[real-model]"
    python scripts/bench/bench_training_phase.py --parts one four --output docs/benchmarks/training_phase_real_cpu.json
    python scripts/bench/bench_training_phase.py --parts memory --output docs/benchmarks/training_phase_real_cpu.json

(`memory` in an invocation of its own: its process keeps about 9 GB after it, beside which a trainer's run of
`one` at 32 rows, about 16 GB, does not fit in 24 GB.)
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time

from trl_tlt.tooling.benchmarks import run_parts  # first: the Hugging Face libraries offline


# isort: split


import torch  # noqa: E402
from bench_real_model import encode, load, run_trainer  # noqa: E402  (scripts/bench/, beside this script)

from trl_tlt.engine import SamplingParams, SpeculativeEngine  # noqa: E402
from trl_tlt.tooling.real_model import real_model_prompts, real_regime_policy_path  # noqa: E402
from trl_tlt.training.micro_batching import SPLIT_TOKENS, trimmed_logps_and_entropies  # noqa: E402


PROMPTS, GENERATIONS = 8, 4


def training_phases(run: dict) -> list[float]:
    """Each step's seconds minus its rollout's (TLT's rollout includes its spot training, at the rollout's end)."""
    return [step - rollout for step, rollout in zip(run["step_seconds"], run["rollout_seconds"], strict=True)]


def one_run(args) -> None:
    """`--run KIND`: one trainer's run, in a process of its own, into `--run-output`."""
    path, steps = real_regime_policy_path(), argparse.Namespace(steps=args.steps)
    result = run_trainer(
        args.run, steps, None, path=path, num_prompts=PROMPTS, completion=args.max_new_tokens,
        micro_batch=args.micro_batch,
    )  # fmt: skip
    with open(args.run_output, "w") as f:
        json.dump(result, f)


def compare(args, micro_batch: int, suffix: str) -> dict:
    """Both trainers, each in a fresh process (the same memory state at its start: within one process the second run
    inherits the first's allocations), GRPOTrainer first."""
    real_regime_policy_path()  # built once, before the runs
    runs = {}
    for kind in ("grpo", "tlt"):
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            command = [sys.executable, __file__, "--run", kind, "--micro-batch", str(micro_batch), "--steps",
                       str(args.steps), "--max-new-tokens", str(args.max_new_tokens), "--run-output", out.name]  # fmt: skip
            subprocess.run(command, check=True)
            runs[kind] = json.load(out)  # the child wrote the file by its name; this handle reads it from the start
    for run in runs.values():
        run["training_phase_seconds"] = training_phases(run)

    def ratio(key):
        return statistics.median(runs["grpo"][key]) / statistics.median(runs["tlt"][key])

    return {
        f"runs{suffix}": {"steps": args.steps, "prompts": PROMPTS, "micro_batch": micro_batch, "runs": runs},
        f"training_phase_ratio{suffix}": ratio("training_phase_seconds"),
        f"step_ratio{suffix}": ratio("step_seconds"),
        f"rollout_ratio{suffix}": ratio("rollout_seconds"),
        f"training_phase_seconds_grpo{suffix}": statistics.median(runs["grpo"]["training_phase_seconds"]),
        f"training_phase_seconds_tlt{suffix}": statistics.median(runs["tlt"]["training_phase_seconds"]),
    }


def part_one(args) -> dict:
    return compare(args, PROMPTS * GENERATIONS, "")


def part_four(args) -> dict:
    return compare(args, PROMPTS * GENERATIONS // 4, "_4_micro_batches")


def part_memory(args) -> dict:
    from trl.trainer.utils import add_fused_lm_head

    policy, tokenizer = load(real_regime_policy_path())
    prompts = encode(tokenizer, real_model_prompts(PROMPTS, seed=11)) * GENERATIONS
    params = SamplingParams(
        temperature=1.0, max_new_tokens=args.max_new_tokens, eos_token_ids=(tokenizer.eos_token_id,)
    )
    out = SpeculativeEngine(policy, drafter=None).generate(prompts, params, generator=torch.Generator().manual_seed(0))
    completions = [list(c) for c in out.completion_ids]
    width_p, width_c = max(map(len, prompts)), max(map(len, completions))
    ids = torch.full((len(prompts), width_p + width_c), tokenizer.pad_token_id)
    mask = torch.zeros_like(ids)
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):  # GRPOTrainer's layout
        ids[i, width_p - len(p) : width_p + len(c)] = torch.tensor(p + c)
        mask[i, width_p - len(p) : width_p + len(c)] = 1
    add_fused_lm_head(policy, outputs=("log_probs", "entropy"))  # as GRPOTrainer's loss forward computes them
    policy.train()

    def forward(input_ids, attention_mask, keep, chunk_size=None):  # GRPOTrainer's forward over completions
        labels = input_ids.masked_fill(attention_mask == 0, -100)
        labels[:, :-keep] = -100
        out = policy(input_ids=input_ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True)
        return out.log_probs[:, -keep:], out.entropy[:, -keep:], None

    layouts = {
        "trl": lambda: forward(ids, mask, width_c),
        "tlt": lambda: trimmed_logps_and_entropies(forward, ids, mask, width_c, None, True, SPLIT_TOKENS["cpu"]),
    }

    def loss_and_backward(name):
        policy.zero_grad(set_to_none=True)
        logps, entropies, _ = layouts[name]()
        ((logps + 0.01 * entropies) * mask[:, width_p:]).sum().backward()

    saved, seconds = {}, {name: [] for name in layouts}
    for _ in range(3):  # timed without hooks, alternated
        for name in layouts:
            start = time.perf_counter()
            loss_and_backward(name)
            seconds[name].append(time.perf_counter() - start)
    for name in layouts:  # the activations autograd keeps: every saved tensor's storage, once
        storages = {}

        def pack(tensor, storages=storages):
            storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            loss_and_backward(name)
        saved[name] = sum(storages.values())
    lengths = [len(c) for c in completions]
    return {
        "memory": {"rows": len(prompts), "prompt_width": width_p, "completion_lengths": lengths, "seconds": seconds},
        "loss_forward_saved_bytes_trl": saved["trl"],
        "loss_forward_saved_bytes_tlt": saved["tlt"],
        "loss_forward_saved_bytes_ratio": saved["tlt"] / saved["trl"],
        "loss_forward_backward_seconds_ratio": statistics.median(seconds["trl"]) / statistics.median(seconds["tlt"]),
        "padded_positions_ratio": len(lengths) * (width_p + width_c) / sum(width_p + n for n in lengths),
    }


PARTS = {"one": part_one, "four": part_four, "memory": part_memory}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", choices=list(PARTS), default=["memory"])
    parser.add_argument("--steps", type=int, default=10, help="one, four: GRPO steps per run.")
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--output", default=None, help="JSON to write (its keys from other parts are kept).")
    parser.add_argument("--run", choices=["grpo", "tlt"], default=None, help=argparse.SUPPRESS)  # one run (a child)
    parser.add_argument("--micro-batch", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--run-output", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(2)
    if args.run:
        one_run(args)
        return
    run_parts("training_phase_real", PARTS, args.parts, args, args.output)


if __name__ == "__main__":
    main()
