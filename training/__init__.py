"""Training recipe for DFlash drafts: `python -m training --help` for the command line, or the library API below."""

from .anchors import anchor_attention_mask, block_inputs, loss_weights, sample_anchors
from .data import load_examples, regenerate_responses, tokenize_examples
from .trainer import (
    TrainConfig,
    block_loss,
    build_draft_config,
    check_output_dir,
    install_weights,
    measure_acceptance,
    new_draft,
    save_draft,
    train,
    warm_start_from_target,
)

__all__ = [
    "TrainConfig",
    "anchor_attention_mask",
    "block_inputs",
    "block_loss",
    "build_draft_config",
    "check_output_dir",
    "install_weights",
    "load_examples",
    "loss_weights",
    "measure_acceptance",
    "new_draft",
    "regenerate_responses",
    "sample_anchors",
    "save_draft",
    "tokenize_examples",
    "train",
    "warm_start_from_target",
]
