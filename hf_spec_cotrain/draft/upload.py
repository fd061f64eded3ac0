"""The upload of a saved draft folder to the Hub: the draft's own `push_to_hub`, and the trainer's push of the folder
it saved with its model card (`hf_spec_cotrain.draft.card`)."""

from pathlib import Path

from huggingface_hub import HfApi


def push_draft_folder(
    folder: str | Path,
    repo_id: str,
    *,
    token: str | bool | None = None,
    private: bool | None = None,
    revision: str | None = None,
    create_pr: bool = False,
    commit_message: str = "Upload EAGLE-3 draft",
):
    """Upload a saved draft folder (checkpoint plus README.md) to ``repo_id``; returns the commit info."""
    api = HfApi(token=token)
    repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
    return api.upload_folder(
        repo_id=repo_id, folder_path=str(folder), commit_message=commit_message, revision=revision, create_pr=create_pr
    )
