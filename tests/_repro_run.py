"""Helper of tests/test_drop_in.py (not a test): the completions of 3 sampled TLT GRPO steps, in a fresh process.

python tests/_repro_run.py MODEL_DIR OUTPUT_DIR TLT_ARGS_JSON RESULT_JSON
"""

import json
import os
import sys


for _var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(_var, "1")
sys.path.insert(0, os.path.dirname(__file__))

from testing_utils import make_trainer, recorder  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from trl_tlt import TLTConfig, TLTGRPOTrainer  # noqa: E402


if __name__ == "__main__":
    model_dir, output_dir, extra, result = sys.argv[1:5]
    seen = []
    trainer = make_trainer(
        TLTGRPOTrainer,
        TLTConfig,
        AutoModelForCausalLM.from_pretrained(model_dir),
        output_dir,
        rewards=recorder(seen),
        max_steps=3,
        **json.loads(extra),
    )
    trainer.train()
    with open(result, "w") as f:
        json.dump(seen, f)
