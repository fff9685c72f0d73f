"""The behaviour's fingerprint: 3 GRPO steps of TLTGRPOTrainer, sampled and greedy, spot training on, on a tiny policy
built here; sha256 of every step's completions, of the trained policy and of the trained drafter. A change that must
leave behaviour as it is (a restructure) leaves every digest as it is.

    python scripts/tools/fingerprint.py [--output fingerprint.json] [--compare earlier.json]

Deterministic by construction: a seeded tiny policy, spot training with an exact step count, the bandit on its
modelled costs, one thread.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile

from trl_tlt.tooling.benchmarks import trainer_config, write_json  # first: the Hugging Face libraries offline


# isort: split

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402


CORPUS = ["12+34=46\n46+7=53\n#### 53", "The quick brown fox jumps over the lazy dog. Count: 1 2 3 4 5."] * 20
PROMPTS = ["12+34=", "The quick", "1 2 3", "hello world"]


def digest(values) -> str:
    h = hashlib.sha256()
    for value in values:
        if isinstance(value, torch.Tensor):
            h.update(value.detach().float().cpu().contiguous().numpy().tobytes())
        else:
            h.update(json.dumps(value).encode())
    return h.hexdigest()[:16]


def run(mode: str, policy_dir: str, output_dir: str) -> dict:
    from trl_tlt import TLTGRPOTrainer

    seen = []

    def reward(completions, completion_ids, **kwargs):
        seen.append([list(ids) for ids in completion_ids])
        return [float(sum(ids) % 7) for ids in completion_ids]  # varies within a group: the policy trains

    args = trainer_config(
        "tlt", output_dir, num_prompts=2, num_generations=4, micro_batch=8, max_completion_length=16, steps=3,
        learning_rate=1e-2, gradient_checkpointing=True, tlt_args=dict(spot_training=True, spot_steps_per_rollout=2, spot_tokens_per_step=64,
        selector_deterministic=True), generation_kwargs={"do_sample": False} if mode == "greedy" else None,
    )  # fmt: skip
    from transformers import AutoModelForCausalLM

    trainer = TLTGRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(policy_dir),
        reward_funcs=reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS * 4}),
    )
    trainer.train()
    drafter = trainer.tlt_drafter.model
    return {
        "completions": [digest(step) for step in seen],
        "policy": digest(p for _, p in sorted(trainer.model.state_dict().items())),
        "drafter": digest(p for _, p in sorted(drafter.state_dict().items())),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", help="write the fingerprint here (JSON)")
    parser.add_argument("--compare", help="an earlier fingerprint: exit 1 unless every digest is equal")
    options = parser.parse_args()
    torch.set_num_threads(1)
    from trl_tlt.tooling.tiny import build_tiny_model, build_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = build_tokenizer(CORPUS, vocab_size=320)
        policy = build_tiny_model(tokenizer, hidden_size=64, num_hidden_layers=3, num_attention_heads=2)
        policy.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        result = {mode: run(mode, tmp, os.path.join(tmp, mode)) for mode in ("sampled", "greedy")}
    print(json.dumps(result, indent=2))
    if options.output:
        write_json(result, options.output)
    if options.compare:
        earlier = json.loads(open(options.compare).read())
        same = all(earlier[mode][key] == result[mode][key] for mode in result for key in result[mode])
        print("identical" if same else "DIFFERENT")
        sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
