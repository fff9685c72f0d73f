"""What every script under scripts/ shares: the offline environment, the trainer configuration of a CPU benchmark,
a run's JSON with its provenance, and bootstrap intervals.

Import it first thing (before transformers, datasets or TRL): it makes the Hugging Face libraries offline, as the tests
and the demo are (no Hub at run time).

Example:
    >>> from trl_tlt.tooling.benchmarks import trainer_config, write_json
    >>> config = trainer_config("tlt", output_dir, num_prompts=8, num_generations=8, max_completion_length=512, steps=30)
"""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Callable


for _var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(_var, "1")

from .provenance import machine, stamp  # noqa: E402, F401  (machine: for the scripts that qualify it)


def trainer_config(
    trainer: str,
    output_dir: str,
    *,
    num_prompts: int,
    num_generations: int,
    max_completion_length: int,
    steps: int,
    seed: int = 0,
    micro_batch: int | None = None,
    tlt_args: dict | None = None,
    **extra,
):
    """The configuration of one benchmark run on CPU: GRPOTrainer's (`trainer="grpo"`) or TLTGRPOTrainer's ("tlt", with
    `tlt_args` as TLTConfig fields). One process, float32, no checkpoints or reporting; each generation batch is
    `num_prompts` x `num_generations` rows in micro-batches of `micro_batch` rows (default: one group,
    `num_generations`); `extra`: any other GRPOConfig field."""
    from trl import GRPOConfig

    from trl_tlt import TLTConfig

    micro_batch = micro_batch or num_generations
    fields = dict(
        output_dir=output_dir, use_cpu=True, bf16=False, gradient_checkpointing=False, report_to="none",
        per_device_train_batch_size=micro_batch,
        gradient_accumulation_steps=num_prompts * num_generations // micro_batch,
        num_generations=num_generations, max_completion_length=max_completion_length, max_steps=steps,
        logging_steps=1, save_strategy="no", seed=seed, disable_tqdm=True,
    )  # fmt: skip
    fields.update(extra)
    if trainer == "grpo":
        return GRPOConfig(**fields)
    return TLTConfig(**fields, **(tlt_args or {}))


def step_timer():
    """A `TrainerCallback` whose `times` are the wall seconds of every optimizer step (rollout, scoring and training)."""
    from transformers import TrainerCallback

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.times, self._start = [], None

        def on_step_begin(self, args, state, control, **kwargs):
            self._start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter() - self._start)

    return StepTimes()


def timed_calls(obj, name: str) -> list[float]:
    """The wall seconds of every later call of `obj.name` (the method wrapped on the instance), in a list filled as
    they happen."""
    seconds, method = [], getattr(obj, name)

    def timed(*args, **kwargs):
        start = time.perf_counter()
        output = method(*args, **kwargs)
        seconds.append(time.perf_counter() - start)
        return output

    setattr(obj, name, timed)
    return seconds


def write_json(result: dict, path: str | None) -> None:
    """Write `result`, stamped with its command, commit, machine and seconds (`provenance.stamp`), to `path`
    (indented JSON) and say so; nothing when `path` is None."""
    if path:
        with open(path, "w") as f:
            json.dump(stamp(result), f, indent=2)
        print(f"wrote {path}")


def run_parts(benchmark: str, parts: dict[str, Callable], names: list[str], args, path: str | None) -> None:
    """Run the parts `names` of a script whose parts each return their keys (`parts[name](args)`), time each
    (`{name}_part_seconds`), and write them with `write_json` into `path`, keeping the keys of parts run before."""
    result = {}
    if path and os.path.exists(path):
        with open(path) as f:
            result = {k: v for k, v in json.load(f).items() if k not in ("command", "commit", "machine", "seconds")}
    result["benchmark"] = benchmark
    for name in names:
        start = time.perf_counter()
        values = parts[name](args)
        values[f"{name}_part_seconds"] = time.perf_counter() - start
        print({k: v for k, v in values.items() if not isinstance(v, dict)})
        result.update(values)
        write_json(result, path)  # after each part: a later part's failure keeps what the earlier ones measured


def bootstrap_interval(
    statistic: Callable[[list[int]], float], n: int, draws: int = 2000, seed: int = 0
) -> tuple[float, float]:
    """95% percentile bootstrap interval of `statistic(picks)`, where `picks` resamples range(n) with replacement.

    Paired: the statistic reads every series it compares at the same picks (e.g. the same prompt sets for both
    methods), so what the sets have in common cancels out.
    """
    rng = random.Random(seed)
    values = sorted(statistic([rng.randrange(n) for _ in range(n)]) for _ in range(draws))
    return values[int(0.025 * draws)], values[int(0.975 * draws) - 1]
