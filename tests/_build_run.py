"""Helper of tests/test_workload.py (not a test): build a tiny policy and its EAGLE-3 head in a fresh process and print
their checksums as JSON.

python tests/_build_run.py CACHE_DIR [--unpinned]    (--unpinned: the build keeps the process's thread count)
"""

import json
import os
import sys


os.environ.setdefault("HF_HUB_OFFLINE", "1")

from trl_tlt.tooling.workload import DrafterRecipe, PolicyRecipe, build_eagle3_drafter, builds  # noqa: E402


RECIPE = PolicyRecipe(
    num_sft_examples=256, hidden_size=64, num_hidden_layers=3, intermediate_size=128, sft_batch_size=16
)
DRAFTER = DrafterRecipe(num_prompts=16, num_eval_prompts=4, epochs=1, max_tokens_per_batch=256)

if __name__ == "__main__":
    if "--unpinned" in sys.argv:  # the negative control: what the pinning prevents
        import torch

        builds.BUILD_THREADS = torch.get_num_threads()
    drafter = build_eagle3_drafter(RECIPE, DRAFTER, cache_dir=sys.argv[1], verbose=False)
    policy = drafter.parent / f"policy-{RECIPE.key()}"
    print(json.dumps({"policy": builds.build_checksum(policy), "drafter": builds.build_checksum(drafter)}))
