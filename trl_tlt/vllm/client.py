"""`TLTVLLMClient`: TRL's `VLLMClient`, plus the drafter push and a weight transfer that works on a CPU.

- `push_drafter` sends the trainer's drafter into the server's draft model with vLLM's draft-weight session
  (`/start_draft_weight_update`, `/update_weights`, `/finish_weight_update`), over the server's own backend.
- A server started with `--weight-transfer-config '{"backend": "tlt_shm"}'` (`transfer.py`) receives the policy sync
  and the drafter push as files on this host instead of an NCCL broadcast (which moves nothing on a CPU); other
  backends go through TRL's code unchanged.
- `loaded_weights` reads back, through the server, the checksums of what its workers last loaded (`tlt_shm` with
  `TLTWorkerExtension`), to compare with `last_update_sha256`, the digest of the last update sent.
- `restarted` tells whether the server is still the one `init_communicator` set up (its workers' process ids, with
  `TLTWorkerExtension`), waiting for it where it does not answer.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file
from trl.generation.vllm_client import VLLMClient

from . import TRANSFER_BACKEND as BACKEND


def file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def transfer_folder(num_bytes: int) -> Path:
    """Where an update of `num_bytes` is written: /dev/shm (memory, no disk) where it has room, else the temporary
    folder; both are the host's, which a server on the same host reads."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > 2 * num_bytes:
        return shm
    return Path(tempfile.gettempdir())


class TLTVLLMClient(VLLMClient):
    """TRL's client with `push_drafter`, `loaded_weights` and, on a `tlt_shm` server, a CPU transport."""

    backend: str | None = None  # the server's weight-transfer backend, read at `init_communicator`
    count_spec_decode = False  # read the server's speculative-decoding totals around each generate call
    last_spec_decode: tuple[float, float, float] | None = None  # the last call's (drafts, draft tokens, accepted)
    request_timeout: float = 600.0  # seconds a weight-update request may take before it counts as failed

    last_update_sha256: str | None = None  # `tlt_shm`: the digest of the last update the server took
    boot: frozenset[str] | None = None  # the server's worker processes at `init_communicator` (None: not told)

    def check_server(self, total_timeout: float = 0.0, retry_interval: float = 2.0):
        import requests

        try:
            super().check_server(total_timeout, retry_interval)
        except requests.ConnectionError as error:
            raise ConnectionError(
                f"No vLLM server answers at {self.base_url} (waited {total_timeout} s). Start one with `trl-tlt "
                "vllm-serve --model POLICY` (docs/server.md) before the trainer, or set vllm_server_base_url "
                "(vllm_server_host / vllm_server_port) and vllm_server_timeout."
            ) from error

    def init_communicator(self, device: torch.device | str | int = 0):
        config = self.get_server_info()["weight_transfer_config"]
        self.backend = None if config is None else config.get("backend")
        self.boot = None
        with contextlib.suppress(Exception):  # a server without TLTWorkerExtension: restarts are not told
            self.boot = self.server_boot()
        if self.backend != BACKEND:
            return super().init_communicator(device)
        self._post(f"{self.base_url}/init_weight_transfer_engine", json={"init_info": {}})
        with contextlib.suppress(Exception):  # a session a killed trainer left open would refuse every later start
            self._post_once("finish_weight_update")

    def server_boot(self) -> frozenset[str]:
        """The ids of the server's worker processes, drawn at their start (needs `TLTWorkerExtension`)."""
        return frozenset(self._post_once("collective_rpc", {"method": "trl_tlt_boot"})["results"])

    def restarted(self, timeout: float) -> bool:
        """Whether the server is no longer the one `init_communicator` set up (it was restarted: new worker processes,
        holding the weights they started with), waiting up to `timeout` seconds for a server that does not answer
        (then `ConnectionError`). False for a server without `TLTWorkerExtension`, which cannot tell."""
        import requests

        if self.boot is None:
            return False
        deadline = time.monotonic() + timeout
        while True:  # TRL's `check_server` waits on a request without a timeout: a server that hangs would hold it
            with contextlib.suppress(requests.RequestException):
                if requests.get(f"{self.base_url}/health", timeout=10).status_code == 200:
                    return self.server_boot() != self.boot
            if time.monotonic() > deadline:
                raise ConnectionError(f"The vLLM server at {self.base_url} did not answer within {timeout} s.")
            time.sleep(2)

    def _start_weight_update(self):
        if self.backend != BACKEND:
            return super()._start_weight_update()
        self._post_once("start_weight_update")

    def _finish_weight_update(self):
        if self.backend != BACKEND:
            return super()._finish_weight_update()
        self._post_once("finish_weight_update")

    def update_named_params(
        self, metadata: list[tuple[str, str, list[int]]], named_params: Iterator[tuple[str, torch.Tensor]]
    ):
        if self.backend != BACKEND:
            return super().update_named_params(metadata, named_params)
        self.last_update_sha256 = None
        tensors = {name: tensor.detach().to("cpu", copy=True).contiguous() for name, tensor in named_params}
        folder = transfer_folder(sum(t.numel() * t.element_size() for t in tensors.values()))
        with tempfile.TemporaryDirectory(prefix="trl-tlt-weights-", dir=folder) as tmp:
            path = Path(tmp) / "update.safetensors"
            save_file(tensors, str(path.with_suffix(".partial")))
            path.with_suffix(".partial").rename(path)  # the server only ever sees a whole file
            sha256 = file_digest(path)
            update_info = {"path": str(path), "sha256": sha256}
            if self._updating_weights:
                self._post_once("update_weights", {"update_info": update_info})
            else:
                with self.weight_update():
                    self._post_once("update_weights", {"update_info": update_info})
        self.last_update_sha256 = sha256

    def push_drafter(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load `named_tensors` (the drafter's checkpoint tensors) into the server's draft model, in one draft-weight
        session. Raises on failure; where the server's backend checks an update whole (`tlt_shm`), a failed push
        loaded nothing."""
        named_tensors = list(named_tensors)
        metadata = [(name, str(t.dtype).removeprefix("torch."), list(t.shape)) for name, t in named_tensors]
        self._post_once("start_draft_weight_update")
        self._updating_weights = True
        try:
            self.update_named_params(metadata, iter(named_tensors))
        except BaseException:
            with contextlib.suppress(Exception):  # the worker ended the session itself when its update failed
                self._finish_weight_update()
            raise
        finally:
            self._updating_weights = False
        self._finish_weight_update()
        self.reset_prefix_cache()

    def _post_once(self, route: str, body: dict | None = None) -> dict:
        """POST without TRL's retries: a weight update that failed is not sent again (the worker ended its session)."""
        import requests  # TRL's client needs it; this module is imported without it too

        response = requests.post(f"{self.base_url}/{route}", json=body or {}, timeout=self.request_timeout)
        if response.status_code != 200:
            raise RuntimeError(f"The vLLM server refused /{route}: {response.status_code}, {response.text[:500]}")
        return response.json()

    def generate(self, *args, **kwargs):
        return self._counting(super().generate, *args, **kwargs)

    def chat(self, *args, **kwargs):
        return self._counting(super().chat, *args, **kwargs)

    def _counting(self, call, *args, **kwargs):
        before = self.spec_decode_counters() if self.count_spec_decode else None
        output = call(*args, **kwargs)
        if before is not None:
            self.last_spec_decode = tuple(b - a for a, b in zip(before, self.spec_decode_counters()))
        return output

    def spec_decode_counters(self) -> tuple[float, float, float]:
        """The server's totals so far (drafts, draft tokens, accepted tokens), from its Prometheus `/metrics`: the
        difference over a generate call is that call's (and any other client's at the same time)."""
        text = self.session.get(f"{self.base_url}/metrics", timeout=30).text
        names = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total")  # fmt: skip
        totals = dict.fromkeys(names, 0.0)
        for line in text.splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in totals:
                totals[name] += float(line.rsplit(" ", 1)[1])
        return tuple(totals[name] for name in names)

    def own_draft_lm_head(self) -> None:
        """Give the server's draft model its own LM head where vLLM shares the policy's with it (an EAGLE head whose
        LM head was identical at load): pushing the drafter would otherwise overwrite the policy's. Needs the server's
        `--worker-extension-cls trl_tlt.vllm.transfer.TLTWorkerExtension`."""
        self._post_once("collective_rpc", {"method": "trl_tlt_own_draft_lm_head"})

    def loaded_weights(self) -> list[dict[str, str]]:
        """Per worker, the sha256 of the last `tlt_shm` file it loaded into each target ("policy", "draft"): what
        the server holds. Needs the server's `--worker-extension-cls trl_tlt.vllm.transfer.TLTWorkerExtension`."""
        return self._post(f"{self.base_url}/collective_rpc", json={"method": "trl_tlt_loaded_weights"})["results"]
