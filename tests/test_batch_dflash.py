"""Batched `spec_generate`: every row of a left-padded batch equals that prompt decoded alone."""

import pytest
import torch
from conftest import (
    ALL_WINDOW,
    MIXED_WINDOW,
    VOCAB,
    OracleDraft,
    chi_square_p_value,
    exact_joint_distribution,
    exact_two_token_distribution,
    greedy_reference,
    make_draft,
    make_draft_config,
    make_target,
    make_tokenizer,
    watched_target,
)
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
    TemperatureLogitsWarper,
)

import tree_dflash

PAD = 0


def left_pad(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def expected_rows(target, prompts, max_new: int, stop: int | None = None) -> list[list[int]]:
    """Each prompt's plain greedy continuation alone, cut after the first stop token."""
    rows = []
    for p in prompts:
        new = greedy_reference(target, torch.tensor([p]), max_new)[0, len(p) :].tolist()
        rows.append(new[: new.index(stop) + 1] if stop in new else new)
    return rows


def new_tokens(out: torch.Tensor, prompt_width: int, lengths: list[int]) -> list[list[int]]:
    return [row[prompt_width : prompt_width + n] for row, n in zip(out.tolist(), lengths)]


PROMPTS = [[5], [7, 8, 9, 10, 11, 12], [20, 21, 3, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49]]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("block_size", [4, 8])
def test_every_row_equals_its_prompt_decoded_alone(arch, block_size):
    target, draft = make_target(arch), make_draft()
    ids, mask = left_pad(PROMPTS)
    expected = expected_rows(target, PROMPTS, 20)
    out = draft.spec_generate(
        target,
        ids,
        attention_mask=mask,
        max_new_tokens=20,
        block_size=block_size,
        stop_token_ids=None,
        return_stats=True,
    )
    assert out.output_ids.shape == (3, ids.shape[1] + 20)
    assert torch.equal(out.output_ids[:, : ids.shape[1]], ids), "the padded prompts come back as they went in"
    assert new_tokens(out.output_ids, ids.shape[1], [20] * 3) == expected
    assert all(sum(row) + 1 >= 20 for row in out.acceptance_lengths), "the prefill gives the first token"


class BatchOracle(OracleDraft):
    """Right for `k` tokens of each row's own continuation, with `k` different per row and per round, so rows
    accept different prefixes in the same round; records each round's `k` per row."""

    def setup_rows(self, target, references: list[list[int]], block_size: int, k: int | None = None):
        """`k`: the same for every row and round (e.g. the whole block: each row's reference, never wrong)."""
        self.setup(target, torch.tensor([references[0]]), 0)
        self.references, self.block_size, self.ks, self.fixed_k = references, block_size, [], k
        return self

    def forward(self, noise_embeds, context_hidden_states, position_ids=None, **kwargs):
        out = super(OracleDraft, self).forward(noise_embeds, context_hidden_states, position_ids=position_ids, **kwargs)
        block, rounds = noise_embeds.shape[1], len(self.ks)
        rows = []
        ks = [(rounds + 2 * r) % block if self.fixed_k is None else self.fixed_k for r in range(len(self.row_ids))]
        for row, k in zip(self.row_ids, ks):
            self.reference, self.k = self.references[row], k
            start = int(position_ids[len(rows), -block])
            rows.append(torch.stack([self.logits_at(start + i, i) for i in range(block)]))
        self.ks.append(dict(zip(self.row_ids, ks)))
        out.last_hidden_state = (torch.stack(rows) @ self.lm_head_pinv.T).to(noise_embeds.dtype)
        return out


@pytest.fixture
def row_ids_to_oracle(monkeypatch):
    """Tells a `BatchOracle` which batch rows each draft pass holds."""
    import batch_dflash

    original = batch_dflash.draft_block

    def recording(draft_model, embed, head, rows, cache, size):
        draft_model.row_ids = rows.ids.tolist()
        return original(draft_model, embed, head, rows, cache, size)

    monkeypatch.setattr(batch_dflash, "draft_block", recording)


def test_rows_accept_different_prefixes_in_the_same_round_and_stay_exact(row_ids_to_oracle):
    """Forces every k from 0 to block - 1 on every row, different per row in each round; a row's acceptance is its
    own k + 1 (or less where its output ends), and output equals each prompt's plain greedy decoding."""
    target, block_size, max_new = make_target("qwen3"), 6, 30
    prompts = PROMPTS
    references = [p + e for p, e in zip(prompts, expected_rows(target, prompts, max_new + block_size))]
    draft = BatchOracle(make_draft_config()).eval().setup_rows(target, references, block_size)
    ids, mask = left_pad(prompts)
    out = draft.spec_generate(
        target,
        ids,
        attention_mask=mask,
        max_new_tokens=max_new,
        block_size=block_size,
        stop_token_ids=None,
        return_stats=True,
    )
    assert new_tokens(out.output_ids, ids.shape[1], [max_new] * 3) == expected_rows(target, prompts, max_new)
    for row in range(3):
        rounds = [ks[row] for ks in draft.ks if row in ks]
        taus = out.acceptance_lengths[row]
        assert taus[:-1] == [k + 1 for k in rounds[: len(taus) - 1]], f"row {row}"
        assert set(rounds) == set(range(block_size)), f"row {row} saw k {set(rounds)}"  # block - 1: all accepted
    assert any(len(set(ks.values())) == len(ks) > 1 for ks in draft.ks), "rows accepted different k in one round"


def test_rows_that_stop_leave_the_batch_and_are_padded_after_their_end():
    target, draft = make_target("llama"), make_draft()
    continuations = expected_rows(target, PROMPTS, 24)
    stop = continuations[1][3]  # row 1 stops at its 4th new token; the others wherever this token comes, if at all
    expected = expected_rows(target, PROMPTS, 24, stop)
    sizes = []
    target.register_forward_pre_hook(
        lambda m, args, kwargs: sizes.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )
    ids, mask = left_pad(PROMPTS)
    out = draft.spec_generate(target, ids, attention_mask=mask, max_new_tokens=24, stop_token_ids=[stop])
    width, lengths = ids.shape[1], [len(e) for e in expected]
    assert new_tokens(out, width, lengths) == expected
    assert out.shape[1] == width + max(lengths)
    pad = stop if target.generation_config.pad_token_id is None else target.generation_config.pad_token_id
    for row, n in enumerate(lengths):  # as generate: the pad token, else the stop token
        assert out[row, width + n :].tolist() == [pad] * (max(lengths) - n), "padded after the row's end"
    assert min(lengths) < 24 and sizes[-1] < 3, f"a stopped row kept costing compute: batch sizes {sizes}"


def test_each_row_keeps_its_own_sampling_distribution():
    """Chi-square, per row, of two sampled tokens against that prompt's exact distribution (fails at p < 1e-4)."""
    target = make_target("llama", initializer_range=0.5)
    draft = make_draft()
    temperature, n = 1.0, 1500
    prompts = [[5, 6, 7], [9]]
    ids, mask = left_pad(prompts)
    processors = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    exact = [exact_two_token_distribution(target, torch.tensor([p]), processors) for p in prompts]
    counts = torch.zeros(2, VOCAB * VOCAB)
    g = torch.Generator().manual_seed(0)
    for _ in range(n):
        out = draft.spec_generate(
            target,
            ids,
            attention_mask=mask,
            max_new_tokens=2,
            temperature=temperature,
            block_size=4,
            generator=g,
            stop_token_ids=None,
        )
        for row, (t1, t2) in enumerate(out[:, -2:].tolist()):
            counts[row, t1 * VOCAB + t2] += 1
    for row in range(2):
        p_value, chi2, dof = chi_square_p_value(counts[row], exact[row])
        assert p_value > 1e-4, f"row {row}: chi2={chi2:.1f} dof={dof} p={p_value:.2e}"


def test_rows_accepting_different_lengths_while_sampling_keep_their_own_distributions(row_ids_to_oracle):
    """Each row's draft proposes that prompt's greedy continuation, which a sampled target accepts for a random number
    of tokens, different per row: chi-square per row of the three new tokens (the prefill's, then two drafted
    positions) against that prompt's exact joint distribution at temperature 1 (fails at p < 1e-4)."""
    target, n, block_size = make_target("llama", initializer_range=0.5), 2000, 4
    prompts = [[5, 6, 7], [9]]
    references = [p + e for p, e in zip(prompts, expected_rows(target, prompts, 8))]
    draft = BatchOracle(make_draft_config()).eval().setup_rows(target, references, block_size, k=block_size)
    processors = LogitsProcessorList([TemperatureLogitsWarper(1.0)])
    exact = [exact_joint_distribution(target, torch.tensor([p]), processors, 3).flatten() for p in prompts]
    ids, mask = left_pad(prompts)
    counts, firsts = torch.zeros(2, VOCAB**3), []
    g = torch.Generator().manual_seed(0)
    for _ in range(n):
        out = draft.spec_generate(
            target,
            ids,
            attention_mask=mask,
            max_new_tokens=3,
            temperature=1.0,
            block_size=block_size,
            generator=g,
            stop_token_ids=None,
            return_stats=True,
        )
        for row, (t1, t2, t3) in enumerate(out.output_ids[:, -3:].tolist()):
            counts[row, (t1 * VOCAB + t2) * VOCAB + t3] += 1
        firsts.append(tuple(lengths[0] for lengths in out.acceptance_lengths))
    for row in range(2):
        p_value, chi2, dof = chi_square_p_value(counts[row], exact[row])
        assert p_value > 1e-4 and dof > 20, f"row {row}: chi2={chi2:.1f} dof={dof} p={p_value:.2e}"
        assert {f[row] for f in firsts} >= {1, 2, 3}, f"row {row} accepted 0, 1 and 2 drafted tokens"
    assert sum(a != b for a, b in firsts) > n // 10, "rows accepted different lengths in the same round"


def test_rows_held_to_the_shortest_acceptance_stay_exact():
    """The benchmark's simple alternative: every row commits the batch's shortest accepted prefix each round."""
    target, draft = make_target("qwen3"), make_draft()
    ids, mask = left_pad(PROMPTS)
    out = draft._batched_spec_generate(
        target,
        ids,
        mask,
        max_new_tokens=16,
        stop_token_ids=None,
        temperature=0.0,
        top_p=1.0,
        top_k=0,
        block_size=4,
        return_stats=True,
        generator=None,
        align_rows=True,
    )
    assert new_tokens(out.output_ids, ids.shape[1], [16] * 3) == expected_rows(target, PROMPTS, 16)
    assert out.acceptance_lengths[0] == out.acceptance_lengths[1] == out.acceptance_lengths[2]


@pytest.mark.parametrize("max_new", [1, 2, 9])
def test_rows_that_end_at_the_prefill_or_in_the_first_round(max_new):
    """One new token (the prefill's), or a stop token as one row's first new token: that row leaves the batch before
    the draft ever ran for it."""
    target, draft = make_target("llama"), make_draft()
    stop = expected_rows(target, PROMPTS, 1)[0][0]
    expected = expected_rows(target, PROMPTS, max_new, stop)
    ids, mask = left_pad(PROMPTS)
    out = draft.spec_generate(target, ids, attention_mask=mask, max_new_tokens=max_new, stop_token_ids=stop)
    assert new_tokens(out, ids.shape[1], list(map(len, expected))) == expected
    assert len(expected[0]) == 1


@pytest.mark.parametrize(
    "target_kwargs, message",
    [
        ({"attn": "flash_attention_2"}, "batch verification needs an attention implementation that takes a custom 4D"),
        (MIXED_WINDOW, "batch verification past the target's sliding window .* needs a mask per layer type"),
    ],
)
def test_a_target_whose_attention_cannot_take_the_batch_mask_is_refused(target_kwargs, message, monkeypatch):
    monkeypatch.setattr(tree_dflash, "takes_masks_by_layer_type", lambda decoder: False)
    target, calls = watched_target(**target_kwargs)
    ids, mask = left_pad(PROMPTS)
    with pytest.raises(ValueError, match=message):
        make_draft().spec_generate(target, ids, attention_mask=mask, max_new_tokens=32)
    assert not calls, "the target ran before the error"


@pytest.mark.parametrize("target_kwargs", [ALL_WINDOW, MIXED_WINDOW], ids=["all", "mixed"])
def test_rows_stay_exact_past_a_sliding_window(target_kwargs, row_ids_to_oracle):
    """Far past the window (8 tokens), with holes where rows rejected drafts: every k forced on every row, and each
    row's tree with a lookup branch, windowed by each key's position in its row; output equals plain greedy."""
    target, block_size, max_new = make_target(**target_kwargs), 6, 30
    references = [p + e for p, e in zip(PROMPTS, expected_rows(target, PROMPTS, max_new + block_size))]
    draft = BatchOracle(make_draft_config()).eval().setup_rows(target, references, block_size)
    ids, mask = left_pad(PROMPTS)
    settings = dict(attention_mask=mask, max_new_tokens=max_new, stop_token_ids=None)
    out = draft.spec_generate(target, ids, block_size=block_size, **settings)
    assert new_tokens(out, ids.shape[1], [max_new] * 3) == expected_rows(target, PROMPTS, max_new)
    assert {k for ks in draft.ks for k in ks.values()} == set(range(block_size))
    out = make_draft().spec_generate(target, ids, tree_budget=6, prompt_lookup_num_tokens=4, **settings)
    assert new_tokens(out, ids.shape[1], [max_new] * 3) == expected_rows(target, PROMPTS, max_new)


def test_a_draft_with_sliding_window_layers_is_refused_in_both_batch_routes():
    """A row's rejected slots stay in the draft's cache as holes, which a window counted by key index would include."""
    target, calls = watched_target()
    draft = make_draft(layer_types=["sliding_attention", "full_attention"], use_sliding_window=True, sliding_window=8)
    ids, mask = left_pad(PROMPTS)
    message = "sliding-window layers would count a row's rejected slots toward their window"
    with pytest.raises(ValueError, match=message):
        draft.spec_generate(target, ids, attention_mask=mask, max_new_tokens=32)
    with pytest.raises(ValueError, match=message):
        target.generate(ids, attention_mask=mask, assistant_model=draft, max_new_tokens=32, do_sample=False)
    assert not calls, "the target ran before the error"
    one_row = torch.tensor([PROMPTS[1]])
    assert draft.spec_generate(target, one_row, max_new_tokens=4).shape[1] == one_row.shape[1] + 4  # one row decodes


# ---------------------------------------------------------------------------------------------------------------------
# `target.generate` with a batch: the call's logits processors and stopping criteria, per row.


class AvoidRecent(LogitsProcessor):
    """Reads the input ids: bans the tokens among each row's last three."""

    def __call__(self, input_ids, scores):
        return scores.scatter(1, input_ids[:, -3:], -float("inf"))


class StopAt(StoppingCriteria):
    def __init__(self, token):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def processing_settings(name: str, free: list[list[int]]) -> dict:
    """Settings that change at least one row's plain greedy output `free` (each row's new tokens). Stopping comes
    with an EOS token no row writes: only with one does plain batched `generate` pad a row after its stop (without,
    it keeps writing the row's tokens until every row stops), and padding after the stop is what DFlash does."""
    unused = min(set(range(3, VOCAB)) - {t for row in free for t in row})
    if name == "penalties":
        return dict(repetition_penalty=1.5, no_repeat_ngram_size=2)
    if name == "min_new_tokens":  # row 1 would end at its third token
        return dict(eos_token_id=free[1][2], min_new_tokens=8)
    if name == "logits_processor":
        return dict(logits_processor=LogitsProcessorList([AvoidRecent()]))
    if name == "stopping_criteria":
        return dict(stopping_criteria=StoppingCriteriaList([StopAt(free[2][4])]), eos_token_id=unused)
    return dict(stop_strings=[f"t{free[0][5]}"], tokenizer=make_tokenizer(), eos_token_id=unused)


SETTINGS = ["penalties", "min_new_tokens", "logits_processor", "stopping_criteria", "stop_strings"]


@pytest.mark.parametrize("name", SETTINGS)
def test_generate_applies_each_rows_processors_and_criteria_as_plain_batched_generate(name, row_ids_to_oracle):
    """Output equals plain batched `target.generate` with the same settings, while the oracle forces every row to
    accept a different k in each round (so processors see prefixes that end inside accepted drafts)."""
    target, block_size, max_new = make_target("qwen3"), 6, 24
    ids, mask = left_pad(PROMPTS)
    width, common = ids.shape[1], dict(attention_mask=mask, max_new_tokens=max_new, do_sample=False, pad_token_id=PAD)
    free = target.generate(ids, **common)[:, width:].tolist()
    settings = processing_settings(name, free)
    plain = target.generate(ids, **common, **settings)
    assert plain[:, width:].tolist() != free, f"{name} changes no row, so the test would prove nothing"
    references = [p + row[width:] for p, row in zip(PROMPTS, plain.tolist())]  # pads past a row's end: never accepted
    draft = BatchOracle(make_draft_config()).eval().setup_rows(target, references, block_size)
    out = target.generate(ids, assistant_model=draft, num_assistant_tokens=block_size - 1, **common, **settings)
    assert torch.equal(out, plain)
    assert any(k > 0 for ks in draft.ks for k in ks.values()), "the draft's tokens were accepted"


class BanLast(LogitsProcessor):
    """Reads the input ids: bans each row's last token, so the second sampled token depends on the first."""

    def __call__(self, input_ids, scores):
        return scores.scatter(1, input_ids[:, -1:], -float("inf"))


def test_generate_samples_each_row_through_its_own_processors():
    """Chi-square, per row, of two tokens sampled with a processor that reads each row's prefix (fails at p < 1e-4)."""
    target, draft = make_target("llama", initializer_range=0.5), make_draft()
    prompts, n = [[5, 6, 7], [9]], 1200
    ids, mask = left_pad(prompts)
    processors = LogitsProcessorList([BanLast(), TemperatureLogitsWarper(0.8)])
    exact = [exact_joint_distribution(target, torch.tensor([p]), processors, 2).flatten() for p in prompts]
    counts = torch.zeros(2, VOCAB * VOCAB)
    torch.manual_seed(0)
    for _ in range(n):
        out = target.generate(
            ids,
            attention_mask=mask,
            assistant_model=draft,
            max_new_tokens=2,
            do_sample=True,
            temperature=0.8,
            top_k=0,
            pad_token_id=PAD,
            logits_processor=[BanLast()],
        )
        for row, (t1, t2) in enumerate(out[:, -2:].tolist()):
            counts[row, t1 * VOCAB + t2] += 1
    for row in range(2):
        assert counts[row].view(VOCAB, VOCAB).diagonal().sum() == 0, "a row repeated the token its processor bans"
        p_value, chi2, dof = chi_square_p_value(counts[row], exact[row])
        assert p_value > 1e-4, f"row {row}: chi2={chi2:.1f} dof={dof} p={p_value:.2e}"


class SeenScores(StoppingCriteria):
    """Records what each call's `scores` argument was; never stops."""

    def __init__(self):
        self.seen = []

    def __call__(self, input_ids, scores, **kwargs):
        self.seen.append(scores if scores is None else type(scores))
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def test_stopping_criteria_get_the_scores_plain_batched_generate_gives_them():
    """Plain `generate` hands its criteria the scores it collects for its output: None unless `output_scores` is set.
    A batch returns sequences only, so it refuses `output_scores` and hands None, as plain batched `generate` does."""
    target, draft = make_target("llama"), make_draft()
    ids, mask = left_pad(PROMPTS)
    common = dict(attention_mask=mask, max_new_tokens=6, pad_token_id=PAD, do_sample=False)
    plain, ours = SeenScores(), SeenScores()
    target.generate(ids, **common, stopping_criteria=StoppingCriteriaList([plain]))
    target.generate(ids, **common, assistant_model=draft, stopping_criteria=StoppingCriteriaList([ours]))
    assert plain.seen and ours.seen and set(plain.seen) == set(ours.seen) == {None}
    with pytest.raises(ValueError, match="sequences only"):
        target.generate(
            ids,
            **common,
            assistant_model=draft,
            output_scores=True,
            return_dict_in_generate=True,
            stopping_criteria=StoppingCriteriaList([ours]),
        )


def test_generate_returns_a_batch_as_the_output_object_it_asked_for():
    target, draft = make_target("llama"), make_draft()
    ids, mask = left_pad(PROMPTS)
    out = target.generate(
        ids,
        attention_mask=mask,
        assistant_model=draft,
        max_new_tokens=6,
        pad_token_id=PAD,
        return_dict_in_generate=True,
    )
    plain = target.generate(ids, attention_mask=mask, max_new_tokens=6, pad_token_id=PAD)
    assert torch.equal(out.sequences, plain)


# ---------------------------------------------------------------------------------------------------------------------
# Trees and the prompt-lookup branch, per row in a batch.

REPEATING = [[5, 6, 7, 5, 6, 7, 5, 6], [9], [20, 21, 22, 23, 20, 21, 22, 23, 20, 21, 22, 23, 20]]


@pytest.fixture
def gathered(monkeypatch):
    """Counts the rounds whose accepted paths were moved within the cache (a path that is no chain prefix)."""
    import batch_dflash

    calls, original = [], batch_dflash.gather_round_slots
    monkeypatch.setattr(batch_dflash, "gather_round_slots", lambda *args: calls.append(1) or original(*args))
    return calls


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("trees", [dict(tree_budget=12), dict(tree_budget=6, prompt_lookup_num_tokens=4)])
def test_every_row_verifies_its_own_tree_and_equals_its_prompt_decoded_alone(arch, trees, gathered):
    """fp32, tiny random models: each row's tree (and lookup branch) in one packed verify; rows whose paths leave the
    first-choice chain have their path moved in the cache, and every row equals its prompt's plain greedy output."""
    target, draft = make_target(arch), make_draft()
    ids, mask = left_pad(REPEATING)
    out = draft.spec_generate(
        target, ids, attention_mask=mask, max_new_tokens=40, stop_token_ids=None, return_stats=True, **trees
    )
    assert new_tokens(out.output_ids, ids.shape[1], [40] * 3) == expected_rows(target, REPEATING, 40)
    assert gathered, "no row accepted a path off the first-choice chain, so the gather went untested"
    assert max(n for row in out.acceptance_lengths for n in row) > 1, "no drafted token was accepted"


def test_a_batchs_trees_size_by_each_rows_confidence_and_keep_exact():
    """`tree_min_prob` per row: rows whose draft is unsure verify fewer nodes; output stays exact."""
    target, draft = make_target("qwen3"), make_draft()
    sizes = []
    target.register_forward_pre_hook(
        lambda m, args, kwargs: sizes.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    ids, mask = left_pad(REPEATING)
    out = draft.spec_generate(
        target, ids, attention_mask=mask, max_new_tokens=30, stop_token_ids=None, tree_budget=20, tree_min_prob=0.02
    )
    assert new_tokens(out, ids.shape[1], [30] * 3) == expected_rows(target, REPEATING, 30)
    assert len(set(sizes[1:])) > 1 and max(sizes[1:]) < 21, f"verify widths {sizes[1:]}"


def test_rows_accept_different_paths_through_their_trees_at_every_k(row_ids_to_oracle, gathered):
    """The oracle is right for k tokens per row (every k, different per row) inside a tree of second choices:
    each row's acceptance is its own k + 1 and output equals each prompt's plain greedy decoding."""
    target, block_size, max_new = make_target("qwen3"), 6, 30
    references = [p + e for p, e in zip(PROMPTS, expected_rows(target, PROMPTS, max_new + block_size))]
    draft = BatchOracle(make_draft_config()).eval().setup_rows(target, references, block_size)
    ids, mask = left_pad(PROMPTS)
    out = draft.spec_generate(
        target,
        ids,
        attention_mask=mask,
        max_new_tokens=max_new,
        block_size=block_size,
        stop_token_ids=None,
        return_stats=True,
        tree_budget=10,
    )
    assert new_tokens(out.output_ids, ids.shape[1], [max_new] * 3) == expected_rows(target, PROMPTS, max_new)
    for row in range(3):
        rounds = [ks[row] for ks in draft.ks if row in ks]
        assert set(rounds) == set(range(block_size)), f"row {row} saw k {set(rounds)}"
        assert max(out.acceptance_lengths[row]) == block_size


def test_each_row_keeps_its_own_sampling_distribution_through_its_tree():
    """Chi-square, per row, of two sampled tokens verified through a tree and a lookup branch (fails at p < 1e-4)."""
    target = make_target("llama", initializer_range=0.5)
    draft = make_draft()
    n, prompts = 1500, [[5, 6, 5, 6, 5], [9]]
    ids, mask = left_pad(prompts)
    processors = LogitsProcessorList([TemperatureLogitsWarper(1.0)])
    exact = [exact_two_token_distribution(target, torch.tensor([p]), processors) for p in prompts]
    counts = torch.zeros(2, VOCAB * VOCAB)
    g = torch.Generator().manual_seed(0)
    for _ in range(n):
        out = draft.spec_generate(
            target,
            ids,
            attention_mask=mask,
            max_new_tokens=2,
            temperature=1.0,
            block_size=4,
            generator=g,
            stop_token_ids=None,
            tree_budget=8,
            prompt_lookup_num_tokens=2,
        )
        for row, (t1, t2) in enumerate(out[:, -2:].tolist()):
            counts[row, t1 * VOCAB + t2] += 1
    for row in range(2):
        p_value, chi2, dof = chi_square_p_value(counts[row], exact[row])
        assert p_value > 1e-4, f"row {row}: chi2={chi2:.1f} dof={dof} p={p_value:.2e}"


@pytest.mark.parametrize("name", SETTINGS)
def test_generate_applies_each_rows_processors_at_every_tree_node(name, gathered):
    """The draft config's tree and lookup branch through batched `target.generate`: a processor that reads input ids
    gets, at each node, the row's output and that node's own path, so output equals plain batched `generate`."""
    target, max_new = make_target("qwen3"), 24
    ids, mask = left_pad(REPEATING)
    width, common = ids.shape[1], dict(attention_mask=mask, max_new_tokens=max_new, do_sample=False, pad_token_id=PAD)
    free = target.generate(ids, **common)[:, width:].tolist()
    settings = processing_settings(name, free)
    plain = target.generate(ids, **common, **settings)
    draft = make_draft()
    draft.config.tree_budget, draft.config.prompt_lookup_num_tokens = 10, 4
    assert torch.equal(target.generate(ids, assistant_model=draft, **common, **settings), plain)
    assert gathered, "no row accepted a path off its first-choice chain"


def test_a_batchs_generation_config_is_merged_with_the_targets_as_generate_merges_it():
    """A user config without `eos_token_id` takes the target's, as `generate` does (it used to never stop); rows are
    padded after their end with the first EOS id, as `generate` pads when no pad token is set."""
    from transformers import GenerationConfig

    target, draft = make_target("llama"), make_draft()
    ids, mask = left_pad(PROMPTS)
    free = target.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=PAD)
    first, second = free[1, ids.shape[1] + 2].item(), free[0, ids.shape[1] + 5].item()
    target.generation_config.eos_token_id, target.generation_config.pad_token_id = [first, second], None
    user = GenerationConfig(max_new_tokens=12, do_sample=False)
    plain = target.generate(ids, attention_mask=mask, generation_config=user)
    ours = target.generate(ids, attention_mask=mask, generation_config=user, assistant_model=draft)
    assert torch.equal(ours, plain)
    width = ids.shape[1]
    ended = [row for row in range(3) if first in plain[row, width:].tolist() or second in plain[row, width:].tolist()]
    assert ended, "no row stopped at an EOS id"
    spec = draft.spec_generate(target, ids, attention_mask=mask, max_new_tokens=12)
    assert torch.equal(spec, plain)
