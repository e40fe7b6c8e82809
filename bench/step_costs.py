"""Per-round costs behind DFlash's speed on this machine, measured on real decode rounds of a target (default: the
embedded one) and a draft (default: the shipped one): the verify-cost curve (one target pass over n new tokens and
the crop back; n = 1 is a plain decode step), then for each block size a round's draft step (its layers on the newly
committed features with its cache, and its head over its `draft_vocab`), the verify pass, and the cache crop.

    python -m bench.step_costs [--dtype auto] [--threads 2] [--repeats 10] [--context 64] [--accepted 2]
"""

import argparse
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from cache_dflash import cache_kwarg, drop_last
from decoding_dflash import LayerFeatures, draft_step
from default_target import DTYPES, load_default_target, resolve_dtype
from head_dflash import DraftHead, draft_embedding
from modeling_dflash import DFlashDraftModel

ROOT = Path(__file__).resolve().parents[1]


def mean_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1000


def random_ids(target, length: int) -> torch.Tensor:
    """Ordinary tokens (ids 100-999 where the vocabulary has them)."""
    vocab = target.get_input_embeddings().num_embeddings
    return torch.randint(min(100, vocab // 2), min(1000, vocab), (1, length))


def prefilled(target, draft, context: int, new: int):
    """Both caches after `context` committed tokens, the draft's holding all but the `new` last features."""
    name = cache_kwarg(target)
    ids = random_ids(target, context + 1)
    target_cache, draft_cache = DynamicCache(), DynamicCache()
    with LayerFeatures(target, draft.config.target_layer_ids) as features:
        target(input_ids=ids[:, :context], use_cache=True, **{name: target_cache})
        committed = features.pop()
    embed, head = draft_embedding(draft, target), DraftHead(draft, target.get_output_embeddings())
    draft_step(
        draft,
        embed,
        head,
        ids[:, context - new : context - new + 1],
        committed[:, : context - new],
        context - new,
        draft_cache,
        2,
    )
    return target_cache, draft_cache, committed[:, context - new :], ids[:, context:], (embed, head)


def verify_ms(target, target_cache, block: int, repeats: int) -> float:
    """Milliseconds of a target pass over `block` new tokens and the crop back; one token is a plain decode step."""
    name = cache_kwarg(target)
    verify_ids = random_ids(target, block)

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


def load_target(path: str | None, dtype: str):
    if path is None:
        return load_default_target(dtype)[0]
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


@torch.inference_mode()
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--context", type=int, default=64, help="committed tokens before the round")
    parser.add_argument("--accepted", type=int, default=1, help="drafted tokens the previous round kept")
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default="float32",
        help="of target and draft; auto: bfloat16 where the hardware multiplies it natively (default float32)",
    )
    parser.add_argument("--target", help="target folder (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--draft", default=str(ROOT), help="draft folder (default: this repository's root)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = resolve_dtype(args.dtype)
    target = load_target(args.target, dtype)
    draft = DFlashDraftModel.from_pretrained(args.draft, dtype=dtype).eval()
    cache = prefilled(target, draft, args.context, 1)[0]
    curve = {n: verify_ms(target, cache, n, args.repeats) for n in (1, 2, 4, 8, 16, 32)}
    step = curve[1]
    print(f"{dtype}, context {args.context}: one target pass over n new tokens and the crop back, ms (x decode step)")
    print("  ".join(f"n={n}: {ms:.1f} ({ms / step:.2f}x)" for n, ms in curve.items()))
    for block in (4, 8, 16):
        costs = round_costs(target, draft, block, args.context, args.accepted, args.repeats)
        total = costs["draft"] + costs["verify"]
        print(
            f"block {block:2d} round: draft {costs['draft']:.1f} ms + verify and crop {costs['verify']:.1f} ms = "
            f"{total:.1f} ms, {total / step:.2f} decode steps: break-even at tau {total / step:.2f}"
        )


if __name__ == "__main__":
    main()
