"""The main job: stream a DFlash generation on the embedded default, then time plain decoding of the same prompt.

    python -m demo "Explain speculative decoding in one paragraph." [--max-new-tokens 128] [--block-size B] [--dtype D]
        [--no-draft-int8]

In float32 DFlash's greedy output is token-identical to plain decoding. In bfloat16 (the default where the hardware
multiplies it natively) a pass over several tokens rounds differently from several one-token passes, so the two may
part where the target's top two logits are within rounding of each other; the demo says where and by how much.
"""

import argparse
import time
from pathlib import Path

import torch
import transformers
from transformers import AutoModel, TextStreamer

from common.checks import check_decoding_args, check_model_path
from common.exactness import explained
from default_target import DTYPES, load_default_target, resolve_dtype
from plan_dflash import default_tree_budget

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("prompt", nargs="?", default="Explain speculative decoding in one paragraph.")
    parser.add_argument("--draft", default=str(ROOT), help="DFlash draft folder (default: this repo)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument(
        "--block-size", type=int, help="tokens per block (default: the draft's config, which ships the best measured)"
    )
    parser.add_argument("--block-size-schedule", choices=["constant", "heuristic"], default="constant")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--draft-int8",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="draft with its int8 copy (default; `draft.int8_copy()`: the draft's pass reads half the "
        "bfloat16 bytes, and output stays exact, as the target verifies every token)",
    )
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default="auto",
        help="auto (default): bfloat16 where the hardware multiplies it natively, else float32, the token-exact mode",
    )
    args = parser.parse_args(argv)
    check_args(parser, args)
    return args


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every argument error before any model loads, as argparse reports its own (`error: ...`, exit status 2)."""
    check_decoding_args(parser, args)
    if not args.prompt.strip():
        parser.error("the prompt is empty")
    check_model_path(parser, "--draft", args.draft, draft=True)


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def plain_generate(target, tokenizer, ids, max_new_tokens: int, temperature: float) -> torch.Tensor:
    return target.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=temperature > 0,
        temperature=temperature or None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    )


def comparison(target, ids, ours: torch.Tensor, plain: torch.Tensor, dtype: str, temperature: float) -> str:
    """How DFlash's output relates to plain decoding's, and why where they part."""
    if temperature > 0:
        return "sampled (the same distribution as plain decoding, not the same tokens)"
    prompt_len = ids.shape[1]
    found, tie = explained(target, ids[0].tolist(), ours[0, prompt_len:].tolist(), plain[0, prompt_len:].tolist())
    if found is None:
        return f"identical to plain greedy ({dtype})"
    if tie:
        return f"differs from plain greedy at {found.describe()}; --dtype float32 gives token-identical output"
    return f"differs from plain greedy at {found.describe()}, and not only at rounding ties: a bug, please report it"


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    dtype = resolve_dtype(args.dtype)
    target, tokenizer = load_default_target(dtype)
    draft = AutoModel.from_pretrained(args.draft, trust_remote_code=True, dtype=dtype).eval()
    draft = draft.int8_copy() if args.draft_int8 else draft
    args.block_size = args.block_size or draft.config.block_size
    tree_budget = default_tree_budget(draft, target, args.block_size_schedule)
    lookup = default_tree_budget(draft, target, args.block_size_schedule, name="prompt_lookup_num_tokens")
    messages = [{"role": "user", "content": args.prompt}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)[
        "input_ids"
    ]
    common = dict(
        max_new_tokens=args.max_new_tokens, stop_token_ids=[tokenizer.eos_token_id], temperature=args.temperature
    )
    draft.spec_generate(target=target, input_ids=ids, max_new_tokens=4, block_size=args.block_size)  # warm-up
    why = " (auto: this machine multiplies bf16 natively)" if args.dtype == "auto" and dtype != "float32" else ""
    print(f"dtype {dtype}{why}; transformers {transformers.__version__}, torch {torch.__version__}", flush=True)

    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    stats, dflash_s = timed(
        lambda: draft.spec_generate(
            target=target,
            input_ids=ids,
            block_size=args.block_size,
            block_size_schedule=args.block_size_schedule,
            return_stats=True,
            streamer=streamer,
            **common,
        )
    )
    plain, plain_s = timed(lambda: plain_generate(target, tokenizer, ids, args.max_new_tokens, args.temperature))
    plain_new = plain.shape[1] - ids.shape[1]
    dflash_tps, plain_tps = stats.num_output_tokens / dflash_s, plain_new / plain_s
    settings = ", ".join(
        [f"block {args.block_size}", args.block_size_schedule]
        + ([f"tree of {tree_budget}"] if tree_budget else [])
        + ([f"lookup branch of {lookup}"] if lookup else [])
        + [str(dtype)]
        + (["int8 draft"] if args.draft_int8 else [])
    )
    lines = [
        f"\nDFlash: {stats.num_output_tokens} tokens in {dflash_s:.2f} s = {dflash_tps:.1f} tok/s, "
        f"mean acceptance length {stats.mean_acceptance_length:.2f} ({settings})",
        f"plain:  {plain_new} tokens in {plain_s:.2f} s = {plain_tps:.1f} tok/s ({dtype})",
    ]
    if dtype != "float32":  # the exact mode's speed too, so both gains show
        exact_target, _ = load_default_target("float32")
        plain_generate(exact_target, tokenizer, ids, 4, args.temperature)  # warm-up
        exact, exact_s = timed(
            lambda: plain_generate(exact_target, tokenizer, ids, args.max_new_tokens, args.temperature)
        )
        exact_new = exact.shape[1] - ids.shape[1]
        lines.append(f"plain:  {exact_new} tokens in {exact_s:.2f} s = {exact_new / exact_s:.1f} tok/s (float32)")
    lines.append(
        f"speedup {dflash_tps / plain_tps:.2f}x over plain {dtype}; output "
        f"{comparison(target, ids, stats.output_ids, plain, dtype, args.temperature)}"
    )
    print("\n".join(lines))


if __name__ == "__main__":
    main()
