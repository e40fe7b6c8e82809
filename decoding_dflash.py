"""One row's layout for the round loop (`OneRow` through `tree_dflash.decode_rounds`), and the round pieces every
route shares (the target's layer features, the draft pass, token picking, where the output ends).

Each round drafts a block `[last token, MASK x (B-1)]` in one draft pass, verifies it in one target pass, keeps the
longest prefix the target agrees with plus the target's own next token, and crops both caches to that prefix.
Sampling (temperature > 0) uses the one-hot rule: the draft proposes its argmax, the target samples every block
position, and draft tokens are kept while they equal the target's samples. Every kept token is a target sample
given a prefix of target samples, so the output has exactly the target's distribution.
"""

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
from transformers.generation.streamers import BaseStreamer

try:
    from .cache_dflash import (
        RollbackCache,
        cache_kwarg,
        compact_cache,
        drop_last,
        record_verify_states,
        static_length,
        target_cache_for,
    )
    from .configuration_dflash import first_stop
    from .head_dflash import DraftHead, draft_embedding
    from .plan_dflash import TreePlan, check_compile_request, compiled_cache_slots, decoder_layers, stop_ids
    from .proposal_dflash import argmax_tokens, propose, tree_attention_mask, tree_position_ids
    from .tree_dflash import DraftTree, Round, decode_rounds, mask_layout
except ImportError:  # imported as a top-level module from the repo root or an installed project
    from cache_dflash import (
        RollbackCache,
        cache_kwarg,
        compact_cache,
        drop_last,
        record_verify_states,
        static_length,
        target_cache_for,
    )
    from configuration_dflash import first_stop
    from head_dflash import DraftHead, draft_embedding
    from plan_dflash import TreePlan, check_compile_request, compiled_cache_slots, decoder_layers, stop_ids
    from proposal_dflash import argmax_tokens, propose, tree_attention_mask, tree_position_ids
    from tree_dflash import DraftTree, Round, decode_rounds, mask_layout


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


@functools.cache
def compiled_forward() -> Callable:
    """`model.forward(**kwargs)` compiled once per process, as gpt-fast compiles its decode step: dynamo guards on the
    model it is given, so each target gets its own graph and nothing is stored on the target."""
    return torch.compile(lambda model, **kwargs: model.forward(**kwargs), dynamic=False)


def verify_forward(target, compile_verify: bool) -> Callable:
    """What runs the verify passes: the target, or its compiled forward (the prefill stays eager, since its length
    changes with every prompt)."""
    return functools.partial(compiled_forward(), target) if compile_verify else target


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


def drafted_trees(logits, vocab, plan: TreePlan, warpers) -> list[DraftTree]:
    """Each row's drafted proposal, before its lookup branch (`tree_dflash.round_trees` adds it and cuts the tree):
    its argmax chain, or its best-first tree. `vocab` maps the columns of `logits` to token ids (None: the whole
    vocabulary)."""
    if plan.budget is None:
        return [DraftTree.chain(row) for row in argmax_tokens(logits, vocab).tolist()]
    return [propose(row_logits[None], plan.budget, warpers, vocab, plan.min_prob) for row_logits in logits]


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


@dataclass
class OneRow:
    """One row's caches and state through `tree_dflash.decode_rounds`: its draft pass, its verify (the chain, or a
    tree with its ancestor mask), and its commit (the accepted path's keys and features kept, the rest dropped)."""

    draft_model: torch.nn.Module
    target: torch.nn.Module
    plan: TreePlan
    target_cache: object
    features: LayerFeatures
    verify_pass: Callable  # the target, or its compiled forward
    warpers: LogitsProcessorList
    generator: torch.Generator | None
    ending: OutputEnd
    block_size: int
    schedule: str
    prompt: list[int]  # what the lookup searches before the output
    tokens: list[int]  # the output so far
    last: torch.Tensor  # [1, 1] the last committed token, not yet in the target's cache
    context: torch.Tensor  # target features the draft has not read yet
    start: int  # the last token's position
    acceptance_lengths: list[int] = field(default_factory=list)
    expected: list[float] = field(default_factory=list)

    def __post_init__(self):
        head = DraftHead(self.draft_model, self.target.get_output_embeddings())
        # a selector reads whole-vocabulary logits; otherwise the draft's own vocabulary is all a round looks at
        self.step_head, self.vocab = (head, None) if self.draft_model.has_selector else (head.scores, head.vocab)
        self.embed, self.draft_cache = draft_embedding(self.draft_model, self.target), DynamicCache()
        self.cache_name, self.kv_slots = cache_kwarg(self.target), static_length(self.target_cache)
        self.layout, self.block = mask_layout(self.target), self.block_size

    def live(self) -> int:
        return 0 if self.ending.done(self.tokens) else 1

    def histories(self) -> list[list[int]]:
        return [self.prompt + self.tokens]

    def draft(self) -> list[DraftTree]:
        logits, hidden = draft_step(
            self.draft_model,
            self.embed,
            self.step_head,
            self.last,
            self.context,
            self.start,
            self.draft_cache,
            self.block,
        )
        if self.plan.is_chain:  # it stays on the device until the verify's one transfer
            self.proposal = chain_proposal(
                self.draft_model, logits, hidden, self.last, self.warpers, self.generator, self.vocab
            )
            return [None]
        return drafted_trees(logits, self.vocab, self.plan, self.warpers)

    def verify(self, trees: list[DraftTree | None]) -> tuple[list[DraftTree], list[list[int]]]:
        (tree,) = trees
        device = self.last.device
        drafted = self.proposal if tree is None else torch.tensor([tree.tokens], dtype=torch.long, device=device)
        ids = torch.cat([self.last, drafted], dim=1)
        if self.plan.is_chain:
            positions, mask = torch.arange(self.start, self.start + ids.shape[1], device=device)[None], None
        else:
            positions = tree_position_ids(tree, self.start, device)
            mask = tree_attention_mask(tree, self.start, self.target.dtype, device, self.kv_slots, self.layout)
        if isinstance(self.target_cache, RollbackCache):
            self.target_cache.save(ids)
        out = self.verify_pass(
            input_ids=ids,
            position_ids=positions,
            attention_mask=mask,
            use_cache=True,
            **{self.cache_name: self.target_cache},
        )
        self.chosen = pick_tokens(out.logits, self.warpers, self.generator)
        tokens = torch.cat([drafted[0], self.chosen[0]]).tolist()  # the round's device-to-host transfer
        n = drafted.shape[1]
        return [DraftTree.chain(tokens[:n]) if tree is None else tree], [tokens[n:]]

    def commit(self, step: Round) -> None:
        (path,), (tokens,) = step.paths, step.committed()
        self.tokens += tokens
        self.acceptance_lengths.append(len(path))
        self.expected += step.estimates
        # keep the accepted path only; the other nodes' keys were computed from tokens that were not committed
        compact_cache(self.target_cache, self.start, path)
        fresh, self.last = self.features.pop(path), self.chosen[:, path[-1] : path[-1] + 1]
        self.context = fresh if step.drafted else torch.cat([self.context, fresh], dim=1)  # what the draft has not read
        self.start += len(path)
        if self.schedule == "heuristic":
            self.block = next_block_size(self.block, len(path) - 1, self.block_size)


@torch.inference_mode()
def decode_row(
    draft,
    target,
    input_ids: torch.Tensor,
    plan: TreePlan,
    *,
    max_new_tokens: int,
    stop_token_ids,
    temperature: float,
    top_p: float,
    top_k: int,
    block_size: int,
    return_stats: bool,
    generator: torch.Generator | None,
    streamer: BaseStreamer | None,
    block_size_schedule: str,
    cache_implementation: str | None,
    past_key_values,
    compile_verify: bool,
):
    """`spec_generate` for one `[1, prompt_len]` prompt, its checks done and its `plan` resolved: the prefill, then
    `tree_dflash.decode_rounds` over its `OneRow`."""
    cache_implementation = check_compile_request(
        compile_verify, cache_implementation, past_key_values, block_size_schedule, plan.lookup, plan.min_prob
    )
    slots = compiled_cache_slots(plan.final_length) if compile_verify else plan.final_length
    target_cache = target_cache_for(target, cache_implementation, past_key_values, plan.final_length, slots)
    ending = OutputEnd(stop_ids(target, stop_token_ids), max_new_tokens)
    warpers = sampling_warpers(temperature, top_k, top_p)
    input_ids = input_ids.to(target.device)
    prompt_len = input_ids.shape[1]
    if streamer is not None:
        streamer.put(input_ids[0].cpu())

    with LayerFeatures(target, draft.config.target_layer_ids) as features:
        # prefill: the target reads the prompt and picks the first new token
        out = target(input_ids=input_ids, use_cache=True, logits_to_keep=1, **{cache_kwarg(target): target_cache})
        last = pick_tokens(out.logits[:, -1:], warpers, generator)
        context, out = features.pop(), None
        record_verify_states(target_cache, block_size)  # after the prefill, whose states no crop goes back to
        row = OneRow(
            draft,
            target,
            plan,
            target_cache,
            features,
            verify_pass=verify_forward(target, compile_verify),
            warpers=warpers,
            generator=generator,
            ending=ending,
            block_size=block_size,
            schedule=block_size_schedule,
            prompt=input_ids[0].tolist() if plan.lookup else [],
            tokens=last[0].tolist(),
            last=last,
            context=context,
            start=prompt_len,  # position of the last committed token, which is not yet in the target's cache
        )
        streamed = stream_tokens(streamer, row.tokens, 0, ending.update(row.tokens))
        for _ in decode_rounds(row, plan.lookup, plan.max_ngram, plan.sizer(target, 1)):
            streamed = stream_tokens(streamer, row.tokens, streamed, ending.update(row.tokens))

    end = ending.update(row.tokens)
    if streamer is not None:
        streamer.end()
    output_ids = torch.cat([input_ids, torch.tensor([row.tokens[:end]], device=input_ids.device)], dim=1)
    if not return_stats:
        return output_ids
    return SpecGenerateOutput(output_ids, row.acceptance_lengths, prompt_len, end, row.expected)
