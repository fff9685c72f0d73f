"""The embedded policy, its drafters and the drift scenario, built offline from recipes and cached by their hash."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from datasets import Dataset

from .task import DRIFT_STEP_MIXTURE, SFT_STEP_MIXTURE, TaskConfig, make_dataset, prompt_token_ids


def recipe_key(recipe) -> str:
    """Cache key of a recipe dataclass: a hash of every field."""
    payload = json.dumps(dataclasses.asdict(recipe), sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:12]


@dataclass(frozen=True)
class PolicyRecipe:
    """Everything that determines the embedded policy; its hash is the cache key.

    Args:
        task: The task RL trains on.
        sft_task: The task the SFT data is drawn from (same problems, shorter on average).
        seed: Seeds the data, the initialisation and training.
        vocab_size: BPE vocabulary size of the tokenizer.
        hidden_size, num_hidden_layers, num_attention_heads, intermediate_size: Qwen2 dimensions (head_dim 32).
        num_sft_examples: SFT problems generated.
        sft_batch_size, sft_learning_rate: SFT schedule (one pass, AdamW, cosine).
    """

    task: TaskConfig = TaskConfig()
    sft_task: TaskConfig = TaskConfig(step_mixture=SFT_STEP_MIXTURE)
    seed: int = 0
    vocab_size: int = 400
    hidden_size: int = 128
    num_hidden_layers: int = 8
    num_attention_heads: int = 4
    intermediate_size: int = 512
    num_sft_examples: int = 40000
    sft_batch_size: int = 32
    sft_learning_rate: float = 1e-3

    def key(self) -> str:
        return recipe_key(self)


# Every build trains with this many threads, whatever the machine's cores: float reductions, and so the weights, depend
# on how the work is split. With it, two builds on one machine and torch version are bit-identical (tests/test_workload.py).
BUILD_THREADS = 2


@contextmanager
def deterministic_build(seed: int) -> Iterator[None]:
    """Seeded, deterministic algorithms, `BUILD_THREADS` threads; the caller's settings are restored after."""
    import torch

    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(BUILD_THREADS)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(seed)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)


def build_checksum(path: str | Path) -> str:
    """What a build made, in 16 hex digits: sha256 of its tensors (by name, with dtype and shape) and its tokenizer.
    Not of the files' bytes: safetensors writes its header's metadata in a different order from run to run."""
    from safetensors.torch import load_file

    digest = hashlib.sha256()
    for name, tensor in sorted(load_file(str(Path(path) / "model.safetensors")).items()):
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.contiguous().numpy().tobytes())
    tokenizer = Path(path) / "tokenizer.json"
    if tokenizer.exists():
        digest.update(tokenizer.read_bytes())
    return digest.hexdigest()[:16]


def default_cache_dir() -> Path:
    """`$TRL_TLT_CACHE`, else `$XDG_CACHE_HOME/trl_tlt`, else `~/.cache/trl_tlt`."""
    if "TRL_TLT_CACHE" in os.environ:
        return Path(os.environ["TRL_TLT_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "trl_tlt"


def save_build(model, tokenizer, path: Path, recipe) -> None:
    """Save a built model, its tokenizer and `recipe` (a dataclass) at `path`, atomically: written beside it, then
    renamed, so that a half-built model is never picked up."""
    tmp = path.with_name(path.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "recipe.json").write_text(json.dumps(dataclasses.asdict(recipe), indent=2))
    tmp.rename(path)


def sft_dataset(recipe: PolicyRecipe) -> Dataset:
    """The SFT data of the recipe (prompt/completion conversations); also the warm-start data for drafters."""
    return make_dataset(recipe.num_sft_examples, seed=recipe.seed + 1, task=recipe.sft_task, with_solutions=True)


def build_policy_tokenizer(recipe: PolicyRecipe):
    """A BPE tokenizer trained on the recipe's SFT texts."""
    from ..tiny import build_tokenizer

    data = sft_dataset(recipe)
    corpus = [p[0]["content"] + "\n" + c[0]["content"] for p, c in zip(data["prompt"], data["completion"])][:5000]
    return build_tokenizer(corpus, vocab_size=recipe.vocab_size)


def encode_sft_example(tokenizer, prompt, completion) -> tuple[list[int], list[int]]:
    """(input ids, labels): the chat-rendered prompt, then the completion and EOS; prompt labels are -100."""
    prompt_ids = prompt_token_ids(tokenizer, [prompt])[0]
    completion_ids = tokenizer(completion[-1]["content"], add_special_tokens=False)["input_ids"]
    completion_ids = completion_ids + [tokenizer.eos_token_id]
    return prompt_ids + completion_ids, [-100] * len(prompt_ids) + completion_ids


def train_sft(
    model, tokenizer, dataset: Dataset, batch_size: int, learning_rate: float, seed: int, verbose: bool = True
):
    """Completion-only SFT on CPU: AdamW (beta2 0.95), linear warm-up, cosine decay, gradient clipping 1.0.

    A plain loop rather than `trl.SFTTrainer`: on this task and budget, SFTTrainer with its default optimizer
    settings stayed at the format-only loss plateau (~1.4 nats/token after 1000 steps) where this loop reaches
    ~0.2 in 500 steps; the loop also keeps the build deterministic and within its CPU budget.
    """
    import math

    import torch

    # Length-grouped batches: lengths are long-tailed, and one long example would pad its whole batch. Shuffle,
    # sort windows of 64 batches by length (`num_steps`), cut into batches, shuffle the batches.
    rng = random.Random(seed)
    order = list(range(len(dataset)))
    rng.shuffle(order)
    window, lengths = 64 * batch_size, dataset["num_steps"]
    batches = []
    for begin in range(0, len(order), window):
        chunk = sorted(order[begin : begin + window], key=lambda i: lengths[i])
        batches += [chunk[j : j + batch_size] for j in range(0, len(chunk), batch_size)]
    rng.shuffle(batches)
    num_steps = len(batches)
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, betas=(0.9, 0.95), weight_decay=0.0)
    warmup = min(100, num_steps // 10)

    def lr_factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(num_steps - warmup, 1)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    model.train()
    start, running = time.perf_counter(), []
    for step in range(num_steps):
        rows = dataset[batches[step]]
        examples = [encode_sft_example(tokenizer, p, c) for p, c in zip(rows["prompt"], rows["completion"])]
        width = max(len(ids) for ids, _ in examples)
        input_ids = torch.tensor([ids + [tokenizer.pad_token_id] * (width - len(ids)) for ids, _ in examples])
        labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in examples])
        attention_mask = (labels != -100) | (
            torch.arange(width)[None] < torch.tensor([len(i) for i, _ in examples])[:, None]
        )
        loss = model(input_ids=input_ids, attention_mask=attention_mask.long(), labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        running.append(loss.item())
        if verbose and ((step + 1) % 200 == 0 or step + 1 == num_steps):
            print(
                f"  sft step {step + 1}/{num_steps}  loss {sum(running) / len(running):.3f}  "
                f"{time.perf_counter() - start:.0f}s",
                flush=True,
            )
            running = []
    return model.eval()


def _build_sft_model(
    path: Path,
    tokenizer,
    shape: PolicyRecipe,
    data: Dataset,
    schedule: tuple[int, float],
    seed: int,
    recipe,
    verbose: bool,
) -> Path:
    """Train a new Qwen2 model of `shape` on `data` by SFT (`schedule`: batch size, learning rate), seeded with
    `seed`, and save it with `recipe` atomically at `path`."""
    from ..tiny import build_tiny_model

    start = time.perf_counter()
    with deterministic_build(seed):
        model = build_tiny_model(
            tokenizer,
            arch="qwen2",
            hidden_size=shape.hidden_size,
            num_hidden_layers=shape.num_hidden_layers,
            num_attention_heads=shape.num_attention_heads,
            intermediate_size=shape.intermediate_size,
            max_position_embeddings=1024,
            seed=seed,
        )
        if verbose:
            n = sum(p.numel() for p in model.parameters())
            print(
                f"training {path.name} ({n / 1e6:.2f}M parameters, {shape.num_hidden_layers} layers) by SFT ...",
                flush=True,
            )
        model = train_sft(model, tokenizer, data, *schedule, seed, verbose)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    save_build(model, tokenizer, path, recipe)
    if verbose:
        print(f"{path.name} built in {time.perf_counter() - start:.0f}s", flush=True)
    return path


def _build_from_policy_recipe(path: Path, tokenizer, recipe: PolicyRecipe, num_hidden_layers: int, verbose: bool):
    """A model of `recipe`'s width with `num_hidden_layers`, trained on the recipe's SFT data with its schedule."""
    shape = dataclasses.replace(recipe, num_hidden_layers=num_hidden_layers)
    schedule = (recipe.sft_batch_size, recipe.sft_learning_rate)
    return _build_sft_model(path, tokenizer, shape, sft_dataset(recipe), schedule, recipe.seed, recipe, verbose)


def build_policy(
    recipe: PolicyRecipe | None = None, cache_dir: str | Path | None = None, verbose: bool = True
) -> Path:
    """Build the embedded policy (tokenizer + SFT model) or reuse the cached one. Returns its directory."""
    recipe = recipe or PolicyRecipe()
    path = Path(cache_dir or default_cache_dir()) / f"policy-{recipe.key()}"
    if (path / "config.json").exists():
        return path
    return _build_from_policy_recipe(path, build_policy_tokenizer(recipe), recipe, recipe.num_hidden_layers, verbose)


def build_draft_lm(
    recipe: PolicyRecipe | None = None,
    cache_dir: str | Path | None = None,
    num_hidden_layers: int = 1,
    verbose: bool = True,
) -> Path:
    """A small LM drafter warm-started on the policy's SFT data, with the policy's tokenizer (cached)."""
    from transformers import AutoTokenizer

    recipe = recipe or PolicyRecipe()
    policy_path = build_policy(recipe, cache_dir, verbose)
    path = policy_path.parent / f"draft-lm-{recipe.key()}-L{num_hidden_layers}"
    if (path / "config.json").exists():
        return path
    tokenizer = AutoTokenizer.from_pretrained(policy_path)
    return _build_from_policy_recipe(path, tokenizer, recipe, num_hidden_layers, verbose)


@dataclasses.dataclass(frozen=True)
class DrafterRecipe:
    """The embedded EAGLE-3 drafter's warm start (its hash, with the policy's, is the cache key).

    The policy completes `num_prompts` RL-task prompts at temperature 1; the head trains `epochs` passes over them
    (rows of `max_tokens_per_batch` packed tokens); acceptance is measured on `num_eval_prompts` held-out prompts.
    """

    num_prompts: int = 2000
    num_eval_prompts: int = 64
    epochs: int = 5
    learning_rate: float = 2e-3
    max_tokens_per_batch: int = 1024
    ttt_length: int = 4
    seed: int = 0

    def key(self) -> str:
        return recipe_key(self)


def build_eagle3_drafter(
    recipe: PolicyRecipe | None = None,
    drafter_recipe: DrafterRecipe | None = None,
    cache_dir: str | Path | None = None,
    verbose: bool = True,
) -> Path:
    """The embedded policy's warm-start EAGLE-3 drafter (`trl_tlt.training.warm_start.warm_start_drafter`), cached.

    Its `train_report.json` holds the acceptance length at k = 4 before and after training.
    """
    recipe, drafter_recipe = recipe or PolicyRecipe(), drafter_recipe or DrafterRecipe()
    policy_path = build_policy(recipe, cache_dir, verbose)
    return _warm_start_eagle3(policy_path, f"eagle3-{recipe.key()}-{drafter_recipe.key()}", drafter_recipe, verbose)


def _warm_start_eagle3(
    policy_path: Path, name: str, drafter_recipe: DrafterRecipe, verbose: bool, sft: PolicyRecipe | None = None
) -> Path:
    """The warm-start EAGLE-3 drafter of the policy at `policy_path`, cached beside it under `name`.

    It trains on the policy's own completions of RL-task prompts, or with `sft` on the first
    `drafter_recipe.num_prompts` examples of that recipe's SFT data (the policy's features, fixed responses).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_tlt.engine.sampling import SamplingParams
    from trl_tlt.training.distillation import DistillConfig
    from trl_tlt.training.warm_start import warm_start_drafter

    path = policy_path.parent / name
    if (path / "config.json").exists():
        return path
    start = time.perf_counter()
    if verbose:
        print(f"warm-starting {path.name} (EAGLE-3 drafter) ...", flush=True)
    policy = AutoModelForCausalLM.from_pretrained(policy_path).eval()
    policy.requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(policy_path)
    r = drafter_recipe
    params = SamplingParams(temperature=1.0, max_new_tokens=512, eos_token_ids=(tokenizer.eos_token_id,))
    tmp = path.with_name(path.name + ".tmp")
    if sft is None:  # the policy completes the prompts itself
        prompts, completions = make_dataset(r.num_prompts, seed=r.seed + 2)["prompt"], None
    else:
        data = sft_dataset(sft).select(range(r.num_prompts))
        prompts = data["prompt"]
        completions = [tokenizer(c[-1]["content"], add_special_tokens=False)["input_ids"] for c in data["completion"]]
        completions = [c + [tokenizer.eos_token_id] for c in completions]
    with deterministic_build(r.seed):
        report = warm_start_drafter(
            policy,
            prompt_token_ids(tokenizer, prompts),
            tmp,
            params,
            completions=completions,
            eval_prompts=prompt_token_ids(tokenizer, make_dataset(r.num_eval_prompts, seed=r.seed + 3)["prompt"]),
            epochs=r.epochs,
            learning_rate=r.learning_rate,
            config=DistillConfig(ttt_length=r.ttt_length, max_tokens_per_batch=r.max_tokens_per_batch),
            k=4,
            seed=r.seed,
            progress=verbose,
        )
    (tmp / "recipe.json").write_text(json.dumps(dataclasses.asdict(r), indent=2))
    tmp.rename(path)  # atomic: a half-trained drafter is never picked up
    if verbose:
        before, after = report["before"]["mean_acceptance_length"], report["after"]["mean_acceptance_length"]
        print(
            f"{path.name} built in {time.perf_counter() - start:.0f}s: acceptance length at k=4 {before:.2f} -> "
            f"{after:.2f}",
            flush=True,
        )
    return path


@dataclasses.dataclass(frozen=True)
class DriftRecipe:
    """The drift scenario's start policy: a policy of the embedded one's shape and tokenizer, trained by one SFT from
    scratch on solutions in which a second style ("steps") is in its support; GRPO under `style_reward` then moves the
    policy to it (its hash is the cache key).

    Args:
        policy: The embedded policy's recipe: the tokenizer, the model's shape, and the SFT data the frozen head
            warm-starts on (`drafter`). The embedded policy itself is not built.
        steps_prompt_fraction: Fraction of the SFT prompts that ask for the "steps" style (", in steps") and are
            answered in it: practice in that style (so that GRPO's move to it costs little accuracy) without the
            start policy writing it more often unasked.
        steps_style_fraction: Fraction of the other (plain) prompts answered in the "steps" style unasked: how
            often the start policy writes it on the RL task's prompts, which never ask for it.
        task: The SFT problems: three times the embedded SFT's share of long ones (`DRIFT_STEP_MIXTURE`).
        num_examples, batch_size, learning_rate: The SFT (one pass, AdamW, cosine). Small batches: on 2 cores the
            task's arithmetic is learned per optimizer step more than per example (16,000 examples take about as long
            in batches of 8 as in batches of 32, and in batches of 8 reach a lower loss than 40,000 in batches of 32).
        drafter: The warm start of its EAGLE-3 drafter (the one kept frozen for comparison): offline, on the
            embedded policy's SFT data (all in the compact style) with this policy's features, as EAGLE heads are
            trained on a fixed chat corpus.
        seed: Seeds the initialisation and training (the data: `seed + 1`).
    """

    policy: PolicyRecipe = PolicyRecipe()
    steps_prompt_fraction: float = 0.25
    steps_style_fraction: float = 0.3
    task: TaskConfig = TaskConfig(step_mixture=DRIFT_STEP_MIXTURE)
    num_examples: int = 16000
    batch_size: int = 8
    learning_rate: float = 1e-3
    drafter: DrafterRecipe = DrafterRecipe(epochs=2)
    seed: int = 0

    def key(self) -> str:
        """The start policy's cache key: every field but `drafter` (the head is keyed by both)."""
        return recipe_key(dataclasses.replace(self, drafter=None))

    def sft_dataset(self) -> Dataset:
        """The start policy's SFT data."""
        return make_dataset(
            self.num_examples,
            seed=self.seed + 1,
            task=self.task,
            with_solutions=True,
            steps_style_fraction=self.steps_style_fraction,
            steps_prompt_fraction=self.steps_prompt_fraction,
        )


# Builds shipped with the package (the drift scenario's start policy and head: 16 minutes of SFT on a 2-core CPU
# without AVX-512, the same on every machine), by cache name, with the checksums they were built with.
SHIPPED_DIR = Path(__file__).with_name("shipped")
SHIPPED_CHECKSUMS = SHIPPED_DIR / "checksums.json"


def shipped_checksum(name: str) -> str | None:
    """The checksum (`build_checksum`) of the build `name` as shipped, None if it is not shipped."""
    if not SHIPPED_CHECKSUMS.is_file():
        return None
    return json.loads(SHIPPED_CHECKSUMS.read_text()).get(name)


def _from_shipped(path: Path, verbose: bool) -> bool:
    """Copy the shipped build of `path`'s name into the cache at `path`, checked against its checksum (a copy that does
    not match is removed: the build is then made from code). Returns whether it did."""
    source, expected = SHIPPED_DIR / path.name, shipped_checksum(path.name)
    if expected is None or not (source / "config.json").is_file():
        return False
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(source, tmp)
    if build_checksum(tmp) != expected:
        shutil.rmtree(tmp)
        print(f"the shipped {path.name} does not match its checksum {expected}: building it from code", flush=True)
        return False
    tmp.rename(path)
    if verbose:
        print(f"{path.name}: the shipped build ({expected}), checked", flush=True)
    return True


def _check_rebuild(path: Path) -> None:
    """Say whether a build made from code (`rebuild=True`) equals the shipped one: its checksum against theirs."""
    expected, built = shipped_checksum(path.name), build_checksum(path)
    if expected is None:
        return
    verdict = "equals the shipped build" if built == expected else f"differs from the shipped build ({expected})"
    print(f"{path.name} rebuilt from code: {built}, {verdict}", flush=True)


def build_drift_policy(
    recipe: DriftRecipe | None = None, cache_dir: str | Path | None = None, verbose: bool = True, rebuild: bool = False
) -> tuple[Path, Path]:
    """The drift scenario (cached): its start policy and that policy's warm-start EAGLE-3 drafter.

    Returns `(policy_dir, drafter_dir)`. Train it with GRPO under `style_reward` (log `steps_style_fraction` beside
    it): the reward rises as the policy writes its solutions in the "steps" style, and a drafter frozen at the
    start goes stale. The default recipe's builds ship with the package (`SHIPPED_DIR`, checked against their
    checksums); `rebuild=True` makes them from code instead, into the cache, and compares them with the shipped ones.
    """
    recipe = recipe or DriftRecipe()
    root = Path(cache_dir or default_cache_dir())
    path = root / f"drift-{recipe.key()}"
    name = f"eagle3-drift-{recipe.key()}-{recipe.drafter.key()}"
    if rebuild:
        for folder in (path, root / name):
            shutil.rmtree(folder, ignore_errors=True)
    if not (path / "config.json").exists() and (rebuild or not _from_shipped(path, verbose)):
        tokenizer = build_policy_tokenizer(recipe.policy)
        schedule, saved = (recipe.batch_size, recipe.learning_rate), dataclasses.replace(recipe, drafter=None)
        _build_sft_model(path, tokenizer, recipe.policy, recipe.sft_dataset(), schedule, recipe.seed, saved, verbose)
    if not (root / name / "config.json").exists() and not rebuild:
        _from_shipped(root / name, verbose)
    drafter = _warm_start_eagle3(path, name, recipe.drafter, verbose, sft=recipe.policy)
    if rebuild:
        _check_rebuild(path)
        _check_rebuild(drafter)
    return path, drafter
