"""A call's checks and its resolved plan: every refusal a call can meet comes before any compute, and what is left
is a `TreePlan` (tree size, lookup branch, sizing, final length) that the decoding loops read.
"""

import functools
import os
import sys
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

try:
    from .cache_dflash import check_target_supported, is_hybrid, static_length
    from .configuration_dflash import check_fits_target
    from .cost_dflash import verify_costs
    from .tree_dflash import TreeSizer, check_tree_supported, config_tree, resolve_tree_sizing
except ImportError:  # imported as a top-level module from the repo root or an installed project
    from cache_dflash import check_target_supported, is_hybrid, static_length
    from configuration_dflash import check_fits_target
    from cost_dflash import verify_costs
    from tree_dflash import TreeSizer, check_tree_supported, config_tree, resolve_tree_sizing


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


def is_own_file(path: str) -> bool:
    """Whether `path` is one of this model repo's files (flat beside this one; tests elsewhere keep their frames)."""
    return path.endswith("_dflash.py") and os.path.dirname(path) == os.path.dirname(__file__)


def warn_caller(message: str) -> None:
    """A UserWarning at the caller's line, past this repo's `*_dflash.py` files and torch's decorators (Python 3.12's
    `skip_file_prefixes`, by file name)."""
    level, frame = 2, sys._getframe(1)
    while frame.f_back is not None and (
        is_own_file(frame.f_code.co_filename) or f"{os.sep}torch{os.sep}" in frame.f_code.co_filename
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
        return TreeSizer(verify_costs(target, rows * (self.budget + 1 + self.lookup), self.costs, rows=rows))


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
