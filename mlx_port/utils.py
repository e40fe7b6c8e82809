"""Loading DFlash drafts with mlx-lm's own loader (strict, and rebuilding quantized layers from the config), and
targets through `mlx_lm.load` with the RoPE fields it reads."""

import json
from pathlib import Path
from typing import Any

import mlx_lm
from huggingface_hub import hf_hub_download, snapshot_download
from mlx_lm.utils import load_model

from configuration_dflash import check_draft_config, legacy_rope_fields

from .model import DFlash2Model, Model, ModelArgs

DRAFT_FILES = ["*.json", "model*.safetensors", "*.py"]


def fetch_path(path_or_hf_repo: str) -> Path:
    """A local folder as it is, or a Hub id downloaded (or found in the local Hub cache)."""
    path = Path(path_or_hf_repo)
    return path if path.exists() else Path(snapshot_download(path_or_hf_repo, allow_patterns=DRAFT_FILES))


def draft_classes(config: dict) -> tuple[type, type]:
    """`load_model`'s class hook; refuses configs without the DFlash fields (e.g. a target folder)."""
    check_draft_config(config)
    return (DFlash2Model if "DFlash2DraftModel" in (config.get("architectures") or []) else Model), ModelArgs


def load_draft_model(path: Path, lazy: bool = False) -> tuple[Model, dict]:
    """Loads a raw Hugging Face draft folder or a converted one; a missing or extra tensor is an error."""
    try:
        return load_model(path, lazy=lazy, strict=True, get_model_classes=draft_classes)
    except ValueError as e:
        if "parameter" not in str(e):  # mlx names missing, extra and mis-shaped tensors so
            raise
        raise ValueError(f"DFlash draft at {path} does not match the draft architecture: {e}") from e


def load_draft(path_or_hf_repo: str, *, sliding_window_size: int | None = None) -> Model:
    """Loads a DFlash draft for `stream_generate`. `sliding_window_size` bounds its context cache (tokens)."""
    if sliding_window_size is not None and sliding_window_size < 1:
        raise ValueError(f"sliding_window_size must be at least 1, got {sliding_window_size}")
    model, _ = load_draft_model(fetch_path(path_or_hf_repo))
    model.sliding_window_size = sliding_window_size
    return model


def target_config(path_or_hf_repo: str) -> dict:
    path = Path(path_or_hf_repo)
    file = path / "config.json" if path.exists() else Path(hf_hub_download(path_or_hf_repo, "config.json"))
    return json.loads(file.read_text())


def load(path_or_hf_repo: str, model_config: dict | None = None, **kwargs) -> Any:
    """`mlx_lm.load` for a target, passing the RoPE fields of a transformers-5 config where mlx-lm would miss them
    (it would silently use base 10000); `model_config` entries win."""
    overrides = legacy_rope_fields(target_config(path_or_hf_repo)) | (model_config or {})
    return mlx_lm.load(path_or_hf_repo, model_config=overrides, **kwargs)
