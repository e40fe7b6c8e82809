"""Per-round costs behind DFlash's speed on this machine, measured on real decode rounds of the default target and
the shipped draft: a plain decode step, then for each block size a round's draft step (its layers on the newly
committed features with its cache, and its head), the verify pass, and the cache crop.

    python -m bench.step_costs [--threads 2] [--repeats 10] [--context 64] [--accepted 2]
"""

import argparse
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from default_target import load_default_target
from generation_dflash import LayerFeatures, cache_kwarg, draft_embedding, draft_head, draft_step, drop_last
from modeling_dflash import DFlashDraftModel

ROOT = Path(__file__).resolve().parents[1]


def mean_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1000


def prefilled(target, draft, context: int, new: int):
    """Both caches after `context` committed tokens, the draft's holding all but the `new` last features."""
    name, ids = cache_kwarg(target), torch.randint(100, 1000, (1, context + 1))
    target_cache, draft_cache = DynamicCache(), DynamicCache()
    with LayerFeatures(target, draft.config.target_layer_ids) as features:
        target(input_ids=ids[:, :context], use_cache=True, **{name: target_cache})
        committed = features.pop()
    embed, head = draft_embedding(draft, target), draft_head(draft, target.get_output_embeddings())
    draft_step(draft, embed, head, ids[:, context - new : context - new + 1], committed[:, : context - new],
                 context - new, draft_cache, 2)
    return target_cache, draft_cache, committed[:, context - new :], ids[:, context:], (embed, head)


def verify_ms(target, target_cache, block: int, repeats: int) -> float:
    """Milliseconds of a target pass over `block` new tokens and the crop back; one token is a plain decode step."""
    name, verify_ids = cache_kwarg(target), torch.randint(100, 1000, (1, block))

    def verify_and_crop():
        target(input_ids=verify_ids, use_cache=True, **{name: target_cache}).logits.argmax(-1).tolist()
        drop_last(target_cache, block)

    return mean_ms(verify_and_crop, repeats)


def round_costs(target, draft, block: int, context: int, accepted: int, repeats: int) -> dict[str, float]:
    """Milliseconds of one round's draft step (its layers on the `accepted + 1` features the last round committed,
    with its cache, and its head) and verify pass with the crop; both caches return to their length after each."""
    target_cache, draft_cache, new, last, (embed, head) = prefilled(target, draft, context, accepted + 1)

    def timed_draft():
        draft_step(draft, embed, head, last, new, context, draft_cache, block)[0].argmax(-1).tolist()
        drop_last(draft_cache, new.shape[1])

    return {"draft": mean_ms(timed_draft, repeats), "verify": verify_ms(target, target_cache, block, repeats)}


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--context", type=int, default=64, help="committed tokens before the round")
    parser.add_argument("--accepted", type=int, default=1, help="drafted tokens the previous round kept")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, _ = load_default_target()
    draft = DFlashDraftModel.from_pretrained(ROOT).eval()
    step = verify_ms(target, prefilled(target, draft, args.context, 1)[0], 1, args.repeats)
    print(f"plain decode step: {step:.1f} ms (context {args.context})")
    for block in (4, 8, 16):
        costs = round_costs(target, draft, block, args.context, args.accepted, args.repeats)
        total = costs["draft"] + costs["verify"]
        print(f"block {block:2d} round: draft {costs['draft']:.1f} ms + verify and crop {costs['verify']:.1f} ms = "
              f"{total:.1f} ms, {total / step:.2f} decode steps: break-even at tau {total / step:.2f}")


if __name__ == "__main__":
    main()
