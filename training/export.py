"""`python -m training.export`: install a trained draft's `config.json` and `model.safetensors` into a model repo.

Only those two files change; the repo's code files stay as they are. The draft is loaded strictly first, so a
broken or foreign folder is refused before anything is replaced.
"""

import argparse
import sys
from pathlib import Path

from modeling_dflash import DFlashDraftModel

from .trainer import install_weights


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m training.export", description=__doc__.split("\n\n")[0])
    p.add_argument("--draft", required=True, type=Path, help="draft folder written by `python -m training`")
    p.add_argument("--repo", default=Path("."), type=Path, help="model repo root to install into (default: .)")
    args = p.parse_args(argv)
    if not (args.repo / "modeling_dflash.py").exists():
        raise SystemExit(f"{args.repo} is not a DFlash model repo (no modeling_dflash.py); refusing to write there")
    DFlashDraftModel.from_pretrained(args.draft)  # strict: missing or extra tensors raise
    install_weights(args.draft, args.repo)
    print(f"installed {args.draft}/config.json and model.safetensors into {args.repo}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
