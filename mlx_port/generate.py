"""DFlash speculative decoding on MLX: `stream_generate`, `generate` and `python -m mlx_port generate`.

Each round drafts a block `[last token, MASK x (B-1)]` in one draft pass, verifies it in one target pass, keeps the
longest prefix the target agrees with plus the target's own next token, and rolls the target cache back to that
prefix. Sampling uses the one-hot rule: the draft proposes its argmax, the target samples every block position, and
draft tokens are kept while they equal the target's samples, so the output has exactly the target's distribution.

With `tree_budget` (or the draft config's), a round verifies a best-first tree of the draft's top choices instead
(`tree_dflash.py`, shared with torch): every node sees the cache and its ancestors at the position of its depth,
the walk follows the children holding the target's choices, and the cache keeps the accepted path only.

The loop is torch's, `tree_dflash.decode_rounds`, over this row's `MlxRow` (its draft pass, verify and commit).

    python -m mlx_port generate --model TARGET --draft-model draft-mlx --prompt "..." --max-tokens 256 --temp 0.0
"""

import argparse
import contextlib
import sys
import time
import warnings
import weakref
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generation_stream, wired_limit
from mlx_lm.models.cache import ArraysCache, ConcatenateKVCache, KVCache, QuantizedKVCache, make_prompt_cache
from mlx_lm.sample_utils import greedy_sampler, make_sampler
from mlx_lm.tokenizer_utils import TokenizerWrapper

from common.checks import check_model_path
from configuration_dflash import check_fits_target, check_sampling, first_stop
from tree_dflash import (
    DraftTree,
    Round,
    TreeSizer,
    VerifyCosts,
    best_first,
    config_tree,
    decode_rounds,
    resolve_tree_sizing,
)

from .model import Model

REPO_ROOT = Path(__file__).resolve().parents[1]  # the model repo: its draft is the default
Sampler = Callable[[mx.array], mx.array]
TRIMMABLE_CACHES = (KVCache, QuantizedKVCache, ConcatenateKVCache)
MEASURED: dict[int, VerifyCosts] = {}  # id(model) -> its t(n) on this process's device, as torch's `cost_dflash`
COST_CONTEXT = 64  # cached tokens each timed pass attends to


@dataclass
class GenerationResponse:
    """What `stream_generate` yields: one response per round (the first carries the prefill's token).

    Args:
        text: the next segment of decoded text (can be empty).
        token: the last token of this round; `tokens`: every token this round committed (a stop token included).
        accepted: drafted tokens the target kept this round (the acceptance length, tau, is `accepted + 1`).
        prompt_tokens, prompt_tps: prompt length and prefill speed.
        generation_tokens, generation_tps: tokens generated so far and their rate after the first one.
        peak_memory: peak memory so far in GB.
        finish_reason: "stop" (a stop token), "length" (`max_tokens`) or None.
    """

    text: str
    token: int
    tokens: list[int]
    accepted: int
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: float
    finish_reason: str | None = None


# ---------------------------------------------------------------------------------------------------------------------
# The target's parts and the checks, all before any compute.


def decoder_layers(model: nn.Module) -> list:
    """The inner `model.model.layers` list; on some models `model.layers` is a property returning a new list."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, list):
        raise ValueError(f"DFlash needs an mlx-lm model with `model.model.layers`; {type(model).__name__} has none")
    return layers


def target_head(model: nn.Module) -> Callable[[mx.array], mx.array]:
    """The target's output head (its `lm_head`, or the tied embedding) applied to hidden states."""
    owner = getattr(model, "language_model", model)
    head = getattr(owner, "lm_head", None)
    return head if head is not None else model.model.embed_tokens.as_linear


def draft_embedding(draft: Model, embed: nn.Module) -> Callable[[mx.array], mx.array]:
    """The target's (raw) embedding table, times `input_embedding_scale` when the draft's config sets it, as the
    torch `draft_embedding`."""
    scale = draft.args.dflash_field("input_embedding_scale")
    return embed if scale is None else (lambda ids: embed(ids) * scale)


def draft_head(draft: Model, head: Callable[[mx.array], mx.array]) -> Callable[[mx.array], mx.array]:
    """`head` as the draft proposes with it, as the torch `DraftHead`: times `output_multiplier`, soft-capped by
    `final_logit_softcapping`, and -inf outside `dflash_config.draft_vocab` when the draft was trained on that subset
    (FR-Spec); the target still verifies over its whole vocabulary."""
    multiplier, cap = draft.args.dflash_field("output_multiplier"), draft.args.dflash_field("final_logit_softcapping")
    vocab = draft.args.dflash_config.get("draft_vocab")
    penalty = None
    if vocab is not None:
        penalty = mx.full((draft.args.vocab_size,), -mx.inf)
        penalty[mx.array(vocab)] = 0.0

    def proposed(hidden: mx.array) -> mx.array:
        logits = head(hidden)
        if multiplier is not None:
            logits = logits * multiplier
        if cap:
            logits = mx.tanh(logits / cap) * cap
        return logits if penalty is None else logits + penalty

    return proposed


def check_draft_fits_target(draft: Model, model: nn.Module) -> None:
    """Raises a ValueError naming the first mismatch between the draft's config and the target."""
    embed = model.model.embed_tokens
    vocab_size, hidden_size = embed.weight.shape[0], embed(mx.array([0])).shape[-1]
    check_fits_target(draft.args, num_layers=len(decoder_layers(model)), hidden_size=hidden_size, vocab_size=vocab_size)


def check_generation_inputs(prompt: mx.array, block_size: int) -> None:
    if prompt.ndim != 1:
        raise ValueError(f"DFlash decodes one sequence at a time; got a prompt of shape {prompt.shape}")
    if prompt.size == 0:
        raise ValueError("the prompt is empty: DFlash needs at least one input token")
    if block_size < 2:
        raise ValueError(f"block_size must be at least 2 (the last token plus one drafted token), got {block_size}")


def check_target_cache(cache: list) -> bool:
    """True when the target keeps recurrent state (ArraysCache) that must be restored and re-run after a rejection."""
    unsupported = sorted({type(c).__name__ for c in cache if not isinstance(c, TRIMMABLE_CACHES + (ArraysCache,))})
    if unsupported:
        raise ValueError(
            f"DFlash cannot roll back the target's {', '.join(unsupported)} cache after a rejected draft; supported "
            "are KVCache, QuantizedKVCache and ConcatenateKVCache (trimmed) and ArraysCache (restored and re-run)"
        )
    return any(isinstance(c, ArraysCache) for c in cache)


# ---------------------------------------------------------------------------------------------------------------------
# Hooks and pure helpers.


class LayerCapture:
    """Stands in for a target layer in its list: calls it and records its output."""

    def __init__(self, layer: nn.Module, index: int, outputs: dict):
        self.layer, self.index, self.outputs = layer, index, outputs

    def __call__(self, *args, **kwargs):
        out = self.layer(*args, **kwargs)
        self.outputs[self.index] = out
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.layer, name)  # models read layer attributes such as qwen3_5's `is_linear`


@contextlib.contextmanager
def capture_layer_outputs(model: nn.Module, layer_ids: list[int]) -> Iterator[dict]:
    """Records the outputs of `layer_ids` while open; the target's layer list is restored however it closes."""
    layers, outputs = decoder_layers(model), {}
    originals = {i: layers[i] for i in layer_ids}
    try:
        for i, layer in originals.items():
            layers[i] = LayerCapture(layer, i, outputs)
        yield outputs
    finally:
        for i, layer in originals.items():
            layers[i] = layer


def context_features(outputs: dict, layer_ids: list[int]) -> mx.array:
    """Concatenates the captured outputs; layer `i`'s output is transformers' `hidden_states[i + 1]`."""
    return mx.concatenate([outputs[i] for i in layer_ids], axis=-1)


def snapshot_states(cache: list) -> list:
    """References to every ArraysCache's arrays; the models replace those arrays rather than write into them."""
    return [(list(c.cache), c.left_padding, c.lengths) if isinstance(c, ArraysCache) else None for c in cache]


def restore_states(cache: list, states: list) -> None:
    for c, state in zip(cache, states):
        if state is not None:
            c.cache, c.left_padding, c.lengths = list(state[0]), state[1], state[2]


def encode_prompt(tokenizer: TokenizerWrapper, prompt: str | list[int] | mx.array) -> mx.array:
    """As mlx_lm's `stream_generate`: a string is tokenized (adding BOS unless present), token ids are kept."""
    if isinstance(prompt, mx.array):
        return prompt
    if isinstance(prompt, str):
        bos = tokenizer.bos_token
        prompt = tokenizer.encode(prompt, add_special_tokens=bos is None or not prompt.startswith(bos))
    return mx.array(prompt, dtype=mx.uint32)


# ---------------------------------------------------------------------------------------------------------------------
# Draft trees: the nodes, their mask and positions, and the cache afterwards.


def slot_scaling(model: nn.Module) -> str | None:
    """The config key by which the target scales attention by cache offset (mlx-lm's llama4, ministral3, mistral4)."""
    args = vars(getattr(model, "args", None) or object())
    for fields in (args, args.get("rope_parameters") or {}, args.get("text_config") or {}):
        for key in ("attn_temperature_tuning", "llama_4_scaling_beta"):
            if isinstance(fields, dict) and fields.get(key):
                return key
    return None


def tree_problem(model: nn.Module) -> str | None:
    """Why the target cannot verify a tree, if it cannot: each layer's attention must place a node by its `rope`,
    and nothing may scale attention by the cache offset, which for a tree node is not its position."""
    if key := slot_scaling(model):
        return f"{type(model).__name__} scales attention by cache offset ({key}), and a tree node's is not its depth"
    for i, layer in enumerate(decoder_layers(model)):
        if not callable(getattr(getattr(layer, "self_attn", None), "rope", None)):
            return f"layer {i} of {type(model).__name__} has no self_attn.rope to place tree nodes at their depths"
    return None


def resolve_tree_settings(
    draft: Model, model: nn.Module, recurrent: bool, tree_budget: int | None, lookup: int | None
) -> tuple[int | None, int]:
    """The round's tree budget (None: the chain) and lookup branch length (0: none). None follows the draft's
    config by torch's rule (`config_tree`), stepping aside with a warning where the target cannot verify a tree;
    an explicit setting the target cannot take is refused."""
    settings = []
    for name, asked in (("tree_budget", tree_budget), ("prompt_lookup_num_tokens", lookup)):
        if asked is None:
            nodes = config_tree(
                draft.args.dflash_config.get(name), adaptive=False, selector=draft.has_selector, recurrent=recurrent
            )
            if nodes and (problem := tree_problem(model)):
                why = f"verifying the argmax chain instead of the draft config's {name}={nodes}: {problem}"
                warnings.warn(why, stacklevel=3)
                nodes = None
            settings.append(nodes)
            continue
        if not isinstance(asked, int) or isinstance(asked, bool) or asked < 0:
            raise ValueError(f"{name} must be a non-negative integer (0: none), got {asked!r}")
        reason = (
            "a DFlash 2 draft's selector walks one chain"
            if draft.has_selector
            else "the target's recurrent state (ArraysCache) follows one path"
            if recurrent
            else tree_problem(model)
        )
        if asked and reason:
            raise ValueError(f"{name}={asked} needs a tree verify, but {reason}; use the chain ({name}=0)")
        settings.append(asked or None)
    return settings[0], settings[1] or 0


def best_first_tree(logits: mx.array, budget: int) -> DraftTree:
    """`tree_dflash.best_first` over the draft's top `budget` choices at each block position (`[depth, vocab]`)."""
    log_probs = logits.astype(mx.float32)
    log_probs = log_probs - mx.logsumexp(log_probs, axis=-1, keepdims=True)
    width = min(budget, log_probs.shape[-1])
    top = mx.argpartition(-log_probs, kth=width - 1, axis=-1)[:, :width]
    order = mx.take_along_axis(top, mx.argsort(-mx.take_along_axis(log_probs, top, axis=-1), axis=-1), axis=-1)
    return best_first(mx.take_along_axis(log_probs, order, axis=-1).tolist(), order.tolist(), budget)


class NodePositions(nn.Module):
    """Stands in for an attention layer's RoPE during a tree verify: each node at its own position (the root's plus
    its depth) instead of the cache offset plus its index."""

    def __init__(self, rope: Callable, positions: mx.array):
        super().__init__()
        self.rope, self.positions = rope, positions

    def __call__(self, x: mx.array, offset: Any = None) -> mx.array:
        # each node as its own batch row: mx.fast.rope takes one offset per row
        return self.rope(x.transpose(2, 1, 0, 3), offset=self.positions).transpose(2, 1, 0, 3)


@contextlib.contextmanager
def tree_attention(model: nn.Module, cache: list, tree: DraftTree, start: int) -> Iterator[None]:
    """While open, a target call over `[root, tree nodes]` verifies the tree: every cache hands the layers the
    ancestor mask (over the `start` cached tokens and the tree) and every layer's RoPE places nodes by depth."""
    mask = mx.concatenate([mx.ones((len(tree.tokens) + 1, start), dtype=mx.bool_), mx.array(tree.ancestor_rows())], 1)
    positions = mx.array(tree.positions(start))
    attentions = [layer.self_attn for layer in decoder_layers(model)]
    ropes = [attention.rope for attention in attentions]
    try:
        for c in cache:
            c.make_mask = lambda *args, **kwargs: mask
        for attention, rope in zip(attentions, ropes):
            attention.rope = NodePositions(rope, positions)
        yield
    finally:
        for c in cache:
            c.__dict__.pop("make_mask", None)
        for attention, rope in zip(attentions, ropes):
            attention.rope = rope


def trim(layer_cache, n: int) -> None:
    """Drops the last `n` tokens: a `ConcatenateKVCache`'s own trim lowers its offset only, and its next update would
    concatenate onto the dropped keys, so its arrays are cut too."""
    layer_cache.trim(n)
    if isinstance(layer_cache, ConcatenateKVCache) and layer_cache.keys is not None:
        layer_cache.keys = layer_cache.keys[..., : layer_cache.offset, :]
        layer_cache.values = layer_cache.values[..., : layer_cache.offset, :]


def keep_path(cache: list, start: int, path: list[int], size: int) -> None:
    """Moves the accepted path's keys and values (node indices from the root) to the front of the tree's `size`
    slots and drops the rest, so the cache holds the committed sequence only."""
    if path != list(range(len(path))):
        index = mx.array([start + node for node in path])
        for c in cache:
            for arrays in (c.keys, c.values):
                for a in arrays if isinstance(arrays, tuple) else (arrays,):  # a quantized cache holds three
                    a[..., start : start + len(path), :] = a[..., index, :]
    for c in cache:
        trim(c, size - len(path))


def target_costs(model: nn.Module, most_tokens: int, costs=None) -> VerifyCosts:
    """The call's t(n): `costs` when given (a `VerifyCosts` or a mapping of tokens to seconds), else the table kept
    for this target, measured now up to `most_tokens` if it does not reach that far."""
    if costs is not None:
        return VerifyCosts.given(costs)
    kept = MEASURED.get(id(model))
    if kept is None or kept.tokens[-1] < most_tokens:
        if kept is None:
            weakref.finalize(model, MEASURED.pop, id(model), None)
        kept = MEASURED[id(model)] = measure_verify_costs(model, most_tokens)
    return kept


def measure_verify_costs(model: nn.Module, most_tokens: int, repeats: int = 2) -> VerifyCosts:
    """`VerifyCosts.timed` over passes of each of `VerifyCosts.sizes_to_time` tokens after `COST_CONTEXT` cached
    ones, each trimmed back after timing."""
    sizes = VerifyCosts.sizes_to_time(most_tokens)
    ids = mx.random.randint(0, model.model.embed_tokens.weight.shape[0], (1, COST_CONTEXT + sizes[-1]))
    cache = make_prompt_cache(model)
    mx.eval(model(ids[:, :COST_CONTEXT], cache=cache), [c.state for c in cache])

    def timed(n: int) -> float:
        tic = time.perf_counter()
        mx.eval(model(ids[:, COST_CONTEXT : COST_CONTEXT + n], cache=cache))
        seconds = time.perf_counter() - tic
        for c in cache:
            trim(c, n)
        return seconds

    return VerifyCosts.timed(sizes, timed, repeats)


# ---------------------------------------------------------------------------------------------------------------------
# The loop.


def dflash_generate_step(
    prompt: mx.array,
    model: nn.Module,
    draft: Model,
    *,
    block_size: int | None = None,
    sampler: Sampler | None = None,
    sliding_window_size: int | None = None,
    prefill_step_size: int = 2048,
    tree_budget: int | None = None,
    prompt_lookup_num_tokens: int | None = None,
    max_matching_ngram_size: int = 2,
    tree_sizing: str | None = None,
    verify_costs: Any = None,
) -> Generator[tuple[list[int], int], None, None]:
    """Yields `(tokens, accepted)` per round without end: first the prefill's token, then each verified block.

    Args:
        prompt: `[prompt_len]` token ids.
        model: an mlx-lm target whose hidden states `draft` was trained on.
        draft: a DFlash draft from `load_draft`.
        block_size: tokens per block, including the last committed token; defaults to the draft's `block_size`.
        sampler: maps `[n, vocab]` log-probabilities to `[n]` tokens; greedy by default.
        sliding_window_size: bounds the draft's context cache; defaults to the value given to `load_draft`.
        prefill_step_size: prompt tokens per prefill pass.
        tree_budget: verify a best-first tree of this many drafted nodes (depth at most `block_size - 1`) instead of
            the argmax chain; 0: the chain; None: the draft config's, as torch (the chain for a DFlash 2 draft or a
            recurrent target).
        prompt_lookup_num_tokens, max_matching_ngram_size: also verify, as one more branch of the tree, up to this
            many tokens that followed an earlier occurrence of the last n committed tokens (transformers'
            prompt-lookup rule); None: the draft config's.
        tree_sizing: `"cost"` cuts each round's tree to the width that maximises expected committed tokens per second
            on this machine, by torch's rule (`tree_dflash.TreeSizer`); `"fixed"` verifies `tree_budget` nodes; None:
            the draft config's, else fixed.
        verify_costs: t(n) for cost sizing (a `tree_dflash.VerifyCosts` or a mapping of tokens to seconds); None:
            measured once per target at the first call and kept for the process.
    """
    block_size = block_size or draft.args.block_size
    check_generation_inputs(prompt, block_size)
    check_draft_fits_target(draft, model)
    cache = make_prompt_cache(model)
    is_hybrid = check_target_cache(cache)
    budget, lookup = resolve_tree_settings(draft, model, is_hybrid, tree_budget, prompt_lookup_num_tokens)
    sizing = resolve_tree_sizing(tree_sizing, draft.args.dflash_config.get("tree_sizing"), budget is not None)
    sizer = TreeSizer(target_costs(model, budget + 1 + lookup, verify_costs)) if sizing == "cost" else None
    row = MlxRow(
        model,
        draft,
        cache,
        sampler or greedy_sampler,
        block_size,
        budget=budget,
        chain=budget is None and not lookup,
        recurrent=is_hybrid,
        sliding_window_size=sliding_window_size,
    )
    with mx.stream(generation_stream), capture_layer_outputs(model, draft.target_layer_ids) as row.outputs:
        yield row.prefill(prompt, prefill_step_size), 0
        for step in decode_rounds(row, lookup, max_matching_ngram_size, sizer):
            (tokens,) = step.committed()
            yield tokens, len(tokens) - 1


class MlxRow:
    """The row's caches and state through `tree_dflash.decode_rounds`, as torch's `OneRow`: its draft pass, its
    verify (the chain, or a tree with its ancestor mask and RoPE by depth), and its commit (the cache cut back to
    the accepted path, or for a recurrent target its state restored and the path re-run)."""

    def __init__(self, model: nn.Module, draft: Model, cache: list, sampler: Sampler, block_size: int, **plan):
        """`plan`: the round's `budget` (None: no drafted tree), whether it verifies the bare `chain` (no tree, no
        lookup), whether the target is `recurrent`, and the draft cache's `sliding_window_size`."""
        self.model, self.draft_model, self.cache, self.sampler = model, draft, cache, sampler
        self.budget, self.chain, self.recurrent = plan["budget"], plan["chain"], plan["recurrent"]
        self.draft_cache = draft.make_cache(plan["sliding_window_size"])
        self.block_size, self.layer_ids = block_size, draft.target_layer_ids
        self.head, self.embed = draft_head(draft, target_head(model)), draft_embedding(draft, model.model.embed_tokens)
        self.masks = [draft.mask_token_id] * (block_size - 1)
        self.outputs: dict = {}  # the layers' outputs the draft reads, while `capture_layer_outputs` holds them

    def sample(self, logits: mx.array) -> mx.array:
        logits = logits.astype(mx.float32)  # as transformers' generate: a bf16 model's logits sampled in float32
        return self.sampler(logits - mx.logsumexp(logits, axis=-1, keepdims=True))

    def prefill(self, prompt: mx.array, step_size: int) -> list[int]:
        """Reads the prompt; returns the first new token."""
        features = []
        for start in range(0, prompt.size - 1, step_size):  # as mlx-lm: these chunks' logits are never computed
            self.model(prompt[None, start : min(start + step_size, prompt.size - 1)], cache=self.cache)
            features.append(context_features(self.outputs, self.layer_ids))
            mx.eval(features[-1], [c.state for c in self.cache])
        logits = self.model(prompt[None, -1:], cache=self.cache)  # the last prompt token alone: one position of logits
        features.append(context_features(self.outputs, self.layer_ids))
        self.last, self.context = self.sample(logits[0, -1:]).item(), mx.concatenate(features, axis=1)
        self.history = prompt.tolist() + [self.last]  # what the lookup branch searches
        return [self.last]

    def live(self) -> int:
        return 1  # the caller stops the generator

    def histories(self) -> list[list[int]]:
        return [self.history]

    def draft(self) -> list[DraftTree | None]:
        block = self.embed(mx.array([[self.last] + self.masks]))
        hidden = self.draft_model(block, self.context, cache=self.draft_cache)[:, 1:]
        if self.chain:  # it stays lazy until the verify's one evaluation
            self.proposal = mx.argmax(self.head(hidden), axis=-1)[0]
            if self.draft_model.has_selector:  # DFlash 2: a walk over the head's top-k, with the call's sampler
                walk = self.draft_model.candidate_selector.walk
                self.proposal = walk(self.head(hidden), hidden, mx.array([self.last]), self.sample)[0]
            return [None]
        if self.budget:
            return [best_first_tree(self.head(hidden)[0], self.budget)]
        return [DraftTree.chain(mx.argmax(self.head(hidden), axis=-1)[0].tolist())]

    def verify(self, trees: list[DraftTree | None]) -> tuple[list[DraftTree], list[list[int]]]:
        (tree,) = trees
        if tree is None:  # the chain: the target scores `[last, d_1 .. d_{B-1}]`; `last` is not yet in its cache
            drafted = self.proposal
            self.ids = mx.concatenate([mx.array([self.last], dtype=drafted.dtype), drafted])[None]
            self.states = snapshot_states(self.cache) if self.recurrent else None
            chosen = self.sample(self.model(self.ids, cache=self.cache)[0]).astype(drafted.dtype)
            tokens = mx.concatenate([drafted, chosen]).tolist()  # the round's one host round trip
            return [DraftTree.chain(tokens[: drafted.size])], [tokens[drafted.size :]]
        self.start = self.cache[0].offset
        with tree_attention(self.model, self.cache, tree, self.start):
            return trees, [self.sample(self.model(mx.array([[self.last] + tree.tokens]), cache=self.cache)[0]).tolist()]

    def commit(self, step: Round) -> None:
        (tree,), (path,), (tokens,) = step.trees, step.paths, step.committed()
        features = context_features(self.outputs, self.layer_ids)
        if self.chain:
            fresh = features[:, : len(path)]
            self.rewind(len(tree.tokens) + 1 - len(path), self.ids[0, : len(path)])
        else:
            fresh = features[:, mx.array(path)]
            keep_path(self.cache, self.start, path, len(tree.tokens) + 1)
        # the features the draft has not read yet
        self.context = fresh if step.drafted else mx.concatenate([self.context, fresh], axis=1)
        self.last = tokens[-1]
        self.history.extend(tokens)

    def rewind(self, num_rejected: int, kept: mx.array) -> None:
        if num_rejected == 0:
            return
        if self.states is None:
            for c in self.cache:
                trim(c, num_rejected)  # drop the rejected tail: its keys came from wrong tokens
            return
        # recurrent state cannot be cropped: restore the pre-verify state and re-run the kept prefix
        restore_states(self.cache, self.states)
        for c in self.cache:
            if not isinstance(c, ArraysCache):
                trim(c, self.block_size)
        self.model(kept[None], cache=self.cache)


def stream_generate(
    model: nn.Module,
    draft: Model,
    tokenizer: Any,
    prompt: str | list[int] | mx.array,
    *,
    block_size: int | None = None,
    max_tokens: int = 256,
    temperature: float = 0.0,
    sampler: Sampler | None = None,
    sliding_window_size: int | None = None,
    prefill_step_size: int = 2048,
    tree_budget: int | None = None,
    prompt_lookup_num_tokens: int | None = None,
    max_matching_ngram_size: int = 2,
    tree_sizing: str | None = None,
    verify_costs: Any = None,
) -> Generator[GenerationResponse, None, None]:
    """Generates with `model`, drafting blocks with `draft`; like mlx_lm's `stream_generate`, one response per round.

    Output equals the target's own decoding: identical tokens at `temperature=0`, the same distribution above it.
    `sampler` (mlx-lm's `make_sampler`) overrides `temperature`. Generation ends at the first of the tokenizer's
    `eos_token_ids`, even inside a block, or after exactly `max_tokens` tokens. `tree_budget` and
    `prompt_lookup_num_tokens` (None: the draft config's, as in torch; 0: off) verify a draft tree and a lookup
    branch instead of the chain, and `tree_sizing="cost"` cuts the tree to what its verify costs here
    (`dflash_generate_step`).
    """
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    prompt = encode_prompt(tokenizer, prompt)
    check_generation_inputs(prompt, block_size or draft.args.block_size)
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    steps = dflash_generate_step(
        prompt,
        model,
        draft,
        block_size=block_size,
        sampler=sampler or make_sampler(temperature),
        sliding_window_size=sliding_window_size,
        prefill_step_size=prefill_step_size,
        tree_budget=tree_budget,
        prompt_lookup_num_tokens=prompt_lookup_num_tokens,
        max_matching_ngram_size=max_matching_ngram_size,
        tree_sizing=tree_sizing,
        verify_costs=verify_costs,
    )
    detokenizer, stops, num_tokens = tokenizer.detokenizer, tokenizer.eos_token_ids, 0
    with wired_limit(model, [generation_stream]):
        tic = time.perf_counter()
        try:
            for tokens, accepted in steps:
                if num_tokens == 0:
                    prompt_tps = prompt.size / (time.perf_counter() - tic)
                    tic = time.perf_counter()
                tokens = tokens[: max_tokens - num_tokens]
                stop = first_stop(tokens, stops)
                tokens, num_tokens = tokens[:stop], num_tokens + len(tokens[:stop])
                for t in tokens if stop is None else tokens[:-1]:
                    detokenizer.add_token(t)
                finish = "stop" if stop is not None else "length" if num_tokens == max_tokens else None
                if finish is not None:
                    detokenizer.finalize()
                yield GenerationResponse(
                    text=detokenizer.last_segment,
                    token=tokens[-1],
                    tokens=tokens,
                    accepted=accepted,
                    prompt_tokens=prompt.size,
                    prompt_tps=prompt_tps,
                    generation_tokens=num_tokens,
                    generation_tps=(num_tokens - 1) / max(time.perf_counter() - tic, 1e-9),
                    peak_memory=mx.get_peak_memory() / 1e9,
                    finish_reason=finish,
                )
                if finish is not None:
                    return
        finally:
            steps.close()  # removes the layer hooks now, not when the generator is collected


def generate(model: nn.Module, draft: Model, tokenizer: Any, prompt: str | list[int] | mx.array, **kwargs) -> str:
    """The whole response text; `kwargs` go to `stream_generate`."""
    return "".join(r.text for r in stream_generate(model, draft, tokenizer, prompt, **kwargs))


# ---------------------------------------------------------------------------------------------------------------------
# Command line.


QUANTIZED_BLOCK_SIZE = 4  # the MLX DFlash ports' measured advice for quantized models: blocks of about 4-5


def is_quantized(model: nn.Module) -> bool:
    return any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in model.named_modules())


def default_block_size(model: nn.Module, draft: Model) -> int:
    """The draft's block size, capped at `QUANTIZED_BLOCK_SIZE` when the target or the draft is quantized."""
    if is_quantized(model) or is_quantized(draft):
        return min(draft.args.block_size, QUANTIZED_BLOCK_SIZE)
    return draft.args.block_size


def configure_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Generate with an mlx-lm target and a DFlash draft.")
    parser.add_argument(
        "--model",
        help="Target: local mlx-lm folder or Hugging Face Hub id (default: the embedded SmolLM2-135M-Instruct, "
        "default_target_path()).",
    )
    parser.add_argument(
        "--draft-model",
        default=str(REPO_ROOT),
        help="DFlash draft folder (converted or raw) or Hub id (default: this repo's draft).",
    )
    parser.add_argument("--prompt", default="hello", help="Prompt text.")
    parser.add_argument("--max-tokens", type=int, default=256, help="Maximum number of tokens to generate.")
    parser.add_argument("--temp", type=float, default=0.0, help="Sampling temperature (0 is greedy).")
    parser.add_argument("--top-p", type=float, default=1.0, help="Sampling top-p (1.0: off).")
    parser.add_argument("--top-k", type=int, default=0, help="Sampling top-k (0: off).")
    parser.add_argument("--min-p", type=float, default=0.0, help="Sampling min-p (0.0: off).")
    parser.add_argument(
        "--block-size",
        type=int,
        default=None,
        help=f"Tokens per draft block (default: the draft's; with a quantized target or draft at most "
        f"{QUANTIZED_BLOCK_SIZE}, the MLX DFlash ports' advice from their measurements, which put the best block for "
        "quantized models at about 4-5).",
    )
    parser.add_argument(
        "--tree-budget",
        type=int,
        default=None,
        help="Drafted nodes of a best-first tree verified each round (0: the argmax chain; default: the draft's).",
    )
    parser.add_argument(
        "--prompt-lookup-num-tokens",
        type=int,
        default=None,
        help="Tokens of a prompt-lookup branch verified each round (0: none; default: the draft's config).",
    )
    parser.add_argument(
        "--tree-sizing",
        choices=("cost", "fixed"),
        default=None,
        help="cost: cut each round's tree to what its verify costs on this machine; fixed: verify --tree-budget nodes "
        "(default: the draft's config, else fixed).",
    )
    parser.add_argument("--sliding-window-size", type=int, default=None, help="Bound on the draft's context cache.")
    parser.add_argument("--seed", type=int, default=None, help="Random seed for sampling.")
    parser.add_argument("--ignore-chat-template", action="store_true", help="Use the prompt as it is.")
    parser.add_argument("--compare", action="store_true", help="Also run mlx-lm's plain generation and compare speed.")
    return parser


def check_cli_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuses bad settings before any model loads, and fills in the default target's path."""
    try:
        check_sampling(args.temp, args.top_p, args.top_k)
    except ValueError as error:
        parser.error(f"{error} (--temp, --top-p, --top-k)")
    if not 0 <= args.min_p <= 1:
        parser.error(f"--min-p must be in [0, 1], got {args.min_p}")
    if args.max_tokens < 1:
        parser.error(f"--max-tokens must be at least 1, got {args.max_tokens}")
    if args.model is None:
        from default_target import default_target_path

        args.model = str(default_target_path())
        print(f"[INFO] target: {args.model}", file=sys.stderr)
    check_model_path(parser, "--model", args.model, draft=False)
    check_model_path(parser, "--draft-model", args.draft_model, draft=True)


def main() -> None:
    from mlx_lm import stream_generate as plain_stream_generate

    from .utils import load, load_draft

    parser = configure_parser()
    args = parser.parse_args()
    check_cli_args(parser, args)
    if args.seed is not None:
        mx.random.seed(args.seed)
    model, tokenizer = load(args.model)
    draft = load_draft(args.draft_model, sliding_window_size=args.sliding_window_size)
    prompt = args.prompt
    if tokenizer.has_chat_template and not args.ignore_chat_template:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    block_size = args.block_size or default_block_size(model, draft)
    sampler = make_sampler(args.temp, top_p=args.top_p, min_p=args.min_p, top_k=args.top_k)
    kwargs = dict(
        block_size=block_size,
        max_tokens=args.max_tokens,
        sampler=sampler,
        tree_budget=args.tree_budget,
        prompt_lookup_num_tokens=args.prompt_lookup_num_tokens,
        tree_sizing=args.tree_sizing,
    )
    responses = []
    for r in stream_generate(model, draft, tokenizer, prompt, **kwargs):
        print(r.text, end="", flush=True)
        responses.append(r)
    tau = sum(q.accepted + 1 for q in responses[1:]) / max(len(responses) - 1, 1)  # the first is the prefill's token
    print(
        f"\nDFlash: {r.generation_tokens} tokens, {r.generation_tps:.3f} tokens-per-sec, prompt {r.prompt_tps:.3f} "
        f"tokens-per-sec, mean acceptance length {tau:.2f}, peak memory {r.peak_memory:.3f} GB"
    )
    if args.compare:
        plain = list(plain_stream_generate(model, tokenizer, prompt, max_tokens=args.max_tokens, sampler=sampler))
        p = plain[-1]
        identical = [t for response in responses for t in response.tokens] == [q.token for q in plain]
        same = "identical" if identical else "different (expected when sampling)" if args.temp else "DIFFERENT"
        print(
            f"mlx-lm: {p.generation_tokens} tokens, {p.generation_tps:.3f} tokens-per-sec; "
            f"DFlash speed-up {r.generation_tps / p.generation_tps:.2f}x; output {same}"
        )


if __name__ == "__main__":
    main()
