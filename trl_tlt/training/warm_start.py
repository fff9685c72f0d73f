"""Offline drafter training (a warm start before RL, as SpecForge's offline mode): the policy's samples with the
hidden states its forwards recorded, drafter steps on them within an epoch, time or token budget, and the acceptance
length measured as it learns (`trl-tlt train-drafter`, `trl_tlt.tooling.warm_start`)."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch
from transformers import PreTrainedModel

from ..drafters.draft_vocab import DEFAULT_DRAFT_VOCAB_SIZE, fitted_size
from ..drafters.eagle3 import Eagle3Model
from .distillation import (
    DistillConfig,
    DrafterSample,
    Features,
    eagle3_loss,
    lm_distill_loss,
    pack,
    sample_features,
)


def cosine_lr(step: int, total: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(total - warmup, 1)))


def training_batches(features: list[Features], is_eagle: bool, config: DistillConfig) -> tuple[list, list[int]]:
    """The drafter's batches of about `config.max_tokens_per_batch` tokens (an EAGLE-3 head's packed rows, a small
    LM's padded batches of similar lengths) and the tokens each trains on."""
    if is_eagle:
        batches = pack(features, config.max_tokens_per_batch)
        return batches, [int((b.seq_ids > 0).sum()) for b in batches]
    batches, current = [], []
    for f in sorted(features, key=lambda f: len(f.sample.token_ids)):
        if current and len(f.sample.token_ids) * (len(current) + 1) > config.max_tokens_per_batch:
            batches.append(current)
            current = []
        current.append(f)
    batches.append(current)
    return batches, [sum(len(f.sample.token_ids) for f in b) for b in batches]


def _synchronized(param: torch.Tensor) -> float:
    """The clock once the device's kernels are done (CUDA runs them after the call returns)."""
    if param.is_cuda:
        torch.cuda.synchronize(param.device)
    return time.perf_counter()


def train_drafter(
    policy: PreTrainedModel,
    drafter: Eagle3Model | PreTrainedModel,
    samples: list[DrafterSample],
    epochs: int = 1,
    learning_rate: float = 1e-3,
    config: DistillConfig | None = None,
    seed: int = 0,
    progress: bool = True,
    max_seconds: float | None = None,
    max_tokens: int | None = None,
    evaluate=None,
    eval_every_seconds: float = 60.0,
) -> list[dict[str, float]]:
    """Warm-start (or continue training) a drafter on rollouts of `policy`; returns the per-step metrics.

    `drafter`: an `Eagle3Model`, or a causal LM sharing the policy's tokenizer (wrap it with peft first to train
    LoRA adapters only). The policy stays frozen; its features are those the samples' rollouts recorded (or computed
    once), so every step costs the drafter alone. Training stops after `epochs`, or once it has trained for
    `max_seconds` or on `max_tokens` tokens (the learning rate's cosine then spans what the budget allows).
    `evaluate(drafter)` (-> acceptance length) runs every `eval_every_seconds` of training and after the last step.
    Each step's row has `tokens` and `seconds` (trained so far; evaluation not counted), and `acceptance` where it
    ran.
    """
    from tqdm.auto import tqdm

    config = config or DistillConfig()
    is_eagle = isinstance(drafter, Eagle3Model)
    batches, batch_tokens = training_batches(sample_features(policy, drafter, samples), is_eagle, config)
    params = [p for p in drafter.parameters() if p.requires_grad]
    if not params:
        raise ValueError("The drafter has no trainable parameters.")
    optimizer = torch.optim.AdamW(params, lr=learning_rate, betas=(0.9, 0.95), weight_decay=0.0)
    plan = [epochs * len(batches)]  # steps the schedule spans: cut to the budget once a step's cost is known
    if max_tokens is not None:
        plan[0] = max(1, min(plan[0], math.ceil(max_tokens * len(batches) / sum(batch_tokens))))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: cosine_lr(s, plan[0], max(plan[0] // 20, 1)))
    head_weight = policy.get_output_embeddings().weight
    generator = torch.Generator().manual_seed(seed)
    history: list[dict[str, float]] = []
    acceptance = None
    seconds, tokens, last_eval = 0.0, 0, 0.0
    bar = tqdm(total=plan[0], desc="drafter", disable=not progress)
    order = [i for _ in range(epochs) for i in torch.randperm(len(batches), generator=generator).tolist()]
    for step, index in enumerate(order):
        start = time.perf_counter()
        drafter.train()
        if is_eagle:
            loss, metrics = eagle3_loss(drafter, head_weight, batches[index], config)
        else:
            loss, metrics = lm_distill_loss(drafter, head_weight, batches[index], config.chunk_size)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        scheduler.step()
        seconds += _synchronized(params[0]) - start
        tokens += batch_tokens[index]
        if step == 2 and max_seconds is not None:  # the budget in steps, from the first steps' cost
            plan[0] = max(3, min(plan[0], int(max_seconds / (seconds / 3))))
            bar.total = plan[0]
        metrics.update(loss=float(loss.detach()), tokens=tokens, seconds=seconds)
        done = (
            step + 1 >= min(plan[0], len(order))
            or (max_tokens is not None and tokens >= max_tokens)
            or (max_seconds is not None and seconds >= max_seconds)
        )
        if evaluate is not None and (seconds - last_eval >= eval_every_seconds or done):
            acceptance, last_eval = evaluate(drafter.eval()), seconds
            metrics["acceptance"] = acceptance
        history.append(metrics)
        bar.update()
        accept = {} if acceptance is None else {"accept": f"{acceptance:.2f}"}
        bar.set_postfix(loss=f"{metrics['loss']:.3f}", acc0=f"{metrics.get('acc_0', 0):.2f}", **accept)
        if done:
            break
    bar.close()
    drafter.eval()
    return history


@torch.no_grad()
def generate_samples(
    policy: PreTrainedModel,
    prompts: list[list[int]],
    params,
    batch_size: int = 64,
    seed: int = 0,
    progress: bool = False,
    record_layers: list[int] | None = None,
) -> list[DrafterSample]:
    """The policy's own completions of `prompts` (the engine without speculation), with the policy's hidden states at
    `record_layers` that its forwards computed (`DrafterSample.features`; what drafter training reads)."""
    from tqdm.auto import tqdm

    from ..engine.generate import SpeculativeEngine

    engine = SpeculativeEngine(policy)
    generator = torch.Generator(device=policy.device).manual_seed(seed)
    samples = []
    with tqdm(total=len(prompts), desc="policy samples", unit="prompt", disable=not progress) as bar:
        for begin in range(0, len(prompts), batch_size):
            batch = prompts[begin : begin + batch_size]
            out = engine.generate(batch, params, generator=generator, record_layers=record_layers)
            features = out.features or [None] * len(batch)
            samples += [
                DrafterSample(p + c, len(p), f, None if f is None else 0)
                for p, c, f in zip(batch, out.completion_ids, features, strict=True)
                if c
            ]
            bar.update(len(batch))
    return samples


@torch.no_grad()
def evaluate_acceptance(
    policy: PreTrainedModel, drafter, prompts: list[list[int]], params, k: int = 4, batch_size: int = 64, seed: int = 0
) -> dict:
    """Speculate k tokens at every step; mean acceptance length and acceptance rate per draft position."""
    from ..engine.generate import SpeculativeEngine

    engine = SpeculativeEngine(policy, drafter=drafter, num_speculative_tokens=k)
    generator = torch.Generator(device=policy.device).manual_seed(seed)
    drafts, accepted, per_pos = 0, 0, [0] * k
    for begin in range(0, len(prompts), batch_size):
        stats = engine.generate(prompts[begin : begin + batch_size], params, generator=generator).stats
        drafts += stats.num_drafts
        accepted += stats.num_accepted_tokens
        for j, count in enumerate(stats.num_accepted_tokens_per_pos):
            per_pos[j] += count
    return {
        "k": k,
        "num_prompts": len(prompts),
        "num_drafts": drafts,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else 1.0,
        "acceptance_rate_per_position": [c / drafts if drafts else 0.0 for c in per_pos],
    }


def policy_samples(
    policy, prompts, params, completions, drafter, aux_layer_ids, seed, progress
) -> list[DrafterSample]:
    """The warm start's samples: the policy's completions of `prompts` with the hidden states a new EAGLE-3 head (at
    `aux_layer_ids`, default its own) or a small LM (`drafter`) trains on, or the given `completions` (no features:
    `train_drafter` runs the policy over them once)."""
    from ..drafters.eagle3.config import default_aux_layer_ids

    if completions is None:
        num_layers = policy.config.get_text_config().num_hidden_layers
        aux = list(aux_layer_ids or default_aux_layer_ids(num_layers)) if drafter is None else []
        layers = [*aux, num_layers]  # what the drafter reads, and the policy's distribution
        samples = generate_samples(policy, prompts, params, seed=seed, progress=progress, record_layers=layers)
    else:
        samples = [DrafterSample(p + c, len(p)) for p, c in zip(prompts, completions, strict=True) if c]
    if not samples:
        raise ValueError("No training samples: every completion is empty.")
    return samples


def warm_start_drafter(
    policy: PreTrainedModel,
    prompts: list[list[int]],
    output_dir,
    params,
    drafter: PreTrainedModel | None = None,
    completions: list[list[int]] | None = None,
    eval_prompts: list[list[int]] | None = None,
    epochs: int = 3,
    learning_rate: float = 1e-3,
    config: DistillConfig | None = None,
    draft_vocab_size: int | None = None,
    aux_hidden_state_layer_ids: list[int] | None = None,
    k: int = 4,
    seed: int = 0,
    progress: bool = True,
    max_seconds: float | None = None,
    max_tokens: int | None = None,
    eval_every_seconds: float = 60.0,
) -> dict:
    """Train a drafter for `policy` offline, evaluate its acceptance on `eval_prompts`, save it to `output_dir`.

    `drafter=None` builds a new EAGLE-3 head (draft vocabulary from the rollouts' token frequencies, sized to the
    tokens they use as the trainer sizes a new head's, or `draft_vocab_size`); otherwise
    `drafter` is a small causal LM (optionally a peft model: LoRA adapters only). `completions` (aligned with
    `prompts`) skip generation; by default the policy completes every prompt with `params`, as in RL, and its forwards
    record the features the drafter trains on. `max_seconds` / `max_tokens`: the training budget (`train_drafter`).
    Returns a report (also written to `output_dir/train_report.json`), with `curve`: the acceptance length at k on
    `eval_prompts` against trained tokens and seconds, measured every `eval_every_seconds` of training.
    """
    from ..drafters import ModelDrafter
    from ..drafters.eagle3 import Eagle3Drafter

    start = time.perf_counter()
    samples = policy_samples(policy, prompts, params, completions, drafter, aux_hidden_state_layer_ids, seed, progress)
    generate_s = time.perf_counter() - start
    vocab = policy.config.get_text_config().vocab_size
    if drafter is None:
        counts = torch.zeros(vocab)
        for s in samples:
            counts += torch.bincount(torch.tensor(s.token_ids[s.prompt_length :]), minlength=vocab)[:vocab]
        # as a new head in the trainer: sized to the tokens the policy uses (`fitted_size`), unless given
        size = draft_vocab_size or fitted_size(counts, min(DEFAULT_DRAFT_VOCAB_SIZE, vocab))
        model = Eagle3Model.for_policy(policy, aux_hidden_state_layer_ids, size, counts)
        make = Eagle3Drafter
    else:
        model = drafter

        def make(m):
            return ModelDrafter(m, vocab)

    def evaluate(m):
        return evaluate_acceptance(policy, make(m), eval_prompts, params, k=k, seed=seed)["mean_acceptance_length"]

    report: dict = {"num_samples": len(samples), "num_tokens": sum(len(s.token_ids) for s in samples), "k": k}
    if eval_prompts:
        report["before"] = evaluate_acceptance(policy, make(model), eval_prompts, params, k=k, seed=seed)
    train_start = time.perf_counter()
    history = train_drafter(
        policy, model, samples, epochs, learning_rate, config, seed, progress, max_seconds, max_tokens,
        evaluate if eval_prompts else None, eval_every_seconds,
    )  # fmt: skip
    report["train_seconds"] = time.perf_counter() - train_start  # evaluations included
    report["generate_seconds"] = generate_s
    report["steps"] = len(history)
    report["first"] = history[0]  # the first drafter step's loss and accuracies
    last = history[-10:]  # the last steps' loss and accuracies (not the running counts, not the evaluations)
    keys = [key for key in history[-1] if key not in ("tokens", "seconds", "acceptance")]
    report["final"] = {key: sum(h.get(key, 0.0) for h in last) / len(last) for key in keys}
    if eval_prompts:
        report["curve"] = [{"tokens": 0, "seconds": 0.0, "acceptance": report["before"]["mean_acceptance_length"]}]
        report["curve"] += [
            {key: h[key] for key in ("tokens", "seconds", "acceptance")} for h in history if "acceptance" in h
        ]
        report["after"] = evaluate_acceptance(policy, make(model), eval_prompts, params, k=k, seed=seed)
    output_dir = Path(output_dir)
    model.save_pretrained(output_dir)
    (output_dir / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report
