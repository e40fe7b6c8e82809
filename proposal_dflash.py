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
    logits: torch.Tensor, budget: int | None, warpers=None, vocab: torch.Tensor | None = None, min_prob: float = 0.0
) -> DraftTree:
    """The round's draft: the argmax chain when `budget` is None, else a best-first tree of at most `budget` nodes
    whose path probability is at least `min_prob`, scored with the draft's distribution after the call's sampling
    warpers (none when greedy), so a token the target cannot sample is never proposed. `logits`: `[1, depth, vocab]`,
    over the draft's vocabulary `vocab` when given (then every other token has probability 0, and the warpers read
    the same distribution)."""
    if budget is None:
        best = logits[0].max(dim=-1).indices
        return DraftTree.chain((best if vocab is None else vocab[best]).tolist())
    scores = warpers(None, logits[0].float()) if warpers else logits[0].float()
    return build_tree(torch.log_softmax(scores, dim=-1), budget, vocab, math.log(min_prob) if min_prob else -math.inf)


def ancestors(tree: DraftTree) -> torch.Tensor:
    return torch.tensor(tree.ancestor_rows(), dtype=torch.bool)


def tree_attention_mask(
    tree: DraftTree, cache_len: int, dtype: torch.dtype, device, kv_len: int | None = None
) -> torch.Tensor:
    """Additive `[1, 1, n + 1, kv_len]` mask over `[cache ; tree ; unused slots]`: all of the cache, ancestors only,
    none of the slots after the tree (a static cache's keys span its whole length)."""
    n = len(tree.tokens) + 1
    unused = (kv_len or cache_len + n) - cache_len - n
    visible = torch.cat(
        [torch.ones(n, cache_len, dtype=torch.bool), ancestors(tree), torch.zeros(n, unused, dtype=torch.bool)], dim=1
    )
    mask = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, torch.finfo(dtype).min)
    return mask[None, None].to(device)


def tree_position_ids(tree: DraftTree, start: int, device) -> torch.Tensor:
    return torch.tensor([tree.positions(start)], device=device)
