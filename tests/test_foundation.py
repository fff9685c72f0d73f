"""The package installs, the fixtures build offline, and the stock GRPOTrainer trains a fixture model on CPU."""

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer


def test_tokenizer_roundtrip_and_chatml(tiny_model_dirs, tokenizer):
    loaded = AutoTokenizer.from_pretrained(tiny_model_dirs["qwen2"])
    text = "12+34=46\n#### 46"
    assert loaded(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert loaded.decode(loaded(text)["input_ids"]) == text
    assert loaded.eos_token == "<|im_end|>" and loaded.pad_token == "<|endoftext|>"
    rendered = loaded.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_tiny_models_load(tiny_model_dirs):
    for arch, path in tiny_model_dirs.items():
        model = AutoModelForCausalLM.from_pretrained(path)
        assert model.config.model_type == arch
        assert model.config.hidden_size // model.config.num_attention_heads == 32


def test_stock_grpo_trainer_one_step(tiny_model_dirs, tmp_path):
    from trl import GRPOConfig, GRPOTrainer

    dataset = Dataset.from_dict({"prompt": ["1+2=", "3+4=", "5+6=", "7+8="]})

    def reward_len(completions, **kwargs):
        return [float(len(c)) for c in completions]

    args = GRPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        report_to="none",
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=8,
        max_steps=1,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
    )
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dirs["qwen2"])
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = GRPOTrainer(model=model, reward_funcs=reward_len, args=args, train_dataset=dataset)
    trainer.train()
    assert trainer.state.global_step == 1
    changed = [n for n, p in trainer.model.named_parameters() if not torch.equal(before[n], p.detach())]
    assert changed, "one GRPO step changed no parameter"
