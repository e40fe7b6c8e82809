"""Random anchors and the block-sparse attention mask that trains many draft blocks of a sequence in one pass.

A block anchored at position `a` is `[x_a, MASK x (B-1)]` at positions `a .. a+B-1`. It sees the target's features
of positions strictly before `a` (what the draft's cache holds at decode time) plus its own block, and predicts
`x_{a+1} .. x_{a+B-1}`.
"""

import torch


def loss_weights(block_size: int, gamma: float) -> torch.Tensor:
    """`exp(-(k-1)/gamma)` for block positions `k = 1..B-1`: early positions matter most for acceptance."""
    k = torch.arange(1, block_size, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


def dpace_weights(accept_prob: torch.Tensor, trained: torch.Tensor, alpha: float = 0.5) -> torch.Tensor:
    """D-PACE position weights (arXiv 2605.18810) over the last axis of `[..., B-1]` block positions.

    With `s_k = (1 - alpha) * q_k + alpha` (q: the draft's probability of the label),
    `w_k = sum_{j >= k} prod_{i <= j} s_i`:
    the gradient share of position `k` in the surrogate of expected accepted length. Untrained positions are no-ops in
    the products and add nothing to the sums. Detached: the weights steer the cross-entropy, they are not trained.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"dpace alpha must be in [0, 1], got {alpha}")
    smooth = torch.where(trained, (1 - alpha) * accept_prob.detach() + alpha, torch.ones_like(accept_prob))
    prefix = smooth.cumprod(-1) * trained
    return prefix.flip(-1).cumsum(-1).flip(-1) * trained


def default_gamma(block_size: int) -> float:
    """The paper's values (7 for B=16, 5 for B=10, 4 for B=8), interpolated linearly elsewhere."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, max(1.0, 4.0 + (block_size - 8) * 3.0 / 8.0))


def sample_anchors(
    loss_starts: torch.Tensor,
    lengths: torch.Tensor,
    num_anchors: int,
    generator: torch.Generator,
    block_size: int | None = None,
    stride: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct sorted anchors in `[loss_start, length - 2]` per row: `(anchors [b, m], valid [b, m])`.

    `num_anchors=0` is dense: each row gets one anchor per `stride` candidates (rounded up; `stride` defaults to
    `block_size`, so the blocks cover about every response token once, as public recipes do; a smaller stride
    overlaps them). Rows with fewer anchors than the widest repeat their first candidate in the spare slots, marked
    invalid.
    """
    counts = (lengths - 1 - loss_starts).clamp(min=0).tolist()
    if num_anchors == 0:
        stride = stride or block_size
        if not stride:
            raise ValueError("dense anchors (num_anchors=0) need the block size or a stride")
        per_row = [-(-c // stride) for c in counts]
    else:
        per_row = [min(c, num_anchors) for c in counts]
    width = max(max(per_row, default=0), 1)
    anchors = torch.zeros(len(lengths), width, dtype=torch.long)
    valid = torch.zeros(len(lengths), width, dtype=torch.bool)
    for row, (lo, count, take) in enumerate(zip(loss_starts.tolist(), counts, per_row)):
        picked = torch.randperm(count, generator=generator)[:take].sort().values + lo
        anchors[row, : len(picked)], valid[row, : len(picked)] = picked, True
        anchors[row, len(picked) :] = lo
    return anchors, valid


def block_positions(anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """`[b, m, B]` absolute positions of every block."""
    return anchors[..., None] + torch.arange(block_size, device=anchors.device)


def anchor_attention_mask(anchors: torch.Tensor, context_len: int, block_size: int) -> torch.Tensor:
    """Boolean `[b, m*B, context_len + m*B]` mask, True where a block query may attend.

    Keys are `[context ; blocks]`: block `j` sees context positions `< anchors[:, j]` and the `B` keys of its own block.
    """
    b, m = anchors.shape
    ctx = torch.arange(context_len, device=anchors.device)
    sees_context = ctx[None, None, :] < anchors[..., None]  # [b, m, ctx]
    sees_context = sees_context.repeat_interleave(block_size, dim=1)  # one row per query
    block_of = torch.arange(m * block_size, device=anchors.device) // block_size
    sees_block = (block_of[:, None] == block_of[None, :]).expand(b, -1, -1)
    return torch.cat([sees_context, sees_block], dim=-1)


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Boolean `[b, q, k]` -> additive `[b, 1, q, k]` (0 where allowed, the dtype's minimum elsewhere)."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)[:, None]


def block_inputs(
    input_ids: torch.Tensor,
    anchors: torch.Tensor,
    valid: torch.Tensor,
    lengths: torch.Tensor,
    block_size: int,
    mask_token_id: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block tokens `[b, m, B]`, their labels `[b, m, B-1]` and a label mask `[b, m, B-1]`.

    Labels are the tokens at `a+1 .. a+B-1`; positions past the sequence end or in invalid blocks are masked.
    """
    positions = block_positions(anchors, block_size)
    tokens = torch.full(positions.shape, mask_token_id, dtype=torch.long, device=input_ids.device)
    tokens[..., 0] = input_ids.gather(1, anchors)
    label_pos = positions[..., 1:]
    label_mask = (label_pos < lengths[:, None, None]) & valid[..., None]
    flat = label_pos.clamp(max=input_ids.shape[1] - 1).flatten(1)
    labels = input_ids.gather(1, flat).view(label_pos.shape)
    return tokens, labels, label_mask
