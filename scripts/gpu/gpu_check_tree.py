"""GPU check of the lean draft/verify loop and tree speculation (docs/engine.md, "The CUDA path").

On the embedded policy and its warm EAGLE-3 head (from `--cache-dir`: build them on a CPU machine with
`python -m trl_tlt.tooling.workload` and carry the directory), prints one table:

1. greedy token identity with `model.generate` (float64) for a chain and two trees, batch 1, 5 and 16;
2. spec-on / spec-off throughput (tokens per second, the bench_rollout protocol) of EAGLE-3 chain and tree arms at
   batch 1 (1x1), 8 (2x4) and 64 (8x8);
3. the drafter's step (`_DraftSession.step`, batch 8) eager vs `torch.compile(mode="reduce-overhead")` (CUDA graphs):
   compile + capture seconds and milliseconds per step.

    python scripts/gpu/gpu_check_tree.py --cache-dir .gpu_cache --output $OUT/gpu_check_tree.json
    python scripts/gpu/gpu_check_tree.py --device cpu --smoke          # the same code on CPU, small (tested)
"""

from __future__ import annotations

import argparse
import time

from trl_tlt.tooling.benchmarks import machine, write_json  # first: the Hugging Face libraries offline


# isort: split

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from trl_tlt.drafters.eagle3 import Eagle3Drafter, Eagle3Model  # noqa: E402
from trl_tlt.drafters.eagle3.lean import _DraftSession, _LeanHead  # noqa: E402
from trl_tlt.engine.generate import SpeculativeEngine  # noqa: E402
from trl_tlt.engine.kv_cache import RaggedKVModel  # noqa: E402
from trl_tlt.engine.sampling import SamplingParams  # noqa: E402
from trl_tlt.engine.speculation import FixedSpeculation  # noqa: E402
from trl_tlt.tooling.workload import build_eagle3_drafter, build_policy, make_dataset, prompt_token_ids  # noqa: E402


ARMS = {"chain k4": (4,), "chain k6": (6,), "tree 4/2/8": (4, 2, 8), "tree 6/4/24": (6, 4, 24)}


def engine(model, head, arm):
    if arm is None:
        return SpeculativeEngine(model)
    drafter = Eagle3Drafter(head)
    if len(arm) == 1:
        return SpeculativeEngine(model, drafter, num_speculative_tokens=arm[0])
    return SpeculativeEngine(model, drafter, speculation=FixedSpeculation(arm[0], "default", *arm[1:]))


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def greedy_identity(model, eagle_path, tokenizer, device, max_new_tokens) -> bool:
    model64 = model.to(torch.float64)
    head64 = Eagle3Model.from_pretrained(eagle_path, model64).to(torch.float64)
    prompts = prompt_token_ids(tokenizer, make_dataset(16, seed=7)["prompt"])
    eos = tokenizer.eos_token_id
    expected = []
    for prompt in prompts:
        ids = model64.generate(
            torch.tensor([prompt], device=device), do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos
        )[0, len(prompt) :].tolist()
        expected.append(ids[: ids.index(eos) + 1] if eos in ids else ids)
    params = SamplingParams(do_sample=False, max_new_tokens=max_new_tokens, eos_token_ids=(eos,))
    ok = True
    for arm in ((4,), (3, 2, 5), (4, 3, 21)):
        for batch in (1, 5, 16):
            out = engine(model64, head64, arm).generate(prompts[:batch], params)
            ok &= out.completion_ids == expected[:batch]
    model.to(torch.float32)
    return ok


def throughput(model, head, tokenizer, device, shapes, sets, max_new_tokens) -> dict:
    params = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, eos_token_ids=(tokenizer.eos_token_id,))
    arms = {"spec off": None, **ARMS}
    result = {}
    for shape in shapes:
        num_prompts, num_generations = (int(x) for x in shape.split("x"))
        tokens = {name: 0 for name in arms}
        seconds = {name: 0.0 for name in arms}
        for repeat in range(sets):
            data = make_dataset(num_prompts, seed=1000 + 17 * repeat + num_prompts)
            prompts = [p for p in prompt_token_ids(tokenizer, data["prompt"]) for _ in range(num_generations)]
            for name, arm in arms.items():
                generator = torch.Generator(device=device).manual_seed(repeat)
                sync(device)
                start = time.perf_counter()
                out = engine(model, head, arm).generate(prompts, params, generator=generator)
                sync(device)
                seconds[name] += time.perf_counter() - start
                tokens[name] += out.stats.num_emitted_tokens
        rate = {name: tokens[name] / seconds[name] for name in arms}
        result[shape] = {name: rate[name] / rate["spec off"] for name in ARMS}
    return result


def draft_step_timing(model, head, device, steps) -> dict:
    batch, hidden = 8, model.config.hidden_size
    runner = RaggedKVModel(head, output_hidden_states=True)
    lean = _LeanHead(head)
    with torch.no_grad():
        runner.prefill([[5] * 100] * batch, hidden_states=torch.randn(batch, 100, hidden, device=device))
        tokens = torch.randint(0, 200, (batch, 1), device=device)
        state = torch.randn(batch, 1, hidden, device=device)

        def run(step):
            session = _DraftSession(lean, runner, 4)
            h = state
            for depth in range(1, 5):
                _, h = step(session, tokens, h, depth)

        def timed(step):
            run(step)
            sync(device)
            start = time.perf_counter()
            for _ in range(steps):
                run(step)
            sync(device)
            return 1000 * (time.perf_counter() - start) / (4 * steps)

        eager = timed(lambda s, t, h, d: s.step(t, h, d))
        mode = "reduce-overhead" if device.type == "cuda" else "default"
        compiled_step = torch.compile(_DraftSession.step, mode=mode, dynamic=False)
        start = time.perf_counter()
        run(lambda s, t, h, d: compiled_step(s, t, h, d))
        sync(device)
        warmup = time.perf_counter() - start
        compiled = timed(lambda s, t, h, d: compiled_step(s, t, h, d))
    return {"eager_ms_per_step": eager, "compiled_ms_per_step": compiled, "compile_seconds": warmup, "mode": mode}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (a CPU test of the script)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile timing")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    policy_path = build_policy(cache_dir=args.cache_dir)
    eagle_path = build_eagle3_drafter(cache_dir=args.cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(policy_path)
    model = AutoModelForCausalLM.from_pretrained(policy_path).to(device).eval()
    head = Eagle3Model.from_pretrained(eagle_path, model).eval()

    shapes = ["1x1", "2x4"] if args.smoke else ["1x1", "2x4", "8x8"]
    max_new = 24 if args.smoke else 512
    result = {
        "check": "gpu_check_tree",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else machine(),
        "greedy_identity": greedy_identity(model, eagle_path, tokenizer, device, 16 if args.smoke else 64),
        "spec_on_over_off": throughput(model, head, tokenizer, device, shapes, 1 if args.smoke else 6, max_new),
    }
    print(f"device: {result['device']}")
    print(f"greedy identity (chain, trees; batch 1/5/16): {result['greedy_identity']}")
    print(f"{'spec-on / spec-off':<20}" + "".join(f"{name:>14}" for name in ARMS))
    for shape, row in result["spec_on_over_off"].items():
        print(f"{'batch ' + shape:<20}" + "".join(f"{row[name]:>13.2f}x" for name in ARMS))
    write_json(result, args.output)  # the figures so far, should the compile stage fail
    if not args.no_compile:
        try:
            result["draft_step"] = draft_step_timing(model, head, device, 5 if args.smoke else 200)
        except Exception as error:  # a failed capture is a finding of this check, not the end of it
            result["draft_step_error"] = f"{type(error).__name__}: {error}"
            print(f"draft step compile failed: {result['draft_step_error']}")
    if "draft_step" in result:
        d = result["draft_step"]
        print(
            f"draft step (batch 8): eager {d['eager_ms_per_step']:.3f} ms, compiled ({d['mode']}) "
            f"{d['compiled_ms_per_step']:.3f} ms after {d['compile_seconds']:.1f} s of compile and capture"
        )
    write_json(result, args.output)
    if not result["greedy_identity"]:
        raise SystemExit("greedy identity FAILED")


if __name__ == "__main__":
    main()
