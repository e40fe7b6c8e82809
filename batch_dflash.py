"""Batched DFlash: left-padded prompts decoded together, every row accepting its own prefix in every round
(`RaggedBatch` through `tree_dflash.decode_rounds`, the loop one row and MLX run too).

The ragged cache. The target's cache stays one rectangular tensor per layer, and each row keeps its own position
ids. Every round appends each active row's block; the keys a row rejected stay behind as holes that the row's
attention mask hides from then on, so no row is rolled back to another's acceptance and nothing is copied. Keys
that every row rejected are cropped at once. The draft's context cache follows the same rule, and a row that ends
(a stop token, `max_new_tokens`) leaves both caches, so it costs nothing afterwards.
"""

from dataclasses import dataclass

import torch
from transformers import (
    DynamicCache,
    LogitsProcessorList,
    StoppingCriteriaList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

try:
    from .cache_dflash import cache_kwarg, drop_last, is_hybrid, select_cache_rows
    from .decoding_dflash import (
        LayerFeatures,
        OutputEnd,
        SpecGenerateOutput,
        drafted_trees,
        pick_tokens,
        sampling_warpers,
    )
    from .head_dflash import DraftHead, draft_embedding
    from .plan_dflash import EOS_FROM_GENERATION_CONFIG, TreePlan, stop_ids
    from .proposal_dflash import layer_masks
    from .tree_dflash import DraftTree, Round, check_tree_supported, decode_rounds, mask_layout
except ImportError:  # imported as a top-level module from the repo root or an installed project
    from cache_dflash import cache_kwarg, drop_last, is_hybrid, select_cache_rows
    from decoding_dflash import (
        LayerFeatures,
        OutputEnd,
        SpecGenerateOutput,
        drafted_trees,
        pick_tokens,
        sampling_warpers,
    )
    from head_dflash import DraftHead, draft_embedding
    from plan_dflash import EOS_FROM_GENERATION_CONFIG, TreePlan, stop_ids
    from proposal_dflash import layer_masks
    from tree_dflash import DraftTree, Round, check_tree_supported, decode_rounds, mask_layout


def left_padding_mask(input_ids: torch.Tensor, attention_mask) -> torch.Tensor:
    """The `[b, prompt_len]` bool mask of real tokens, refusing anything but left padding with a token in every row."""
    if attention_mask is None:
        return torch.ones_like(input_ids, dtype=torch.bool)
    mask = torch.as_tensor(attention_mask, device=input_ids.device)
    if mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask has shape {tuple(mask.shape)}, input_ids {tuple(input_ids.shape)}")
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("attention_mask must hold 0 (padding) and 1 (token)")
    mask = mask.bool()
    if not bool(mask[:, -1].all()) or bool((mask[:, 1:] < mask[:, :-1]).any()):
        raise ValueError(
            "batched DFlash needs left padding (every row's tokens at the end, as generate wants for decoder-only "
            "models): set tokenizer.padding_side = 'left'"
        )
    return mask


def refuse_batch_options(draft, target, final_length: int, **options) -> None:
    """Names the first option a batch cannot take, with the reason, before any compute."""
    reasons = {
        "streamer": "a streamer takes one sequence, as transformers refuses it with batches",
        "block_size_schedule": "the adaptive schedule sizes one row's block",
        "cache_implementation": "a batch's ragged cache is dynamic",
        "past_key_values": "a batch builds its own ragged cache",
        "compile_verify": "the compiled verify runs one row on a static cache",
    }
    for name, reason in reasons.items():
        if options.get(name):
            raise ValueError(f"{name}={options[name]!r} is not supported with a batch of prompts: {reason}")
    if draft.has_selector:
        raise ValueError("a DFlash 2 draft's selector walks one row; decode its prompts one at a time")
    if any(layer.self_attn.sliding_window for layer in draft.layers):
        raise ValueError(
            "the draft's sliding-window layers would count a row's rejected slots toward their window; "
            "decode the prompts one at a time"
        )
    if is_hybrid(target):
        raise ValueError(f"the recurrent layers of {type(target).__name__} cannot skip a row's rejected tokens")
    check_tree_supported(target, 1, final_length, "batch", "decode the prompts one at a time")


@dataclass
class Rows:
    """The active rows: batch row ids, then per row its next position, last token, and what the draft reads next."""

    ids: torch.Tensor  # [b] rows of the call's batch
    position: torch.Tensor  # [b] position of the last committed token, which is not yet in the target's cache
    last: torch.Tensor  # [b, 1]
    target_keys: torch.Tensor  # [b, cached] bool: which target cache entries the row sees
    draft_keys: torch.Tensor  # [b, cached] bool: the same for the draft's context cache
    context: torch.Tensor  # [b, n, features] target features the draft has not read yet
    context_keys: torch.Tensor  # [b, n] bool
    context_positions: torch.Tensor  # [b, n]

    def select(self, keep: torch.Tensor) -> "Rows":
        return Rows(*(getattr(self, f)[keep] for f in self.__dataclass_fields__))


def draft_block(draft, embed, head, rows: Rows, cache: DynamicCache, block_size: int) -> torch.Tensor:
    """Each row's `[b, block_size - 1, vocab']` draft logits over the draft's vocabulary (`head.vocab`), reading the
    rows' new context."""
    b = rows.ids.shape[0]
    block = torch.full((b, block_size), draft.config.mask_token_id, dtype=torch.long, device=rows.last.device)
    block[:, :1] = rows.last
    offsets = torch.arange(block_size, device=block.device)
    keys = torch.cat([rows.draft_keys, rows.context_keys, torch.ones_like(block, dtype=torch.bool)], dim=1)
    hidden = draft(
        noise_embeds=embed(block),
        context_hidden_states=rows.context,
        position_ids=torch.cat([rows.context_positions, rows.position[:, None] + offsets], dim=1),
        attention_mask=keys.long(),
        past_key_values=cache,
    ).last_hidden_state[:, 1:]
    drop_last(cache, block_size)  # the cache keeps committed context only
    rows.draft_keys = torch.cat([rows.draft_keys, rows.context_keys], dim=1)
    rows.context, rows.context_keys = rows.context[:, :0], rows.context_keys[:, :0]
    rows.context_positions = rows.context_positions[:, :0]
    return head.scores(hidden)


def verify_trees(target, cache, rows: Rows, trees: list[DraftTree]) -> torch.Tensor:
    """The target's `[b, n, vocab]` logits after each row's `[last, tree nodes]`, packed to the largest tree: every
    node at its row's position plus its depth, seeing its row's cache entries and its ancestors; a padding slot sees
    only itself, and nothing sees it."""
    n, device = max(len(tree.tokens) for tree in trees) + 1, rows.last.device
    last = rows.last[:, 0].tolist()
    ids, depths, visible = [], [], torch.zeros(len(trees), n, n, dtype=torch.bool)
    for row, tree in enumerate(trees):
        pad = n - len(tree.tokens) - 1
        ids.append([last[row]] + tree.tokens + [last[row]] * pad)
        depths.append([0] + tree.depths + [0] * pad)
        size = len(tree.tokens) + 1
        visible[row, :size, :size] = torch.tensor(tree.ancestor_rows(), dtype=torch.bool)
        visible[row, range(size, n), range(size, n)] = True
    ids = torch.tensor(ids, device=device)
    visible = torch.cat([rows.target_keys[:, None].expand(-1, n, -1), visible.to(device)], dim=2)
    positions = rows.position[:, None] + torch.tensor(depths, device=device)
    cached = rows.target_keys.cumsum(-1) - 1  # a row's visible slots hold its committed tokens in order
    out = target(
        input_ids=ids,
        position_ids=positions,
        attention_mask=layer_masks(
            visible, positions, torch.cat([cached, positions], 1), target.dtype, mask_layout(target)
        ),
        use_cache=True,
        **{cache_kwarg(target): cache},
    )
    return out.logits


# warpers that never read the input ids: one call covers every row and position
PREFIX_FREE = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)


class RowPicker:
    """Picks each row's tokens from the target's logits through that row's logits processors. A processor that reads
    input ids gets, at each position, the row's own prefix (its padded prompt, its output so far, the drafted tokens
    before the position): the input ids plain batched `generate` would give it at that step."""

    def __init__(self, processors: list[LogitsProcessorList], prompts: torch.Tensor, sample: bool, generator):
        self.processors, self.prompts, self.sample, self.generator = processors, prompts, sample, generator
        self.per_row = any(not isinstance(p, PREFIX_FREE) for row in processors for p in row)

    def __call__(self, logits: torch.Tensor, rows: list[int], outputs: list[list[int]], trees: list[DraftTree]):
        """`[b, n]` tokens from `[b, n, vocab]` logits: at each row's node, the choice that follows the row's output
        and the node's path (`trees`; none at the prefill)."""
        if not self.per_row:  # every row has the same warpers (or none)
            return pick_tokens(logits, self.processors[0] if self.sample else LogitsProcessorList(), self.generator)
        trees = trees or [DraftTree.chain([])] * len(rows)
        scores = torch.stack([self.row_scores(lg, row, outputs[row], t) for lg, row, t in zip(logits, rows, trees)])
        if not self.sample:
            return scores.max(dim=-1).indices
        probs = torch.softmax(scores.flatten(0, 1), dim=-1)
        return torch.multinomial(probs, 1, generator=self.generator).view(scores.shape[:2])

    def row_scores(self, logits: torch.Tensor, row: int, output: list[int], tree: DraftTree) -> torch.Tensor:
        """The row's processed scores at each node (raw logits at the padding slots after its tree)."""
        prefix = torch.cat([self.prompts[row], torch.tensor(output, dtype=torch.long, device=logits.device)])
        scores = [
            self.processors[row](
                torch.cat([prefix, torch.tensor(tree.path_tokens(node), dtype=torch.long, device=logits.device)])[None],
                logits[node : node + 1].float(),
            )
            for node in range(len(tree.tokens) + 1)
        ]
        return torch.cat(scores + [logits[len(scores) :].float()])


class CriteriaEnd(OutputEnd):
    """An `OutputEnd` that also ends where the call's stopping criteria first stop, checked once at each new prefix
    of the row (its padded prompt and output), as plain batched `generate` checks them after each step."""

    def __init__(self, stops: set[int], max_new_tokens: int, criteria: StoppingCriteriaList, prompt: torch.Tensor):
        super().__init__(stops, max_new_tokens)
        self.criteria, self.prompt = criteria, prompt

    def update(self, tokens: list[int]) -> int:
        checked, stopped = self.checked, self.stop is not None
        length = super().update(tokens)
        if stopped:
            return length
        ids = torch.cat([self.prompt, torch.tensor(tokens[:length], dtype=torch.long, device=self.prompt.device)])
        for n in range(checked + 1, length + 1):
            if bool(self.criteria(ids[None, : self.prompt.shape[0] + n], None).all()):
                self.stop = n
                return n
        return length


def commit_paths(rows: Rows, cache: DynamicCache, features: torch.Tensor, paths: list[list[int]], chosen: torch.Tensor):
    """Moves every row past its accepted path and bonus token: the path's keys and features move to the round's
    first slots, the slots after the longest path are cropped, and a shorter path leaves holes its row's mask hides
    from then on."""
    n, device = chosen.shape[1], chosen.device
    width = max(map(len, paths))
    index = torch.tensor([path + path[-1:] * (width - len(path)) for path in paths], device=device)
    if any(path != list(range(len(path))) for path in paths):  # a chain prefix is in place already
        gather_round_slots(cache, n, index)
    drop_last(cache, n - width)
    lengths = torch.tensor([len(path) for path in paths], device=device)
    kept = torch.arange(width, device=device)[None] < lengths[:, None]
    rows.target_keys = torch.cat([rows.target_keys, kept], dim=1)
    fresh = features.gather(1, index[..., None].expand(-1, -1, features.shape[-1]))
    rows.context = torch.cat([rows.context, fresh], dim=1)  # after the features the draft has not read yet
    rows.context_keys = torch.cat([rows.context_keys, kept], dim=1)
    positions = rows.position[:, None] + torch.arange(width, device=device)
    rows.context_positions = torch.cat([rows.context_positions, positions], dim=1)
    rows.last = chosen.gather(1, index.gather(1, lengths[:, None] - 1))
    rows.position = rows.position + lengths


def gather_round_slots(cache: DynamicCache, n: int, index: torch.Tensor) -> None:
    """Writes, per row, the keys and values of the last round's slots `index` (`[b, width]`) into its first slots."""
    for layer in cache.layers:
        if getattr(layer, "keys", None) is None:
            continue
        first = layer.keys.shape[-2] - n
        for tensor in (layer.keys, layer.values):
            at = index[:, None, :, None].expand(-1, tensor.shape[1], -1, tensor.shape[-1])
            tensor[..., first : first + index.shape[1], :] = tensor[..., first:, :].gather(2, at)


@dataclass
class RaggedBatch:
    """A batch's live rows through `tree_dflash.decode_rounds`: one draft pass and one packed verify for all of
    them, each row accepting its own path in the ragged cache, and a row that ends leaving the batch."""

    draft_model: torch.nn.Module
    target: torch.nn.Module
    plan: TreePlan
    warpers: LogitsProcessorList | None
    pick: RowPicker
    ends: list[OutputEnd]
    rows: Rows
    features: LayerFeatures
    target_cache: DynamicCache
    draft_cache: DynamicCache
    prompt_tokens: list[list[int]]  # each row's unpadded prompt, which the lookup searches
    block_size: int
    outputs: list[list[int]]  # per row of the call's batch, as `taus` and `expected`
    taus: list[list[int]]
    expected: list[list[float]]

    def __post_init__(self):
        self.embed = draft_embedding(self.draft_model, self.target)
        self.head = DraftHead(self.draft_model, self.target.get_output_embeddings())

    def live(self) -> int:
        return self.rows.ids.numel()

    def histories(self) -> list[list[int]]:
        return [self.prompt_tokens[row] + self.outputs[row] for row in self.rows.ids.tolist()]

    def draft(self) -> list[DraftTree]:
        logits = draft_block(self.draft_model, self.embed, self.head, self.rows, self.draft_cache, self.block_size)
        return drafted_trees(logits, self.head.vocab, self.plan, self.warpers)

    def verify(self, trees: list[DraftTree]) -> tuple[list[DraftTree], list[list[int]]]:
        verified = verify_trees(self.target, self.target_cache, self.rows, trees)
        self.chosen = self.pick(verified, self.rows.ids.tolist(), self.outputs, trees)
        return trees, self.chosen.tolist()  # the round's device-to-host transfer

    def commit(self, step: Round) -> None:
        ids = self.rows.ids.tolist()
        for row, tokens, path in zip(ids, step.committed(), step.paths):
            self.outputs[row] += tokens
            self.taus[row].append(len(path))
        for row, estimate in zip(ids, step.estimates):
            self.expected[row].append(estimate)
        commit_paths(self.rows, self.target_cache, self.features.pop(), step.paths, self.chosen)
        self.rows = drop_finished(self.rows, self.ends, self.outputs, self.target_cache, self.draft_cache)


@torch.inference_mode()
def batched_spec_generate(
    self,
    target,
    input_ids: torch.Tensor,
    attention_mask=None,
    *,
    max_new_tokens: int,
    stop_token_ids,
    temperature: float,
    top_p: float,
    top_k: int,
    block_size: int,
    return_stats: bool,
    generator: torch.Generator | None,
    pad_token_id: int | None = None,
    align_rows: bool = False,
    row_processors: list[LogitsProcessorList] | None = None,
    stopping_criteria: StoppingCriteriaList | None = None,
    plan: TreePlan | None = None,
    **options,
):
    """`spec_generate` for a batch of left-padded prompts (`input_ids` `[b, prompt_len]` and their `attention_mask`):
    `[b, prompt_len + new]` ids, each row padded after its end with the pad token, as `generate` returns them; with
    `return_stats`, a `SpecGenerateOutput` whose `acceptance_lengths` holds one list per row. Every row equals that
    prompt's own decoding: identical tokens at `temperature=0` in float32, its own distribution above.
    `align_rows` keeps every row to the batch's shortest acceptance each round, so the cache has no holes: the simple
    alternative, measured by `python -m bench --batch-size`. `row_processors` (one `LogitsProcessorList` per row,
    then in place of the temperature, top-k and top-p warpers; `temperature > 0` still means sampling) and
    `stopping_criteria` apply per row, as plain batched `generate` applies them: `target.generate` passes the call's.
    `plan` says how rows propose (default: the chain); each row verifies its own tree, packed with the others'."""
    plan = plan or TreePlan(final_length=input_ids.shape[1] + max_new_tokens + block_size)
    refuse_batch_options(self, target, plan.final_length, **options)
    real = left_padding_mask(input_ids, attention_mask)
    prompt_tokens = [ids[keep].tolist() for ids, keep in zip(input_ids, real)] if plan.lookup else []
    warpers = None if row_processors else sampling_warpers(temperature, top_k, top_p)
    stops = stop_ids(target, stop_token_ids)
    pad = pad_token_id if pad_token_id is not None else pad_id(target, stop_token_ids)
    processors = row_processors or [sampling_warpers(temperature, top_k, top_p)] * input_ids.shape[0]
    pick = RowPicker(processors, input_ids, temperature > 0, generator)
    batch, prompt_len = input_ids.shape
    target_cache, draft_cache = DynamicCache(), DynamicCache()
    outputs = [[] for _ in range(batch)]
    ends = [
        CriteriaEnd(stops, max_new_tokens, stopping_criteria, prompt)
        if stopping_criteria
        else OutputEnd(stops, max_new_tokens)
        for prompt in input_ids
    ]
    positions = (real.long().cumsum(dim=1) - 1).clamp(min=0)

    with LayerFeatures(target, self.config.target_layer_ids) as features:
        out = target(
            input_ids=input_ids,
            attention_mask=real.long(),
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **{cache_kwarg(target): target_cache},
        )
        last = pick(out.logits[:, -1:], list(range(batch)), outputs, [])
        rows = Rows(
            ids=torch.arange(batch, device=input_ids.device),
            position=real.sum(dim=1),
            last=last,
            target_keys=real,
            draft_keys=real[:, :0],
            context=features.pop(),
            context_keys=real,
            context_positions=positions,
        )
        for row, token in enumerate(last[:, 0].tolist()):
            outputs[row].append(token)
        batch_rows = RaggedBatch(
            self,
            target,
            plan,
            warpers,
            pick,
            ends,
            drop_finished(rows, ends, outputs, target_cache, draft_cache),
            features,
            target_cache,
            draft_cache,
            prompt_tokens,
            block_size,
            outputs=outputs,
            taus=[[] for _ in range(batch)],
            expected=[[] for _ in range(batch)],
        )
        for _ in decode_rounds(batch_rows, plan.lookup, plan.max_ngram, plan.sizer(target, batch), align_rows):
            pass  # each round commits itself

    new = [tokens[: end.update(tokens)] for tokens, end in zip(outputs, ends)]
    width = max(len(tokens) for tokens in new)
    padded = torch.tensor([tokens + [pad] * (width - len(tokens)) for tokens in new], device=input_ids.device)
    output_ids = torch.cat([input_ids, padded], dim=1)
    if not return_stats:
        return output_ids
    return SpecGenerateOutput(output_ids, batch_rows.taus, prompt_len, width, batch_rows.expected)


def drop_finished(rows: Rows, ends: list[OutputEnd], outputs, target_cache, draft_cache) -> Rows:
    """The rows still decoding; a finished row's entries leave both caches."""
    done = [ends[row].done(outputs[row]) for row in rows.ids.tolist()]
    if not any(done):
        return rows
    keep = torch.tensor([not d for d in done], device=rows.ids.device)
    select_cache_rows(target_cache, keep)
    select_cache_rows(draft_cache, keep)
    return rows.select(keep)


def pad_id(target, stop_token_ids) -> int:
    """The pad token `generate` writes after a row's end: the generation config's, else the first stop token (as
    `generate` pads with the first EOS id), else 0."""
    pad = getattr(target.generation_config, "pad_token_id", None)
    if pad is None:
        if stop_token_ids is EOS_FROM_GENERATION_CONFIG:
            stop_token_ids = getattr(target.generation_config, "eos_token_id", None)
        pad = stop_token_ids
    if isinstance(pad, (list, tuple)):
        pad = pad[0] if pad else None
    return 0 if pad is None else int(pad)
