"""Draft trees (`tree_dflash.py`): the builder, the mask, cache compaction, and exact decoding through
`spec_generate`."""

import itertools
import math

import pytest
import torch
import transformers
from conftest import (
    ALL_WINDOW,
    MIXED_WINDOW,
    VOCAB,
    OracleDraft,
    SecondChoiceDraft,
    chi_square_p_value,
    exact_two_token_distribution,
    greedy_reference,
    make_draft,
    make_draft_config,
    make_target,
    sample_two_tokens,
    watched_target,
)
from transformers import DynamicCache, LogitsProcessorList, TemperatureLogitsWarper

import decoding_dflash
import plan_dflash
import tree_dflash
from cache_dflash import cache_kwarg, compact_cache
from decoding_dflash import drafted_trees
from proposal_dflash import ancestors, build_tree, tree_attention_mask, tree_position_ids
from tree_dflash import DraftTree, mask_layout, prompt_lookup


def cached_pass(target, cache: DynamicCache, **kwargs) -> None:
    with torch.no_grad():
        target(use_cache=True, **{cache_kwarg(target): cache}, **kwargs)


def path_tokens(tree: DraftTree, node: int) -> tuple[int, ...]:
    tokens = []
    while node:
        tokens.append(tree.tokens[node - 1])
        node = tree.parents[node - 1]
    return tuple(reversed(tokens))


def all_prefix_scores(log_probs: torch.Tensor) -> dict[tuple[int, ...], float]:
    """Every token path of every depth, with the sum of its log-probabilities (brute force)."""
    depth, vocab = log_probs.shape
    return {
        path: sum(float(log_probs[d, t]) for d, t in enumerate(path))
        for n in range(1, depth + 1)
        for path in itertools.product(range(vocab), repeat=n)
    }


@pytest.mark.parametrize("budget", [1, 3, 7, 20])
def test_builder_takes_the_best_paths_best_first(budget):
    log_probs = torch.log_softmax(torch.randn(3, 5, generator=torch.Generator().manual_seed(budget)) * 2, dim=-1)
    tree = build_tree(log_probs, budget)
    scores = all_prefix_scores(log_probs)
    best = sorted(scores, key=scores.get, reverse=True)[:budget]
    paths = [path_tokens(tree, node) for node in range(1, len(tree.tokens) + 1)]
    assert len(paths) == budget and set(paths) == set(best)
    taken = [scores[p] for p in paths]
    assert taken == sorted(taken, reverse=True), "nodes must come in score order"
    assert all(parent < node for node, parent in enumerate(tree.parents, 1)), "parents precede children"
    assert tree.depths == [len(p) for p in paths] and max(tree.depths) <= 3


def test_builder_respects_depth_and_never_proposes_impossible_tokens():
    log_probs = torch.full((2, 6), float("-inf"))
    log_probs[:, :2] = math.log(0.5)
    tree = build_tree(log_probs, 100)
    assert len(tree.tokens) == 2 + 4 and set(tree.tokens) == {0, 1} and max(tree.depths) == 2


@pytest.mark.parametrize("budget", [None, 1, 4, 9])
def test_draft_vocabulary_scores_propose_what_whole_vocabulary_logits_do(budget):
    # spec_generate scores the draft's vocabulary only; the tree and chain must equal those of the -inf-padded logits
    vocab = torch.tensor([7, 2, 11, 5, 0])
    compact = torch.randn(1, 3, len(vocab), generator=torch.Generator().manual_seed(3)) * 2
    full = torch.full((1, 3, 12), float("-inf")).index_copy_(-1, vocab, compact)
    warpers = LogitsProcessorList([TemperatureLogitsWarper(0.7)])
    plan = plan_dflash.TreePlan(budget=budget)
    for warp in [None, warpers]:
        (expected,), (got,) = drafted_trees(full, None, plan, warp), drafted_trees(compact, vocab, plan, warp)
        assert (got.tokens, got.parents, got.depths) == (expected.tokens, expected.parents, expected.depths)
    assert set(got.tokens) <= set(vocab.tolist())


def test_mask_and_positions_of_a_hand_built_tree():
    #      root
    #     /    \
    #    1(a)   2(b)
    #    |       \
    #    3(c)     4(d)
    #    |
    #    5(e)
    tree = DraftTree(tokens=[10, 11, 12, 13, 14], parents=[0, 0, 1, 2, 3], depths=[1, 1, 2, 2, 3])
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 0, 1, 0, 0, 0],
            [1, 1, 0, 1, 0, 0],
            [1, 0, 1, 0, 1, 0],
            [1, 1, 0, 1, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(ancestors(tree), expected)
    mask = tree_attention_mask(tree, cache_len=3, dtype=torch.float32, device="cpu")
    assert mask.shape == (1, 1, 6, 9)
    assert torch.equal(mask[0, 0] == 0, torch.cat([torch.ones(6, 3, dtype=torch.bool), expected], dim=1))
    assert tree_position_ids(tree, 7, "cpu").tolist() == [[7, 8, 8, 9, 9, 10]]
    # the target chose b at the root, d at b, and something absent at d
    assert tree.accept([11, 99, 13, 99, 7, 99]) == [0, 2, 4]
    assert tree.accept([42, 0, 0, 0, 0, 0]) == [0]
    assert not tree.is_chain() and DraftTree.chain([4, 5, 6]).is_chain()


def test_compacted_cache_equals_the_cache_of_the_committed_tokens():
    """Verify a tree, keep a path that is not a prefix of the node order, and compare with a plain pass."""
    target = make_target("qwen3")
    prompt = torch.tensor([[5, 6, 7, 8]])
    tree = DraftTree(tokens=[10, 11, 12, 13, 14], parents=[0, 0, 1, 2, 3], depths=[1, 1, 2, 2, 3])
    cache, reference = DynamicCache(), DynamicCache()
    cached_pass(target, cache, input_ids=prompt[:, :-1])
    cached_pass(
        target,
        cache,
        input_ids=torch.tensor([[8, *tree.tokens]]),
        position_ids=tree_position_ids(tree, 3, "cpu"),
        attention_mask=tree_attention_mask(tree, 3, torch.float32, "cpu"),
    )
    compact_cache(cache, 3, [0, 2, 4])  # root, b, d
    cached_pass(target, reference, input_ids=torch.tensor([[5, 6, 7, 8, 11, 13]]))
    assert cache.get_seq_length() == reference.get_seq_length() == 6
    for ours, plain in zip(cache.layers, reference.layers):
        torch.testing.assert_close(ours.keys, plain.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ours.values, plain.values, atol=1e-5, rtol=1e-5)


@pytest.fixture
def recorded_paths(monkeypatch):
    """Every accepted path `spec_generate` compacts the cache to, with a copy of the cache right after."""
    paths, caches = [], []

    def recording(cache, first, path):
        compact_cache(cache, first, path)
        paths.append(path)
        caches.append([(layer.keys.clone(), layer.values.clone()) for layer in cache.layers])

    monkeypatch.setattr(decoding_dflash, "compact_cache", recording)
    return paths, caches


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2", "mistral"])
@pytest.mark.parametrize("block_size", [4, 8, 16])
@pytest.mark.parametrize("budget", [1, 4, 16, 32])
def test_tree_greedy_equals_target_greedy(arch, block_size, budget):
    target, draft = make_target(arch), make_draft()
    for prompt_len in (1, 9):
        ids = torch.randint(3, VOCAB - 1, (1, prompt_len), generator=torch.Generator().manual_seed(prompt_len))
        max_new = 2 * block_size + 3
        out = draft.spec_generate(
            target=target, input_ids=ids, max_new_tokens=max_new, block_size=block_size, tree_budget=budget
        )
        assert torch.equal(out, greedy_reference(target, ids, max_new)), f"{arch} B={block_size} budget={budget}"


@pytest.mark.parametrize("block_size", [4, 8, 16])
@pytest.mark.parametrize("budget", [1, 4, 16, 32])
def test_tree_accepts_the_second_choice_where_the_chain_cannot(block_size, budget, recorded_paths):
    """Right for k tokens, then right only in second place: the chain accepts k drafted tokens, a tree with room
    for that second choice (its B-th best node) k + 1. Output stays exact and the cache matches plain decoding."""
    target = make_target("qwen3")
    ids = torch.randint(3, VOCAB - 1, (1, 6), generator=torch.Generator().manual_seed(0))
    max_new = 3 * block_size
    reference = greedy_reference(target, ids, max_new + block_size)
    paths, caches = recorded_paths
    for k in range(block_size - 1):
        paths.clear(), caches.clear()
        draft = SecondChoiceDraft(make_draft_config()).eval().setup(target, reference, k)
        chain = draft.spec_generate(
            target=target, input_ids=ids, max_new_tokens=max_new, block_size=block_size, return_stats=True
        )
        tree = draft.spec_generate(
            target=target,
            input_ids=ids,
            max_new_tokens=max_new,
            block_size=block_size,
            tree_budget=budget,
            return_stats=True,
        )
        assert torch.equal(chain.output_ids, reference[:, : 6 + max_new]) and torch.equal(
            tree.output_ids, chain.output_ids
        )
        assert set(chain.acceptance_lengths[:-1]) == {k + 1}, f"k={k}"
        expected = k + 2 if budget >= block_size else min(k, budget) + 1
        assert set(tree.acceptance_lengths[:-1]) == {expected}, f"k={k} budget={budget}"
        tree_paths = paths[len(chain.acceptance_lengths) :]
        assert any(p != list(range(len(p))) for p in tree_paths) == (budget >= block_size), (
            "the second choice was taken"
        )
        last_cache = caches[-1]
        # the cache holds every committed token but the last round's bonus
        assert last_cache[0][0].shape[-2] == 6 + sum(tree.acceptance_lengths)
        plain = DynamicCache()
        cached_pass(target, plain, input_ids=reference[:, : 6 + sum(tree.acceptance_lengths)])
        for (keys, values), layer in zip(last_cache, plain.layers):
            torch.testing.assert_close(keys, layer.keys, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(values, layer.values, atol=1e-5, rtol=1e-5)


def test_tree_sampling_matches_target_distribution(recorded_paths):
    """Chi-square test of the first two sampled tokens through a tree against the exact target distribution.

    The second token is decided at depth 1 of the tree, where the draft ranks a wrong token first and the greedy
    token second, so the walk often takes the second branch; the test checks it did, and fails at p < 1e-4.
    """
    target = make_target("llama", initializer_range=0.5)
    ids, temperature, n = torch.tensor([[5, 6, 7]]), 1.0, 2000
    exact = exact_two_token_distribution(target, ids, LogitsProcessorList([TemperatureLogitsWarper(temperature)]))
    draft = SecondChoiceDraft(make_draft_config()).eval().setup(target, greedy_reference(target, ids, 8), 0)
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(VOCAB * VOCAB)
    paths, _ = recorded_paths
    for _ in range(n):
        out = draft.spec_generate(
            target=target,
            input_ids=ids,
            max_new_tokens=2,
            temperature=temperature,
            block_size=4,
            tree_budget=8,
            generator=g,
        )
        t1, t2 = out[0, 3:].tolist()
        counts[t1 * VOCAB + t2] += 1
    assert len(paths) == n, "one tree round per call"
    assert sum(len(p) > 1 and p[1] != 1 for p in paths) > n // 10, "the walk must often take the second branch"
    p_value, chi2, dof = chi_square_p_value(counts, exact)
    assert p_value > 1e-4, f"chi2={chi2:.1f} dof={dof} p={p_value:.2e}"


def test_draft_config_sets_the_default_budget_and_zero_asks_for_the_chain():
    target, draft = make_target("llama"), make_draft()  # block size 8: a chain verifies 8 tokens, this tree 7
    ids = torch.tensor([[5, 6, 7]])
    expected, lengths = greedy_reference(target, ids, 12), []
    target.register_forward_pre_hook(
        lambda module, args, kwargs: lengths.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    draft.config.tree_budget = 6
    assert draft.config.dflash_config["tree_budget"] == 6
    for budget, verified in ((None, 7), (0, 8), (3, 4)):
        lengths.clear()
        out = draft.spec_generate(target=target, input_ids=ids, max_new_tokens=12, tree_budget=budget)
        assert torch.equal(out, expected) and set(lengths[1:]) == {verified}, (budget, lengths)
    lengths.clear()  # the heuristic schedule adapts a chain, so the config's tree yields to it
    out = draft.spec_generate(target=target, input_ids=ids, max_new_tokens=12, block_size_schedule="heuristic")
    assert torch.equal(out, expected) and lengths[1] == 8, (
        lengths
    )  # a chain of the whole block first, not a 7-node tree
    draft.config.tree_budget = None
    assert "tree_budget" not in draft.config.dflash_config


@pytest.mark.parametrize(
    "target_kwargs, kwargs, message",
    [
        ({}, {"tree_budget": -1}, "tree_budget must be at least 1"),
        ({}, {"tree_budget": 4, "block_size_schedule": "heuristic"}, "adapts a chain"),
        ({"attn": "flash_attention_2"}, {"tree_budget": 4}, "takes a custom 4D mask"),
        (MIXED_WINDOW, {"tree_budget": 4}, "needs a mask per layer type"),
    ],
)
def test_unsupported_tree_requests_fail_before_compute(target_kwargs, kwargs, message, monkeypatch):
    monkeypatch.setattr(tree_dflash, "takes_masks_by_layer_type", lambda decoder: False)
    target, calls = watched_target(**target_kwargs)
    with pytest.raises(ValueError, match=message):
        make_draft().spec_generate(target=target, input_ids=torch.tensor([[5, 6]]), max_new_tokens=32, **kwargs)
    assert not calls, "the target ran before the error"


def test_the_config_tree_steps_aside_for_a_target_that_cannot_verify_it(monkeypatch):
    """A config's tree is a default: for a target that mixes sliding and full layers but takes one mask for both,
    which the call could outgrow (or attention without a 4D mask), the chain is verified, with a warning, and output
    stays exact; an explicit tree_budget still raises."""
    monkeypatch.setattr(tree_dflash, "takes_masks_by_layer_type", lambda decoder: False)
    target = make_target(**MIXED_WINDOW)
    ids = torch.tensor([[5, 6, 7]])
    expected = greedy_reference(target, ids, 32)
    lengths = []
    target.register_forward_pre_hook(
        lambda module, args, kwargs: lengths.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    draft = OracleDraft(make_draft_config()).eval().setup(target, expected, 3)
    draft.config.tree_budget = 4
    with pytest.warns(
        UserWarning, match="verifying the argmax chain instead of the draft config's tree of 4: .*mask per layer type"
    ) as record:
        out = draft.spec_generate(target=target, input_ids=ids, max_new_tokens=32)
    assert record[0].filename == __file__, "the warning points at the caller's line"
    assert torch.equal(out, expected) and set(lengths[1:]) == {8}, lengths  # chains of the whole block
    with pytest.raises(ValueError, match="needs a mask per layer type"):
        draft.spec_generate(target=target, input_ids=ids, max_new_tokens=32, tree_budget=4)
    fa2 = make_target("llama")
    fa2.config._attn_implementation_internal = "flash_attention_2"  # only read: the decision comes before any pass
    with pytest.warns(UserWarning, match="takes a custom 4D mask"):
        assert plan_dflash.default_tree_budget(draft, fa2, "constant") is None
    assert plan_dflash.default_tree_budget(draft, make_target("llama"), "constant") == 4
    draft.config.tree_budget, draft.config.prompt_lookup_num_tokens = (
        None,
        3,
    )  # a config's lookup branch steps aside too
    lengths.clear()
    with pytest.warns(
        UserWarning, match="instead of the draft config's prompt_lookup_num_tokens=3: .*mask per layer type"
    ):
        out = draft.spec_generate(target=target, input_ids=ids, max_new_tokens=32)
    assert torch.equal(out, expected) and set(lengths[1:]) == {8}, lengths
    with pytest.raises(ValueError, match="prompt_lookup_num_tokens=3.*needs a mask per layer type"):
        draft.spec_generate(target=target, input_ids=ids, max_new_tokens=32, prompt_lookup_num_tokens=3)


@pytest.mark.parametrize("target_kwargs, by_type", [(ALL_WINDOW, False), (MIXED_WINDOW, True)], ids=["all", "mixed"])
@pytest.mark.parametrize("k", [0, 2, 5])
def test_trees_stay_exact_past_a_sliding_window(target_kwargs, by_type, k):
    """Far past the window (8 tokens), a tree and a lookup branch verified with the window applied to the mask (to
    every layer, or by layer type where only some slide) give plain greedy output, for a draft right for k tokens;
    the masks hid cached keys outside the window."""
    target = make_target(**target_kwargs)
    ids = torch.tensor([[5, 6, 7]])
    expected = greedy_reference(target, ids, 40)
    masks = []
    target.register_forward_pre_hook(
        lambda m, args, kwargs: masks.append(kwargs.get("attention_mask")), with_kwargs=True
    )
    draft = OracleDraft(make_draft_config()).eval().setup(target, expected, k)
    out = draft.spec_generate(target, ids, max_new_tokens=40, tree_budget=4, prompt_lookup_num_tokens=3)
    assert torch.equal(out, expected)
    assert mask_layout(target) == (8, by_type)
    sliding = [m["sliding_attention"] if by_type else m for m in masks[1:]]
    hidden = [(mask[0, 0, :, : mask.shape[-1] - mask.shape[-2]] < 0).any() for mask in sliding]
    assert any(hidden) and all(hidden[-5:]), "late verifies must hide keys outside the window"


# ---------------------------------------------------------------------------------------------------------------------
# Prompt-lookup branches.


def test_prompt_lookup_follows_transformers_rule():
    from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

    g = torch.Generator().manual_seed(0)
    for trial in range(200):
        ids = torch.randint(3, 9, (1, int(torch.randint(2, 40, (1,), generator=g))), generator=g)
        num, ngram = int(torch.randint(1, 8, (1,), generator=g)), int(torch.randint(1, 4, (1,), generator=g))
        theirs = PromptLookupCandidateGenerator(  # an EOS never drafted: transformers 4.57 needs one
            eos_token_id=torch.tensor([-1]), num_output_tokens=num, max_matching_ngram_size=ngram, max_length=10**6
        )
        candidates, _ = theirs.get_candidates(ids)
        assert prompt_lookup(ids[0].tolist(), num, ngram) == candidates[0, ids.shape[1] :].tolist(), trial


def test_a_branch_reuses_the_shared_prefix_and_keeps_parents_first():
    tree = DraftTree([5, 6, 9, 7], [0, 1, 0, 2], [1, 2, 1, 3])  # 5 -> 6 -> 7 and 9
    merged = tree.with_branch([5, 6, 8, 4])
    assert (
        merged.tokens == [5, 6, 9, 7, 8, 4]
        and merged.parents == [0, 1, 0, 2, 2, 5]
        and merged.depths == [1, 2, 1, 3, 3, 4]
    )
    assert tree.tokens == [5, 6, 9, 7]  # the draft's tree is left as it was
    assert merged.accept([5, 6, 8, 0, 0, 4, 1]) == [0, 1, 2, 5, 6]  # the walk goes down the lookup branch
    assert tree.with_branch([5, 6]) == tree and tree.with_branch([]) == tree


def lookup_nodes_taken(paths: list[list[int]], draft_nodes: int) -> int:
    """Rounds whose accepted path went through a node only the lookup branch added (appended after the draft's)."""
    return sum(any(node > draft_nodes for node in path) for path in paths)


@pytest.mark.parametrize("budget", [0, 4])
@pytest.mark.parametrize("lookup", [1, 3, 7])
def test_lookup_branches_keep_greedy_exact_at_every_partial_acceptance(budget, lookup, recorded_paths):
    """A draft right for k tokens per block, then wrong, plus lookup branches: output equals plain greedy at every k,
    and with k = 0 (the draft never right) the lookup branch alone is accepted in some rounds."""
    target = make_target("qwen3")
    paths, _ = recorded_paths
    taken = 0
    for seed in range(3):
        ids = torch.randint(3, VOCAB - 1, (1, 6), generator=torch.Generator().manual_seed(seed))
        max_new = 40
        reference = greedy_reference(target, ids, max_new + 8)
        for k in range(0, 7, 2):
            paths.clear()
            draft = OracleDraft(make_draft_config()).eval().setup(target, reference, k)
            out = draft.spec_generate(
                target=target,
                input_ids=ids,
                max_new_tokens=max_new,
                tree_budget=budget,
                prompt_lookup_num_tokens=lookup,
                return_stats=True,
            )
            assert torch.equal(out.output_ids, reference[:, : 6 + max_new]), f"seed={seed} k={k}"
            if k == 0:
                lookup_rounds = lookup_nodes_taken(paths, budget or 7)
                # the draft is never right here, so every round that commits more than its bonus took the lookup branch
                assert sum(n > 1 for n in out.acceptance_lengths) == lookup_rounds, f"seed={seed}"
                taken += lookup_rounds
    assert taken > 0, "no round accepted a lookup-only branch"


def planted_prompt(target) -> torch.Tensor:
    """A prompt `[z, c1, c2, y.., z]` whose greedy continuation is `c1, c2`: after sampling `c1`, lookup proposes
    `c2`."""
    for seed in range(100):
        body = torch.randint(3, VOCAB - 1, (6,), generator=torch.Generator().manual_seed(seed)).tolist()
        planted = [0, 0]
        for _ in range(4):
            ids = torch.tensor([[body[-1], *planted, *body]])
            found = greedy_reference(target, ids, 2)[0, -2:].tolist()
            if found == planted:
                return ids
            planted = found
    raise AssertionError("no prompt found")


def test_lookup_branch_sampling_matches_target_distribution(recorded_paths):
    """Chi-square of two sampled tokens against the exact distribution, with a wrong draft and a lookup branch that
    the walk takes in a good share of the runs (checked); fails at p < 1e-4."""
    target = make_target("llama", initializer_range=0.5)
    ids = planted_prompt(target)
    temperature, n = 1.0, 2000
    exact = exact_two_token_distribution(target, ids, LogitsProcessorList([TemperatureLogitsWarper(temperature)]))
    draft = (
        OracleDraft(make_draft_config()).eval().setup(target, torch.zeros(1, 64, dtype=torch.long), -1)
    )  # never right
    paths, _ = recorded_paths
    counts, _ = sample_two_tokens(
        draft, target, ids, n, temperature, new_tokens=2, prompt_lookup_num_tokens=4, tree_budget=2
    )
    taken = lookup_nodes_taken(paths, 2)
    assert taken > n // 20, f"the lookup branch was accepted in {taken} of {n} runs"
    p_value, chi2, dof = chi_square_p_value(counts, exact)
    assert p_value > 1e-4, f"chi2={chi2:.1f} dof={dof} p={p_value:.2e}"


def test_draft_config_sets_the_default_lookup_and_bad_settings_are_refused():
    target, draft = make_target("llama"), make_draft()
    ids = torch.tensor([[5, 6, 7, 5, 6]])
    sizes = []
    target.register_forward_pre_hook(
        lambda module, args, kwargs: sizes.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    draft.config.prompt_lookup_num_tokens = 3
    assert draft.config.to_dict()["dflash_config"]["prompt_lookup_num_tokens"] == 3
    out = draft.spec_generate(target=target, input_ids=ids, max_new_tokens=12, tree_budget=0)
    assert torch.equal(out, greedy_reference(target, ids, 12))
    assert max(sizes[1:]) > 8  # the chain's 8 tokens plus a lookup branch
    sizes.clear()
    draft.spec_generate(target=target, input_ids=ids, max_new_tokens=12, tree_budget=0, prompt_lookup_num_tokens=0)
    assert max(sizes[1:]) == 8
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="prompt_lookup_num_tokens"):
            draft.spec_generate(target=target, input_ids=ids, max_new_tokens=4, prompt_lookup_num_tokens=bad)
    with pytest.raises(ValueError, match="max_matching_ngram_size"):
        draft.spec_generate(
            target=target, input_ids=ids, max_new_tokens=4, prompt_lookup_num_tokens=2, max_matching_ngram_size=0
        )
    with pytest.raises(ValueError, match="prompt_lookup_num_tokens=2.*'constant'"):
        draft.spec_generate(
            target=target, input_ids=ids, max_new_tokens=4, prompt_lookup_num_tokens=2, block_size_schedule="heuristic"
        )


@pytest.mark.parametrize("min_prob", [0.0, 0.05, 0.3, 1.0])
def test_builder_leaves_out_nodes_below_the_min_prob(min_prob):
    log_probs = torch.log_softmax(torch.randn(4, 6, generator=torch.Generator().manual_seed(1)) * 2, dim=-1)
    full = build_tree(log_probs, 30)
    scores = all_prefix_scores(log_probs)
    threshold = math.log(min_prob) if min_prob else -math.inf
    cut = build_tree(log_probs, 30, min_log_prob=threshold)
    n = len(cut.tokens)
    assert (cut.tokens, cut.parents) == (full.tokens[:n], full.parents[:n]), "a best-first prefix of the uncut tree"
    assert all(scores[path_tokens(full, node)] >= threshold for node in range(1, n + 1))
    assert n == 30 or scores[path_tokens(full, n + 1)] < threshold, "the first node left out is below the cut"
    assert n == {0.0: 30, 1.0: 0}[min_prob] if min_prob in (0.0, 1.0) else 0 < n < 30


@pytest.mark.parametrize("block_size", [4, 8])
def test_a_min_prob_leaves_out_the_unlikely_second_choice_and_stays_exact(block_size, recorded_paths):
    """The second choice after k sure tokens has draft probability about 0.007: a min prob of 0.001 keeps it (k + 2
    accepted, as the tree), one of 0.01 leaves it out (k + 1, as the chain); output is plain greedy either way."""
    target = make_target("qwen3")
    ids = torch.randint(3, VOCAB - 1, (1, 6), generator=torch.Generator().manual_seed(0))
    max_new = 3 * block_size
    reference = greedy_reference(target, ids, max_new + block_size)
    for k in range(block_size - 1):
        draft = SecondChoiceDraft(make_draft_config()).eval().setup(target, reference, k)
        for min_prob, expected in ((0.001, k + 2), (0.01, k + 1)):
            out = draft.spec_generate(
                target=target,
                input_ids=ids,
                max_new_tokens=max_new,
                block_size=block_size,
                tree_budget=2 * block_size,
                tree_min_prob=min_prob,
                return_stats=True,
            )
            assert torch.equal(out.output_ids, reference[:, : 6 + max_new]), f"k={k} min_prob={min_prob}"
            assert set(out.acceptance_lengths[:-1]) == {expected}, f"k={k} min_prob={min_prob}"


@pytest.mark.parametrize("lookup", [0, 3])
def test_an_unsure_draft_verifies_fewer_tokens_and_output_stays_exact(lookup):
    """A random draft is never sure: with a min prob of 0.9 most rounds verify the last token alone (plus any lookup
    branch), and output still equals plain greedy."""
    target, draft = make_target("llama"), make_draft()
    sizes = []
    target.register_forward_pre_hook(
        lambda module, args, kwargs: sizes.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    for seed in range(3):
        ids = torch.randint(3, VOCAB - 1, (1, 5), generator=torch.Generator().manual_seed(seed))
        out = draft.spec_generate(
            target=target,
            input_ids=ids,
            max_new_tokens=20,
            tree_budget=6,
            tree_min_prob=0.9,
            prompt_lookup_num_tokens=lookup,
        )
        assert torch.equal(out, greedy_reference(target, ids, 20)), f"seed={seed}"
    assert sizes.count(1) > len(sizes) // 2, f"verify lengths {sizes}"


def test_confidence_sized_tree_sampling_matches_target_distribution(recorded_paths):
    """Chi-square of two sampled tokens through trees whose size follows the draft's confidence (checked: rounds
    verified different numbers of nodes); fails at p < 1e-4."""
    target = make_target("llama", initializer_range=0.5)
    ids, temperature, n = torch.tensor([[5, 6, 7]]), 1.0, 2000
    exact = exact_two_token_distribution(target, ids, LogitsProcessorList([TemperatureLogitsWarper(temperature)]))
    draft = make_draft(initializer_range=0.5)
    sizes = []
    target.register_forward_pre_hook(
        lambda module, args, kwargs: sizes.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    counts, _ = sample_two_tokens(draft, target, ids, n, temperature, new_tokens=2, tree_budget=6, tree_min_prob=0.05)
    assert len(set(sizes[1::2])) > 1, f"tree sizes must vary with the draft's confidence: {set(sizes[1::2])}"
    p_value, chi2, dof = chi_square_p_value(counts, exact)
    assert p_value > 1e-4, f"chi2={chi2:.1f} dof={dof} p={p_value:.2e}"


def test_bad_min_probs_are_refused_before_compute():
    target, draft = make_target("llama"), make_draft()
    ids = torch.tensor([[5, 6, 7]])
    for bad in (-0.1, 1.0, "0.2", True):
        with pytest.raises(ValueError, match="tree_min_prob"):
            draft.spec_generate(target=target, input_ids=ids, max_new_tokens=4, tree_budget=4, tree_min_prob=bad)
    with pytest.raises(ValueError, match="verifies the chain"):
        draft.spec_generate(
            target=target, input_ids=ids, max_new_tokens=4, tree_budget=0, tree_min_prob=0.2, prompt_lookup_num_tokens=0
        )


@pytest.mark.skipif(
    not hasattr(transformers, "Ministral3Config"), reason="Ministral 3 is in transformers 5 and newer, not 4.57"
)
def test_a_target_scaling_attention_by_position_ids_stays_exact_in_trees_and_batches(monkeypatch):
    """transformers' Ministral 3 and Mistral 4 scale queries by `llama_4_scaling_beta` from `position_ids`, which trees
    and batches set to each token's own position, so they verify trees exactly (mlx-lm's, by cache offset, does not:
    refused in test_mlx_port.py). Every acceptance length, a tree with the lookup branch, and a left-padded batch."""
    import conftest

    monkeypatch.setitem(conftest.TARGET_CONFIGS, "ministral3", transformers.Ministral3Config)
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 1.0, "original_max_position_embeddings": 4}
    target = make_target("ministral3", initializer_range=0.2, rope_parameters={**rope, "llama_4_scaling_beta": 2.0})
    unscaled = make_target("ministral3", initializer_range=0.2, rope_parameters={**rope, "llama_4_scaling_beta": 0.0})
    ids = torch.tensor([[5, 6, 7]])
    expected = greedy_reference(target, ids, 24)
    assert not torch.equal(expected, greedy_reference(unscaled, ids, 24)), "the scale must change the output"
    for k in range(8):
        draft = SecondChoiceDraft(make_draft_config()).eval().setup(target, expected, k)
        out = draft.spec_generate(target, ids, max_new_tokens=24, tree_budget=8, prompt_lookup_num_tokens=3)
        assert torch.equal(out, expected), k
    batch = make_draft().spec_generate(
        target,
        torch.tensor([[0, 0, 9], [5, 6, 7]]),
        attention_mask=torch.tensor([[0, 0, 1], [1, 1, 1]]),
        max_new_tokens=12,
        stop_token_ids=None,
    )
    assert torch.equal(batch[1], expected[0, :15]) and torch.equal(
        batch[0, 2:], greedy_reference(target, torch.tensor([[9]]), 12)[0]
    )


def test_a_target_scaling_attention_by_cache_slot_is_refused_for_trees_and_batches():
    """Llama 4's `attn_temperature_tuning` scales by cache slot; a tree node's or a batch row's slot is not its
    position. The chain (slots equal to positions) still runs."""
    target, draft = make_target("llama"), make_draft()
    target.config.attn_temperature_tuning = True
    calls = []
    target.register_forward_pre_hook(lambda *a: calls.append(1))
    ids = torch.tensor([[5, 6, 7]])
    with pytest.raises(ValueError, match="scales attention by the slot"):
        draft.spec_generate(target=target, input_ids=ids, max_new_tokens=4, tree_budget=4)
    with pytest.raises(ValueError, match="scales attention by the slot"):
        draft.spec_generate(target=target, input_ids=ids, max_new_tokens=4, tree_budget=0, prompt_lookup_num_tokens=3)
    with pytest.raises(ValueError, match="batch verification .* scales attention by the slot"):
        draft.spec_generate(target=target, input_ids=torch.tensor([[5, 6, 7], [8, 9, 10]]), max_new_tokens=4)
    assert not calls, "the target ran before the error"
    chain = draft.spec_generate(
        target=target, input_ids=ids, max_new_tokens=4, tree_budget=0, prompt_lookup_num_tokens=0
    )
    assert torch.equal(chain, greedy_reference(target, ids, 4))


class ListRows:
    """`decode_rounds`' rows over plain lists: each row's target continues its own `reference`, and its draft is right
    for its `ks` tokens, then wrong; `bare` leaves each chain "on the device" (None) until the verify."""

    def __init__(self, references: list[list[int]], ks: list[int], length: int, bare: bool = False):
        self.references, self.ks, self.length, self.bare = references, ks, length, bare
        self.outputs, self.drafts, self.verified, self.held = [[r[0]] for r in references], 0, [], []

    def live(self) -> int:
        return sum(len(out) < self.length for out in self.outputs)

    def histories(self) -> list[list[int]]:
        return [list(out) for out in self.outputs]

    def draft(self) -> list:
        self.drafts += 1
        self.held = [
            [ref[len(out) + i] if i < k else -1 for i in range(4)] for (ref, out), k in zip(self.pairs(), self.ks)
        ]
        return [None] * len(self.held) if self.bare else [tree_dflash.DraftTree.chain(c) for c in self.held]

    def verify(self, trees: list) -> tuple[list, list[list[int]]]:
        if self.bare and self.held:
            trees = [tree_dflash.DraftTree.chain(chain) for chain in self.held]
        self.verified.append([len(tree.tokens) for tree in trees])
        chosen = [
            [ref[len(out) + len(tree.path_tokens(node))] for node in range(len(tree.tokens) + 1)]
            for tree, (ref, out) in zip(trees, self.pairs())
        ]
        return trees, chosen

    def commit(self, step: tree_dflash.Round) -> None:
        for out, tokens in zip(self.outputs, step.committed()):
            out += tokens
        self.held = []

    def pairs(self):
        return list(zip(self.references, self.outputs))


class EveryOtherRound:
    """A sizer stub: drafts every other round, keeping the proposals whole."""

    def __init__(self):
        self.rounds, self.fed, self.timed = 0, [], []

    def drafts(self) -> bool:
        self.rounds += 1
        return self.rounds % 2 == 1

    def start_draft(self) -> None:
        pass

    def cut(self, trees, branches):
        return [t.with_branch(b) for t, b in zip(trees, branches)], [1.0 + len(t.tokens) for t in trees]

    def accepted(self, paths) -> None:
        self.fed.append([len(p) for p in paths])

    def verified(self, tokens, rows, seconds) -> None:
        self.timed.append((tokens, rows, seconds > 0))


REFERENCES = [list(range(100, 140)), list(range(200, 240))]


def test_decode_rounds_commits_each_rows_reference_and_follows_the_sizer():
    """The one round loop, framework-free: rows right for k = 2 tokens commit 3 a drafted round and 1 a plain step,
    their output is each row's reference, the draft runs only in drafted rounds (a plain step verifies no node), the
    sizer hears only drafted rounds' acceptance, and every round's verify: its tokens in all and its seconds."""
    rows, sizer = ListRows(REFERENCES, [2, 2], 20), EveryOtherRound()
    steps = list(tree_dflash.decode_rounds(rows, sizer=sizer))
    assert [out[:20] for out in rows.outputs] == [r[:20] for r in REFERENCES]
    assert [[len(p) for p in s.paths] for s in steps] == [[3, 3] if s.drafted else [1, 1] for s in steps]
    assert rows.drafts == sum(s.drafted for s in steps) > 0 and sizer.fed == [[3, 3]] * rows.drafts
    assert rows.verified == [[4, 4] if s.drafted else [0, 0] for s in steps]
    assert [s.estimates for s in steps] == [[5.0, 5.0] if s.drafted else [1.0, 1.0] for s in steps]
    assert sizer.timed == [(2 * 5, 2, True) if s.drafted else (2, 2, True) for s in steps]


@pytest.mark.parametrize("bare", [False, True])
def test_decode_rounds_takes_chains_left_on_the_device_and_aligns_rows(bare):
    """A chain the draft leaves on the device (None) is the tree its verify hands back; `align_rows` holds every row
    to the round's shortest path (the second row's draft is never right), and output stays each reference."""
    rows = ListRows(REFERENCES, [2, 2], 16, bare)
    assert all(len(p) == 3 for step in tree_dflash.decode_rounds(rows) for p in step.paths)
    assert [out[:16] for out in rows.outputs] == [r[:16] for r in REFERENCES]
    uneven = ListRows(REFERENCES, [2, 0], 12, bare)
    paths = [[len(p) for p in step.paths] for step in tree_dflash.decode_rounds(uneven, align_rows=True)]
    assert len(paths) == 11 and all(lengths == [1, 1] for lengths in paths)
    assert [out[:12] for out in uneven.outputs] == [r[:12] for r in REFERENCES]
