"""`DrafterWriter`: a checkpoint's drafter written in the background, whole or not at all."""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

from ..drafters.eagle3 import Eagle3Model


class DrafterWriter:
    """Writes a drafter into a checkpoint's folder from a background thread: its weights snapshotted at the call, saved
    into `NAME.tmp`, then renamed, so that a run killed while writing leaves no half-written folder behind. One write at
    a time; a failed write's error is raised by the next `join` (the training thread's), never passed over."""

    def __init__(self):
        self._thread: threading.Thread | None = None
        self._error: tuple[Path, BaseException] | None = None

    def write(self, drafter, path: Path) -> None:
        """`drafter` (an `Eagle3Model`, in vLLM's layout where it can be, or a causal LM) into the folder `path`."""
        save_kwargs = {}
        if isinstance(drafter, Eagle3Model):
            weights = {k: v.to("cpu", copy=True) for k, v in drafter.export_state_dict().items()}
            save_kwargs["engine"] = "vllm" if drafter.exportable else "trl-tlt"
        else:
            weights = {k: v.detach().to("cpu", copy=True) for k, v in drafter.state_dict().items()}

        def write():
            tmp = path.with_name(path.name + ".tmp")
            try:
                shutil.rmtree(tmp, ignore_errors=True)
                drafter.save_pretrained(tmp, state_dict=weights, **save_kwargs)
                shutil.rmtree(path, ignore_errors=True)
                os.replace(tmp, path)
            except BaseException as error:  # re-raised by join, in the training thread
                shutil.rmtree(tmp, ignore_errors=True)
                self._error = (path, error)

        self.join()
        self._thread = threading.Thread(target=write, name="tlt-drafter-checkpoint")
        self._thread.start()

    def join(self) -> None:
        """Wait for the background write, if any; raise its error, if it failed, so that a checkpoint without its
        drafter never passes unnoticed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            path, error = self._error
            self._error = None
            raise RuntimeError(
                f"Writing the drafter of {path.parent} failed ({type(error).__name__}: {error}); that checkpoint has "
                f"no {path.name}/ and cannot be resumed with it. The previous checkpoints are intact."
            ) from error
