"""Where a real DFlash round's time goes: `spec_generate` with the draft's defaults on chat prompts (first turns), its
parts timed by wrapping them in `decoding_dflash`, against a plain decode step of the same target on the same
prompts (`target.generate`'s milliseconds per new token).

Parts per round: `draft` (the draft's layers and its head over `draft_vocab`), `tree` (building the round's tree from
the draft's distributions), `lookup` (finding the prompt-lookup branch), `verify` (the target pass over the tree),
`accept` (the target's choices), `compaction` (both caches cut to the accepted path), and `rest` (everything else:
the walk, features, host transfers, Python). With `--batch-size N` the prompts run as left-padded batches of N
rows through batched `spec_generate` against plain batched `generate`: a round is then one draft pass and one
packed verify for every live row, and `compaction` is the rows' commit.

    python -m bench.round_profile [--dtype bfloat16] [--threads 2] [--dataset mt-bench,humaneval,gsm] [--max-samples 4]
        [--draft-int8] [--batch-size 4] [--tree-sizing cost]
"""

import argparse
import time
from collections import defaultdict
from contextlib import contextmanager

import torch

import batch_dflash
import decoding_dflash
import tree_dflash
from bench.batch import left_padded, pad_token, per_row
from bench.datasets import load_prompts
from bench.harness import encode, truncate
from bench.run import stop_token_ids
from default_target import DTYPES, load_default_target, resolve_dtype
from modeling_dflash import DFlashDraftModel

from .step_costs import ROOT

PARTS = {  # (module, function) -> part
    (decoding_dflash, "draft_step"): "draft",
    (decoding_dflash, "propose"): "tree",
    (tree_dflash, "prompt_lookup"): "lookup",
    (decoding_dflash, "pick_tokens"): "accept",
    (decoding_dflash, "compact_cache"): "compaction",
    (batch_dflash, "draft_block"): "draft",
    (batch_dflash, "verify_trees"): "verify",
    (batch_dflash, "pick_tokens"): "accept",
    (batch_dflash, "commit_paths"): "compaction",
}


@contextmanager
def timed_parts(totals: dict[str, float]):
    """Adds each wrapped function's milliseconds to `totals[part]`, and the verify passes' to `totals["verify"]`."""

    def timing(fn, part):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                totals[part] += (time.perf_counter() - start) * 1000

        return wrapper

    originals = {key: getattr(*key) for key in [*PARTS, (decoding_dflash, "verify_forward")]}
    for (module, name), part in PARTS.items():
        setattr(module, name, timing(originals[module, name], part))
    decoding_dflash.verify_forward = lambda target, compiled: timing(
        originals[decoding_dflash, "verify_forward"](target, compiled), "verify"
    )
    try:
        yield totals
    finally:
        for (module, name), fn in originals.items():
            setattr(module, name, fn)


def profile(
    target, draft, batches: list[tuple[torch.Tensor, torch.Tensor]], max_new_tokens: int, stops, pad, **options
):
    """Milliseconds per round of each part, the round, and a plain decode step of the same rows; new tokens per round
    over the live rows (tau at one row), and DFlash's tokens/s against plain decoding's."""
    totals, rounds, round_ms, new_tokens, plain_ms, plain_steps, plain_tokens = defaultdict(float), 0, 0.0, 0, 0.0, 0, 0
    for ids, mask in batches:
        start = time.perf_counter()
        target(ids, attention_mask=mask, logits_to_keep=1)  # a prefill's cost, left out of both
        prefill_ms = (time.perf_counter() - start) * 1000
        start = time.perf_counter()
        plain = target.generate(
            ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad
        )
        plain_ms += (time.perf_counter() - start) * 1000 - prefill_ms
        plain_steps += plain.shape[1] - ids.shape[1]
        plain_tokens += sum(len(truncate(row, stops, max_new_tokens)) for row in plain[:, ids.shape[1] :].tolist())
        with timed_parts(totals):
            start = time.perf_counter()
            out = draft.spec_generate(
                target, ids, attention_mask=mask, max_new_tokens=max_new_tokens, return_stats=True, **options
            )
            round_ms += (time.perf_counter() - start) * 1000 - prefill_ms
        lengths = per_row(out.acceptance_lengths)
        rounds += max(map(len, lengths))
        new_tokens += sum(map(sum, lengths))
    parts = {part: ms / rounds for part, ms in totals.items()}
    speedup = (new_tokens / round_ms) / (plain_tokens / plain_ms)
    parts["rest"] = round_ms / rounds - sum(parts.values())
    return {
        "parts": parts,
        "round": round_ms / rounds,
        "decode_step": plain_ms / plain_steps,
        "tau": new_tokens / rounds,
        "speedup": speedup,
    }


def report(dtype, result: dict) -> str:
    step = result["decode_step"]
    lines = [
        f"{dtype}: plain decode step {step:.1f} ms; DFlash round {result['round']:.1f} ms = "
        f"{result['round'] / step:.2f} decode steps at {result['tau']:.2f} new tokens a round over the live rows "
        f"({result['speedup']:.2f}x plain tokens/s)"
    ]
    for part, ms in sorted(result["parts"].items(), key=lambda kv: -kv[1]):
        lines.append(f"  {part:<11} {ms:6.2f} ms  {ms / step:5.2f} decode steps")
    beyond = result["round"] - result["parts"].get("verify", 0.0)
    lines.append(f"  beyond the verify: {beyond:.1f} ms, {beyond / step:.2f} decode steps")
    return "\n".join(lines)


@torch.inference_mode()
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=DTYPES, default="auto", help="of target and draft (default auto)")
    parser.add_argument("--dataset", default="mt-bench,humaneval,gsm")
    parser.add_argument("--max-samples", type=int, default=4, help="prompts per dataset (first turns)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--draft", default=str(ROOT), help="draft folder (default: this repository's root)")
    parser.add_argument("--draft-int8", action="store_true", help="profile the draft's int8 copy (`int8_copy()`)")
    parser.add_argument("--batch-size", type=int, default=1, help="rows per call, left-padded")
    parser.add_argument("--tree-sizing", choices=["fixed", "cost"], help="default: the draft config's")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = resolve_dtype(args.dtype)
    target, tokenizer = load_default_target(dtype)
    draft = DFlashDraftModel.from_pretrained(args.draft, dtype=dtype).eval()
    draft = draft.int8_copy() if args.draft_int8 else draft
    prompts = [
        encode(tokenizer, [{"role": "user", "content": row["turns"][0]}])
        for name in args.dataset.split(",")
        for row in load_prompts(name, args.max_samples)
    ]
    stops = stop_token_ids(target, tokenizer)
    pad = pad_token(tokenizer, stops)
    batches = [left_padded(prompts[i : i + args.batch_size], pad) for i in range(0, len(prompts), args.batch_size)]
    options = {"tree_sizing": args.tree_sizing} if args.tree_sizing else {}
    for ids, mask in {len(ids): (ids, mask) for ids, mask in batches}.values():  # warm-up, t(n) per row count
        draft.spec_generate(target, ids, attention_mask=mask, max_new_tokens=8, **options)
    print(report(dtype, profile(target, draft, batches, args.max_new_tokens, stops, pad, **options)))


if __name__ == "__main__":
    main()
