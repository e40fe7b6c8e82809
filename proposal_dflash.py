"""A round's proposal from the draft's logits, in torch: the argmax chain or a best-first tree (`tree_dflash`'s
framework-free rules), and the mask and positions a tree is verified with."""

import math

import torch

try:
    from .tree_dflash import DraftTree, best_first
except ImportError:  # imported as a top-level module from the repo root or an installed project
    from tree_dflash import DraftTree, best_first


def build_tree(
    log_probs: torch.Tensor, budget: int, vocab: torch.Tensor | None = None, min_log_prob: float = float("-inf")
) -> DraftTree:
    """`best_first` over the draft's top choices. `log_probs`: `[depth, vocab]`, the draft's log-probabilities at
    block positions 1..depth; `vocab` maps its columns to token ids when they cover only the draft's vocabulary."""
    width = min(budget, log_probs.shape[-1])
    values, indices = log_probs.float().topk(width, dim=-1)
    return best_first(values.tolist(), (indices if vocab is None else vocab[indices]).tolist(), budget, min_log_prob)


def propose(
    logits: torch.Tensor, budget: int, warpers=None, vocab: torch.Tensor | None = None, min_prob: float = 0.0
) -> DraftTree:
    """The round's drafted tree: best-first, of at most `budget` nodes whose path probability is at least
    `min_prob`, scored with the draft's distribution after the call's sampling
    warpers (none when greedy), so a token the target cannot sample is never proposed. `logits`: `[1, depth, vocab]`,
    over the draft's vocabulary `vocab` when given (then every other token has probability 0, and the warpers read
    the same distribution)."""
    scores = warpers(None, logits[0].float()) if warpers else logits[0].float()
    return build_tree(torch.log_softmax(scores, dim=-1), budget, vocab, math.log(min_prob) if min_prob else -math.inf)


def argmax_tokens(logits: torch.Tensor, vocab: torch.Tensor | None = None) -> torch.Tensor:
    """The draft's first choice at each position; `vocab` maps the columns of `logits` to token ids when they cover
    only the draft's vocabulary."""
    best = logits.max(dim=-1).indices
    return best if vocab is None else vocab[best]


def ancestors(tree: DraftTree) -> torch.Tensor:
    return torch.tensor(tree.ancestor_rows(), dtype=torch.bool)


def tree_attention_mask(
    tree: DraftTree, cache_len: int, dtype: torch.dtype, device, kv_len: int | None = None, layout=(None, False)
) -> torch.Tensor | dict:
    """The verify's mask over `[cache ; tree ; unused slots]`: all of the cache, ancestors only, none of the slots
    after the tree (a static cache's keys span its whole length); windowed by the target's `layout` as
    `layer_masks` does."""
    n = len(tree.tokens) + 1
    unused = (kv_len or cache_len + n) - cache_len - n
    visible = torch.cat(
        [torch.ones(n, cache_len, dtype=torch.bool), ancestors(tree), torch.zeros(n, unused, dtype=torch.bool)], dim=1
    )
    queries = torch.tensor(tree.positions(cache_len))
    keys = torch.cat([torch.arange(cache_len), queries, torch.arange(unused) + cache_len + n])
    return layer_masks(visible[None].to(device), queries[None].to(device), keys[None].to(device), dtype, layout)


def layer_masks(visible: torch.Tensor, queries: torch.Tensor, keys: torch.Tensor, dtype: torch.dtype, layout):
    """The additive `[b, 1, q, k]` mask of `visible` (`[b, q, k]` bool) that a verify passes, given each query's and
    key's position (`[b, q]`, `[b, k]`), windowed by the target's `tree_dflash.mask_layout`: for all layers, or as
    transformers' mapping by layer type (`{"full_attention": ..., "sliding_attention": ...}`), so a tree stays exact
    past the window."""
    window, mixed = layout
    if window is None:
        return additive_mask(visible, dtype)
    windowed = additive_mask(visible & (queries[:, :, None] - keys[:, None, :] < window), dtype)
    return {"full_attention": additive_mask(visible, dtype), "sliding_attention": windowed} if mixed else windowed


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`[b, q, k]` bool -> the `[b, 1, q, k]` additive mask transformers' attention takes."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(
        ~visible, torch.finfo(dtype).min
    )[:, None]


def tree_position_ids(tree: DraftTree, start: int, device) -> torch.Tensor:
    return torch.tensor([tree.positions(start)], device=device)
