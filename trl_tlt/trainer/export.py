"""The trained drafter out of the trainer: saved in the layout vLLM and SGLang load, and its model card for the Hub."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from ..drafters.eagle3 import Eagle3Model


def save_drafter(model, path: str | os.PathLike, drafter_type: str) -> None:
    """`model` (an EAGLE-3 head or a small LM, None for model-free drafters) saved at `path`, or an error naming why
    it cannot be."""
    if model is None:
        raise ValueError(
            f"drafter_type={drafter_type!r} has no weights to save; use drafter_type='eagle3' or 'model'."
        )
    if isinstance(model, Eagle3Model) and not model.exportable:
        raise ValueError(
            f"This EAGLE-3 head reads policy layers {model.aux_layer_ids} (the policy has fewer than 3 decoder "
            "layers): vLLM and SGLang cannot load it. Checkpoints keep it in trl-tlt's layout (checkpoint-*/drafter)."
        )
    model.save_pretrained(path)


def drafter_model_card(repo_id: str, policy: str, drafter_type: str, num_speculative_tokens: int) -> str:
    """The README of a drafter pushed to the Hub: what it is, for which policy, and how to serve it with vLLM."""
    method = "eagle3" if drafter_type == "eagle3" else "draft_model"
    usage = (
        f'llm = LLM(model="{policy}", speculative_config={{"method": "{method}", "model": "{repo_id}", '
        f'"num_speculative_tokens": {num_speculative_tokens}}})'
    )
    return (
        f"---\nlibrary_name: trl-tlt\ntags: [trl, trl-tlt, speculative-decoding, {method}]\nbase_model: {policy}\n---\n\n"
        f"# {repo_id}\n\nA speculative-decoding drafter ({drafter_type}) for `{policy}`, trained with "
        "trl-tlt during GRPO (TLT, *Taming the Long Tail*).\n\n"
        f"## Serve with vLLM\n\n```python\nfrom vllm import LLM\n\n{usage}\n```\n"
    )


def push_to_hub(save, card: str, repo_id: str, private: bool | None, token: str | None, commit_message: str):
    """`save(folder)` the drafter with `card` as its README and upload the folder to the Hub as `repo_id`."""
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    with tempfile.TemporaryDirectory() as folder:
        save(folder)
        (Path(folder) / "README.md").write_text(card)
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        return api.upload_folder(folder_path=folder, repo_id=repo_id, commit_message=commit_message)
