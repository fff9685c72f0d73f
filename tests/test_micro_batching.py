"""The training phase without the long tail's padding (TLTConfig.micro_batching) gives GRPOTrainer's loss and
gradients: every loss type, with beta > 0, num_iterations = 2 and gradient accumulation, on a long-tailed batch."""

import pytest
import torch
from datasets import Dataset
from testing_utils import PROMPTS, config_kwargs, reward_len
from transformers import AutoModelForCausalLM, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from trl_tlt import TLTConfig, TLTGRPOTrainer
from trl_tlt.training.micro_batching import REGROUPABLE_LOSS_TYPES, completion_lengths, group_by_length


MAX_COMPLETION = 48
# Completion lengths of the 16 rows of a generation batch (4 prompts x 4): a long tail, one row truncated.
LENGTHS = [2, 3, 3, 4, 5, 2, 6, 3, 4, 48, 3, 2, 5, 30, 4, 3]
PARENT_FORWARD = GRPOTrainer._get_per_token_logps_and_entropies


def fixed_rollout(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
    """Stands in for both trainers' generation: deterministic long-tailed completions, EOS-terminated but one."""
    eos = self.eos_token_ids[0]
    out = []
    for i, prompt in enumerate(prompt_ids):
        n = LENGTHS[i % len(LENGTHS)]
        body = [(prompt[-1] + 7 * j + i) % 250 + 5 for j in range(n)]
        out.append(body if n == MAX_COMPLETION else body[:-1] + [eos])
    return out, None


class GradientRecorder(TrainerCallback):
    """Snapshot every parameter's gradient before the first optimizer step."""

    def __init__(self):
        self.grads = None

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if self.grads is None:
            self.grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def one_step(trainer_cls, config_cls, model_dir, tmp_path, monkeypatch, **overrides):
    """One optimizer step over 4 accumulated micro-batches of 4 rows; returns the summed micro-batch losses, the
    gradients, the completion lengths of each micro-batch's rows, and the widths of the forwards over completions."""
    monkeypatch.setattr(trainer_cls, "_generate_single_turn", fixed_rollout)
    widths = []

    def recording(self, model, input_ids, *args, **kwargs):
        widths.append(tuple(input_ids.shape))
        return PARENT_FORWARD(self, model, input_ids, *args, **kwargs)

    monkeypatch.setattr(GRPOTrainer, "_get_per_token_logps_and_entropies", recording)
    args = config_cls(
        **config_kwargs(
            tmp_path,
            per_device_train_batch_size=4,
            gradient_accumulation_steps=4,
            num_generations=4,
            max_completion_length=MAX_COMPLETION,
            beta=0.1,
            num_iterations=2,
            learning_rate=1e-3,
            **overrides,
        )
    )
    trainer = trainer_cls(
        model=AutoModelForCausalLM.from_pretrained(model_dir),
        reward_funcs=reward_len,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS * 4}),
    )
    recorder = GradientRecorder()
    trainer.add_callback(recorder)
    losses, micro_batches = [], []
    compute_loss = trainer.compute_loss

    def recording_loss(model, inputs, *a, **kw):
        mask = inputs["completion_mask"]
        micro_batches.append(sorted(completion_lengths(mask, mask.size(1)).tolist()))
        loss = compute_loss(model, inputs, *a, **kw)
        losses.append(loss.detach())
        return loss

    trainer.compute_loss = recording_loss
    trainer.train()
    return torch.stack(losses[:4]).sum(), recorder.grads, micro_batches[:4], widths


# Stated tolerance: float32 round-off of the same arithmetic on differently shaped (narrower) tensors.
TOLERANCE = dict(rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "vespo", "luspo"])
def test_loss_and_gradients_equal_grpo_trainer(tiny_model_dirs, tmp_path, monkeypatch, loss_type):
    extra = {"importance_sampling_level": "sequence"} if loss_type == "luspo" else {}
    model_dir = tiny_model_dirs["qwen2"]
    base_loss, base_grads, base_batches, base_widths = one_step(
        GRPOTrainer, GRPOConfig, model_dir, tmp_path / "grpo", monkeypatch, loss_type=loss_type, **extra
    )
    loss, grads, batches, widths = one_step(
        TLTGRPOTrainer, TLTConfig, model_dir, tmp_path / "tlt", monkeypatch, loss_type=loss_type, **extra
    )
    torch.testing.assert_close(loss, base_loss, **TOLERANCE)
    assert grads.keys() == base_grads.keys() and grads
    for name, grad in base_grads.items():
        torch.testing.assert_close(grads[name], grad, msg=name, **TOLERANCE)
    # every forward over completions ran narrower in total (loss, old and reference log-probs)
    assert sum(b * w for b, w in widths) < 0.6 * sum(b * w for b, w in base_widths)
    all_rows = sorted(n for batch in base_batches for n in batch)
    assert sorted(n for batch in batches for n in batch) == all_rows  # the same rows in the optimizer step
    if loss_type in REGROUPABLE_LOSS_TYPES:  # dealt into micro-batches by length
        assert batches == [all_rows[i : i + 4] for i in range(0, 16, 4)]
    else:  # bnpo normalises per micro-batch: GRPOTrainer's micro-batches (trim-only)
        assert batches == base_batches


def test_trim_only_cases_keep_the_micro_batches(tiny_model_dirs, tmp_path, monkeypatch):
    """`top_entropy_quantile` (a quantile per micro-batch) and `micro_batching="trimmed"` do not regroup."""
    model_dir = tiny_model_dirs["qwen2"]
    for tag, extra in (("entropy", {"top_entropy_quantile": 0.5}), ("trimmed", {"micro_batching": "trimmed"})):
        tlt_extra = extra if tag == "trimmed" else extra
        base_extra = {} if tag == "trimmed" else extra
        base_loss, base_grads, base_batches, _ = one_step(
            GRPOTrainer, GRPOConfig, model_dir, tmp_path / f"grpo-{tag}", monkeypatch, **base_extra
        )
        loss, grads, batches, _ = one_step(
            TLTGRPOTrainer, TLTConfig, model_dir, tmp_path / f"tlt-{tag}", monkeypatch, **tlt_extra
        )
        assert batches == base_batches, tag
        torch.testing.assert_close(loss, base_loss, **TOLERANCE)
        for name, grad in base_grads.items():
            torch.testing.assert_close(grads[name], grad, msg=name, **TOLERANCE)


def test_padded_is_trl_s_layout(tiny_model_dirs, tmp_path, monkeypatch):
    """`micro_batching="padded"` turns the feature off: the forwards have GRPOTrainer's shapes, bit-equal results."""
    model_dir = tiny_model_dirs["qwen2"]
    base_loss, base_grads, base_batches, base_widths = one_step(
        GRPOTrainer, GRPOConfig, model_dir, tmp_path / "grpo", monkeypatch
    )
    loss, grads, batches, widths = one_step(
        TLTGRPOTrainer, TLTConfig, model_dir, tmp_path / "tlt", monkeypatch, micro_batching="padded"
    )
    assert widths == base_widths and batches == base_batches
    assert torch.equal(loss, base_loss)
    assert all(torch.equal(grads[n], g) for n, g in base_grads.items())


def test_group_by_length_keeps_each_optimizer_step_s_rows():
    batches = [
        {"completion_mask": torch.tensor(m), "advantages": torch.tensor(a), "names": n, "num_items_in_batch": 9}
        for m, a, n in (
            ([[1, 1, 1], [1, 0, 0]], [0.1, 0.2], ["a", "b"]),
            ([[1, 1, 0], [1, 0, 0]], [0.3, 0.4], ["c", "d"]),
            ([[1, 1, 1], [1, 1, 1]], [0.5, 0.6], ["e", "f"]),
            ([[1, 0, 0], [1, 1, 0]], [0.7, 0.8], ["g", "h"]),
        )
    ]
    grouped = group_by_length(batches, gradient_accumulation_steps=2)
    assert [g["names"] for g in grouped] == [["b", "d"], ["c", "a"], ["g", "h"], ["e", "f"]]
    assert torch.equal(grouped[1]["advantages"], torch.tensor([0.3, 0.1]))
    assert all(g["num_items_in_batch"] == 9 for g in grouped)
