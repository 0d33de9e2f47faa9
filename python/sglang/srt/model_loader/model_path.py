"""Turn --model-path into a local checkpoint directory: the built-in tiny model, a directory, or a hub id."""

from __future__ import annotations

import os


def resolve_model_path(model_path: str) -> str:
    from sglang.srt.model_loader.tiny_checkpoint import builtin_model_path, is_builtin_model_name

    if os.path.isdir(model_path):
        return model_path
    if is_builtin_model_name(model_path):
        return builtin_model_path(model_path)
    if os.path.exists(model_path):
        raise ValueError(f"--model-path {model_path!r} is a file; give the checkpoint directory")
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(model_path, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"])
    except Exception as e:  # offline, unknown repo, bad id: say what was tried
        raise ValueError(f"--model-path {model_path!r} is not a directory, not the built-in model "
                         f"'tiny-deepseek-v4', and could not be fetched from the hub: {e}") from None
