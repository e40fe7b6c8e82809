"""A verify sized by its cost (`tree_dflash.sized_width`, `cost_dflash.py`): the rule, the measured t(n), and exact
decoding through cost-sized trees at one row and many."""

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import greedy_reference, make_draft, make_target, watched_target

import cache_dflash
import cost_dflash
import tree_dflash
from tree_dflash import Calibration, DraftTree, TreeSizer, VerifyCosts, best_nodes, node_values, sized_width

FLAT = VerifyCosts([1, 64], [10.0, 10.0])  # any width costs one (slow) decode step, beside which a draft is free
STEEP = VerifyCosts([1, 2, 64], [0.010, 0.020, 0.640])  # each token costs a decode step: verify nothing drafted


def test_verify_costs_interpolate_between_and_beyond_the_measured_sizes():
    costs = VerifyCosts([1, 4, 16], [0.01, 0.02, 0.05])
    assert costs(1) == 0.01 and costs(4) == 0.02
    assert costs(10) == pytest.approx(0.035)
    assert costs(28) == pytest.approx(0.08)  # beyond the largest: the last segment's slope
    assert "16 tokens" in costs.table()


def test_verify_costs_are_timed_in_turns_and_never_fall_with_width():
    passes = {1: [0.030, 0.010], 2: [0.016, 0.018], 4: [0.014, 0.020]}  # a slow spell, then 2's pass slower than 4's
    order = []

    def time_pass(n):
        order.append(n)
        return passes[n][order.count(n) - 1]

    costs = VerifyCosts.timed([1, 2, 4], time_pass, repeats=2)
    assert order == [1, 2, 4, 1, 2, 4], "every size once per round, so a slow spell is shared"
    assert costs.tokens == [1, 2, 4]
    assert costs.seconds == [0.010, 0.014, 0.014], "each size's fastest, capped by any wider size's"


def test_the_width_is_what_maximises_expected_tokens_per_second():
    probs = [[0.9, 0.5, 0.3, 0.1, 0.05]]
    assert sized_width(probs, FLAT, 0.0) == 5
    assert sized_width(probs, STEEP, 0.0) == 0  # a plain decode step
    costs = VerifyCosts([1, 8], [0.010, 0.017])  # 1 ms a token
    # (1 + 0.9 + 0.5 + 0.3) / 0.013 beats both one fewer and one more node
    assert sized_width(probs, costs, 0.0) == 3
    rates = [(1 + sum(probs[0][:w])) / costs(w + 1) for w in range(6)]
    assert max(range(6), key=rates.__getitem__) == 3


def test_more_rows_verify_narrower_trees_and_calibration_scales_the_probabilities():
    costs = VerifyCosts([1, 16, 256], [0.010, 0.012, 0.100])
    probs = [0.9, 0.6, 0.4, 0.3, 0.2, 0.1, 0.05]
    one, twelve = sized_width([probs], costs, 0.005), sized_width([probs] * 12, costs, 0.005)
    assert one > twelve
    calibration = Calibration(prior=2.0)
    assert calibration.factor == 1.0
    calibration.update(predicted=8.0, measured=3)
    assert calibration.factor == pytest.approx(5 / 10)
    scaled = [[calibration.factor * p for p in probs]] * 12
    assert sized_width(scaled, costs, 0.005) < twelve  # a draft that over-promised gets less


def test_nodes_are_valued_by_draft_and_lookup_and_the_best_keep_their_parents():
    # node 1 (draft, p 0.8) -> 2 (draft, 0.4); the branch [t1, 9, 8] shares node 1 and adds 3 -> 4
    tree = DraftTree([4, 5], [0, 1], [1, 2], [math.log(0.8), math.log(0.4)]).with_branch([4, 9, 8])
    values = node_values(tree, 2, [4, 9, 8], draft_factor=1.0, lookup_rates={"first": 0.7, "follows": 0.7})
    assert values == pytest.approx([0.8, 0.4, 0.56, 0.392]), "each lookup node: its parent's value times a rate"
    assert best_nodes(values, 2) == [1, 3]
    cut = tree.subtree(best_nodes(values, 3))
    assert (cut.tokens, cut.parents, cut.depths) == ([4, 5, 9], [0, 1, 1], [1, 2, 2])


def test_a_nodes_value_is_a_probability_however_the_draft_was_calibrated():
    tree = DraftTree([4, 5], [0, 1], [1, 2], [math.log(0.8), math.log(0.4)])
    assert node_values(tree, 2, [], 2.0, {"first": 0.5, "follows": 0.5}) == pytest.approx([1.0, 0.8])


def test_a_lookup_nodes_rate_is_its_branchs_first_tokens_or_the_one_for_tokens_below_it():
    """A lookup branch's first token is rarely right; once a copy matches it tends to go on, so below the first
    token, shared with the draft's tree or not, another rate applies."""
    tree = DraftTree([4], [0], [1], [math.log(0.6)]).with_branch([4, 9, 8])
    assert tree_dflash.lookup_kinds(tree, [4, 9, 8]) == [(1, "first"), (2, "follows"), (3, "follows")]
    values = node_values(tree, 1, [4, 9, 8], 1.0, {"first": 0.2, "follows": 0.5})
    assert values == pytest.approx([0.6, 0.3, 0.15]), "the shared node keeps the draft's larger value"


def test_the_draft_is_calibrated_on_the_nodes_the_lookup_branch_does_not_share():
    """Two proposers agreeing are right more often than either alone, so a shared node calibrates neither: here the
    shared node is accepted and the draft's own is not."""
    sizer = TreeSizer(FLAT)
    siblings = DraftTree([4, 5], [0, 0], [1, 1], [math.log(0.5), math.log(0.5)])
    sizer.start_draft()
    (cut,), _ = sizer.cut([siblings], [[4]])
    sizer.accepted([[0, cut.tokens.index(4) + 1]])
    assert sizer.draft.factor == pytest.approx(2.0 / 2.5), "the draft's own node: 0.5 expected, none accepted"
    assert all(c.updates == 0 for c in sizer.lookup.values()), "the shared node is no lookup trial either"


def test_the_lookup_rates_are_per_token_given_its_parent():
    """A round whose lookup-only branch of three is accepted for one token counts a success for the first token and a
    failure for the second, whose parent was accepted; the third, below a rejected node, is no trial."""
    sizer = TreeSizer(FLAT)
    sizer.start_draft()
    (cut,), _ = sizer.cut([DraftTree([9], [0], [1], [math.log(0.1)])], [[4, 5, 6]])
    assert cut.tokens == [9, 4, 5, 6]
    sizer.accepted([[0, 2]])
    assert sizer.lookup_rates() == pytest.approx({"first": (0.25 + 1) / (1 + 1), "follows": (0.75 + 0) / (1 + 1)})
    assert sizer.draft.factor == pytest.approx(2.0 / 2.1)


def test_verifies_are_costed_by_what_the_calls_own_took():
    """A call whose plain steps take their t(n) but whose wider verifies take three times it cuts its tree to a plain
    step; a kind of verify not yet run is costed by the other kind's ratio, so neither is favoured unmeasured."""
    costs = VerifyCosts([1, 8], [0.010, 0.017])  # 1 ms a token: three nodes pay at first
    chain = DraftTree([4, 5, 6], [0, 1, 2], [1, 2, 3], [math.log(p) for p in (0.9, 0.5, 0.3)])
    sizer = TreeSizer(costs)
    sizer.start_draft()
    assert len(sizer.cut([chain], [[]])[0][0].tokens) == 3
    sizer.verified(4, 1, 3 * costs(4))
    ratio = sizer.verify_seconds(4, 1) / costs(4)
    assert ratio > 2 and sizer.verify_seconds(1, 1) / costs(1) == pytest.approx(ratio), "borrowed"
    sizer.start_draft()
    assert len(sizer.cut([chain], [[]])[0][0].tokens) == 3, "both kinds scaled alike: the same width"
    sizer.verified(1, 1, costs(1))
    assert sizer.verify_seconds(1, 1) == pytest.approx(costs(1)) and sizer.verify_seconds(4, 1) / costs(4) == ratio
    sizer.start_draft()
    assert sizer.cut([chain], [[]])[0][0].tokens == [], "a plain step"


def test_a_best_first_prefix_is_a_tree():
    tree = DraftTree([4, 5, 6, 7], [0, 0, 1, 3], [1, 1, 2, 3], [-0.1, -0.5, -0.7, -0.9])
    cut = tree.prefix(2)
    assert (cut.tokens, cut.parents, cut.depths) == ([4, 5], [0, 0], [1, 1])
    assert cut.path_probs() == pytest.approx([0.904837, 0.606531], rel=1e-5)


def test_the_target_is_timed_once_per_process_and_a_table_can_be_passed_in(monkeypatch):
    target, draft = make_target("llama"), make_draft()
    draft.config.tree_budget = 6
    cost_dflash.MEASURED.pop(target, None)
    timed = []
    original = cost_dflash.measure_verify_costs
    monkeypatch.setattr(cost_dflash, "measure_verify_costs", lambda *a, **k: timed.append(a[1]) or original(*a, **k))
    ids = torch.tensor([[5, 6, 7]])
    for _ in range(2):
        draft.spec_generate(target, ids, max_new_tokens=8, tree_sizing="cost")
    assert timed == [7], "measured once, up to the call's widest verify (the root and 6 nodes)"
    costs = cost_dflash.MEASURED[target]
    assert len(costs) == 1 and next(iter(costs.values())).tokens[-1] == 7
    draft.spec_generate(target, ids, max_new_tokens=8, tree_sizing="cost", verify_costs={1: 0.01, 8: 0.01})
    assert timed == [7], "a table passed in is used as is"


def test_a_batch_is_timed_in_its_own_shape_and_kept_per_row_count():
    target = make_target("llama")
    cost_dflash.MEASURED.pop(target, None)
    shapes, cached_rows, name = [], [], cache_dflash.cache_kwarg(target)

    def record(module, args, kwargs):
        shapes.append(tuple(kwargs["input_ids"].shape))
        layers = kwargs[name].layers
        keys = getattr(layers[0], "keys", None) if layers else None
        cached_rows.append(None if keys is None or keys.numel() == 0 else keys.shape[0])

    target.register_forward_pre_hook(record, with_kwargs=True)
    costs = cost_dflash.verify_costs(target, 9, rows=3)
    assert costs.tokens == [3, 6, 9], "t(n) by tokens in all: 3 rows of 1, 2 and 3 tokens"
    assert shapes[0] == (1, cost_dflash.CONTEXT), "one row's context, copied to every row"
    assert shapes[1:] == [(3, 1), (3, 2), (3, 3)] * 2, "timed in turns"
    assert set(cached_rows[1:]) == {3}
    assert costs.seconds == sorted(costs.seconds), "a wider verify never costs less"
    shapes.clear()
    assert cost_dflash.verify_costs(target, 9, rows=3) is costs and not shapes, "kept for the process"
    one_row = cost_dflash.verify_costs(target, 4)
    assert one_row.tokens == [1, 2, 4] and shapes[0] == (1, cost_dflash.CONTEXT)
    assert {key[-1] for key in cost_dflash.MEASURED[target]} == {1, 3}


def verify_widths(target) -> list[int]:
    widths = []
    target.register_forward_pre_hook(lambda m, a, kw: widths.append(kw["input_ids"].shape[1]), with_kwargs=True)
    return widths


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_cost_sized_trees_follow_the_cost_and_decode_exactly_at_one_row(arch):
    """fp32: a flat t(n) verifies the whole tree, a steep one only the next token (a plain decode step), and one in
    between sizes each round by the draft's confidence; every output equals plain greedy decoding."""
    target, draft = make_target(arch), make_draft()
    ids = torch.tensor([[5, 6, 7, 5, 6, 7, 5]])
    expected = greedy_reference(target, ids, 30)
    widths = verify_widths(target)
    between = VerifyCosts([1, 16], [0.010, 0.013])  # 0.2 ms a token
    for costs in (FLAT, STEEP, between):
        widths.clear()
        out = draft.spec_generate(
            target, ids, max_new_tokens=30, tree_budget=10, tree_sizing="cost", verify_costs=costs, return_stats=True
        )
        assert torch.equal(out.output_ids, expected)
        assert len(out.expected_acceptance_lengths) == len(out.acceptance_lengths)
        if costs is FLAT:
            assert set(widths[1:]) == {11}
        elif costs is STEEP:
            assert set(widths[1:]) == {1} and set(out.acceptance_lengths) == {1}
        else:
            assert len(set(widths[1:])) > 1, f"widths {widths[1:]}"


def cost_sized_rows(draft, target, prompts: list[list[int]], **settings) -> tuple[list[list[int]], object]:
    """Each left-padded prompt's 30 new tokens under cost sizing (no stop token), and the call's stats."""
    from test_batch_dflash import left_pad, new_tokens

    ids, mask = left_pad(prompts)
    out = draft.spec_generate(
        target,
        ids,
        attention_mask=mask,
        max_new_tokens=30,
        stop_token_ids=None,
        tree_sizing="cost",
        return_stats=True,
        **settings,
    )
    return new_tokens(out.output_ids, ids.shape[1], [30] * len(prompts)), out


def test_cost_sized_trees_in_a_batch_share_one_width_and_stay_exact():
    from test_batch_dflash import REPEATING, expected_rows

    target, draft = make_target("qwen3"), make_draft()
    widths = verify_widths(target)
    between = VerifyCosts([1, 48], [0.010, 0.0194])
    rows, out = cost_sized_rows(
        draft, target, REPEATING, tree_budget=12, prompt_lookup_num_tokens=3, verify_costs=between
    )
    assert rows == expected_rows(target, REPEATING, 30)
    assert len(set(widths[1:])) > 1 and max(widths[1:]) <= 1 + 12 + 3
    assert [len(e) for e in out.expected_acceptance_lengths] == [len(a) for a in out.acceptance_lengths]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"tree_sizing": "auto"}, "tree_sizing must be 'cost' or 'fixed'"),
        ({"tree_sizing": "cost"}, "set tree_budget"),
        ({"tree_sizing": "cost", "tree_budget": 4, "compile_verify": True}, "verifies one shape every round"),
    ],
)
def test_bad_sizing_requests_fail_before_compute(kwargs, message):
    target, calls = watched_target()
    with pytest.raises(ValueError, match=message):
        make_draft().spec_generate(target, torch.tensor([[5, 6]]), max_new_tokens=4, **kwargs)
    assert not calls


def test_the_tree_and_cost_rules_import_neither_torch_nor_transformers():
    """`tree_dflash` is shared with the MLX port: with torch and transformers unimportable, it builds, cuts and
    walks a tree and sizes a verify."""
    code = (
        "import sys; sys.modules['torch'] = sys.modules['transformers'] = None\n"
        "import tree_dflash as t\n"
        "tree = t.best_first([[-0.1, -2.0], [-0.2, -3.0]], [[4, 5], [6, 7]], 3)\n"
        "width = t.sized_width([sorted(tree.path_probs(), reverse=True)], t.VerifyCosts([1, 4], [0.01, 0.01]), 0.0)\n"
        "print(tree.tokens, tree.prefix(width).accept([4, 6, 9, 9]), width)\n"
    )
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[4,", "6,", "5]", "[0,", "1,", "2]", "3"]


def sizer_rounds(sizer: TreeSizer, rounds: int) -> str:
    """Which of `rounds` rounds draft ("d") and which are plain steps ("."), each drafted round a one-node tree."""
    tree, pattern = DraftTree([4], [0], [1], [math.log(0.9)]), ""
    for _ in range(rounds):
        if not sizer.drafts():
            pattern += "."
            continue
        sizer.start_draft()
        sizer.cut([tree], [[]])
        sizer.accepted([[0]])
        pattern += "d"
    return pattern


def test_drafts_that_cannot_pay_give_way_to_plain_steps_for_twice_as_long_each_time():
    """A drafted round slower than a plain step makes the next 1, 2, 4, ... rounds plain steps; one that pays brings
    back drafting every round, and the back-off starts again from one round."""
    assert sizer_rounds(TreeSizer(FLAT), 6) == "dddddd"
    sizer = TreeSizer(STEEP)  # a drafted token costs a whole decode step, so no draft pass pays
    assert sizer_rounds(sizer, 16) == "d.d..d....d....."
    sizer.costs = FLAT
    assert sizer_rounds(sizer, 7) == "...dddd"
    sizer.costs = STEEP
    assert sizer_rounds(sizer, 6) == "d.d..d"
    sizer = TreeSizer(STEEP)
    assert sizer_rounds(sizer, 200).count("d") == 5 + (200 - 63) // 33 + 1, "the back-off stops at MAX_SKIP rounds"


def draft_reads(draft) -> list[tuple[list[list[int]], list[int]]]:
    """Per draft pass: each row's context positions the pass reads (its unmasked ones) and each row's block start."""
    reads = []

    def record(module, args, kwargs):
        n, positions = kwargs["context_hidden_states"].shape[1], kwargs["position_ids"]
        mask = kwargs.get("attention_mask")
        block = positions.shape[1] - n
        keys = mask[:, -(n + block) : -block].bool() if mask is not None else torch.ones_like(positions[:, :n]).bool()
        read = [row[k].tolist() for row, k in zip(positions[:, :n], keys)]
        reads.append((read, positions[:, n].tolist()))

    draft.register_forward_pre_hook(record, with_kwargs=True)
    return reads


def assert_every_committed_position_read_once(reads):
    """Across the passes, each row's context positions run from 0 without gap or repeat, and each pass's block
    starts right after them."""
    seen = [[] for _ in reads[0][0]]
    for read, block_starts in reads:
        for row, positions in enumerate(read):
            seen[row] += positions
            assert seen[row] == list(range(block_starts[row])), f"row {row}"


@pytest.mark.parametrize("batch", [False, True])
def test_plain_steps_leave_their_features_for_the_next_draft_pass_and_stay_exact(batch):
    """fp32, a steep t(n): most rounds are plain steps with no draft pass (1 + 1 + 2 + 4 + 8 ... rounds apart), the
    next pass reads every token they committed, once, at its position, and every row equals plain greedy decoding."""
    from test_batch_dflash import REPEATING, expected_rows

    target, draft = make_target("qwen3"), make_draft()
    prompts = REPEATING if batch else REPEATING[:1]
    reads = draft_reads(draft)
    rows, out = cost_sized_rows(draft, target, prompts, tree_budget=6, verify_costs=STEEP)
    assert rows == expected_rows(target, prompts, 30)
    taus = out.acceptance_lengths if batch else [out.acceptance_lengths]
    assert all(row == [1] * 29 for row in taus), "29 plain steps after the prefill's token"
    assert len(reads) == 5, "draft passes in rounds 1, 3, 6, 11 and 20 of 29"
    assert_every_committed_position_read_once(reads)
