"""Argument checks the command-line tools share (`python -m bench`, `python -m demo`): every error before any model
loads, reported as argparse reports its own (`error: ...`, exit status 2)."""

import argparse
import json
import re
from pathlib import Path

from configuration_dflash import check_draft_config

HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")  # owner/name


def check_decoding_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.temperature < 0:
        parser.error(f"--temperature must be at least 0, got {args.temperature}")
    if args.max_new_tokens < 1:
        parser.error(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if args.block_size is not None and args.block_size < 2:
        parser.error(f"--block-size must be at least 2, got {args.block_size}")
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be at least 1, got {args.threads}")


def check_model_path(parser: argparse.ArgumentParser, flag: str, path: str | None, draft: bool) -> None:
    """A folder that exists (for a draft, one whose config is a DFlash draft's) or a Hub id."""
    if path is None:
        return
    if not Path(path).exists():
        if not HUB_ID.fullmatch(path):
            parser.error(f"{flag} {path}: no such folder")
        return
    if draft:
        try:
            check_draft_config(json.loads((Path(path) / "config.json").read_text()))
        except (OSError, ValueError) as error:
            parser.error(f"{flag} {path}: {error}")
