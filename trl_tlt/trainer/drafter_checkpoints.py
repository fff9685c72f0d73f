"""The drafter in `TLTGRPOTrainer`'s checkpoints, exports and Hub pushes."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import logging

from ..drafters.eagle3 import Eagle3Model


logger = logging.get_logger(__name__)

DRAFTER_DIR = "drafter"  # inside every checkpoint folder
# Each rank's rollout state, in every checkpoint: what a resumed run needs to sample and train as the uninterrupted one
# would (the sampling generator, the speculation policies' statistics, the hybrid drafter's running means and prompt
# history, spot training's optimizer, schedule, buffer and sampling stream).
ROLLOUT_STATE_NAME = "tlt_state/rank{rank}.pt"
HISTORY_NAME = "tlt_history/rank{rank}.json"  # read from checkpoints written before ROLLOUT_STATE_NAME
SPOT_STATE_NAME = "spot_state.pt"  # likewise, in drafter/ (the first rank's spot training state)


class DrafterCheckpoints:
    """Mixed into `TLTGRPOTrainer`. The drafter saved beside every checkpoint (in the background) with each rank's
    rollout state, restored on resume, exported for vLLM / SGLang and pushed to the Hub with a model card."""

    def save_drafter(self, path: str | os.PathLike) -> None:
        """Save the drafter: EAGLE-3 in the layout vLLM and SGLang load, a small LM with `save_pretrained`."""
        model = self._trainable_drafter()
        if model is None:
            raise ValueError(
                f"drafter_type={self.args.drafter_type!r} has no weights to save; use drafter_type='eagle3' or 'model'."
            )
        if isinstance(model, Eagle3Model) and not model.exportable:
            raise ValueError(
                f"This EAGLE-3 head reads policy layers {model.aux_layer_ids} (the policy has fewer than 3 decoder "
                "layers): vLLM and SGLang cannot load it. Checkpoints keep it in trl-tlt's layout (checkpoint-*/drafter)."
            )
        if self.accelerator.is_main_process:
            model.save_pretrained(path)

    def push_drafter_to_hub(
        self,
        repo_id: str,
        private: bool | None = None,
        token: str | None = None,
        commit_message: str = "Upload TLT drafter",
    ):
        """Save the drafter with a model card and upload it to the Hub as `repo_id`. Returns the commit info."""
        from huggingface_hub import HfApi

        if not self.accelerator.is_main_process:
            return None
        api = HfApi(token=token)
        with tempfile.TemporaryDirectory() as folder:
            self.save_drafter(folder)
            (Path(folder) / "README.md").write_text(self._drafter_model_card(repo_id))
            api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
            return api.upload_folder(folder_path=folder, repo_id=repo_id, commit_message=commit_message)

    def _drafter_model_card(self, repo_id: str) -> str:
        policy = self.accelerator.unwrap_model(self.model).config._name_or_path or "the policy"
        method = "eagle3" if self.args.drafter_type == "eagle3" else "draft_model"
        usage = (
            f'llm = LLM(model="{policy}", speculative_config={{"method": "{method}", "model": "{repo_id}", '
            f'"num_speculative_tokens": {self.args.num_speculative_tokens}}})'
        )
        return (
            f"---\nlibrary_name: trl-tlt\ntags: [trl, trl-tlt, speculative-decoding, {method}]\nbase_model: {policy}\n---\n\n"
            f"# {repo_id}\n\nA speculative-decoding drafter ({self.args.drafter_type}) for `{policy}`, trained with "
            "trl-tlt during GRPO (TLT, *Taming the Long Tail*).\n\n"
            f"## Serve with vLLM\n\n```python\nfrom vllm import LLM\n\n{usage}\n```\n"
        )

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        folder = Path(self._get_output_dir(trial=trial)) / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        self._save_rollout_state(folder)
        drafter = self._trainable_drafter()
        if drafter is None or not self.args.should_save:
            return
        # Snapshot now (training goes on), write in the background to drafter.tmp, then rename: a run killed while
        # writing leaves no half-written drafter/ behind.
        if isinstance(drafter, Eagle3Model):
            weights = {k: v.to("cpu", copy=True) for k, v in drafter.export_state_dict().items()}
        else:
            weights = {k: v.detach().to("cpu", copy=True) for k, v in drafter.state_dict().items()}

        save_kwargs = {}
        if isinstance(drafter, Eagle3Model):
            save_kwargs["engine"] = "vllm" if drafter.exportable else "trl-tlt"

        def write():
            tmp, final = folder / f"{DRAFTER_DIR}.tmp", folder / DRAFTER_DIR
            try:
                shutil.rmtree(tmp, ignore_errors=True)
                drafter.save_pretrained(tmp, state_dict=weights, **save_kwargs)
                shutil.rmtree(final, ignore_errors=True)
                os.replace(tmp, final)
            except BaseException as error:  # re-raised by join_drafter_writes, in the training thread
                shutil.rmtree(tmp, ignore_errors=True)
                self._drafter_write_error = (folder, error)

        self.join_drafter_writes()
        self._drafter_writer = threading.Thread(target=write, name="tlt-drafter-checkpoint")
        self._drafter_writer.start()

    def _rollout_state(self) -> dict:
        """This rank's rollout state (`ROLLOUT_STATE_NAME`)."""
        state = {"generator": self._tlt_generator.get_state(), "speculation": self.tlt_speculation.state_dict()}
        if self._tlt_lookup_speculation is not self.tlt_speculation:
            state["lookup_speculation"] = self._tlt_lookup_speculation.state_dict()
        if self.tlt_hybrid is not None:
            state["hybrid"] = self.tlt_hybrid.state_dict()
        if self.tlt_history is not None:
            state["history"] = self.tlt_history.state_dict()
        if self.tlt_spot is not None:
            state["spot"] = self.tlt_spot.state_dict()
        return state

    def _save_rollout_state(self, folder: Path) -> None:
        """Every rank writes its own rollout state, to a temporary file then renamed."""
        path = folder / ROLLOUT_STATE_NAME.format(rank=self.accelerator.process_index)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save(self._rollout_state(), tmp)
        os.replace(tmp, path)

    def _load_rollout_state(self, folder: Path) -> None:
        """This rank's rollout state, or from a checkpoint written before it existed, what that one kept: the prompt
        history (a JSON per rank) and the first rank's spot training state (in drafter/)."""
        rank = self.accelerator.process_index
        path = folder / ROLLOUT_STATE_NAME.format(rank=rank)
        if path.is_file():
            state = torch.load(path, weights_only=True)
        else:
            state = {}
            if (folder / HISTORY_NAME.format(rank=rank)).is_file():
                state["history"] = json.loads((folder / HISTORY_NAME.format(rank=rank)).read_text())
            if (folder / DRAFTER_DIR / SPOT_STATE_NAME).is_file():
                state["spot"] = torch.load(folder / DRAFTER_DIR / SPOT_STATE_NAME, weights_only=True)
        if "generator" in state:
            self._tlt_generator.set_state(state["generator"])
            self.tlt_speculation.load_state_dict(state["speculation"])
        if "lookup_speculation" in state:
            self._tlt_lookup_speculation.load_state_dict(state["lookup_speculation"])
        if self.tlt_hybrid is not None and "hybrid" in state:
            self.tlt_hybrid.load_state_dict(state["hybrid"])
        if self.tlt_history is not None and "history" in state:
            self.tlt_history.load_state_dict(state["history"])
        if self.tlt_spot is not None and "spot" in state:
            self.tlt_spot.load_state_dict(state["spot"])

    def join_drafter_writes(self) -> None:
        """Wait for the background drafter checkpoint write, if any (called before the next one and at train end);
        raise its error, if it failed, so that a checkpoint without its drafter never passes unnoticed."""
        if self._drafter_writer is not None:
            self._drafter_writer.join()
            self._drafter_writer = None
        if self._drafter_write_error is not None:
            folder, error = self._drafter_write_error
            self._drafter_write_error = None
            raise RuntimeError(
                f"Writing the drafter of {folder} failed ({type(error).__name__}: {error}); that checkpoint has no "
                f"{DRAFTER_DIR}/ and cannot be resumed with it. The previous checkpoints are intact."
            ) from error

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        self._load_drafter(Path(resume_from_checkpoint))
        self._load_rollout_state(Path(resume_from_checkpoint))

    def _load_drafter(self, resume_from_checkpoint: Path) -> None:
        drafter = self._trainable_drafter()
        if drafter is None:
            return
        path = Path(resume_from_checkpoint) / DRAFTER_DIR
        if not path.is_dir():
            raise FileNotFoundError(
                f"{resume_from_checkpoint} has no {DRAFTER_DIR}/ (the run stopped before its drafter was written); "
                "delete that checkpoint to resume from the previous one, or resume with drafter_type='none'."
            )
        # In place: the engine's drafter and the spot optimizer keep referring to the same parameters.
        if isinstance(drafter, Eagle3Model):
            policy = self.accelerator.unwrap_model(self.model)
            saved = Eagle3Model.from_pretrained(path, policy)
            if saved.config.draft_vocab_size != drafter.config.draft_vocab_size:  # fitted to the policy's tokens
                drafter.resize_draft_vocab(saved.draft_ids, policy.get_output_embeddings().weight)
                if self.tlt_spot is not None:
                    self.tlt_spot.drafter_resized()
            drafter.load_state_dict(saved.state_dict(), strict=False)
        elif (path / "adapter_model.safetensors").is_file():
            from peft import set_peft_model_state_dict

            set_peft_model_state_dict(drafter, load_file(str(path / "adapter_model.safetensors")))
        else:
            drafter.load_state_dict(load_file(str(path / "model.safetensors")), strict=False)
