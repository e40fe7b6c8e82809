"""`draft.spec_generate`: exactness against plain target decoding, partial acceptance, sampling, stops and errors."""

import copy
import warnings

import pytest
import torch
from conftest import (
    MASK_ID,
    MISMATCHES,
    VOCAB,
    OracleDraft,
    chi_square_p_value,
    exact_joint_distribution,
    exact_two_token_distribution,
    float_linears,
    greedy_reference,
    make_draft,
    make_draft_config,
    make_target,
    sample_two_tokens,
)
from transformers import LogitsProcessorList, TemperatureLogitsWarper

from common.exactness import explained
from head_dflash import DraftHead, is_int8
from plan_dflash import check_draft_fits_target


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2", "mistral"])
@pytest.mark.parametrize("block_size", [2, 4, 8, 16])
def test_greedy_equals_target_greedy(arch, block_size):
    target, draft = make_target(arch), make_draft()
    for prompt_len in (1, 5, 64):
        ids = torch.randint(3, VOCAB - 1, (1, prompt_len), generator=torch.Generator().manual_seed(prompt_len))
        max_new = 3 * block_size + 1  # not a multiple of the block size
        expected = greedy_reference(target, ids, max_new)
        out = draft.spec_generate(
            target=target, input_ids=ids, max_new_tokens=max_new, temperature=0.0, block_size=block_size
        )
        assert torch.equal(out, expected), f"{arch} B={block_size} prompt={prompt_len}"


@pytest.mark.parametrize("block_size", [4, 8, 16])
def test_forced_partial_acceptance_at_every_k(block_size):
    """A draft right for exactly k tokens per block: output stays exact and every round accepts k + 1."""
    target = make_target("qwen3")
    ids = torch.randint(3, VOCAB - 1, (1, 6), generator=torch.Generator().manual_seed(0))
    max_new = 40
    reference = greedy_reference(target, ids, max_new + block_size)
    for k in range(block_size):
        draft = OracleDraft(make_draft_config()).eval().setup(target, reference, k)
        stats = draft.spec_generate(
            target=target,
            input_ids=ids,
            max_new_tokens=max_new,
            temperature=0.0,
            block_size=block_size,
            return_stats=True,
        )
        assert torch.equal(stats.output_ids, reference[:, : 6 + max_new]), f"k={k}"
        assert stats.acceptance_lengths[:-1] == [k + 1] * (len(stats.acceptance_lengths) - 1), f"k={k}"
        # the draft sees the whole prompt first, then exactly the tokens committed by the previous round
        assert draft.calls[0] == (6, 6) and all(n == k + 1 for n, _ in draft.calls[1:]), draft.calls
        assert stats.num_input_tokens == 6 and stats.num_output_tokens == max_new


def test_perfect_draft_needs_fewer_target_passes():
    target = make_target("llama")
    ids = torch.tensor([[5, 6, 7]])
    reference = greedy_reference(target, ids, 64)
    draft = OracleDraft(make_draft_config()).eval().setup(target, reference, 7)
    stats = draft.spec_generate(target=target, input_ids=ids, max_new_tokens=48, block_size=8, return_stats=True)
    assert torch.equal(stats.output_ids, reference[:, :51])
    assert len(stats.acceptance_lengths) == 6 and stats.mean_acceptance_length == 8


def test_stops_at_first_stop_token_inside_accepted_block():
    target = make_target("llama")
    ids = torch.tensor([[5, 6, 7]])
    reference = greedy_reference(target, ids, 40)
    stop = int(reference[0, 3 + 10])  # the 11th new token
    first = next(i for i, t in enumerate(reference[0, 3:].tolist()) if t == stop)
    draft = OracleDraft(make_draft_config()).eval().setup(target, reference, 7)
    out = draft.spec_generate(target=target, input_ids=ids, max_new_tokens=40, stop_token_ids=[stop], block_size=8)
    assert torch.equal(out, reference[:, : 3 + first + 1])


def test_real_tokens_equal_to_mask_id_are_kept():
    """A target that likes the mask token must still see it in the output (z-lab bug #73)."""
    target = make_target("llama")
    with torch.no_grad():
        target.lm_head.weight[MASK_ID] = target.lm_head.weight[MASK_ID] * 0 + target.model.norm.weight * 5
    ids = torch.tensor([[5, 6, 7]])
    expected = greedy_reference(target, ids, 20)
    assert (expected[0, 3:] == MASK_ID).any()
    out = make_draft().spec_generate(target=target, input_ids=ids, max_new_tokens=20, block_size=4)
    assert torch.equal(out, expected)


def test_sampling_matches_target_distribution():
    """Chi-square test of the first two sampled tokens against the exact target distribution.

    The draft proposes the target's greedy tokens, so blocks are often accepted; a verifier that kept draft tokens
    too eagerly would over-weight the greedy path. Cells below an expected count of 5 are pooled; the test fails
    at p < 1e-4.
    """
    target = make_target("llama", initializer_range=0.5)
    ids, temperature, n = torch.tensor([[5, 6, 7]]), 1.0, 2000
    exact = exact_two_token_distribution(target, ids, LogitsProcessorList([TemperatureLogitsWarper(temperature)]))
    draft = OracleDraft(make_draft_config()).eval().setup(target, greedy_reference(target, ids, 8), 7)
    counts, accepted = sample_two_tokens(draft, target, ids, n, temperature)
    assert accepted > n // 5, "the test needs drafted tokens to be accepted"
    p_value, chi2, dof = chi_square_p_value(counts, exact)
    assert p_value > 1e-4, f"chi2={chi2:.1f} dof={dof} p={p_value:.2e}"


def test_sampling_in_bfloat16_matches_target_distribution():
    """In bf16 the one-hot rule still samples every kept token from the target's own distribution; the reference
    is that distribution under bf16 passes over the prompt and each prefix (pooled cells; fails at p < 1e-4)."""
    target = make_target("llama", initializer_range=0.5).to(torch.bfloat16)
    ids = torch.tensor([[5, 6, 7]])
    temperature = 1.0
    n = 2000
    exact = exact_two_token_distribution(target, ids, LogitsProcessorList([TemperatureLogitsWarper(temperature)]))
    draft = (
        OracleDraft(make_draft_config()).eval().setup(target, greedy_reference(target, ids, 8), 7).to(torch.bfloat16)
    )
    counts, accepted = sample_two_tokens(draft, target, ids, n, temperature)
    assert accepted > n // 5, "the test needs drafted tokens to be accepted"
    p_value, chi2, dof = chi_square_p_value(counts, exact)
    assert p_value > 1e-4, f"chi2={chi2:.1f} dof={dof} p={p_value:.2e}"


@pytest.mark.parametrize("tree_budget", [0, 8])
def test_sampling_over_two_drafted_positions_matches_the_joint_distribution(tree_budget):
    """Chi-square of the 2nd and 3rd new tokens, both drafted in the first round, against the target's exact joint
    distribution (the 1st, from the prefill, summed out), through the chain and a tree."""
    target = make_target("llama", initializer_range=0.5)
    ids = torch.tensor([[5, 6, 7]])
    temperature = 1.0
    n = 2000
    processors = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    exact = exact_joint_distribution(target, ids, processors, 3).sum(0).flatten()
    draft = OracleDraft(make_draft_config()).eval().setup(target, greedy_reference(target, ids, 8), 7)
    counts, accepted = sample_two_tokens(draft, target, ids, n, temperature, new_tokens=3, tree_budget=tree_budget)
    assert accepted > n // 10, "the test needs both drafted positions accepted often"
    p_value, chi2, dof = chi_square_p_value(counts, exact)
    assert p_value > 1e-4, f"chi2={chi2:.1f} dof={dof} p={p_value:.2e}"


@pytest.mark.parametrize("change, message", MISMATCHES)
def test_mismatched_draft_is_refused(change, message):
    with pytest.raises(ValueError, match=message):
        check_draft_fits_target(make_draft(**change), make_target("llama"))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"input_ids": torch.tensor([[[5, 6]]])}, "shape \\[batch, prompt_len\\]"),
        (
            {"input_ids": torch.tensor([[5, 6], [7, 8]]), "attention_mask": torch.tensor([[1, 0], [1, 1]])},
            "left padding",
        ),
        (
            {"input_ids": torch.tensor([[5, 6], [7, 8]]), "attention_mask": torch.tensor([[0, 0], [1, 1]])},
            "left padding",
        ),
        (
            {"input_ids": torch.tensor([[5, 6], [7, 8]]), "attention_mask": torch.tensor([[2, 1], [1, 1]])},
            "0 \\(padding\\)",
        ),
        ({"input_ids": torch.tensor([[5, 6], [7, 8]]), "attention_mask": torch.ones(2, 3)}, "attention_mask has shape"),
        ({"input_ids": torch.tensor([[5, 6], [7, 8]]), "tree_min_prob": 0.1}, "tree_min_prob sizes a draft tree"),
        ({"input_ids": torch.tensor([[5, 6], [7, 8]]), "prompt_lookup_num_tokens": -1}, "at least 0"),
        ({"input_ids": torch.tensor([[5, 6], [7, 8]]), "block_size_schedule": "heuristic"}, "block_size_schedule"),
        ({"input_ids": torch.tensor([[5, 6], [7, 8]]), "compile_verify": True}, "compile_verify"),
        ({"input_ids": torch.zeros(1, 0, dtype=torch.long)}, "prompt is empty"),
        ({"max_new_tokens": 0}, "max_new_tokens must be at least 1"),
        ({"block_size": 1}, "block_size must be at least 2"),
        ({"input_ids": "hello"}, "input_ids must be a tensor of token ids .* got str"),
        ({"input_ids": [[5, 6]]}, "input_ids must be a tensor of token ids .* got list"),
        ({"input_ids": torch.tensor([[5.0, 6.0]])}, "integer token ids, got dtype torch.float32"),
        ({"input_ids": torch.tensor([[5, VOCAB]])}, f"input_ids must be in \\[0, {VOCAB}\\)"),
        ({"input_ids": torch.tensor([[-1, 5]])}, "input_ids must be in"),
        ({"input_ids": {"attention_mask": torch.ones(1, 2)}}, "mapping without an 'input_ids' entry"),
        (
            {"input_ids": {"input_ids": torch.tensor([[5, 0]]), "attention_mask": torch.tensor([[1, 0]])}},
            "left padding",
        ),
        ({"max_new_tokens": 1.5}, "max_new_tokens must be an integer, got 1.5"),
        ({"block_size": 4.0}, "block_size must be an integer"),
        ({"stop_token_ids": ["x"]}, "stop_token_ids must be a token id or a list of them"),
        ({"target": None}, "target must be a transformers causal LM, got NoneType"),
    ],
)
def test_bad_arguments_fail_before_compute(kwargs, message):
    target, draft = make_target("llama"), make_draft()
    calls = []
    target.register_forward_pre_hook(lambda *a: calls.append(1))
    args = {"target": target, "input_ids": torch.tensor([[5, 6]]), "max_new_tokens": 4} | kwargs
    with pytest.raises(ValueError, match=message):
        draft.spec_generate(**args)
    assert not calls, "the target ran before the error"


def test_a_tokenizer_output_and_an_int_stop_token_are_accepted():
    """What transformers 5's `apply_chat_template(..., return_tensors="pt", return_dict=True)` returns, and the
    int `generate` accepts for its EOS."""
    from transformers import BatchEncoding

    target = make_target("llama", initializer_range=0.2)  # varied tokens: the stop token first occurs where chosen
    ids = torch.tensor([[5, 6, 7]])
    reference = greedy_reference(target, ids, 20)
    stop = int(reference[0, 3 + 6])
    assert stop not in reference[0, 3 : 3 + 6].tolist()
    draft = OracleDraft(make_draft_config()).eval().setup(target, reference, 3)
    encoding = BatchEncoding({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    out = draft.spec_generate(target=target, input_ids=encoding, max_new_tokens=20, stop_token_ids=stop)
    assert torch.equal(out, reference[:, : 3 + 7])


def test_stops_at_the_targets_configured_eos_unless_told_otherwise():
    """Omitted `stop_token_ids`: the target's `generation_config.eos_token_id`, as `generate` stops; an explicit
    None: no stop token, as in z-lab's reference."""
    target = make_target("llama", initializer_range=0.2)
    ids = torch.tensor([[5, 6, 7]])
    reference = greedy_reference(target, ids, 20)
    eos = int(reference[0, 3 + 6])
    assert eos not in reference[0, 3 : 3 + 6].tolist()
    target.generation_config.eos_token_id = [VOCAB - 3, eos]
    plain = target.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False, pad_token_id=0
    )
    draft = OracleDraft(make_draft_config()).eval().setup(target, reference, 3)
    assert torch.equal(draft.spec_generate(target=target, input_ids=ids, max_new_tokens=20), plain)
    assert plain.shape[1] == 3 + 7 and plain[0, -1] == eos
    assert torch.equal(
        draft.spec_generate(target=target, input_ids=ids, max_new_tokens=20, stop_token_ids=None), reference
    )


def test_streamer_gets_prompt_then_each_output_token_once():
    from test_generate_route import Recorder

    target = make_target("llama")
    ids = torch.tensor([[5, 6, 7]])
    reference = greedy_reference(target, ids, 40)
    stop = int(reference[0, 3 + 12])
    draft = OracleDraft(make_draft_config()).eval().setup(target, reference, 5)
    streamer = Recorder()
    out = draft.spec_generate(target=target, input_ids=ids, max_new_tokens=30, stop_token_ids=[stop], streamer=streamer)
    assert streamer.chunks[0] == [5, 6, 7] and streamer.chunks[-1] == "end"
    assert [t for chunk in streamer.chunks[1:-1] for t in chunk] == out[0, 3:].tolist()
    assert out[0, -1] == stop


@pytest.mark.parametrize("k, blocks", [(0, [8, 7, 6, 5, 4, 3, 2, 2]), (2, [8, 7, 6, 5, 4, 3, 5, 4]), (7, [8] * 8)])
def test_heuristic_schedule_adapts_block_and_stays_exact(k, blocks):
    target = make_target("llama")
    ids = torch.tensor([[5, 6, 7]])
    reference = greedy_reference(target, ids, 80)
    draft = OracleDraft(make_draft_config()).eval().setup(target, reference, k)
    stats = draft.spec_generate(
        target=target,
        input_ids=ids,
        max_new_tokens=60,
        block_size=8,
        block_size_schedule="heuristic",
        return_stats=True,
    )
    assert torch.equal(stats.output_ids, reference[:, :63])
    assert draft.blocks[: len(blocks)] == blocks


def test_unknown_schedule_is_refused():
    with pytest.raises(ValueError, match="block size schedule 'heuristic_transient' is not supported"):
        make_draft().spec_generate(
            target=make_target("llama"), input_ids=torch.tensor([[5]]), block_size_schedule="heuristic_transient"
        )


def verified_blocks(target):
    """Records the token ids of every target pass after the prefill (the verified blocks)."""
    passes = []
    handle = target.register_forward_pre_hook(
        lambda m, args, kwargs: passes.append(kwargs["input_ids"][0].tolist()), with_kwargs=True
    )
    return passes, handle


def test_draft_head_keeps_the_draft_vocab_only():
    target = make_target("llama")
    draft = make_draft()
    draft.config.draft_vocab = [3, 9, 40]
    hidden = torch.randn(1, 5, target.config.hidden_size)
    full, limited = target.lm_head(hidden), DraftHead(draft, target.lm_head)(hidden)
    torch.testing.assert_close(limited[..., [3, 9, 40]], full[..., [3, 9, 40]])  # a smaller matmul may round apart
    assert bool(limited[..., [t for t in range(VOCAB) if t not in (3, 9, 40)]].isneginf().all())


def test_an_int8_copy_drafts_through_int8_layers_and_head_and_output_stays_exact():
    target, draft = make_target("qwen3"), make_draft()
    draft.config.draft_vocab = list(range(2, VOCAB, 2))
    int8 = draft.int8_copy()
    assert is_int8(int8) and not is_int8(draft) and int8.compute_dtype == torch.float32  # the original is kept
    assert float_linears(draft) and not float_linears(int8), "every linear layer of the copy is int8"
    hidden = torch.randn(1, 7, target.config.hidden_size)
    exact, rounded = DraftHead(draft, target.lm_head).scores(hidden), DraftHead(int8, target.lm_head).scores(hidden)
    assert 0 < (rounded - exact).norm() / exact.norm() < 0.05, "the head's rows are int8: close, not equal"
    ids = torch.randint(3, VOCAB - 1, (2, 9), generator=torch.Generator().manual_seed(8))
    batch = int8.spec_generate(target, ids, max_new_tokens=25, block_size=8, stop_token_ids=[])
    for row, batched in zip(ids, batch):
        expected = greedy_reference(target, row[None], 25)
        assert torch.equal(int8.spec_generate(target, row[None], max_new_tokens=25, block_size=8), expected)
        routed = target.generate(row[None], assistant_model=int8, max_new_tokens=25, do_sample=False)
        assert torch.equal(routed, expected) and torch.equal(batched[None], expected)
    bf16 = make_target("qwen3").to(torch.bfloat16)
    passes = []
    hook = int8.layers[0].register_forward_hook(lambda *_: passes.append(1))
    out = int8.spec_generate(bf16, ids[:1], max_new_tokens=24, block_size=8, return_stats=True)  # a bf16 target too
    hook.remove()
    plain = greedy_reference(bf16, ids[:1], 24)
    prompt, ours = ids[0].tolist(), out.output_ids[0, 9:].tolist()
    assert len(ours) == 24 and len(passes) >= len(out.acceptance_lengths) > 0, "the int8 draft ran every round"
    assert explained(bf16, prompt, ours, plain[0, 9:].tolist())[1], "equal to plain bf16 greedy up to rounding ties"
    with pytest.raises(ValueError, match="quantizes for CPUs"):
        make_draft().to("meta").int8_copy()


def test_an_int8_head_follows_the_target_when_its_weights_are_reloaded_in_place():
    """The head's int8 rows are quantized once, and again after `load_state_dict` rewrites the target's weights."""
    target, int8 = make_target("llama"), make_draft().int8_copy()
    hidden = torch.randn(1, 5, target.config.hidden_size)
    before = DraftHead(int8, target.lm_head).scores(hidden)
    target.load_state_dict(make_target("llama", initializer_range=0.5).state_dict())
    exact = DraftHead(make_draft(), target.lm_head).scores(hidden)
    after = DraftHead(int8, target.lm_head).scores(hidden)
    assert (after - exact).norm() / exact.norm() < 0.05 < (before - exact).norm() / exact.norm()
    assert not any("int8" in name for name in int8.__dict__ if name != "_int8_weights"), "nothing stashed on it"


def test_an_int8_copy_is_refused_by_save_pretrained_and_leaves_nothing(tmp_path):
    with pytest.raises(ValueError, match="int8_copy\\(\\) cannot be saved"):
        make_draft().int8_copy().save_pretrained(tmp_path / "int8")
    assert not (tmp_path / "int8").exists()


class Removed:
    """Stands for a namespace torch has removed: any use of it fails."""

    def __getattr__(self, name):
        raise AttributeError(f"torch.ao.{name} was used by a float draft")


def test_float_drafts_run_every_route_without_torch_ao(monkeypatch):
    """The float routes work the day torch removes `torch.ao` (int8 copies need it; float drafts must not)."""
    target, draft = make_target("qwen3"), make_draft()
    ids = torch.randint(3, VOCAB - 1, (2, 6), generator=torch.Generator().manual_seed(3))
    expected = [greedy_reference(target, row[None], 12) for row in ids]
    monkeypatch.setattr(torch, "ao", Removed())
    monkeypatch.setitem(__import__("sys").modules, "torch.ao.quantization", None)
    batch = draft.spec_generate(target, ids, max_new_tokens=12, stop_token_ids=[])
    for row, batched, reference in zip(ids, batch, expected):
        assert torch.equal(draft.spec_generate(target, row[None], max_new_tokens=12), reference)
        assert torch.equal(
            target.generate(row[None], assistant_model=draft, max_new_tokens=12, do_sample=False), reference
        )
        assert torch.equal(batched[None], reference)
    with pytest.raises(ImportError):
        draft.int8_copy()  # proves the namespace was gone while the float routes ran


@pytest.mark.parametrize("block_size", [4, 8])
def test_draft_vocab_limits_proposals_and_output_stays_exact(block_size):
    """A draft trained on a token subset (`config.draft_vocab`) proposes only those tokens; the target still verifies
    over all of them, so output equals plain greedy even where the target writes a token outside the subset."""
    target = make_target("llama")
    ids = torch.tensor([[5, 6, 7]])
    reference = greedy_reference(target, ids, 40 + block_size)
    written = sorted(set(reference[0, 3:].tolist()))
    vocab = [t for t in range(VOCAB) if t != written[0]]  # the target writes a token the draft cannot propose
    draft = OracleDraft(make_draft_config()).eval().setup(target, reference, block_size)
    draft.config.draft_vocab = vocab
    passes, handle = verified_blocks(target)
    stats = draft.spec_generate(target, ids, max_new_tokens=40, block_size=block_size, return_stats=True)
    handle.remove()
    assert torch.equal(stats.output_ids, reference[:, :43])
    assert all(t in vocab for block in passes[1:] for t in block[1:]), "a proposal outside draft_vocab"
    assert max(stats.acceptance_lengths) == block_size and min(stats.acceptance_lengths) < block_size
    out = target.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        assistant_model=draft,
        max_new_tokens=40,
        do_sample=False,
        pad_token_id=0,
    )
    assert torch.equal(out, reference[:, :43])


def test_draft_vocab_outside_the_target_vocab_is_refused():
    target, draft = make_target("llama"), make_draft()
    draft.config.draft_vocab = [1, VOCAB]
    with pytest.raises(ValueError, match=r"draft_vocab must hold token ids in \[0, 64\)"):
        check_draft_fits_target(draft, target)


def test_target_is_never_asked_for_all_hidden_states():
    """The draft reads a few target layers; prefill and verify keep only those (forward hooks), on 4.57 and 5.x."""
    target, draft = make_target("llama"), make_draft()
    seen = []
    target.register_forward_hook(
        lambda m, args, kwargs, out: seen.append((kwargs.get("output_hidden_states"), out.hidden_states)),
        with_kwargs=True,
    )
    ids = torch.tensor([[5, 6, 7]])
    expected = greedy_reference(target, ids, 12)
    seen.clear()
    out = draft.spec_generate(target=target, input_ids=ids, max_new_tokens=12, block_size=4)
    assert torch.equal(out, expected)
    assert len(seen) >= 2 and all(not flag and states is None for flag, states in seen), seen


def test_one_device_to_host_transfer_per_chain_round(monkeypatch):
    target, draft = make_target("llama"), make_draft()
    ids = torch.tensor([[5, 6, 7]])
    expected = greedy_reference(target, ids, 20)
    transfers = []
    for name in ("tolist", "item", "__int__", "__bool__", "__index__", "__float__"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(
            torch.Tensor, name, lambda self, *a, _o=original, _n=name, **k: (transfers.append(_n), _o(self, *a, **k))[1]
        )
    stats = draft.spec_generate(target=target, input_ids=ids, max_new_tokens=20, block_size=4, return_stats=True)
    monkeypatch.undo()
    assert torch.equal(stats.output_ids, expected)
    # the prompt's range check (before any compute), the prefill's, then one per round
    assert transfers == ["tolist"] * (2 + len(stats.acceptance_lengths)), transfers


def test_output_end_looks_at_each_token_once():
    from decoding_dflash import OutputEnd

    ending, tokens = OutputEnd({5}, max_new_tokens=10), [1, 2]
    assert ending.update(tokens) == 2 and not ending.done(tokens) and ending.checked == 2
    tokens += [3, 5, 6]
    assert ending.update(tokens) == 4 and ending.done(tokens)
    assert OutputEnd(set(), 3).update([1, 2, 3, 4]) == 3


@pytest.mark.parametrize("tree_budget", [0, 8])
def test_top_k_and_top_p_sampling_matches_the_filtered_distribution(tree_budget):
    """Chi-square test (fails at p < 1e-4) of the first two tokens sampled with temperature, top-k and top-p, through
    the chain and through a tree, against the exact distribution under transformers' own warpers."""
    from transformers import TopKLogitsWarper, TopPLogitsWarper

    target = make_target("llama", initializer_range=0.3)
    ids, n = torch.tensor([[5, 6, 7]]), 2000
    warpers = LogitsProcessorList([TemperatureLogitsWarper(0.8), TopKLogitsWarper(6), TopPLogitsWarper(0.85)])
    exact = exact_two_token_distribution(target, ids, warpers)
    draft = OracleDraft(make_draft_config()).eval().setup(target, greedy_reference(target, ids, 8), 7)
    g = torch.Generator().manual_seed(0)
    counts, accepted = torch.zeros(VOCAB * VOCAB), 0
    for _ in range(n):
        stats = draft.spec_generate(
            target=target,
            input_ids=ids,
            max_new_tokens=2,
            temperature=0.8,
            top_k=6,
            top_p=0.85,
            block_size=4,
            tree_budget=tree_budget,
            return_stats=True,
            generator=g,
        )
        t1, t2 = stats.output_ids[0, 3:].tolist()
        counts[t1 * VOCAB + t2] += 1
        accepted += stats.acceptance_lengths[0] > 1
    assert accepted > n // 10, "the test needs drafted tokens to be accepted"
    assert (exact > 0).sum() < VOCAB * 6, "the filters must remove tokens"
    p_value, chi2, dof = chi_square_p_value(counts, exact)
    assert p_value > 1e-4, f"chi2={chi2:.1f} dof={dof} p={p_value:.2e}"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -1.0}, "temperature must be at least 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -2}, "top_k must be a non-negative integer"),
    ],
)
def test_bad_sampling_arguments_fail_before_compute(kwargs, message):
    target = make_target("llama")
    calls = []
    target.register_forward_pre_hook(lambda *a: calls.append(1))
    with pytest.raises(ValueError, match=message):
        make_draft().spec_generate(
            target=target, input_ids=torch.tensor([[5, 6]]), max_new_tokens=4, **({"temperature": 1.0} | kwargs)
        )
    assert not calls


def test_input_embedding_scale_embeds_from_the_raw_table():
    """With `input_embedding_scale` the block is the raw table times the scale, bypassing the target's own scaled
    embedding module (Gemma-style); without it the module embeds, as before. Output stays exact."""
    from head_dflash import draft_embedding

    class ScaledEmbedding(torch.nn.Embedding):
        def forward(self, ids):
            return super().forward(ids) * 3.0

    target = make_target("llama")
    scaled = ScaledEmbedding(VOCAB, target.config.hidden_size)
    scaled.weight = target.model.embed_tokens.weight
    target.model.embed_tokens = scaled
    ids, raw = torch.tensor([[5, 6, 7]]), target.model.embed_tokens.weight
    expected = greedy_reference(target, ids, 12)
    for scale, factor in ((None, 3.0), (2.0, 2.0)):
        draft = make_draft(**({} if scale is None else {"input_embedding_scale": scale}))
        block = torch.tensor([[9, MASK_ID, MASK_ID]])
        assert torch.allclose(draft_embedding(draft, target)(block), raw[block] * factor)
        seen = []
        draft.register_forward_pre_hook(lambda m, a, kw, seen=seen: seen.append(kw["noise_embeds"]), with_kwargs=True)
        assert torch.equal(draft.spec_generate(target=target, input_ids=ids, max_new_tokens=12, block_size=4), expected)
        assert torch.allclose(seen[0][0, 1], raw[MASK_ID] * factor)


def test_output_multiplier_and_softcapping_shape_the_draft_logits_only():
    from head_dflash import DraftHead

    target = make_target("llama")
    lm_head, hidden = target.get_output_embeddings(), torch.randn(1, 3, target.config.hidden_size) * 20
    draft = make_draft(output_multiplier=0.5, final_logit_softcapping=2.0)
    with torch.no_grad():
        expected = torch.tanh(lm_head(hidden) * 0.5 / 2.0) * 2.0
        assert torch.allclose(DraftHead(draft, lm_head)(hidden), expected, atol=1e-6)
        draft.config.draft_vocab = [3, 9]
        subset = DraftHead(draft, lm_head)(hidden)
    assert torch.isinf(subset).sum() == 3 * (VOCAB - 2) and torch.allclose(
        subset[..., [3, 9]], expected[..., [3, 9]], atol=1e-6
    )
    ids = torch.tensor([[5, 6, 7]])
    draft.config.draft_vocab = None
    out = draft.spec_generate(target=target, input_ids=ids, max_new_tokens=12, temperature=0.0, block_size=4)
    assert torch.equal(out, greedy_reference(target, ids, 12))


STATIC_CROPPABLE = getattr(__import__("transformers").cache_utils.StaticLayer, "is_croppable", False)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral"])
@pytest.mark.parametrize("tree_budget", [None, 8])
def test_static_cache_is_exact_where_it_can_be_cropped(arch, tree_budget):
    """transformers 5's static layers can be cropped, so a static target cache works (chain and tree); 4.57's cannot,
    and the call says so before any compute."""
    from transformers import StaticCache

    target, draft = make_target(arch), make_draft()
    ids = torch.randint(3, VOCAB - 1, (1, 7), generator=torch.Generator().manual_seed(0))
    expected, caches = greedy_reference(target, ids, 20), []
    target.register_forward_pre_hook(
        lambda m, a, kw: caches.append(kw.get("cache", kw.get("past_key_values"))), with_kwargs=True
    )
    run = lambda **kw: draft.spec_generate(
        target=target, input_ids=ids, max_new_tokens=20, block_size=4, tree_budget=tree_budget, **kw
    )
    if not STATIC_CROPPABLE:
        with pytest.raises(ValueError, match="static one on transformers 5 or newer"):
            run(cache_implementation="static")
        assert not caches
        return
    assert torch.equal(run(cache_implementation="static"), expected)
    assert caches and all(isinstance(c, StaticCache) for c in caches)
    assert torch.equal(run(past_key_values=StaticCache(config=target.config, max_cache_len=64)), expected)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"cache_implementation": "offloaded"}, "cache_implementation='offloaded' is not supported"),
        (
            {"cache_implementation": "static", "past_key_values": "cache"},
            "either cache_implementation or past_key_values",
        ),
        ({"past_key_values": "filled"}, "past_key_values must be empty"),
        ({"past_key_values": "short"}, "the cache holds 8 tokens; this call may need"),
    ],
)
def test_bad_cache_arguments_fail_before_compute(kwargs, message):
    from transformers import DynamicCache, StaticCache

    from cache_dflash import cache_kwarg

    target = make_target("llama")
    if kwargs.get("past_key_values") == "filled":
        kwargs["past_key_values"] = DynamicCache()
        target(torch.tensor([[5, 6]]), use_cache=True, **{cache_kwarg(target): kwargs["past_key_values"]})
    elif kwargs.get("past_key_values") in ("short", "cache"):
        if not STATIC_CROPPABLE and kwargs["past_key_values"] == "short":
            message = "StaticCache cannot be cropped"  # transformers 4.x refuses it before its length is checked
        kwargs["past_key_values"] = StaticCache(config=target.config, max_cache_len=8)
    calls = []
    target.register_forward_pre_hook(lambda *a: calls.append(1))
    with pytest.raises(ValueError, match=message):
        make_draft().spec_generate(target=target, input_ids=torch.tensor([[5, 6]]), max_new_tokens=12, **kwargs)
    assert not calls


@pytest.mark.skipif(
    not STATIC_CROPPABLE, reason="a compiled verify needs a static cache, which transformers 4.x cannot crop"
)
def test_compiled_verify_is_exact_and_feeds_the_draft_the_same_features():
    """`compile_verify=True` runs every verify pass through one compiled graph (static cache, constant block): greedy
    output is identical at every acceptance length, and the draft sees the same target features as eager."""
    target, ids = make_target("llama"), torch.randint(3, VOCAB - 1, (1, 7), generator=torch.Generator().manual_seed(0))
    reference = greedy_reference(target, ids, 20)
    compiled = lambda draft: draft.spec_generate(
        target=target, input_ids=ids, max_new_tokens=20, block_size=4, tree_budget=0, compile_verify=True
    )
    for k in range(4):
        draft = OracleDraft(make_draft_config()).eval().setup(target, reference, k)
        assert torch.equal(compiled(draft), reference), k
        assert all(
            length == k + 1
            for length in draft.spec_generate(
                target=target,
                input_ids=ids,
                max_new_tokens=20,
                block_size=4,
                tree_budget=0,
                compile_verify=True,
                return_stats=True,
            ).acceptance_lengths[:-1]
        )
    eager_calls = []  # the compiled forward bypasses the module's call, so only the eager prefill is seen here
    hook = target.register_forward_pre_hook(lambda *a: eager_calls.append(1))
    assert torch.equal(compiled(draft), reference) and len(eager_calls) == 1
    hook.remove()
    draft, seen = make_draft(), []
    draft.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["context_hidden_states"].clone()), with_kwargs=True)
    eager = draft.spec_generate(
        target=target, input_ids=ids, max_new_tokens=20, block_size=4, tree_budget=0, cache_implementation="static"
    )
    eager_seen, seen[:] = list(seen), []
    assert torch.equal(compiled(draft), eager) and torch.equal(eager, reference)
    assert len(seen) == len(eager_seen) > 1 and all(torch.allclose(a, b, atol=1e-5) for a, b in zip(seen, eager_seen))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"cache_implementation": "dynamic"}, "compile_verify=True needs a static cache"),
        ({"block_size_schedule": "heuristic"}, "compile_verify=True needs block_size_schedule='constant'"),
        ({"prompt_lookup_num_tokens": 3}, "prompt_lookup_num_tokens=3 changes the verify's length by round"),
        ({"tree_budget": 4, "tree_min_prob": 0.2}, "tree_min_prob=0.2 changes the verify's length by round"),
    ],
)
def test_compiled_verify_refuses_changing_shapes_before_compute(kwargs, message):
    target, calls = make_target("llama"), []
    target.register_forward_pre_hook(lambda *a: calls.append(1))
    with pytest.raises(ValueError, match=message):
        make_draft().spec_generate(
            target=target, input_ids=torch.tensor([[5, 6]]), max_new_tokens=12, compile_verify=True, **kwargs
        )
    assert not calls


@pytest.mark.skipif(
    not STATIC_CROPPABLE, reason="a compiled verify needs a static cache, which transformers 4.x cannot crop"
)
def test_a_compiled_verify_stores_nothing_on_the_target_and_follows_a_copy():
    target, ids = make_target("llama"), torch.tensor([[5, 6, 7]])
    before = set(target.__dict__)
    draft = make_draft()
    compiled = dict(max_new_tokens=10, block_size=4, tree_budget=0, compile_verify=True)
    assert torch.equal(draft.spec_generate(target, ids, **compiled), greedy_reference(target, ids, 10))
    assert set(target.__dict__) == before
    other = copy.deepcopy(target)
    other.load_state_dict(make_target("llama", initializer_range=0.5).state_dict())
    expected = greedy_reference(other, ids, 10)
    assert not torch.equal(expected, greedy_reference(target, ids, 10)), "the copy decodes differently"
    assert torch.equal(draft.spec_generate(other, ids, **compiled), expected)


def test_a_draft_for_another_target_is_named_before_the_prompt_is_blamed():
    """Ids tokenized for the draft's (larger-vocabulary) target: the mismatch named is the draft's, not the ids'."""
    target, passes = make_target("llama"), []
    target.register_forward_pre_hook(lambda *a: passes.append(1))
    with pytest.raises(ValueError, match="vocab_size 99 does not match the target's 64"):
        make_draft(vocab_size=99).spec_generate(target, torch.tensor([[5, 80]]), max_new_tokens=4)
    assert not passes


def test_a_prompt_longer_than_the_context_is_refused_and_output_past_it_is_warned_of():
    target, draft, passes = make_target("llama", max_position_embeddings=16), make_draft(), []
    target.register_forward_pre_hook(lambda *a: passes.append(1))
    ids = torch.randint(3, VOCAB - 1, (2, 17), generator=torch.Generator().manual_seed(0))
    message = "the prompt has 17 tokens, more than the target's context of 16"
    for call in (
        lambda: draft.spec_generate(target, ids[:1], max_new_tokens=4),
        lambda: draft.spec_generate(target, ids, max_new_tokens=4),
        lambda: target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=draft, max_new_tokens=4),
    ):
        with pytest.raises(ValueError, match=message):
            call()
    assert not passes, "refused before compute"
    with pytest.warns(UserWarning, match="12 tokens and max_new_tokens=8 run past the target's context of 16") as got:
        out = draft.spec_generate(target, ids[:1, :12], max_new_tokens=8)
    assert got[0].filename == __file__ and out.shape[1] == 20
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        draft.spec_generate(target, ids[:1, :12], max_new_tokens=4)  # within the context: nothing to say


def test_generation_config_settings_it_does_not_apply_are_named():
    """`spec_generate` decodes with its own arguments; what the target's generation config sets beyond the EOS ids
    would be silently ignored, so it is named in a warning."""
    target = make_target("llama")
    draft = make_draft()
    ids = torch.tensor([[5, 6, 7]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        draft.spec_generate(target=target, input_ids=ids, max_new_tokens=4)  # a plain config: nothing to say
    target.generation_config.repetition_penalty = 1.3
    target.generation_config.suppress_tokens = [9]
    with pytest.warns(
        UserWarning,
        match=r"does not apply the target's generation_config settings \['repetition_penalty', 'suppress_tokens'\]",
    ) as record:
        draft.spec_generate(target=target, input_ids=ids, max_new_tokens=4)
    assert record[0].filename == __file__, f"the warning points at the caller's line, not {record[0].filename}"
