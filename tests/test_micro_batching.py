"""The training phase without the long tail's padding (TLTConfig.micro_batching) gives GRPOTrainer's loss and
gradients: every loss type, with beta > 0 and num_iterations = 2, on a long-tailed batch, in 4 accumulated
micro-batches and in one micro-batch per optimizer step (the rows then cut into length-sorted sub-chunks)."""

import pytest
import torch
from datasets import Dataset
from testing_utils import PROMPTS, config_kwargs, reward_len
from transformers import AutoModelForCausalLM, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from trl_tlt import TLTConfig, TLTGRPOTrainer
from trl_tlt.training.micro_batching import (
    REGROUPABLE_LOSS_TYPES,
    _take,
    completion_lengths,
    group_by_length,
    length_sorted_chunks,
    with_count,
)


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


def one_step(trainer_cls, config_cls, model_dir, tmp_path, monkeypatch, layout=(4, 4), **overrides):
    """One optimizer step over `layout` = (rows per micro-batch, accumulated micro-batches): 16 rows in all; returns the
    summed micro-batch losses, the gradients, the completion lengths of each micro-batch's rows, and the shapes of the
    forwards over completions."""
    rows, accumulation = layout
    monkeypatch.setattr(trainer_cls, "_generate_single_turn", fixed_rollout)
    widths = []

    def recording(self, model, input_ids, *args, **kwargs):
        widths.append(tuple(input_ids.shape))
        return PARENT_FORWARD(self, model, input_ids, *args, **kwargs)

    monkeypatch.setattr(GRPOTrainer, "_get_per_token_logps_and_entropies", recording)
    settings = {"beta": 0.1, "num_iterations": 2, "learning_rate": 1e-3, **overrides}
    args = config_cls(
        **config_kwargs(
            tmp_path,
            per_device_train_batch_size=rows,
            gradient_accumulation_steps=accumulation,
            num_generations=4,
            max_completion_length=MAX_COMPLETION,
            **settings,
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
    return torch.stack(losses[:accumulation]).sum(), recorder.grads, micro_batches[:accumulation], widths


# Stated tolerance: float32 round-off of the same arithmetic on differently shaped (narrower) tensors.
TOLERANCE = dict(rtol=1e-5, atol=1e-7)


LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "vespo", "luspo"]


def assert_same_step(loss, grads, base_loss, base_grads):
    torch.testing.assert_close(loss, base_loss, **TOLERANCE)
    assert grads.keys() == base_grads.keys() and grads
    for name, grad in base_grads.items():
        torch.testing.assert_close(grads[name], grad, msg=name, **TOLERANCE)


@pytest.mark.parametrize("layout", [(4, 4), (16, 1)], ids=["4-micro-batches", "1-micro-batch"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_loss_and_gradients_equal_grpo_trainer(tiny_model_dirs, tmp_path, monkeypatch, loss_type, layout):
    extra = {"importance_sampling_level": "sequence"} if loss_type == "luspo" else {}
    model_dir = tiny_model_dirs["qwen2"]
    base_loss, base_grads, base_batches, base_widths = one_step(
        GRPOTrainer, GRPOConfig, model_dir, tmp_path / "grpo", monkeypatch, layout, loss_type=loss_type, **extra
    )
    loss, grads, batches, widths = one_step(
        TLTGRPOTrainer, TLTConfig, model_dir, tmp_path / "tlt", monkeypatch, layout, loss_type=loss_type, **extra
    )
    assert_same_step(loss, grads, base_loss, base_grads)
    # every forward over completions ran narrower in total (loss, old and reference log-probs)
    covered, padded = sum(b * w for b, w in widths), sum(b * w for b, w in base_widths)
    assert covered < (0.6 if layout == (4, 4) else 0.4) * padded
    all_rows = sorted(n for batch in base_batches for n in batch)
    assert sorted(n for batch in batches for n in batch) == all_rows  # the same rows in the optimizer step
    if layout == (16, 1):  # one micro-batch: its forwards cut into sub-chunks, GRPOTrainer's one forward each before
        assert len(widths) > len(base_widths)
    elif loss_type in REGROUPABLE_LOSS_TYPES:  # dealt into micro-batches by length
        assert batches == [all_rows[i : i + 4] for i in range(0, 16, 4)]
    else:  # bnpo normalises per micro-batch: GRPOTrainer's micro-batches (trim-only)
        assert batches == base_batches


def test_mutation_sub_chunks_normalised_each_on_their_own_is_caught(tiny_model_dirs, tmp_path, monkeypatch):
    """The negative control of the test above: the loss of a micro-batch taken per sub-chunk, each normalised on its
    own and averaged (a sub-chunk treated as a micro-batch), is not GRPOTrainer's loss, and the comparison says so."""
    model_dir = tiny_model_dirs["qwen2"]
    base_loss, base_grads, _, _ = one_step(GRPOTrainer, GRPOConfig, model_dir, tmp_path / "grpo", monkeypatch, (16, 1))
    compute = TLTGRPOTrainer._compute_loss

    def per_chunk_loss(self, model, inputs):
        mask = inputs["completion_mask"]
        lengths = completion_lengths(mask, mask.size(1))
        order = torch.argsort(lengths, stable=True)
        bounds = length_sorted_chunks(lengths[order].tolist(), inputs["prompt_ids"].size(1), len(order), 64)
        assert len(bounds) > 1
        losses = [compute(self, model, _take(inputs, order[a:b])) for a, b in bounds]
        return torch.stack(losses).mean()

    monkeypatch.setattr(TLTGRPOTrainer, "_compute_loss", per_chunk_loss)
    loss, grads, _, _ = one_step(TLTGRPOTrainer, TLTConfig, model_dir, tmp_path / "tlt", monkeypatch, (16, 1))
    with pytest.raises(AssertionError):
        assert_same_step(loss, grads, base_loss, base_grads)


def test_sub_chunks_keep_fewer_activations_than_one_padded_forward(tiny_model_dirs, tmp_path, monkeypatch):
    """The loss forward's activations kept for the backward (every tensor autograd saves, counted once per storage):
    the sub-chunks keep fewer bytes than TRL's one padded forward over the same micro-batch."""
    saved = {}

    def measure(trainer_cls, config_cls, tag):
        compute = trainer_cls.compute_loss

        def measured(self, model, inputs, *args, **kwargs):
            storages = {}

            def pack(tensor):
                storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
                return tensor

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                loss = compute(self, model, inputs, *args, **kwargs)
            saved.setdefault(tag, sum(storages.values()))
            return loss

        monkeypatch.setattr(trainer_cls, "compute_loss", measured)
        one_step(trainer_cls, config_cls, tiny_model_dirs["qwen2"], tmp_path / tag, monkeypatch, (16, 1), beta=0.0)

    measure(GRPOTrainer, GRPOConfig, "grpo")
    monkeypatch.undo()
    measure(TLTGRPOTrainer, TLTConfig, "tlt")
    assert 0 < saved["tlt"] < 0.6 * saved["grpo"]


def test_length_sorted_chunks_cut_where_it_saves_more_than_a_forward():
    lengths = [2, 2, 3, 3, 4, 30, 48]
    assert length_sorted_chunks(lengths, 5, 16, 0) == [(0, 2), (2, 4), (4, 5), (5, 6), (6, 7)]  # every saving taken
    assert length_sorted_chunks(lengths, 5, 16, 64) == [(0, 5), (5, 7)]  # 30 and 48 together: a cut saves 18
    assert length_sorted_chunks(lengths, 5, 16, 10_000) == [(0, 7)]  # no cut pays: TRL's one forward
    assert length_sorted_chunks(lengths, 5, 3, 10_000) == [(0, 2), (2, 5), (5, 7)]  # at most 3 rows a forward
    assert length_sorted_chunks([7] * 6, 5, 16, 0) == [(0, 6)]  # even lengths: nothing to save
    # every rank of a sharded policy runs the count agreed: split where it saves most, merged where it costs least
    assert with_count([(0, 7)], lengths, 3) == [(0, 5), (5, 6), (6, 7)]
    assert with_count([(0, 5), (5, 6), (6, 7)], lengths, 2) == [(0, 5), (5, 7)]
    assert with_count([(0, 6)], [7] * 6, 2) == [(0, 5), (5, 6)]  # nothing to save: any cut


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
