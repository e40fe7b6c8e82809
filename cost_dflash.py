"""What a verify costs on this machine: the target's time by the tokens one pass verifies, t(n), measured once per
target, dtype, device, thread count and row count, and kept for the process (`tree_dflash.sized_width` sizes each
round by it).
"""

import time
import weakref

import torch
from transformers import DynamicCache

try:
    from .cache_dflash import cache_kwarg, drop_last, select_cache_rows
    from .tree_dflash import VerifyCosts
except ImportError:  # imported as a top-level module from the repo root or an installed project
    from cache_dflash import cache_kwarg, drop_last, select_cache_rows
    from tree_dflash import VerifyCosts

MEASURED = weakref.WeakKeyDictionary()  # target -> {(dtype, device, threads, rows): VerifyCosts}
CONTEXT = 64  # cached tokens each timed pass attends to, as a verify attends to the prompt and output


def verify_costs(target, most_tokens: int, costs=None, rows: int = 1) -> VerifyCosts:
    """The call's t(n) for `rows` rows verifying `n` tokens in all: `costs` when given (a `VerifyCosts`, or a mapping
    of tokens to seconds), else the table kept for this target and row count, measured now up to `most_tokens` if it
    does not reach that far."""
    if costs is not None:
        return VerifyCosts.given(costs)
    key = (target.dtype, str(target.device), torch.get_num_threads(), rows)
    kept = MEASURED.setdefault(target, {})
    if key not in kept or kept[key].tokens[-1] < most_tokens:
        kept[key] = measure_verify_costs(target, most_tokens, rows=rows)
    return kept[key]


def measure_verify_costs(target, most_tokens: int, rows: int = 1, repeats: int = 2) -> VerifyCosts:
    """`VerifyCosts.timed` over passes of `rows` rows with 1, 2, 4, ... tokens each (and up to `most_tokens` in all)
    after `CONTEXT` cached ones: a batch is timed in its own shape, since its attention reads every row's cache (one
    row's prefill, copied to every row). Each pass is cropped back after timing."""
    sizes = VerifyCosts.sizes_to_time(-(-most_tokens // rows))  # per row
    vocab = target.get_input_embeddings().num_embeddings
    ids = torch.randint(0, vocab, (rows, CONTEXT + sizes[-1]), device=target.device)
    cache = {cache_kwarg(target): DynamicCache()}
    with torch.inference_mode():
        target(input_ids=ids[:1, :CONTEXT], use_cache=True, logits_to_keep=1, **cache)
        # a pass's cost reads the cache's shape, not its values: the one row's, as every row's
        select_cache_rows(next(iter(cache.values())), torch.zeros(rows, dtype=torch.long, device=target.device))

        def time_pass(total: int) -> float:  # `total` tokens in all, `total // rows` in each row
            return timed_pass(target, ids[:, CONTEXT : CONTEXT + total // rows], cache)

        return VerifyCosts.timed([rows * n for n in sizes], time_pass, repeats)


def timed_pass(target, ids: torch.Tensor, cache: dict) -> float:
    synchronize = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
    synchronize()
    start = time.perf_counter()
    target(input_ids=ids, use_cache=True, **cache)
    synchronize()
    seconds = time.perf_counter() - start
    drop_last(next(iter(cache.values())), ids.shape[1])
    return seconds
