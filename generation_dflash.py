"""DFlash decoding: `spec_generate` (a hand-written loop) and `DFlashCandidateGenerator` (for `target.generate`,
which `routing_dflash.py` routes to it).

Each round drafts a block `[last token, MASK x (B-1)]` in one draft pass, verifies it in one target pass, keeps the
longest prefix the target agrees with plus the target's own next token, and crops both caches to that prefix.
Sampling (temperature > 0) uses the one-hot rule: the draft proposes its argmax, the target samples every block
position, and draft tokens are kept while they equal the target's samples. Every kept token is a target sample
given a prefix of target samples, so the output has exactly the target's distribution.
"""

import functools
import os
import sys
import warnings
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.generation.streamers import BaseStreamer

try:
    from .cache_dflash import (
        RollbackCache,
        cache_kwarg,
        check_target_supported,
        compact_cache,
        drop_last,
        is_hybrid,
        record_verify_states,
        static_length,
        target_cache_for,
    )
    from .configuration_dflash import check_fits_target, check_sampling, first_stop
    from .cost_dflash import verify_costs
    from .proposal_dflash import argmax_tokens, propose, tree_attention_mask, tree_position_ids
    from .tree_dflash import (
        DraftTree,
        TreeSizer,
        check_tree_supported,
        config_tree,
        mask_layout,
        prompt_lookup,
        resolve_tree_sizing,
    )
except ImportError:  # imported as a top-level module from the repo root or an installed project
    from cache_dflash import (
        RollbackCache,
        cache_kwarg,
        check_target_supported,
        compact_cache,
        drop_last,
        is_hybrid,
        record_verify_states,
        static_length,
        target_cache_for,
    )
    from configuration_dflash import check_fits_target, check_sampling, first_stop
    from cost_dflash import verify_costs
    from proposal_dflash import argmax_tokens, propose, tree_attention_mask, tree_position_ids
    from tree_dflash import (
        DraftTree,
        TreeSizer,
        check_tree_supported,
        config_tree,
        mask_layout,
        prompt_lookup,
        resolve_tree_sizing,
    )


@dataclass
class SpecGenerateOutput:
    """What `spec_generate(..., return_stats=True)` returns. `acceptance_lengths` counts the bonus token (tau)."""

    output_ids: torch.LongTensor
    acceptance_lengths: list[int] = field(default_factory=list)
    num_input_tokens: int = 0
    num_output_tokens: int = 0
    expected_acceptance_lengths: list[float] = field(default_factory=list)  # with cost sizing: each round's estimate

    @property
    def mean_acceptance_length(self) -> float:
        """Over every round; a batch's `acceptance_lengths` holds one list per row."""
        rounds = [n for row in self.acceptance_lengths for n in (row if isinstance(row, list) else [row])]
        return sum(rounds) / max(len(rounds), 1)


# ---------------------------------------------------------------------------------------------------------------------
# Checks: all run before any compute.


def base_model(target):
    """The target's decoder stack: `base_model_prefix`, else `model` (4.57's Gemma 3 names a prefix it lacks)."""
    base = getattr(target, getattr(target, "base_model_prefix", "model"), None)
    return base if hasattr(base, "layers") else getattr(target, "model", base)


def decoder_layers(target) -> torch.nn.ModuleList:
    """The target's decoder layers (`target.model.layers` in the usual layout)."""
    layers = getattr(base_model(target), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or target.get_output_embeddings() is None:
        raise ValueError(
            f"DFlash needs a decoder-only causal LM with `model.embed_tokens`, `model.layers` and `lm_head`; "
            f"{type(target).__name__} does not have that layout."
        )
    return layers


def check_draft_fits_target(draft, target) -> None:
    """Raises a ValueError naming the first mismatch between the draft's config and the target."""
    if target is None or not callable(getattr(target, "get_input_embeddings", None)):
        raise ValueError(f"target must be a transformers causal LM, got {type(target).__name__}")
    num_layers = len(decoder_layers(target))
    check_target_supported(target)
    vocab_size, hidden_size = target.get_output_embeddings().weight.shape
    check_fits_target(draft.config, num_layers=num_layers, hidden_size=hidden_size, vocab_size=vocab_size)


class FromGenerationConfig:
    """`spec_generate`'s default for `stop_token_ids`: the target's `generation_config.eos_token_id`, as `generate`
    stops; an explicit None keeps z-lab's meaning (no stop token)."""

    def __repr__(self) -> str:
        return "<target.generation_config.eos_token_id>"


EOS_FROM_GENERATION_CONFIG = FromGenerationConfig()


def stop_ids(target, stop_token_ids) -> set[int]:
    """The stop tokens of a call: an int, a list, None (none), or the default (the target's configured EOS ids)."""
    if stop_token_ids is EOS_FROM_GENERATION_CONFIG:
        stop_token_ids = getattr(getattr(target, "generation_config", None), "eos_token_id", None)
    if stop_token_ids is None:
        return set()
    ids = [stop_token_ids] if isinstance(stop_token_ids, int) else list(stop_token_ids)
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"stop_token_ids must be a token id or a list of them, got {stop_token_ids!r}")
    return set(ids)


def prompt_tensor(target, input_ids) -> torch.Tensor:
    """The `[b, prompt_len]` ids of a call, from a tensor or a tokenizer's output (`BatchEncoding`, any mapping
    with `input_ids`), refused by name when they cannot be a prompt for `target`."""
    if target is None or not callable(getattr(target, "get_input_embeddings", None)):
        raise ValueError(f"target must be a transformers causal LM, got {type(target).__name__}")
    if isinstance(input_ids, Mapping):
        if "input_ids" not in input_ids:
            raise ValueError(f"input_ids is a mapping without an 'input_ids' entry (keys: {sorted(input_ids)})")
        input_ids = input_ids["input_ids"]
    if not isinstance(input_ids, torch.Tensor):
        raise ValueError(
            f"input_ids must be a tensor of token ids of shape [batch, prompt_len] (e.g. tokenizer(text, "
            f"return_tensors='pt')), got {type(input_ids).__name__}"
        )
    if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
        raise ValueError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    vocab = target.get_input_embeddings().num_embeddings
    low, high = torch.stack(torch.aminmax(input_ids)).tolist() if input_ids.numel() else (0, 0)  # one host transfer
    if low < 0 or high >= vocab:
        raise ValueError(f"input_ids must be in [0, {vocab}) for this target, got ids from {low} to {high}")
    return input_ids.long()


def check_generation_inputs(input_ids: torch.Tensor, max_new_tokens: int, block_size: int) -> None:
    for name, value in (("max_new_tokens", max_new_tokens), ("block_size", block_size)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{name} must be an integer, got {value!r}")
    if input_ids.dim() != 2 or input_ids.shape[0] == 0:
        raise ValueError(f"input_ids must have shape [batch, prompt_len], got {tuple(input_ids.shape)}")
    if input_ids.shape[1] == 0:
        raise ValueError("the prompt is empty: DFlash needs at least one input token")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if block_size < 2:
        raise ValueError(f"block_size must be at least 2 (the last token plus one drafted token), got {block_size}")


# decoding settings a target's generation config may set that `spec_generate` does not apply (its own arguments
# decide sampling; of the config it reads `eos_token_id` only)
NOT_APPLIED = (
    "do_sample",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "typical_p",
    "epsilon_cutoff",
    "eta_cutoff",
    "repetition_penalty",
    "no_repeat_ngram_size",
    "bad_words_ids",
    "suppress_tokens",
    "begin_suppress_tokens",
    "sequence_bias",
    "min_length",
    "min_new_tokens",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "exponential_decay_length_penalty",
    "renormalize_logits",
)


OWN_FILES = (
    "generation_dflash.py",
    "batch_dflash.py",
    "modeling_dflash.py",
    "tree_dflash.py",
    "cache_dflash.py",
    "cost_dflash.py",
    "proposal_dflash.py",
)


def warn_caller(message: str) -> None:
    """A UserWarning at the caller's line, past this repo's decoding files and torch's decorators (Python 3.12's
    `skip_file_prefixes`, by file name)."""
    level, frame = 2, sys._getframe(1)
    while frame.f_back is not None and (
        os.path.basename(frame.f_code.co_filename) in OWN_FILES or f"{os.sep}torch{os.sep}" in frame.f_code.co_filename
    ):
        level, frame = level + 1, frame.f_back
    warnings.warn(message, UserWarning, stacklevel=level)


def check_context(target, input_ids: torch.Tensor, max_new_tokens: int) -> None:
    """A prompt longer than the target's context is refused; output that would run past it is warned of, as
    `generate` warns."""
    context = getattr(target.config, "max_position_embeddings", None)
    if context is None:
        return
    if input_ids.shape[1] > context:
        raise ValueError(
            f"the prompt has {input_ids.shape[1]} tokens, more than the target's context of {context} "
            "(max_position_embeddings): shorten it"
        )
    if input_ids.shape[1] + max_new_tokens > context:
        warn_caller(
            f"the prompt's {input_ids.shape[1]} tokens and max_new_tokens={max_new_tokens} run past the target's "
            f"context of {context} (max_position_embeddings): output beyond it is out of what the model was trained on"
        )


def warn_generation_config_not_applied(target) -> None:
    """Names what the target's `generation_config` sets that `spec_generate` would otherwise silently ignore."""
    config = getattr(target, "generation_config", None)
    diff = config.to_diff_dict() if config is not None else {}
    ignored = sorted(name for name in NOT_APPLIED if diff.get(name) is not None)
    if ignored:
        warn_caller(
            f"spec_generate does not apply the target's generation_config settings {ignored}: it decodes with its own "
            "temperature, top_k, top_p and stop_token_ids (target.generate(..., assistant_model=draft) applies them)"
        )


def check_schedule(schedule: str | None) -> None:
    if schedule not in (None, "constant", "heuristic"):
        raise ValueError(
            f"block size schedule {schedule!r} is not supported with DFlash; use 'constant' or 'heuristic'"
        )


def check_compile_request(
    compile_verify: bool,
    cache_implementation: str | None,
    past_key_values,
    schedule: str,
    lookup: int = 0,
    tree_min_prob: float = 0.0,
) -> str | None:
    """The cache implementation of the call: a compiled verify needs fixed shapes, so a static cache (the default
    then), a constant block and a tree of one size."""
    if not compile_verify:
        return cache_implementation
    for name, value in (("prompt_lookup_num_tokens", lookup), ("tree_min_prob", tree_min_prob)):
        if value:
            raise ValueError(
                f"compile_verify=True verifies one shape every round, and {name}={value} changes the "
                "verify's length by round (each new length would recompile); leave it unset"
            )
    if cache_implementation == "dynamic" or (past_key_values is not None and static_length(past_key_values) is None):
        raise ValueError(
            "compile_verify=True needs a static cache (fixed verify shapes); a dynamic cache grows every round"
        )
    if schedule != "constant":
        raise ValueError(
            f"compile_verify=True needs block_size_schedule='constant'; "
            f"{schedule!r} changes the verify shape every round"
        )
    return cache_implementation or (None if past_key_values is not None else "static")


def compiled_cache_slots(length: int) -> int:
    """Static cache slots for a compiled verify: a power of two, at least 1024, so calls of other lengths reuse the
    same compiled graph rather than recompiling."""
    return max(1024, 1 << (length - 1).bit_length())


@functools.cache
def compiled_forward() -> Callable:
    """`model.forward(**kwargs)` compiled once per process, as gpt-fast compiles its decode step: dynamo guards on the
    model it is given, so each target gets its own graph and nothing is stored on the target."""
    return torch.compile(lambda model, **kwargs: model.forward(**kwargs), dynamic=False)


def verify_forward(target, compile_verify: bool) -> Callable:
    """What runs the verify passes: the target, or its compiled forward (the prefill stays eager, since its length
    changes with every prompt)."""
    return functools.partial(compiled_forward(), target) if compile_verify else target


def verified_length(prompt_len: int, max_new_tokens: int, block_size: int, tree_budget: int | None) -> int:
    """The longest the target's sequence can grow: the last verify starts just before `max_new_tokens`."""
    return prompt_len + max_new_tokens + max(block_size, (tree_budget or 0) + 1)


def default_tree_budget(
    draft,
    target,
    schedule: str,
    final_length: Callable[[int | None], int] = lambda budget: 0,
    name: str = "tree_budget",
) -> int | None:
    """The config's `tree_budget` (or another tree setting, `name`), which yields to an adaptive chain, a DFlash 2
    selector and a recurrent target, and, with a warning, to a target that cannot verify that tree (its attention
    takes no custom mask, or the call could outgrow its sliding window; `final_length(nodes)` is the call's longest
    sequence)."""
    nodes = config_tree(
        getattr(draft.config, name),
        adaptive=schedule != "constant",
        selector=draft.has_selector,
        recurrent=is_hybrid(target),
    )
    if nodes is None:
        return None
    try:
        check_tree_supported(target, nodes, final_length(nodes))
    except ValueError as reason:  # a default steps aside; an explicit setting keeps raising
        what = f"tree of {nodes}" if name == "tree_budget" else f"{name}={nodes}"
        warn_caller(f"verifying the argmax chain instead of the draft config's {what}: {reason}")
        return None
    return nodes


def check_lookup_request(num_tokens: int | None, max_ngram: int) -> int:
    """The lookup branch's length (0: none), refusing negative or non-integer settings."""
    num_tokens = num_tokens or 0
    for name, value, least in (("prompt_lookup_num_tokens", num_tokens, 0), ("max_matching_ngram_size", max_ngram, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name} must be an integer of at least {least}, got {value!r}")
    return num_tokens


def check_min_prob(min_prob: float, tree_budget: int | None) -> None:
    if isinstance(min_prob, bool) or not isinstance(min_prob, (int, float)) or not 0 <= min_prob < 1:
        raise ValueError(f"tree_min_prob must be a probability in [0, 1), got {min_prob!r}")
    if min_prob and tree_budget is None:
        raise ValueError("tree_min_prob sizes a draft tree, and this call verifies the chain: set tree_budget too")


def check_tree_request(
    draft, target, tree_budget: int | None, schedule: str, final_length: int, name: str = "tree_budget"
) -> None:
    if tree_budget is None:  # the chain
        return
    if is_hybrid(target):
        raise ValueError(
            f"a draft tree ({name}={tree_budget}) needs an attention mask over the tree, "
            "which the recurrent layers "
            f"of {type(target).__name__} cannot take; use the chain ({name}=0)"
        )
    if draft.has_selector:
        raise ValueError(
            f"a draft tree ({name}={tree_budget}) is built from per-position distributions; a DFlash 2 draft's "
            f"selector chooses each token given the one before, so it verifies its chain ({name}=0)"
        )
    if schedule != "constant":
        raise ValueError(
            f"block_size_schedule={schedule!r} adapts a chain; a tree ({name}={tree_budget}) needs 'constant'"
        )
    try:
        check_tree_supported(target, tree_budget, final_length)
    except ValueError as reason:
        if name == "tree_budget":
            raise
        raise ValueError(f"{name}={tree_budget} is verified as a draft tree: {reason}") from None


@dataclass
class TreePlan:
    """How a call's rounds propose: the argmax chain (`budget` None, no lookup), or a best-first draft tree of at most
    `budget` nodes whose path probability is at least `min_prob`, plus a prompt-lookup branch of up to `lookup`
    tokens; `final_length` is the longest the target's sequence can grow."""

    budget: int | None = None
    min_prob: float = 0.0
    lookup: int = 0
    max_ngram: int = 2
    final_length: int = 0
    sizing: str = "fixed"
    costs: object = None  # the caller's t(n) for "cost" sizing (None: measured at the first call)

    @property
    def is_chain(self) -> bool:
        return self.budget is None and not self.lookup

    def sizer(self, target, rows: int) -> "TreeSizer | None":
        """The call's cost-sized rounds (None when the tree is fixed), over `rows` rows."""
        if self.sizing != "cost":
            return None
        return TreeSizer(verify_costs(target, rows * (self.budget + 1 + self.lookup), self.costs))


def tree_plan(
    draft,
    target,
    prompt_len: int,
    max_new_tokens: int,
    block_size: int,
    schedule: str,
    tree_budget: int | None,
    tree_min_prob: float,
    lookup: int | None,
    max_ngram: int,
    compile_verify: bool = False,
    sizing: str | None = None,
    costs=None,
) -> TreePlan:
    """A call's tree settings, the draft config's defaults filled in (each stepping aside, with a warning, where the
    target cannot verify it), checked before any compute."""
    length = functools.partial(verified_length, prompt_len, max_new_tokens, block_size)
    if tree_budget is None:
        tree_budget = default_tree_budget(draft, target, schedule, length)
    tree_budget = tree_budget or None
    if lookup is None and not compile_verify:  # a compiled verify wants one tree size
        lookup = default_tree_budget(
            draft, target, schedule, lambda n: length((tree_budget or block_size - 1) + n), "prompt_lookup_num_tokens"
        )
    lookup = check_lookup_request(lookup, max_ngram)
    final_length = length((tree_budget or block_size - 1) + lookup if lookup else tree_budget)
    check_min_prob(tree_min_prob, tree_budget)
    check_tree_request(draft, target, tree_budget, schedule, final_length)
    if lookup:  # a lookup branch makes every round a tree
        check_tree_request(draft, target, lookup, schedule, final_length, "prompt_lookup_num_tokens")
    sizing = check_sizing(draft, sizing, tree_budget, compile_verify)
    return TreePlan(tree_budget, tree_min_prob, lookup, max_ngram, final_length, sizing, costs)


def check_sizing(draft, sizing: str | None, tree_budget: int | None, compile_verify: bool) -> str:
    """The call's tree sizing: explicit, else the config's (`tree_dflash.resolve_tree_sizing`)."""
    return resolve_tree_sizing(sizing, draft.config.tree_sizing, tree_budget is not None, compile_verify)


def refuse_generate(self, *args, **kwargs):
    """Reached only when transformers bypassed DFlash routing and treated the draft as an ordinary assistant."""
    raise RuntimeError(
        "A DFlash draft is not a language model and cannot run `generate` itself. transformers did not route it to "
        "DFlashCandidateGenerator; use `draft.spec_generate(target=...)` or `speculation_type='dflash'`."
    )


# ---------------------------------------------------------------------------------------------------------------------
# Pure helpers shared by both decoding routes.


class LayerFeatures:
    """Forward hooks that keep the outputs of the target layers the draft reads, and nothing else: no pass asks the
    target for all of its hidden states (about 30x more memory on a long prompt). A context manager; `close()`
    removes the hooks."""

    def __init__(self, target, layer_ids: list[int]):
        layers = decoder_layers(target)
        self.layer_ids, self.outputs = list(layer_ids), {}
        self.hooks = [layers[i].register_forward_hook(self._keep(i)) for i in self.layer_ids]

    def _keep(self, layer_id: int):
        # a layer's output is what `hidden_states[layer_id + 1]` holds
        def hook(module, args, output):
            self.outputs[layer_id] = output[0] if isinstance(output, tuple) else output

        return hook

    def pop(self, index=slice(None)) -> torch.Tensor:
        """The last pass's features at sequence `index`, concatenated `[b, n, len(layer_ids) * H]`; then forgets
        them."""
        context = torch.cat([self.outputs[i][:, index] for i in self.layer_ids], dim=-1)
        self.outputs = {}
        return context

    def close(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks, self.outputs = [], {}

    def __enter__(self) -> "LayerFeatures":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


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


def draft_step(draft, embed, head, last_token, context, start, cache, block_size) -> tuple[torch.Tensor, torch.Tensor]:
    """One draft pass: `[1, block_size - 1, vocab]` logits (`head`, a `DraftHead` or its `scores`, maps hidden states
    to logits) and the `[1, block_size - 1, hidden]` hidden states they came from, for the tokens after `last_token`
    (at `start`)."""
    block = torch.full((1, block_size), draft.config.mask_token_id, dtype=torch.long, device=last_token.device)
    block[:, :1] = last_token
    positions = torch.arange(start - context.shape[1], start + block_size, device=block.device)[None]
    hidden = draft(
        noise_embeds=embed(block), context_hidden_states=context, position_ids=positions, past_key_values=cache
    )
    drop_last(cache, block_size)  # the cache keeps committed context only; the block is re-drafted next round
    hidden = hidden.last_hidden_state[:, 1:]
    return head(hidden), hidden


def choose_block(draft, logits, hidden, last_token, choose) -> torch.Tensor:
    """The block's drafted tokens `[1, n]`, `choose(scores) -> [1]` picking each from its position's scores: the
    draft's logits, or for a DFlash 2 draft its selector's scores given the token chosen before."""
    if draft.has_selector:
        return draft.candidate_selector.walk(logits, hidden, last_token, choose)[0]
    return torch.stack([choose(logits[:, i]) for i in range(logits.shape[1])], dim=1)


def chain_proposal(draft, logits, hidden, last_token, warpers, generator=None, vocab=None) -> torch.Tensor:
    """The chain `spec_generate` verifies: the draft's argmax (any proposal is exact under the one-hot rule), or a
    DFlash 2 selector's walk, greedy, or sampled from its warped scores when the call samples (as z-lab's reference).
    `vocab` maps the columns of `logits` to token ids when they cover only the draft's vocabulary."""
    if not draft.has_selector:
        return argmax_tokens(logits, vocab)
    return choose_block(
        draft, logits, hidden, last_token, lambda scores: pick_tokens(scores[:, None], warpers, generator)[:, 0]
    )


def next_block_size(block_size: int, accepted: int, max_block_size: int) -> int:
    """transformers' "heuristic" schedule: draft two more tokens after a fully accepted block, one fewer otherwise,
    so a draft that is often wrong costs little more than a two-token verify."""
    drafted = block_size - 1
    drafted = drafted + 2 if accepted == drafted else drafted - 1
    return min(max(drafted, 1), max_block_size - 1) + 1


def sampling_warpers(temperature: float, top_k: int = 0, top_p: float = 1.0) -> LogitsProcessorList:
    """transformers' own temperature, top-k and top-p warpers, in `generate`'s order; empty when greedy."""
    if temperature == 0:
        return LogitsProcessorList()
    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_k > 0:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    return warpers


def pick_tokens(
    logits: torch.Tensor, warpers: LogitsProcessorList, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Greedy without warpers, else one independent sample per position from the warped distribution.
    `logits`: `[b, n, vocab]`."""
    if not warpers:
        return logits.max(dim=-1).indices  # the first maximum, as argmax, at a fifth of bf16 argmax's cost on CPU
    scores = warpers(None, logits.flatten(0, 1).float())  # these warpers never read the input ids
    return torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=generator).view(logits.shape[:2])


class OutputEnd:
    """Where the output ends (after the first stop token, at most `max_new_tokens`), looking at each token once."""

    def __init__(self, stop_token_ids: set[int], max_new_tokens: int):
        self.stops, self.max_new_tokens, self.checked, self.stop = stop_token_ids, max_new_tokens, 0, None

    def update(self, tokens: list[int]) -> int:
        """The output length so far; `tokens` only grows between calls."""
        if self.stop is None:
            self.stop, self.checked = first_stop(tokens, self.stops, self.checked), len(tokens)
        return min(self.stop or len(tokens), self.max_new_tokens)

    def done(self, tokens: list[int]) -> bool:
        return self.update(tokens) >= self.max_new_tokens or self.stop is not None


def stream_tokens(streamer: BaseStreamer | None, tokens: list[int], streamed: int, end: int) -> int:
    """Sends `tokens[streamed:end]` to the streamer; returns how many tokens it has now had."""
    if streamer is not None and end > streamed:
        streamer.put(torch.tensor(tokens[streamed:end]))
    return end


# ---------------------------------------------------------------------------------------------------------------------
# The hand-written loop.


@torch.inference_mode()
def spec_generate(
    self,
    target,
    input_ids: torch.LongTensor,
    max_new_tokens: int = 2048,
    attention_mask: torch.Tensor | None = None,
    stop_token_ids: list[int] | int | None = EOS_FROM_GENERATION_CONFIG,
    temperature: float = 0.0,
    *,
    block_size: int | None = None,
    return_stats: bool = False,
    generator: torch.Generator | None = None,
    streamer: BaseStreamer | None = None,
    block_size_schedule: str = "constant",
    tree_budget: int | None = None,
    tree_min_prob: float = 0.0,
    prompt_lookup_num_tokens: int | None = None,
    max_matching_ngram_size: int = 2,
    tree_sizing: str | None = None,
    verify_costs=None,
    top_p: float = 1.0,
    top_k: int = 0,
    cache_implementation: str | None = None,
    past_key_values=None,
    compile_verify: bool = False,
    pad_token_id: int | None = None,
):
    """Generates with `target`, drafting blocks with this DFlash draft. Output equals the target's own decoding with
    this call's settings: identical tokens at `temperature=0` (in float32), the same distribution above it.

    Exactness by dtype: in float32, greedy output is token-identical to plain greedy decoding. In bfloat16 or float16
    a verify pass over several tokens rounds differently from several one-token passes, so greedy output may leave
    plain greedy decoding of the same target, only where the target's top two logits are within a few units in the
    last place of each other (a rounding tie; `common.exactness` measures it, tested on the real target), as in vLLM
    and SGLang. Sampling keeps the target's distribution in every dtype (logits are sampled in float32).

    Args:
        target: a transformers causal LM whose hidden states this draft was trained on.
        input_ids: `[1, prompt_len]` prompt ids (or `[b, prompt_len]`, left-padded), or a tokenizer's output
            holding them and their attention mask (`apply_chat_template(..., return_dict=True, return_tensors="pt")`).
        max_new_tokens: at most this many new tokens.
        attention_mask: with a batch, its `[b, prompt_len]` 0/1 mask; the prompts must be left-padded
            (`tokenizer.padding_side = "left"`). A batch (more than one row, or padding) decodes together, every row
            accepting its own prefix, and returns `[b, prompt_len + new]` ids padded after each row's end
            (`batch_dflash.py`; each row verifies its own tree).
        stop_token_ids: generation ends after the first of these tokens (it is kept); one id or a list. Omitted: the
            target's `generation_config.eos_token_id`, where `generate` stops too; None: no stop token (z-lab's
            meaning). That is all `spec_generate` reads from the generation config: its own arguments decide the
            decoding, and a config that sets other decoding options (`repetition_penalty`, `do_sample`, ...) gets a
            warning naming them.
        temperature: 0 for greedy decoding.
        cache_implementation: the target's cache, `"dynamic"` (default) or `"static"` (preallocated for the prompt,
            `max_new_tokens` and one verify; needs transformers 5 or newer, whose static layers can be cropped).
        pad_token_id: what pads a batch's rows after their end (default: the generation config's pad token, else
            the stop token, as `generate`).
        past_key_values: an empty cache object to use instead (any whose layers can be cropped).
        compile_verify: run the verify passes through `torch.compile(target.forward)` (compiled on the first call and
            kept for the target); needs a static cache, which it then uses by default (a power of two of at least 1024
            slots, so other lengths reuse the graph), the constant schedule and one tree size (no
            `prompt_lookup_num_tokens` or `tree_min_prob`, which change the verify's length by round).
        top_p, top_k: nucleus and top-k filtering of the target's distribution when sampling (1.0 and 0: off), as
            transformers' warpers apply them; output is sampled from exactly that filtered distribution.
        block_size: tokens per draft block, including the last committed token; defaults to `config.block_size`.
        return_stats: return a `SpecGenerateOutput` with acceptance lengths instead of the ids alone.
        generator: optional `torch.Generator` for sampling.
        streamer: optional transformers streamer; it gets the prompt, then each committed token once, in order.
        block_size_schedule: `"constant"`, or `"heuristic"` to adapt the block to acceptance (at most `block_size`),
            as transformers' `num_assistant_tokens_schedule` does.
        tree_budget: verify a draft tree of this many nodes (depth at most `block_size - 1`, built best-first from
            the one draft pass) instead of the argmax chain; 0 for the chain; defaults to `config.tree_budget`
            (absent, with the heuristic schedule, for a DFlash 2 draft or a hybrid target: the chain).
        tree_min_prob: leave out of the tree every node whose path has a draft probability below this, so a round
            whose draft is unsure verifies fewer tokens (none: a plain decode step plus any lookup branch). Pays where
            a verify's cost grows with its length (float32 here), not where it is flat (bfloat16 here); 0: off.
        prompt_lookup_num_tokens: also verify, as one more branch of the round's tree, up to this many tokens that
            followed an earlier occurrence of the last `max_matching_ngram_size` (down to 1) committed tokens in the
            prompt and output (transformers' prompt-lookup rule); 0: none; defaults to
            `config.prompt_lookup_num_tokens` (stepping aside where a tree does, and for `compile_verify`, whose graph
            wants one tree size). Exact like any tree: every kept token is the target's own choice given its prefix,
            whichever proposer put it there.
        tree_sizing: `"cost"` cuts each round's best-first tree (at most `tree_budget` nodes) to the width that
            maximises expected committed tokens per second on this machine: expected acceptance from the draft's path
            probabilities, calibrated online by the acceptance the call has seen, against the target's measured verify
            time t(n) (`cost_dflash.py`); `"fixed"` verifies `tree_budget` nodes; defaults to `config.tree_sizing`,
            else fixed. A batch cuts every row to one width, since its packed verify costs the widest row's.
        verify_costs: t(n) for cost sizing, a `tree_dflash.VerifyCosts` or a mapping of verified tokens to seconds;
            None: measured once per target, dtype, device and thread count at the first call and kept for the process
            (`python -m bench.step_costs` prints it).

    Returns `[b, prompt_len + new]` token ids, or a `SpecGenerateOutput`.
    """
    if isinstance(input_ids, Mapping) and attention_mask is None:
        attention_mask = input_ids.get("attention_mask")
    check_draft_fits_target(self, target)  # before the prompt: a draft for another target would blame its ids
    input_ids = prompt_tensor(target, input_ids)
    block_size = block_size or self.config.block_size
    check_generation_inputs(input_ids, max_new_tokens, block_size)
    check_context(target, input_ids, max_new_tokens)
    check_sampling(temperature, top_p, top_k)
    check_schedule(block_size_schedule)
    warn_generation_config_not_applied(target)
    schedule = block_size_schedule
    plan = tree_plan(
        self,
        target,
        input_ids.shape[1],
        max_new_tokens,
        block_size,
        schedule,
        tree_budget,
        tree_min_prob,
        prompt_lookup_num_tokens,
        max_matching_ngram_size,
        compile_verify,
        tree_sizing,
        verify_costs,
    )
    if input_ids.shape[0] > 1 or (attention_mask is not None and not bool(torch.as_tensor(attention_mask).all())):
        return self._batched_spec_generate(
            target,
            input_ids,
            attention_mask,
            max_new_tokens=max_new_tokens,
            stop_token_ids=stop_token_ids,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            block_size=block_size,
            return_stats=return_stats,
            generator=generator,
            pad_token_id=pad_token_id,
            plan=plan,
            streamer=streamer,
            block_size_schedule=None if schedule == "constant" else schedule,
            cache_implementation=cache_implementation,
            past_key_values=past_key_values,
            compile_verify=compile_verify,
        )
    tree_budget, lookup, tree_min_prob, final_length = plan.budget, plan.lookup, plan.min_prob, plan.final_length
    cache_implementation = check_compile_request(
        compile_verify, cache_implementation, past_key_values, block_size_schedule, lookup, tree_min_prob
    )
    slots = compiled_cache_slots(final_length) if compile_verify else final_length
    target_cache = target_cache_for(target, cache_implementation, past_key_values, final_length, slots)
    verify = verify_forward(target, compile_verify)
    ending, warpers = (
        OutputEnd(stop_ids(target, stop_token_ids), max_new_tokens),
        sampling_warpers(temperature, top_k, top_p),
    )
    embed, head = draft_embedding(self, target), DraftHead(self, target.get_output_embeddings())
    # a selector reads whole-vocabulary logits; otherwise the draft's own vocabulary is all a round looks at
    step_head, vocab = (head, None) if self.has_selector else (head.scores, head.vocab)
    cache_name = cache_kwarg(target)
    draft_cache, kv_slots = DynamicCache(), static_length(target_cache)  # a tree mask spans a static cache's slots
    layout = mask_layout(target)
    input_ids = input_ids.to(target.device)
    prompt_len = input_ids.shape[1]
    prompt = input_ids[0].tolist() if lookup else []
    if streamer is not None:
        streamer.put(input_ids[0].cpu())

    with LayerFeatures(target, self.config.target_layer_ids) as features:
        # prefill: the target reads the prompt and picks the first new token
        out = target(input_ids=input_ids, use_cache=True, logits_to_keep=1, **{cache_name: target_cache})
        last = pick_tokens(out.logits[:, -1:], warpers, generator)
        new_tokens, context, out = last[0].tolist(), features.pop(), None
        record_verify_states(target_cache, block_size)  # after the prefill, whose states no crop goes back to
        acceptance_lengths: list[int] = []
        start = prompt_len  # position of the last committed token, which is not yet in the target's cache
        streamed = stream_tokens(streamer, new_tokens, 0, ending.update(new_tokens))

        block, sizer, expected = block_size, plan.sizer(target, 1), []
        while not ending.done(new_tokens):
            drafting = not sizer or sizer.drafts()  # a cost-sized call skips drafts that do not pay
            if drafting:
                if sizer:
                    sizer.start_draft()
                logits, hidden = draft_step(self, embed, step_head, last, context, start, draft_cache, block)
            if tree_budget is None and not lookup:  # the chain: drafted and chosen tokens come to the host together
                proposal = chain_proposal(self, logits, hidden, last, warpers, generator, vocab)
                verify_ids = torch.cat([last, proposal], dim=1)
                positions, mask = torch.arange(start, start + block, device=input_ids.device)[None], None
            else:  # a tree's shape is decided on the host from the draft's top choices
                if not drafting:  # a plain decode step
                    tree = DraftTree.chain([])
                    expected.append(1.0)
                else:
                    tree = propose(logits, tree_budget, warpers, vocab, tree_min_prob)
                    branch = prompt_lookup(prompt + new_tokens, lookup, max_matching_ngram_size) if lookup else []
                    if sizer:
                        (tree,), estimate = sizer.cut([tree], [branch])
                        expected += estimate
                    elif branch:
                        tree = tree.with_branch(branch)
                drafted = torch.tensor([tree.tokens], dtype=torch.long, device=input_ids.device)  # may be empty
                verify_ids = torch.cat([last, drafted], dim=1)
                positions = tree_position_ids(tree, start, input_ids.device)
                mask = tree_attention_mask(tree, start, target.dtype, input_ids.device, kv_slots, layout)
            if isinstance(target_cache, RollbackCache):
                target_cache.save(verify_ids)
            out = verify(
                input_ids=verify_ids,
                position_ids=positions,
                attention_mask=mask,
                use_cache=True,
                **{cache_name: target_cache},
            )
            chosen = pick_tokens(out.logits, warpers, generator)
            tokens = torch.cat([verify_ids[0, 1:], chosen[0]]).tolist()  # the round's device-to-host transfer
            drafted, chosen_ids = tokens[: verify_ids.shape[1] - 1], tokens[verify_ids.shape[1] - 1 :]
            tree = DraftTree.chain(drafted) if tree_budget is None and not lookup else tree
            path = tree.accept(chosen_ids)
            if sizer and drafting:
                sizer.accepted([path])
            new_tokens += [tree.node_token(node) for node in path[1:]] + [chosen_ids[path[-1]]]
            acceptance_lengths.append(len(path))
            # keep the accepted path only; the other nodes' keys were computed from tokens that were not committed
            compact_cache(target_cache, start, path)
            fresh, last = features.pop(path), chosen[:, path[-1] : path[-1] + 1]
            context = fresh if drafting else torch.cat([context, fresh], dim=1)  # what the draft has not read yet
            start += len(path)
            if block_size_schedule == "heuristic":
                block = next_block_size(block, len(path) - 1, block_size)
            streamed = stream_tokens(streamer, new_tokens, streamed, ending.update(new_tokens))

    end = ending.update(new_tokens)
    if streamer is not None:
        streamer.end()
    output_ids = torch.cat([input_ids, torch.tensor([new_tokens[:end]], device=input_ids.device)], dim=1)
    if not return_stats:
        return output_ids
    return SpecGenerateOutput(output_ids, acceptance_lengths, prompt_len, end, expected)


# ---------------------------------------------------------------------------------------------------------------------
# `target.generate(input_ids, assistant_model=draft)`: a transformers candidate generator.


class DFlashCandidateGenerator(CandidateGenerator):
    """Drafts one block per step from the target's hidden states at `target_layer_ids`.

    Forward hooks on the target's decoder layers capture the features of every target pass; only the tokens the
    target committed are fed to the draft's context cache. Call `close()` to remove the hooks.

    Args:
        target: the model running `generate`.
        draft: a DFlash draft that fits `target`.
        generation_config: the call's generation config (for `max_length`).
        logits_processor: the call's processors, applied to draft logits when `proposal="sample"`.
        proposal: `"argmax"` proposes the draft's argmax and returns no logits, so sampling is verified by the one-hot
            rule; `"sample"` samples each position from the draft and returns its logits for `_speculative_sampling`.
        block_size: defaults to `draft.config.block_size`.
        rollback: the target's `RollbackCache` when it is hybrid: each round's candidates are saved there before the
            target verifies them.
    """

    def __init__(
        self,
        target,
        draft,
        generation_config,
        logits_processor=None,
        *,
        proposal="argmax",
        block_size=None,
        rollback=None,
    ):
        if proposal not in ("argmax", "sample"):
            raise ValueError(f"proposal must be 'argmax' or 'sample', got {proposal!r}")
        check_draft_fits_target(draft, target)
        self.target, self.draft, self.proposal = target, draft, proposal
        self.block_size = self.max_block_size = block_size or draft.config.block_size
        self.schedule = generation_config.num_assistant_tokens_schedule
        self.max_length = generation_config.max_length
        self.do_sample = bool(generation_config.do_sample)
        self.logits_processor = logits_processor
        self.cache, self.context_len, self.proposed = DynamicCache(), 0, False
        self.embed, self.head = draft_embedding(draft, target), DraftHead(draft, target.get_output_embeddings())
        self.features = LayerFeatures(target, draft.config.target_layer_ids)
        self.rollback = rollback

    @property
    def num_drafting_tokens(self) -> int:
        """The most tokens one verify pass takes (the last committed token and the drafted ones): transformers 5.25+
        has a hybrid target's cache record that many recurrent states, so that a crop can go back to any of them."""
        return self.max_block_size

    def close(self) -> None:
        self.features.close()

    @torch.no_grad()
    def get_candidates(self, input_ids: torch.LongTensor, **kwargs) -> tuple[torch.LongTensor, torch.Tensor | None]:
        # the last token is the target's bonus token: committed, but not yet run through the target
        committed = input_ids.shape[1] - 1
        max_new = min(self.block_size - 1, self.max_length - input_ids.shape[1] - 1)
        self.proposed = False
        if not self.features.outputs or max_new <= 0:  # the first call comes before the target's prefill
            return input_ids, None
        self.proposed = True
        new = committed - self.context_len  # the last target pass began at `context_len`; it kept `new` tokens
        context = self.features.pop(slice(0, new))
        logits, hidden = draft_step(
            self.draft, self.embed, self.head, input_ids[:, -1:], context, committed, self.cache, self.block_size
        )
        logits, hidden = logits[:, :max_new].float(), hidden[:, :max_new]
        self.context_len = committed
        if self.proposal == "argmax":
            candidates, scores = (
                torch.cat([input_ids, chain_proposal(self.draft, logits, hidden, input_ids[:, -1:], None)], dim=1),
                None,
            )
        else:
            candidates, scores = self._sample_candidates(input_ids, logits, hidden)
        if self.rollback is not None:  # the target verifies the last committed token and the drafted ones
            self.rollback.save(candidates[:, committed:])
        return candidates, scores

    def _sample_candidates(self, input_ids, logits, hidden) -> tuple[torch.LongTensor, torch.Tensor]:
        """Samples d_i ~ q_i one position at a time, so processors see the drafted prefix (and a DFlash 2 selector
        the token drawn before); returns the processed scores q_i came from, for `_speculative_sampling`."""
        candidates, scores = [input_ids], []

        def choose(position_scores):
            if self.logits_processor:
                position_scores = self.logits_processor(torch.cat(candidates, dim=1), position_scores)
            probs = torch.softmax(position_scores, dim=-1)
            token = torch.multinomial(probs, 1) if self.do_sample else probs.argmax(-1, keepdim=True)
            candidates.append(token)
            scores.append(position_scores)
            return token[:, 0]

        choose_block(self.draft, logits, hidden, input_ids[:, -1:], choose)
        return torch.cat(candidates, dim=1), torch.stack(scores, dim=1)

    def update_candidate_strategy(self, input_ids, scores, num_matches):
        if self.schedule == "heuristic" and self.proposed:
            self.block_size = next_block_size(self.block_size, int(num_matches), self.max_block_size)
        self.proposed = False  # the candidates are verified
