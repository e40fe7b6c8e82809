"""Where a real DFlash round's time goes: `spec_generate` with the draft's defaults on chat prompts (first turns), its
parts timed by wrapping them in `decoding_dflash`, against a plain decode step of the same target on the same
prompts (`target.generate`'s milliseconds per new token).

Parts per round: `draft` (the draft's layers and its head over `draft_vocab`), `tree` (building the round's tree from
the draft's distributions), `lookup` (finding the prompt-lookup branch), `verify` (the target pass over the tree),
`accept` (the target's choices), `compaction` (both caches cut to the accepted path), and `rest` (everything else:
the walk, features, host transfers, Python).

    python -m bench.round_profile [--dtype bfloat16] [--threads 2] [--dataset mt-bench,humaneval,gsm] [--max-samples 4]
        [--draft-int8]
"""

import argparse
import time
from collections import defaultdict
from contextlib import contextmanager

import torch

import decoding_dflash
import tree_dflash
from bench.datasets import load_prompts
from bench.harness import encode
from default_target import DTYPES, load_default_target, resolve_dtype
from modeling_dflash import DFlashDraftModel

from .step_costs import ROOT

PARTS = {  # (module, function) -> part
    (decoding_dflash, "draft_step"): "draft",
    (decoding_dflash, "propose"): "tree",
    (tree_dflash, "prompt_lookup"): "lookup",
    (decoding_dflash, "pick_tokens"): "accept",
    (decoding_dflash, "compact_cache"): "compaction",
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


def profile(target, draft, prompts: list[torch.Tensor], max_new_tokens: int) -> dict:
    """Milliseconds per round of each part, the round, and a plain decode step; tau."""
    totals, rounds, round_ms, new_tokens, plain_ms, plain_tokens = defaultdict(float), 0, 0.0, 0, 0.0, 0
    for ids in prompts:
        start = time.perf_counter()
        target(ids, logits_to_keep=1)  # a prefill's cost, left out of both
        prefill_ms = (time.perf_counter() - start) * 1000
        start = time.perf_counter()
        plain = target.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False
        )
        plain_ms += (time.perf_counter() - start) * 1000 - prefill_ms
        plain_tokens += plain.shape[1] - ids.shape[1]
        with timed_parts(totals):
            start = time.perf_counter()
            out = draft.spec_generate(target, ids, max_new_tokens=max_new_tokens, return_stats=True)
            round_ms += (time.perf_counter() - start) * 1000 - prefill_ms
        rounds += len(out.acceptance_lengths)
        new_tokens += sum(out.acceptance_lengths)
    parts = {part: ms / rounds for part, ms in totals.items()}
    round_ms /= rounds
    parts["rest"] = round_ms - sum(parts.values())
    return {"parts": parts, "round": round_ms, "decode_step": plain_ms / plain_tokens, "tau": new_tokens / rounds}


def report(dtype, result: dict) -> str:
    step = result["decode_step"]
    lines = [
        f"{dtype}: plain decode step {step:.1f} ms; DFlash round {result['round']:.1f} ms = "
        f"{result['round'] / step:.2f} decode steps at tau {result['tau']:.2f} "
        f"(about {result['tau'] * step / result['round']:.2f}x plain)"
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
    draft.spec_generate(target, prompts[0], max_new_tokens=8)  # warm-up
    print(report(dtype, profile(target, draft, prompts, args.max_new_tokens)))


if __name__ == "__main__":
    main()
