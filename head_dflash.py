"""The target's embedding and head as the draft uses them (scaled, soft-capped, cut to the draft's vocabulary), and
their int8 copies for drafting on CPUs.
"""

import functools
import weakref
from collections.abc import Callable

import torch


def draft_embedding(draft, target) -> Callable[[torch.Tensor], torch.Tensor]:
    """How the block is embedded: with the target's embedding module, or, when the draft's config sets
    `input_embedding_scale`, the raw table times that scale, bypassing any scaling inside the module (z-lab's
    reference; Gemma-style targets use sqrt(hidden))."""
    embed = target.get_input_embeddings()
    scale = draft.config.dflash_field("input_embedding_scale")
    if scale is None:
        return embed
    return lambda ids: torch.nn.functional.embedding(ids, embed.weight) * scale


def is_int8(draft) -> bool:
    """Whether `draft` is an `int8_copy()` (a marker it sets, so float drafts never touch `torch.ao`)."""
    return getattr(draft, "_int8_weights", False)


def quantize_int8(module: torch.nn.Module) -> torch.nn.Module:
    """`module` (float32, on the CPU) with its linear layers dynamically quantized in place: int8 weights, float32
    activations. fbgemm's dynamic quantization is deprecated in torch 2.10+ yet 2.4x or more faster on these shapes than
    its successors (`python -m bench.int8_kernels`), so it stays, warning included, until torch removes it."""
    from torch.ao.quantization import quantize_dynamic  # only int8 copies need the deprecated namespace

    return quantize_dynamic(module, {torch.nn.Linear}, torch.qint8, inplace=True)


def rows(weight: torch.Tensor | None, vocab: torch.Tensor | None) -> torch.Tensor | None:
    return weight if weight is None or vocab is None else weight[vocab]


INT8_HEADS = weakref.WeakKeyDictionary()  # draft -> (a weakref to the head's weight, what it was quantized from, head)


def int8_head(draft, lm_head, vocab: list[int] | None, weight, bias) -> Callable[[torch.Tensor], torch.Tensor]:
    """An int8 copy of `weight` and `bias` (`lm_head`'s rows in the draft's vocabulary), taking and giving float32;
    quantized once per draft, head and vocabulary, and again after the head's weights change in place (a reload
    bumps their version)."""
    versions = tuple(getattr(t, "_version", None) for t in (lm_head.weight, lm_head.bias))
    source = (versions, None if vocab is None else tuple(vocab))
    cached = INT8_HEADS.get(draft)
    if cached is None or cached[0]() is not lm_head.weight or cached[1] != source:
        linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
        linear.load_state_dict({"weight": weight.float()} | ({} if bias is None else {"bias": bias.float()}))
        quantized = quantize_int8(torch.nn.Sequential(linear))
        cached = INT8_HEADS[draft] = (weakref.ref(lm_head.weight), source, lambda hidden: quantized(hidden.float()))
    return cached[2]


class DraftHead:
    """The target's head as the draft proposes with it: times `output_multiplier`, then soft-capped by
    `final_logit_softcapping` (`tanh(x / c) * c`) where the config sets them; over `config.draft_vocab` only, when the
    draft was trained on that subset (FR-Spec). The target still verifies over its whole vocabulary with its own head.

    `head(hidden)` gives logits over the whole vocabulary (-inf outside the draft's); `head.scores(hidden)` gives them
    over the draft's vocabulary only, which `head.vocab` maps back to token ids (None: the whole vocabulary)."""

    def __init__(self, draft, lm_head):
        self.multiplier = draft.config.dflash_field("output_multiplier")
        self.cap = draft.config.dflash_field("final_logit_softcapping")
        self.vocab_size = lm_head.weight.shape[0]
        vocab = getattr(draft.config, "draft_vocab", None)
        self.vocab = None if vocab is None else torch.tensor(vocab, device=lm_head.weight.device)
        weight, bias = rows(lm_head.weight, self.vocab), rows(lm_head.bias, self.vocab)
        self.linear = functools.partial(torch.nn.functional.linear, weight=weight, bias=bias)
        if is_int8(draft):  # the draft's own layers are int8: so is its copy of the head's rows
            self.linear = int8_head(draft, lm_head, vocab, weight, bias)

    def scores(self, hidden: torch.Tensor) -> torch.Tensor:
        # 2D: a sliced block fails matmul's fold check, and its bmm would copy the whole head weight every call
        logits = self.linear(hidden.flatten(0, -2)).unflatten(0, hidden.shape[:-1])
        if self.multiplier is not None:
            logits = logits * self.multiplier
        if self.cap:
            logits = torch.tanh(logits / self.cap) * self.cap
        return logits

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.scores(hidden)
        if self.vocab is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.vocab, logits)
