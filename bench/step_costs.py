"""Per-step costs behind DFlash's speed on this machine: target passes over B tokens, the draft's layers and head
(the full head, and the draft's own vocabulary when it has one).

    python -m bench.step_costs [--threads 1] [--repeats 5]
"""

import argparse
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from default_target import load_default_target
from generation_dflash import cache_kwarg, draft_head
from modeling_dflash import DFlashDraftModel

ROOT = Path(__file__).resolve().parents[1]


def mean_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1000


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, _ = load_default_target()
    draft = DFlashDraftModel.from_pretrained(ROOT).eval()
    cache = DynamicCache()
    with_cache = {cache_kwarg(target): cache}
    target(torch.randint(100, 1000, (1, 64)), use_cache=True, **with_cache)
    for block in (1, 2, 4, 8, 16):
        ids = torch.randint(100, 1000, (1, block))

        def verify():
            target(ids, use_cache=True, **with_cache)
            cache.crop(-block)  # keep the context at 64 tokens

        print(f"target pass over {block:2d} tokens: {mean_ms(verify, args.repeats):6.1f} ms")
    full_head, head = target.get_output_embeddings(), draft_head(draft, target.get_output_embeddings())
    vocab = len(draft.config.draft_vocab) if draft.config.draft_vocab else "all"
    features = torch.randn(1, 64, len(draft.config.target_layer_ids) * draft.config.hidden_size)
    for block in (2, 8, 16):
        noise = target.get_input_embeddings()(torch.full((1, block), draft.config.mask_token_id))
        hidden = torch.randn(1, block - 1, draft.config.hidden_size)
        layers = mean_ms(lambda: draft(noise_embeds=noise, context_hidden_states=features), args.repeats)
        full, own = mean_ms(lambda: full_head(hidden), args.repeats), mean_ms(lambda: head(hidden), args.repeats)
        print(f"draft layers, block {block:2d}: {layers:5.1f} ms; head over {block - 1:2d} positions: "
              f"{full:5.1f} ms full, {own:5.1f} ms over the draft's vocabulary ({vocab} tokens)")


if __name__ == "__main__":
    main()
