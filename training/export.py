"""`python -m training.export`: install a trained draft's `config.json` and `model.safetensors` into a model repo.

Only those two files change; the repo's code files stay as they are. The draft is loaded strictly first, so a
broken or foreign folder is refused before anything is replaced. A draft that scores lower than the one already in
the repo (mean held-out teacher-forced tau on the target's greedy responses, both at the new draft's block size) is
refused unless `--force`.
"""

import argparse
import functools
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path

from common.checks import check_model_path
from modeling_dflash import DFlashDraftModel

from .trainer import DRAFT_FILES, install_weights

logger = logging.getLogger(__name__)
DECODE_SETTINGS = ("tree_budget", "prompt_lookup_num_tokens")


def install_if_better(
    draft_dir: Path, repo: Path, score: Callable[[DFlashDraftModel], float], *, force: bool = False
) -> dict:
    """Installs the draft in `draft_dir` into `repo` unless the repo's own draft scores higher; returns both scores."""
    if not (repo / "modeling_dflash.py").exists():
        raise SystemExit(f"{repo} is not a DFlash model repo (no modeling_dflash.py); refusing to write there")
    new = DFlashDraftModel.from_pretrained(draft_dir).eval()  # strict: missing or extra tensors raise
    scores = {"new": score(new)}
    if all((repo / name).exists() for name in DRAFT_FILES):
        shipped = DFlashDraftModel.from_pretrained(repo).eval()
        keep_decode_settings(new.config, shipped.config)
        shipped.config.block_size = (
            new.config.block_size
        )  # same blocks for both: a shipped config may serve smaller ones
        scores["shipped"] = score(shipped)
        if scores["new"] < scores["shipped"] and not force:
            raise SystemExit(
                f"{draft_dir} scores {scores['new']:.3f}, below the shipped draft's {scores['shipped']:.3f}; "
                "nothing was replaced (--force installs it anyway)"
            )
    install_weights(draft_dir, repo, new.config)
    return scores


def keep_decode_settings(new, shipped) -> None:
    """Settings chosen by measuring decoding, not by training (`DECODE_SETTINGS`): the repo's stay unless the new
    draft's config sets its own."""
    for name in DECODE_SETTINGS:
        if getattr(new, name) is None and getattr(shipped, name) is not None:
            setattr(new, name, getattr(shipped, name))


def held_out_score(args: argparse.Namespace) -> Callable[[DFlashDraftModel], float]:
    """Mean held-out teacher-forced tau of a draft at its configured block size, as training logs it."""
    from .__main__ import held_out_sequences, load_target, sequence_settings
    from .anchors import default_gamma, loss_weights
    from .data import load_examples
    from .trainer import evaluate

    @functools.cache
    def held_out():  # loaded on the first score, after the cheap checks
        target, tokenizer = load_target(args.target)
        names = [n for n in args.eval_data.split(",") if n]
        common, regen = sequence_settings(args, regen_batch_size=16)
        examples = {n: load_examples(n, args.eval_examples) for n in names}
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        return target, held_out_sequences(target, tokenizer, examples, args.run_dir, common, regen), pad_id

    def score(draft: DFlashDraftModel) -> float:
        target, sequences, pad_id = held_out()
        block = draft.config.block_size
        result = evaluate(
            draft,
            target,
            sequences,
            num_anchors=args.num_anchors,
            weights=loss_weights(block, default_gamma(block)),
            pad_id=pad_id,
        )
        logger.info("%s: %s", draft.name_or_path, {k: round(v["tau"], 3) for k, v in result.items()})
        return sum(v["tau"] for v in result.values()) / len(result)

    return score


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m training.export", description=__doc__.split("\n\n")[0])
    p.add_argument("--draft", required=True, type=Path, help="draft folder written by `python -m training`")
    p.add_argument("--repo", default=Path("."), type=Path, help="model repo root to install into (default: .)")
    p.add_argument("--force", action="store_true", help="install even if the repo's draft scores higher")
    p.add_argument(
        "--target", default="default", help="target the drafts are scored on ('default': SmolLM2-135M-Instruct)"
    )
    p.add_argument("--eval-data", default="mt-bench,humaneval,gsm", help="held-out sets (comma-separated)")
    p.add_argument("--eval-examples", type=int, default=8, help="held-out prompts per set")
    p.add_argument("--num-anchors", type=int, default=32, help="blocks per held-out sequence")
    p.add_argument("--max-prompt-tokens", type=int, default=128)
    p.add_argument("--max-length", type=int, default=384)
    p.add_argument("--max-new-tokens", type=int, default=256, help="length of the target's held-out responses")
    p.add_argument(
        "--run-dir",
        type=Path,
        default=Path(os.environ.get("DFLASH_CACHE", Path.home() / ".cache" / "dflash")) / "runs" / "export",
        help="cache of the held-out responses (a training run dir reuses its own)",
    )
    args = p.parse_args(argv)
    if not args.draft.is_dir():
        p.error(f"--draft {args.draft}: no such folder")
    check_model_path(p, "--draft", str(args.draft), draft=True)
    if args.target != "default":
        check_model_path(p, "--target", args.target, draft=False)
    if not args.repo.is_dir():
        p.error(f"--repo {args.repo}: no such folder")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    args.run_dir.mkdir(parents=True, exist_ok=True)
    scores = install_if_better(args.draft, args.repo, held_out_score(args), force=args.force)
    print(f"installed {args.draft}/config.json and model.safetensors into {args.repo} (held-out tau {scores})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
