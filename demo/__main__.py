"""The main job: stream a DFlash generation on the embedded default, then time plain decoding of the same prompt.

    python -m demo "Explain speculative decoding in one paragraph." [--max-new-tokens 128] [--block-size B]
"""

import argparse
import time
from pathlib import Path

import torch
from transformers import AutoModel, TextStreamer

from default_target import load_default_target
from generation_dflash import default_tree_budget

ROOT = Path(__file__).resolve().parents[1]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompt", nargs="?", default="Explain speculative decoding in one paragraph.")
    parser.add_argument("--draft", default=str(ROOT), help="DFlash draft folder (default: this repo)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--block-size", type=int, help="tokens per block (default: the draft's config, which ships the best measured)")
    parser.add_argument("--block-size-schedule", choices=["constant", "heuristic"], default="constant")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--threads", type=int, default=2)
    return parser.parse_args()


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    target, tokenizer = load_default_target()
    draft = AutoModel.from_pretrained(args.draft, trust_remote_code=True).eval()
    args.block_size = args.block_size or draft.config.block_size
    tree_budget = default_tree_budget(draft, target, args.block_size_schedule)
    messages = [{"role": "user", "content": args.prompt}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    common = dict(max_new_tokens=args.max_new_tokens, stop_token_ids=[tokenizer.eos_token_id], temperature=args.temperature)
    draft.spec_generate(target=target, input_ids=ids, max_new_tokens=4, block_size=args.block_size)  # warm-up

    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    stats, dflash_s = timed(lambda: draft.spec_generate(
        target=target, input_ids=ids, block_size=args.block_size, block_size_schedule=args.block_size_schedule,
        return_stats=True, streamer=streamer, **common))
    plain, plain_s = timed(lambda: target.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens, do_sample=args.temperature > 0,
        temperature=args.temperature or None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id))
    plain_new = plain.shape[1] - ids.shape[1]
    dflash_tps, plain_tps = stats.num_output_tokens / dflash_s, plain_new / plain_s
    same = "identical to plain greedy" if torch.equal(stats.output_ids, plain) else "differs from plain decoding"
    print(
        f"\nDFlash: {stats.num_output_tokens} tokens in {dflash_s:.2f} s = {dflash_tps:.1f} tok/s, "
        f"mean acceptance length {stats.mean_acceptance_length:.2f} (block {args.block_size}, {args.block_size_schedule}"
        f"{f', tree of {tree_budget}' if tree_budget else ''})"
        f"\nplain:  {plain_new} tokens in {plain_s:.2f} s = {plain_tps:.1f} tok/s"
        f"\nspeedup {dflash_tps / plain_tps:.2f}x; output {same if args.temperature == 0 else 'sampled'}"
    )


if __name__ == "__main__":
    main()
