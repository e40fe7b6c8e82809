"""DFlash 2 drafts (`DFlash2DraftModel`): the published layout, each new piece against a hand-written formula, and
both decoding routes lossless (greedy identity with forced partial acceptance, chi-square sampling)."""

import json

import pytest
import torch
from conftest import (
    HIDDEN,
    VOCAB,
    OracleDraft,
    chi_square_p_value,
    exact_joint_distribution,
    exact_two_token_distribution,
    float_linears,
    greedy_reference,
    make_draft_config,
    make_target,
    sample_two_tokens,
)
from safetensors.torch import load_file, save_file
from test_modeling_dflash import ZLAB_CONFIG, zlab_weights
from transformers import AutoModel, LogitsProcessorList, TemperatureLogitsWarper

from modeling_dflash import BlockConvolution, CandidateSelector, DFlash2DraftModel, DFlashDraftModel

TAPS, GROUP, RANK, TOP_K = 3, 16, 8, 6
DFLASH2 = {"conv_kernel_size": TAPS, "conv_group_size": GROUP, "selector_rank": RANK, "selector_top_k": TOP_K}
# a published DFlash 2 config (reference section 9): every layer sliding, top-level is_causal false
PUBLISHED_CONFIG = {
    **ZLAB_CONFIG,
    "architectures": ["DFlash2DraftModel"],
    "dflash_config": {**ZLAB_CONFIG["dflash_config"], **DFLASH2},
    "layer_types": ["sliding_attention"] * 2,
    "use_sliding_window": True,
    "sliding_window": 2048,
    "is_causal": False,
}


def published_weights(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random tensors under the published DFlash 2 names and shapes, written out from reference section 9."""
    g = torch.Generator().manual_seed(seed)
    h, groups = config["hidden_size"], config["hidden_size"] // GROUP
    weights = zlab_weights(config, seed)
    for i in range(config["num_hidden_layers"]):
        for conv in ("attention_conv", "mlp_conv"):
            weights[f"layers.{i}.{conv}.base_kernel"] = torch.randn(2, TAPS, h, generator=g) * 0.5
            weights[f"layers.{i}.{conv}.kernel_projection.weight"] = (
                torch.randn(2 * TAPS * groups, h, generator=g) * 0.1
            )
    weights["candidate_selector.predecessor_codebook"] = torch.randn(config["vocab_size"], RANK, generator=g)
    weights["candidate_selector.successor_codebook"] = torch.randn(config["vocab_size"], RANK, generator=g)
    weights["candidate_selector.hidden_projection.weight"] = torch.randn(RANK, h, generator=g) * 0.3
    return weights


@pytest.fixture
def published_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(PUBLISHED_CONFIG))
    save_file(published_weights(PUBLISHED_CONFIG), str(tmp_path / "model.safetensors"))
    return tmp_path


def randomize_dflash2(draft, scale: float = 0.3):
    """Convolutions and selector far from identities."""
    with torch.no_grad():
        for name, param in draft.named_parameters():
            if "conv" in name or "selector" in name:
                param.normal_(0, scale)
    return draft


def make_dflash2(seed: int = 1, **overrides) -> DFlash2DraftModel:
    torch.manual_seed(seed)
    return randomize_dflash2(DFlash2DraftModel(make_draft_config(dflash_config=dict(DFLASH2), **overrides)).eval())


class OracleDFlash2(OracleDraft, DFlash2DraftModel):
    """Right for exactly `k` tokens per block, through the DFlash 2 layers and selector; `scale` sets how sure."""

    scale = 50.0

    def logits_at(self, position: int, offset: int) -> torch.Tensor:
        return super().logits_at(position, offset) * (self.scale / 50.0)


def oracle_dflash2(target, reference, k, scale=50.0, **overrides):
    """Its selector's pair scores are live (random codebooks) but smaller than the oracle's margins (its hidden
    states, which make the tiny head's logits, are large)."""
    torch.manual_seed(k)
    draft = (
        OracleDFlash2(make_draft_config(dflash_config=dict(DFLASH2), **overrides)).eval().setup(target, reference, k)
    )
    draft.scale = scale
    randomize_dflash2(draft, 0.1)
    with torch.no_grad():
        draft.candidate_selector.hidden_projection.weight.mul_(1e-3)
    return draft


def count_walks(draft):
    calls, original = [], draft.candidate_selector.walk
    draft.candidate_selector.walk = lambda *a, **kw: calls.append(1) or original(*a, **kw)
    return calls


# ---------------------------------------------------------------------------------------------------------------------
# The layout


def test_published_checkpoint_loads_strictly_with_its_names(published_dir):
    draft = DFlash2DraftModel.from_pretrained(published_dir).eval()
    stored = load_file(published_dir / "model.safetensors")
    ours = draft.state_dict()
    assert set(ours) == set(stored) and all(ours[k].shape == stored[k].shape for k in stored)
    assert "candidate_selector.predecessor_codebook" in ours  # no `.weight` suffix, as published
    assert torch.equal(ours["candidate_selector.successor_codebook"], stored["candidate_selector.successor_codebook"])
    assert draft.layers[0].self_attn.causal is False  # top-level is_causal false overrides the sliding layers


@pytest.mark.parametrize("change", ["suffixed codebook", "missing conv"])
def test_published_layout_is_loaded_strictly(published_dir, change):
    weights = load_file(published_dir / "model.safetensors")
    if change == "suffixed codebook":
        weights["candidate_selector.predecessor_codebook.weight"] = weights.pop(
            "candidate_selector.predecessor_codebook"
        )
    else:
        del weights["layers.1.mlp_conv.base_kernel"]
    save_file(weights, str(published_dir / "model.safetensors"))
    with pytest.raises(ValueError, match="missing_keys|unexpected_keys"):
        DFlash2DraftModel.from_pretrained(published_dir)


def test_a_dflash2_folder_loaded_as_v1_names_the_class(published_dir):
    with pytest.raises(ValueError, match="is a DFlash2DraftModel .* load it with modeling_dflash.DFlash2DraftModel"):
        DFlashDraftModel.from_pretrained(published_dir)


def test_save_writes_the_published_layout_and_loads_back(tmp_path):
    draft = make_dflash2()
    draft.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"] and config["model_type"] == "qwen3"
    assert config["auto_map"]["AutoModel"] == "modeling_dflash.DFlash2DraftModel"
    assert {k: config["dflash_config"][k] for k in DFLASH2} == DFLASH2
    assert set(load_file(tmp_path / "model.safetensors")) == set(
        published_weights(
            make_draft_config().to_dict()
            | {"num_hidden_layers": 2, "head_dim": 16, "dflash_config": {"target_layer_ids": [0, 2]}}
        )
    )
    loaded = AutoModel.from_pretrained(tmp_path, trust_remote_code=True).eval()
    assert type(loaded).__name__ == "DFlash2DraftModel"
    noise, ctx = torch.randn(1, 8, HIDDEN), torch.randn(1, 5, 2 * HIDDEN)
    with torch.no_grad():
        assert torch.equal(
            loaded(noise_embeds=noise, context_hidden_states=ctx).last_hidden_state,
            draft(noise_embeds=noise, context_hidden_states=ctx).last_hidden_state,
        )


@pytest.mark.parametrize(
    "dflash, message",
    [
        ({**DFLASH2, "selector_top_k": VOCAB + 1}, f"selector_top_k {VOCAB + 1} is larger than the vocabulary"),
        ({k: v for k, v in DFLASH2.items() if k != "conv_kernel_size"}, "needs a positive integer conv_kernel_size"),
        ({**DFLASH2, "conv_group_size": 24}, "conv_group_size 24 must divide hidden_size 64"),
    ],
)
def test_bad_dflash2_settings_are_refused(dflash, message):
    with pytest.raises(ValueError, match=message):
        DFlash2DraftModel(make_draft_config(dflash_config=dflash))


# ---------------------------------------------------------------------------------------------------------------------
# Each piece against a hand-written formula


def test_convolution_of_a_one_hot_input():
    """x = e_c at block position 0, zeros after: the input side gives (base[0, 0, c] + W[(0, 0, g), c]) at
    position 0 and base[0, t, c] at position t (the dynamic part there comes from a zero input)."""
    conv = BlockConvolution(make_draft_config(dflash_config=dict(DFLASH2)))
    with torch.no_grad():
        conv.base_kernel.normal_()
        conv.kernel_projection.weight.normal_()
    c, g, block = 21, 21 // GROUP, 5
    x = torch.zeros(1, block, HIDDEN)
    x[0, 0, c] = 1.0
    out, kernels = conv.before(x)
    groups = HIDDEN // GROUP
    w = conv.kernel_projection.weight.view(2, TAPS, groups, HIDDEN)
    expected = torch.zeros(block, HIDDEN)
    expected[0, c] = conv.base_kernel[0, 0, c] + w[0, 0, g, c]
    for t in range(1, TAPS):
        expected[t, c] = conv.base_kernel[0, t, c]
    assert torch.allclose(out[0], expected, atol=1e-6)
    # the output side convolves with the other half of the kernels the input gave (dynamic only at position 0)
    y = torch.zeros(1, block, HIDDEN)
    y[0, 0, c], y[0, 3, c] = 1.0, 2.0
    after = conv.after(y, kernels)[0]
    assert torch.allclose(after[0, c], conv.base_kernel[1, 0, c] + w[1, 0, g, c])
    assert torch.allclose(after[1, c], conv.base_kernel[1, 1, c]) and torch.allclose(
        after[2, c], conv.base_kernel[1, 2, c]
    )
    assert torch.allclose(after[3, c], 2 * conv.base_kernel[1, 0, c]) and torch.allclose(
        after[4, c], 2 * conv.base_kernel[1, 1, c]
    )
    assert after[:, :c].abs().sum() == 0 and after[:, c + 1 :].abs().sum() == 0


def test_identity_convolutions_and_a_no_op_selector_make_a_v1_draft():
    """A fresh DFlash 2 draft (identity convolutions, zero successor codebook) computes exactly its v1 backbone."""
    torch.manual_seed(3)
    v2 = DFlash2DraftModel(make_draft_config(dflash_config=dict(DFLASH2))).eval()
    v1 = DFlashDraftModel(make_draft_config()).eval()
    v1.load_state_dict({k: v for k, v in v2.state_dict().items() if "conv" not in k and "selector" not in k})
    noise, ctx = torch.randn(1, 8, HIDDEN), torch.randn(1, 5, 2 * HIDDEN)
    with torch.no_grad():
        a = v2(noise_embeds=noise, context_hidden_states=ctx).last_hidden_state
        b = v1(noise_embeds=noise, context_hidden_states=ctx).last_hidden_state
        assert torch.allclose(a, b, atol=1e-6)
        logits = torch.randn(1, 7, VOCAB)
        assert torch.equal(v2.candidate_selector.walk(logits, a[:, 1:], torch.tensor([[5]]))[0], logits.argmax(-1))
        v2.layers[1].mlp_conv.base_kernel[1, 1] += 0.5  # a later tap mixes in the position before
        c = v2(noise_embeds=noise, context_hidden_states=ctx).last_hidden_state
    assert torch.allclose(c[:, 0], a[:, 0], atol=1e-6) and not torch.allclose(c[:, 1:], a[:, 1:], atol=1e-3)


def test_selector_walk_on_a_three_token_vocabulary():
    """Scores `logit[c] + sum_r P[p, r] * (H h)[r] * S[c, r]`, top-2 candidates, walked from the anchor."""
    config = make_draft_config(
        vocab_size=3, mask_token_id=2, dflash_config={**DFLASH2, "selector_rank": 1, "selector_top_k": 2}
    )
    selector = CandidateSelector(config)
    with torch.no_grad():
        selector.predecessor_codebook.copy_(torch.tensor([[1.0], [-1.0], [2.0]]))
        selector.successor_codebook.copy_(torch.tensor([[0.0], [3.0], [-2.0]]))
        selector.hidden_projection.weight.zero_()[0, 0] = 1.0  # (H h) = h[0]
    logits = torch.tensor([[[1.0, 0.5, 0.0], [0.0, 1.0, 2.0]]])
    hidden = torch.zeros(1, 2, HIDDEN)
    hidden[0, :, 0] = torch.tensor([1.0, 0.5])
    tokens, scores = selector.walk(logits, hidden, torch.tensor([[0]]))
    # position 0, predecessor 0 (P = 1), h = 1: candidates {0, 1}: 1 + 0 = 1, 0.5 + 3 = 3.5; token 2 is not a candidate
    assert torch.allclose(scores[0, 0], torch.tensor([1.0, 3.5, float("-inf")]))
    # position 1, predecessor 1 (P = -1), h = 0.5: candidates {1, 2}: 1 - 1.5 = -0.5, 2 + 1 = 3
    assert torch.allclose(scores[0, 1], torch.tensor([float("-inf"), -0.5, 3.0]))
    assert tokens.tolist() == [[1, 2]]
    # another rule (here: the worst candidate) picks from the same scores, and the next position follows its pick:
    # position 1 after token 0 (P = 1): 1 + 0.5 * 3 = 2.5, 2 + 0.5 * -2 = 1
    worst = lambda s: s.masked_fill(s.isinf(), float("inf")).argmin(-1)  # noqa: E731
    tokens, scores = selector.walk(logits, hidden, torch.tensor([[0]]), choose=worst)
    assert tokens.tolist() == [[0, 2]] and torch.allclose(scores[0, 1], torch.tensor([float("-inf"), 2.5, 1.0]))


# ---------------------------------------------------------------------------------------------------------------------
# Decoding: both routes, lossless


@pytest.mark.parametrize("block_size", [2, 4, 8, 16])
def test_spec_generate_greedy_equals_plain_with_partial_acceptance(block_size):
    target = make_target("qwen3")
    ids = torch.randint(3, VOCAB - 1, (1, 6), generator=torch.Generator().manual_seed(block_size))
    reference = greedy_reference(target, ids, 30 + block_size)
    draft = make_dflash2()
    walks = count_walks(draft)
    assert torch.equal(
        draft.spec_generate(target=target, input_ids=ids, max_new_tokens=30, block_size=block_size), reference[:, :36]
    )
    assert walks, "the selector chose the drafted tokens"
    for k in range(block_size):
        oracle = oracle_dflash2(target, reference, k)
        stats = oracle.spec_generate(
            target=target, input_ids=ids, max_new_tokens=30, block_size=block_size, return_stats=True
        )
        assert torch.equal(stats.output_ids, reference[:, :36]), f"k={k}"
        assert stats.acceptance_lengths[:-1] == [k + 1] * (len(stats.acceptance_lengths) - 1), f"k={k}"


@pytest.mark.parametrize("block_size", [2, 4, 8, 16])
def test_generate_route_greedy_equals_plain_with_partial_acceptance(block_size):
    target = make_target("llama")
    ids = torch.randint(3, VOCAB - 1, (1, 5), generator=torch.Generator().manual_seed(block_size))
    reference = greedy_reference(target, ids, 30)
    run = lambda draft: target.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        assistant_model=draft,
        max_new_tokens=30,  # noqa: E731
        do_sample=False,
        pad_token_id=0,
    )
    draft = make_dflash2(block_size=block_size)
    walks = count_walks(draft)
    assert torch.equal(run(draft), reference) and walks
    for k in range(block_size):
        oracle = oracle_dflash2(target, reference, k, block_size=block_size)
        assert torch.equal(run(oracle), reference), f"k={k}"
        assert all(n == k + 1 for n, _ in oracle.calls[1:-1]), oracle.calls


def test_spec_generate_sampling_matches_the_target_distribution():
    """Chi-square (fails at p < 1e-4) of the first two tokens; the selector samples its chain from its own scores
    (unsure: oracle logits of 3, so it often draws another candidate), and verification keeps the target's law."""
    target = make_target("llama", initializer_range=0.5)
    ids, temperature, n = torch.tensor([[5, 6, 7]]), 1.0, 2000
    exact = exact_two_token_distribution(target, ids, LogitsProcessorList([TemperatureLogitsWarper(temperature)]))
    draft = oracle_dflash2(target, greedy_reference(target, ids, 8), 7, scale=3.0)
    counts, accepted = sample_two_tokens(draft, target, ids, n, temperature)
    assert accepted > n // 10, "the test needs drafted tokens to be accepted"
    p_value, chi2, dof = chi_square_p_value(counts, exact)
    assert p_value > 1e-4, f"chi2={chi2:.1f} dof={dof} p={p_value:.2e}"


def test_generate_route_sampling_with_selector_probabilities_matches_the_target_distribution():
    """`proposal="sample"`: each drafted token is drawn from the selector's processed scores given the token drawn
    before, and those scores go to transformers' rejection sampling; chi-square of the 2nd and 3rd tokens."""
    target = make_target("llama", initializer_range=0.5)
    ids, n, temperature = torch.tensor([[5, 6, 7]]), 1500, 0.9
    exact = (
        exact_joint_distribution(target, ids, LogitsProcessorList([TemperatureLogitsWarper(temperature)]), 3)
        .sum(0)
        .flatten()
    )
    draft = oracle_dflash2(target, greedy_reference(target, ids, 8), 3, scale=3.0, block_size=4)
    draft.dflash_proposal = "sample"
    torch.manual_seed(0)
    counts = torch.zeros(VOCAB * VOCAB)
    passes = []
    target.register_forward_pre_hook(lambda *a: passes.append(1))
    for _ in range(n):
        out = target.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            assistant_model=draft,
            max_new_tokens=6,
            do_sample=True,
            temperature=temperature,
            top_k=0,
            pad_token_id=0,
        )
        counts[out[0, 4] * VOCAB + out[0, 5]] += 1
    p_value, chi2, dof = chi_square_p_value(counts, exact)
    assert p_value > 1e-4, f"chi2={chi2:.1f} dof={dof} p={p_value:.2e}"
    # each run's 6 tokens came from a prefill and verify passes that each keep their accepted drafts plus one token
    accepted = 6 * n - len(passes)
    assert accepted > n // 2, f"only {accepted} drafted tokens were accepted in {n} runs"


def test_a_tree_is_refused_for_a_dflash2_draft_before_compute():
    target, calls = make_target("llama"), []
    target.register_forward_pre_hook(lambda *a: calls.append(1))
    with pytest.raises(ValueError, match="DFlash 2 draft's selector chooses each token given the one before"):
        make_dflash2().spec_generate(target=target, input_ids=torch.tensor([[5, 6]]), max_new_tokens=8, tree_budget=4)
    assert not calls


def test_an_int8_copy_decodes_exactly():
    """`int8_copy()` quantizes the convolutions' kernel projections and the selector's hidden projection too."""
    target, draft = make_target("qwen3"), make_dflash2()
    int8 = draft.int8_copy()
    parts = ("candidate_selector", "layers.0.attention_conv")
    assert all(float_linears(draft.get_submodule(p)) and not float_linears(int8.get_submodule(p)) for p in parts)
    ids = torch.tensor([[5, 6, 7, 8]])
    assert torch.equal(
        int8.spec_generate(target, ids, max_new_tokens=20, block_size=4), greedy_reference(target, ids, 20)
    )
