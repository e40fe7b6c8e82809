"""`python -m training`: train a DFlash draft for a transformers causal LM and write it as a draft folder.

Example (the embedded default target, teacher-forced ShareGPT replies, held-out tau on the bench sets):

    python -m training --output drafts/smollm2 --data sharegpt --responses dataset --max-examples 4000
"""

import argparse
import json
import logging
import os
import sys
from pathlib import Path

import torch
from accelerate import PartialState

from common.checks import check_model_path
from default_target import DTYPES, load_default_target, resolve_dtype
from modeling_dflash import DFlashDraftModel
from plan_dflash import check_draft_fits_target

from .data import disjoint_sources, load_examples, read_response_cache, regenerate_responses, tokenize_examples
from .features import open_feature_cache
from .trainer import (
    TrainConfig,
    build_draft_config,
    check_output_dir,
    measure_acceptance,
    new_draft,
    save_draft,
    train,
)

DEFAULT_MASK_TOKEN_ID = 16  # `<empty_output>` in SmolLM2's vocab: a special token the target never writes in chat


def program(features_only: bool) -> str:
    return "python -m training.features" if features_only else "python -m training"


def parse_args(argv=None, features_only: bool = False) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=program(features_only), description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--output", type=Path, help="folder for the trained draft (must be new, empty, or a draft with --overwrite)"
    )
    p.add_argument("--overwrite", action="store_true", help="replace a previous draft in --output")
    p.add_argument(
        "--target", default="default", help="target checkpoint folder, or 'default' for SmolLM2-135M-Instruct"
    )
    p.add_argument(
        "--run-dir", type=Path, help="checkpoints and data caches; default ~/.cache/dflash/runs/<output name>"
    )
    g = p.add_argument_group("data")
    g.add_argument(
        "--data", action="append", help="training prompts: 'sharegpt' or a .jsonl file (repeatable; default sharegpt)"
    )
    g.add_argument("--max-examples", type=int, help="use at most this many training prompts per source")
    g.add_argument(
        "--responses",
        choices=["target", "cached", "dataset"],
        default="target",
        help="'target': regenerate responses with the target (greedy, cached in <run-dir>/responses.jsonl); "
        "'cached': only the examples already in that cache, generating nothing; "
        "'dataset': teacher-force the data's own",
    )
    g.add_argument(
        "--eval-data",
        default="mt-bench,humaneval,gsm",
        help="held-out sets (comma-separated; other sources than --data)",
    )
    g.add_argument("--eval-examples", type=int, default=8, help="held-out prompts per set")
    g.add_argument("--max-prompt-tokens", type=int, default=256, help="keep the last this many prompt tokens")
    g.add_argument("--max-length", type=int, default=512, help="truncate prompt + response to this many tokens")
    g.add_argument("--max-new-tokens", type=int, default=256, help="response length when the target regenerates")
    g.add_argument("--regen-batch-size", type=int, default=16, help="prompts per batched generate call")
    g.add_argument(
        "--feature-cache",
        type=Path,
        help="folder of the target's features for these sequences (built first where missing, resumable; "
        "`python -m training.features` only builds it): training then runs no target forward",
    )
    d = p.add_argument_group("draft")
    d.add_argument("--num-layers", type=int, help="draft decoder layers (default 3)")
    d.add_argument("--target-layer-ids", help="comma-separated target layers to read (default: the published spread)")
    d.add_argument(
        "--block-size",
        type=int,
        help="tokens per block, including the last committed one (default 8, or the --init draft's)",
    )
    d.add_argument(
        "--mask-token-id", type=int, help=f"mask token id (default {DEFAULT_MASK_TOKEN_ID} for the default target)"
    )
    d.add_argument(
        "--init",
        default="target",
        help="'target': copy the target's last layers; 'random'; "
        "or a draft folder to continue from (its config is kept)",
    )
    o = p.add_argument_group("optimisation")
    defaults = TrainConfig()
    o.add_argument(
        "--num-anchors",
        type=anchor_count,
        default=defaults.num_anchors,
        help="random blocks per sequence per step, or 'dense': one per block-size response tokens",
    )
    o.add_argument(
        "--anchor-stride",
        type=int,
        help="with --num-anchors dense: response tokens per anchor (default the block size)",
    )
    o.add_argument(
        "--mixed-precision",
        choices=["no", "bf16"],
        default=defaults.mixed_precision,
        help="bf16: the draft's forward and backward under bfloat16 autocast (fp32 master weights)",
    )
    o.add_argument("--bucket-by-length", action="store_true", help="batch sequences of similar length together")
    o.add_argument("--batch-size", type=int, default=defaults.batch_size, help="sequences per step (per process)")
    o.add_argument("--learning-rate", type=float, default=defaults.learning_rate)
    o.add_argument("--weight-decay", type=float, default=defaults.weight_decay)
    o.add_argument("--warmup-ratio", type=float, default=defaults.warmup_ratio)
    o.add_argument(
        "--schedule",
        choices=["cosine", "wsd"],
        default=defaults.schedule,
        help="'cosine', or 'wsd': warm up, hold, then decay linearly over the last --decay-ratio of the steps",
    )
    o.add_argument(
        "--decay-ratio",
        type=float,
        default=defaults.decay_ratio,
        help="fraction of steps that decay with --schedule wsd",
    )
    o.add_argument("--epochs", type=int, default=defaults.epochs)
    o.add_argument("--max-steps", type=int, help="total steps (sets the cosine schedule); default epochs x batches")
    o.add_argument("--grad-clip", type=float, default=defaults.grad_clip)
    o.add_argument("--gamma", type=float, help="loss weight decay exp(-(k-1)/gamma); default 7/5/4 for B=16/10/8")
    o.add_argument(
        "--position-weights",
        choices=["decay", "dpace"],
        default=defaults.position_weights,
        help="block-position loss weights: 'decay' (fixed, --gamma) or 'dpace' (D-PACE, from the draft's confidence)",
    )
    o.add_argument("--dpace-alpha", type=float, default=defaults.dpace_alpha, help="D-PACE smoothing alpha in [0, 1]")
    o.add_argument(
        "--distill-weight", type=float, default=defaults.distill_weight, help="weight of the soft-label loss (0..1)"
    )
    o.add_argument(
        "--updates-per-batch",
        type=int,
        default=defaults.updates_per_batch,
        help="optimizer steps per target pass, each with fresh anchors (reuses the target's features)",
    )
    o.add_argument(
        "--train-vocab-size",
        type=int,
        help="compute the loss over the N most frequent response tokens only (faster on CPU)",
    )
    o.add_argument(
        "--precondition-fc",
        action="store_true",
        help="train fc in units of each feature channel's RMS (saved folded into fc.weight, the published layout)",
    )
    o.add_argument(
        "--label-source",
        choices=["target", "data"],
        default=defaults.label_source,
        help="hard labels: target argmax or data tokens",
    )
    o.add_argument("--eval-every", type=int, default=defaults.eval_every, help="steps between held-out evaluations")
    o.add_argument("--save-every", type=int, default=defaults.save_every, help="steps between checkpoints")
    o.add_argument("--time-budget-minutes", type=float, help="stop (checkpoint and write the draft) after this long")
    o.add_argument("--seed", type=int, default=defaults.seed)
    o.add_argument(
        "--allow-changed-settings",
        action="store_true",
        help="resume a run dir whose checkpoint was written with other settings or data",
    )
    p.add_argument(
        "--dtype",
        default="float32",
        choices=DTYPES,
        help="the target's dtype for regeneration, its frozen passes and --feature-cache (the draft, and the "
        "target's head and embedding in the draft's matmuls, train in float32 or under --mixed-precision); "
        "auto: bfloat16 where the hardware multiplies it natively",
    )
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument(
        "--measure-throughput",
        type=int,
        metavar="STEPS",
        help="run this many steps (plus one warm-up) in a scratch run dir, print blocks/s and tokens/s, write nothing",
    )
    p.add_argument(
        "--measure-tau", action="store_true", help="at the end, run greedy spec_generate on the held-out prompts"
    )
    p.add_argument("--measure-max-new-tokens", type=int, default=96, help="tokens per prompt for --measure-tau")
    args = p.parse_args(argv)
    if args.output is None and not (features_only or args.measure_throughput):
        p.error("the following arguments are required: --output")
    if features_only and args.feature_cache is None:
        p.error("the following arguments are required: --feature-cache")
    if args.target != "default":
        check_model_path(p, "--target", args.target, draft=False)
    if args.init not in ("target", "random"):
        check_model_path(p, "--init", args.init, draft=True)
    return args


def anchor_count(text: str) -> int:
    """`--num-anchors`: a positive count, or 'dense' (0)."""
    if text == "dense":
        return 0
    if not text.isdigit() or int(text) == 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'dense', got {text!r}")
    return int(text)


def load_target(name: str, dtype: str = "float32"):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = resolve_dtype(dtype, "cuda" if torch.cuda.is_available() else "cpu")
    if name == "default":
        return load_default_target(dtype)
    return AutoModelForCausalLM.from_pretrained(name, dtype=dtype).eval(), AutoTokenizer.from_pretrained(name)


def initial_draft(args: argparse.Namespace, target):
    """A new draft from the draft flags, or the draft in the `--init` folder (whose architecture flags must agree)."""
    if args.init in ("target", "random"):
        mask_id = (
            args.mask_token_id
            if args.mask_token_id is not None
            else (DEFAULT_MASK_TOKEN_ID if args.target == "default" else None)
        )
        layer_ids = [int(x) for x in args.target_layer_ids.split(",")] if args.target_layer_ids else None
        config = build_draft_config(
            target,
            num_layers=args.num_layers or 3,
            target_layer_ids=layer_ids,
            block_size=args.block_size or 8,
            mask_token_id=mask_id,
        )
        return new_draft(target, config, init=args.init, seed=args.seed)
    draft = DFlashDraftModel.from_pretrained(args.init, dtype=torch.float32)
    given = {
        "num_layers": (args.num_layers, draft.config.num_hidden_layers),
        "mask_token_id": (args.mask_token_id, draft.config.mask_token_id),
        "target_layer_ids": (
            args.target_layer_ids and [int(x) for x in args.target_layer_ids.split(",")],
            draft.config.target_layer_ids,
        ),
    }
    clash = {k: v for k, v in given.items() if v[0] is not None and v[0] != v[1]}
    if clash:
        raise SystemExit(
            f"--init {args.init}: the draft there has {', '.join(f'{k}={v[1]}' for k, v in clash.items())}; "
            "drop the conflicting flags"
        )
    draft.config.block_size = args.block_size or draft.config.block_size
    check_draft_fits_target(draft, target)
    return draft.train()


def sequence_settings(args: argparse.Namespace, regen_batch_size: int) -> tuple[dict, dict]:
    """Tokenization and regeneration settings from the flags that training and export share."""
    common = dict(max_prompt_tokens=args.max_prompt_tokens, max_length=args.max_length)
    regen = dict(
        batch_size=regen_batch_size, max_new_tokens=args.max_new_tokens, max_prompt_tokens=args.max_prompt_tokens
    )
    return common, regen


def held_out_sequences(
    target, tokenizer, eval_examples: dict[str, list[dict]], run_dir: Path, common: dict, regen: dict
) -> dict:
    """Held-out prompts with the target's own greedy responses (cached in `run_dir/eval-<name>.jsonl`), tokenized."""
    sequences = {}
    for name, examples in eval_examples.items():
        responses = regenerate_responses(target, tokenizer, examples, run_dir / f"eval-{name}.jsonl", **regen)
        sequences[name] = tokenize_examples(tokenizer, examples, regenerated=responses, **common)
    return sequences


def cached_examples(examples: list[dict], path: Path) -> tuple[list[dict], dict[str, list[int]]]:
    """The examples whose responses `path` already holds, and those responses; nothing is generated."""
    cache = read_response_cache(path)
    kept = [e for e in examples if e["id"] in cache]
    if not kept:
        raise SystemExit(f"--responses cached: {path} holds no response for the {len(examples)} selected prompts")
    return kept, cache


def main(argv=None, features_only: bool = False) -> int:
    args = parse_args(argv, features_only)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.output is not None:
        check_output_dir(args.output, args.overwrite)
    cache_root = Path(os.environ.get("DFLASH_CACHE", Path.home() / ".cache" / "dflash"))
    run_dir = args.run_dir or cache_root / "runs" / (args.output or args.feature_cache or Path("throughput")).name
    run_dir.mkdir(parents=True, exist_ok=True)
    state = PartialState()
    target, tokenizer = load_target(args.target, args.dtype)
    target.to(state.device)  # regeneration and the target passes run where training does
    draft = initial_draft(args, target)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    train_examples = [e for source in (args.data or ["sharegpt"]) for e in load_examples(source, args.max_examples)]
    eval_names = [n for n in args.eval_data.split(",") if n]
    eval_examples = {n: load_examples(n, args.eval_examples) for n in eval_names}
    disjoint_sources(train_examples, [e for v in eval_examples.values() for e in v])
    common, regen = sequence_settings(args, args.regen_batch_size)
    regenerated = None
    if args.responses == "target":  # each process generates its share, then all read every share
        regenerate_responses(
            target,
            tokenizer,
            train_examples,
            run_dir / "responses.jsonl",
            **regen,
            rank=state.process_index,
            world=state.num_processes,
        )
        state.wait_for_everyone()
        regenerated = read_response_cache(run_dir / "responses.jsonl")
    elif args.responses == "cached":
        train_examples, regenerated = cached_examples(train_examples, run_dir / "responses.jsonl")
    train_sequences = tokenize_examples(tokenizer, train_examples, regenerated=regenerated, **common)
    feature_cache = None
    if args.feature_cache is not None:
        with state.main_process_first():  # the main process builds what is missing; the others then only read it
            feature_cache = open_feature_cache(
                target, train_sequences, args.feature_cache, draft.config.target_layer_ids, pad_id=pad_id
            )
    if features_only:
        print(
            json.dumps(
                {
                    "feature_cache": str(args.feature_cache),
                    "sequences": len(feature_cache),
                    **feature_cache.manifest_summary(),
                },
                indent=2,
            )
        )
        return 0
    config = train_config(args)
    if args.measure_throughput:
        return measure_throughput(
            draft, target, train_sequences, config, args.measure_throughput, pad_id, feature_cache
        )
    with state.main_process_first():  # one process writes the held-out cache; the others then only read it
        eval_sequences = held_out_sequences(target, tokenizer, eval_examples, run_dir, common, regen)
    logging.info(
        "%d training sequences (%d tokens); held-out: %s",
        len(train_sequences),
        sum(len(s.input_ids) for s in train_sequences),
        {k: len(v) for k, v in eval_sequences.items()},
    )
    summary = train(
        draft,
        target,
        train_sequences,
        run_dir,
        config,
        eval_sequences=eval_sequences,
        pad_id=pad_id,
        allow_changed_settings=args.allow_changed_settings,
        feature_cache=feature_cache,
    )
    if not state.is_main_process:
        return 0
    save_draft(draft, args.output, overwrite=args.overwrite)
    history = summary["history"]
    result = {
        "output": str(args.output),
        "run_dir": str(run_dir),
        "step": summary["step"],
        "finished": summary["finished"],
        "held_out": history[-1] if history and history[-1]["step"] == summary["step"] else None,  # of this draft
        "last_held_out": history[-1] if history else None,
        "throughput": summary["throughput"],
    }
    if not summary["finished"]:
        print(stopped_early(summary, run_dir, args.output), file=sys.stderr)
    if args.measure_tau:
        result["spec_generate_tau"] = {
            name: round(
                measure_acceptance(
                    draft.eval(), target, tokenizer, examples, max_new_tokens=args.measure_max_new_tokens
                ),
                3,
            )
            for name, examples in eval_examples.items()
        }
    print(json.dumps(result, indent=2))
    return 0


def stopped_early(summary: dict, run_dir: Path, output: Path) -> str:
    why = "stopped by Ctrl-C" if summary["interrupted"] else "stopped at its step or time limit"
    return (
        f"training {why} at step {summary['step']} of {summary['total_steps']}: checkpoint "
        f"{run_dir / 'checkpoint.pt'}, the draft so far in {output}; to resume, run the same command with --overwrite"
    )


def train_config(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(
        num_anchors=args.num_anchors,
        anchor_stride=args.anchor_stride,
        batch_size=args.batch_size,
        learning_rate=args.learning_rate,
        weight_decay=args.weight_decay,
        warmup_ratio=args.warmup_ratio,
        epochs=args.epochs,
        max_steps=args.max_steps,
        grad_clip=args.grad_clip,
        gamma=args.gamma,
        position_weights=args.position_weights,
        dpace_alpha=args.dpace_alpha,
        distill_weight=args.distill_weight,
        label_source=args.label_source,
        train_vocab_size=args.train_vocab_size,
        updates_per_batch=args.updates_per_batch,
        precondition_fc=args.precondition_fc,
        schedule=args.schedule,
        decay_ratio=args.decay_ratio,
        mixed_precision=args.mixed_precision,
        bucket_by_length=args.bucket_by_length,
        eval_every=args.eval_every,
        save_every=args.save_every,
        seed=args.seed,
        time_budget_s=args.time_budget_minutes * 60 if args.time_budget_minutes else None,
    )


def measure_throughput(draft, target, sequences, config: TrainConfig, steps: int, pad_id: int, feature_cache) -> int:
    """`steps` training steps after one warm-up, in a scratch run dir; prints the settings and their throughput."""
    import tempfile
    from dataclasses import asdict, replace

    config = replace(config, max_steps=steps + 1, eval_every=0, save_every=10**9, time_budget_s=None)
    with tempfile.TemporaryDirectory() as scratch:
        summary = train(draft, target, sequences, Path(scratch), config, pad_id=pad_id, feature_cache=feature_cache)
    settings = {k: v for k, v in asdict(config).items() if k in THROUGHPUT_SETTINGS}
    print(
        json.dumps(
            {
                "settings": {
                    **settings,
                    "target_dtype": str(target.dtype).removeprefix("torch."),
                    "features": "cache" if feature_cache is not None else "target forward",
                    "threads": torch.get_num_threads(),
                },
                **summary["throughput"],
            },
            indent=2,
        )
    )
    return 0


THROUGHPUT_SETTINGS = (
    "num_anchors",
    "anchor_stride",
    "batch_size",
    "updates_per_batch",
    "train_vocab_size",
    "mixed_precision",
    "bucket_by_length",
)


def cli(argv=None, features_only: bool = False) -> int:
    """`main` with the tool's own refusals (bad settings, folders, data) as one line, as argparse reports its errors."""
    try:
        return main(argv, features_only)
    except (ValueError, FileExistsError) as error:
        print(f"{program(features_only)}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # outside the training loop, which stops cleanly by itself
        print(f"{program(features_only)}: interrupted; run the same command again to resume", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(cli())
