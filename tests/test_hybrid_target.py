"""Hybrid targets (gated-delta linear attention plus full attention, Qwen3.5 / Qwen3-Next style) in torch. Two
rollbacks, each exact in both routes at every rejection length: transformers' own cache, which records the state
after each verified token and crops back to one (`recorded`, 5.25+), and `cache_dflash.RollbackCache`, which saves
the states before each verify pass, restores them after a rejection and advances them over the accepted tokens only
(`saved`, the only one on 5.24)."""

import warnings

import pytest
import torch
import transformers
from conftest import VOCAB, OracleDraft, greedy_reference, make_draft, make_draft_config
from transformers import DynamicCache

import cache_dflash
import routing_dflash
from cache_dflash import RollbackCache

ROLLS_BACK = cache_dflash.LinearAttentionCacheLayerMixin is not None
needs_rollback = pytest.mark.skipif(not ROLLS_BACK, reason="transformers 4.x refuses hybrid targets (tested below)")
RECORDS = cache_dflash.records_recurrent_states()
ROLLBACKS = ["recorded", "saved"] if RECORDS else ["saved"]


def use_rollback(monkeypatch, rollback: str) -> None:
    """`saved`: the `RollbackCache`, even where transformers' own cache could roll back."""
    if rollback == "saved":
        for module in (cache_dflash, routing_dflash):
            monkeypatch.setattr(module, "records_recurrent_states", lambda: False)


@pytest.fixture(params=ROLLBACKS)
def rollback(request, monkeypatch):
    use_rollback(monkeypatch, request.param)
    return request.param


def make_qwen3_next(seed: int = 0):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(seed)
    config = Qwen3NextConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_value_heads=2,
        linear_num_key_heads=2,
        num_experts=2,
        num_experts_per_tok=1,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        pad_token_id=0,
    )
    return finish(Qwen3NextForCausalLM(config))


def make_qwen3_5(seed: int = 0):
    """Gated-delta layers 0-2, full attention in layer 3 (as `tests/test_mlx_port.py`'s MLX target)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(seed)
    config = Qwen3_5TextConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        max_position_embeddings=512,
        pad_token_id=0,
    )
    return finish(Qwen3_5ForCausalLM(config))


def finish(model):
    model.eval().generation_config.eos_token_id = None  # plain decoding runs to max_new_tokens
    return model


TARGETS = {"qwen3_5": make_qwen3_5, "qwen3_next": make_qwen3_next}


def passes(target, caches=None):
    """The tokens of each target pass (and, into `caches`, the type of cache each ran on)."""
    calls = []

    def hook(module, args, kwargs):
        calls.append(kwargs["input_ids"].shape[1])
        if caches is not None:
            caches.add(type(kwargs.get("cache", kwargs.get("past_key_values"))).__name__)

    return calls, target.register_forward_pre_hook(hook, with_kwargs=True)


def run_generate(target, draft, ids, max_new_tokens):
    return target.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        assistant_model=draft,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=0,
    )


def generate_logits(target, ids, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy ids and the target's logits at each new token, `[1, new, V]`."""
    out = target.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=30,
        do_sample=False,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
        **kwargs,
    )
    return out.sequences, torch.stack(out.logits, dim=1)


@pytest.fixture(autouse=True)
def quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' notes on its reference gated-delta kernels
        yield


@needs_rollback
@pytest.mark.parametrize("arch", sorted(TARGETS))
@pytest.mark.parametrize("block_size", [4, 8])
def test_spec_generate_rolls_back_after_every_rejection_length(arch, block_size, rollback):
    """A draft right for exactly k tokens per block rejects B - 1 - k: output equals plain greedy decoding, each
    round accepts k + 1, and each round with a rejection re-runs the target over exactly the k + 1 kept tokens
    (`saved`) or over none (`recorded`: every pass after the prefill is one verify of the block)."""
    target = TARGETS[arch]()
    ids = torch.randint(3, VOCAB - 1, (1, 7), generator=torch.Generator().manual_seed(0))
    reference = greedy_reference(target, ids, 30 + block_size)
    for k in range(block_size):
        draft = OracleDraft(make_draft_config()).eval().setup(target, reference, k)
        calls, handle = passes(target)
        stats = draft.spec_generate(
            target=target, input_ids=ids, max_new_tokens=30, block_size=block_size, return_stats=True
        )
        handle.remove()
        assert torch.equal(stats.output_ids, reference[:, :37]), f"{arch} k={k}"
        assert stats.acceptance_lengths[:-1] == [k + 1] * (len(stats.acceptance_lengths) - 1), f"k={k}"
        reruns = [n for n in calls[1:] if n != block_size]
        expected_reruns = 0 if k == block_size - 1 or rollback == "recorded" else len(stats.acceptance_lengths)
        assert len(reruns) == expected_reruns and set(reruns) <= {k + 1}, (rollback, calls)


@needs_rollback
@pytest.mark.parametrize("arch", sorted(TARGETS))
def test_generate_route_rolls_back_after_every_rejection_length(arch, rollback):
    target, block_size = TARGETS[arch](), 6
    stateful = getattr(type(target), "_is_stateful", None)  # transformers before 5.25 refuses stateful models
    ids = torch.randint(3, VOCAB - 1, (1, 5), generator=torch.Generator().manual_seed(1))
    reference, plain = generate_logits(target, ids)
    for k in range(block_size):
        draft = OracleDraft(make_draft_config(block_size=block_size)).eval().setup(target, reference, k)
        caches = set()
        calls, handle = passes(target, caches)
        out, logits = generate_logits(target, ids, assistant_model=draft)
        handle.remove()
        # logits too: a wrong recurrent state often leaves a tiny target's tokens as they were (see below)
        assert torch.equal(out, reference) and (logits - plain).abs().max() < 1e-5, f"{arch} k={k}"
        assert all(n == k + 1 for n, _ in draft.calls[1:-1]), draft.calls
        assert caches == {"RollbackCache" if rollback == "saved" else "DynamicCache"}, caches
        if rollback == "saved" and k < block_size - 1:  # a rejection re-runs the k + 1 kept tokens
            assert calls[1:3] == [block_size, k + 1], calls
    # the call lifted transformers' refusal only for itself
    assert "_is_stateful" not in vars(target) and getattr(type(target), "_is_stateful", None) == stateful


@pytest.mark.skipif(not RECORDS, reason="transformers before 5.25 records no recurrent states (RollbackCache instead)")
@pytest.mark.parametrize("arch", sorted(TARGETS))
def test_transformers_own_dflash_rolls_back_a_hybrid_target(arch):
    """Where transformers' cache records the states, its own `speculation_type="dflash"` generator is exact on a
    hybrid target too, at every rejection length."""
    target, block_size = TARGETS[arch](), 6
    ids = torch.randint(3, VOCAB - 1, (1, 5), generator=torch.Generator().manual_seed(1))
    reference = greedy_reference(target, ids, 30)
    for k in range(block_size):
        draft = OracleDraft(make_draft_config(block_size=block_size)).eval().setup(target, reference, k)
        out = target.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            assistant_model=draft,
            max_new_tokens=30,
            do_sample=False,
            pad_token_id=0,
            speculation_type="dflash",
        )
        assert torch.equal(out, reference), f"{arch} k={k}"
        assert draft.calls, "transformers' generator never ran the draft"


@pytest.mark.skipif(RECORDS, reason="this transformers' own cache rolls a hybrid target back (tested above)")
@needs_rollback
def test_transformers_own_dflash_is_refused_where_its_cache_cannot_roll_back():
    target = make_qwen3_5()
    with pytest.raises(ValueError, match="own DFlash generator cannot roll back"):
        target.generate(
            torch.tensor([[5, 6, 7]]), assistant_model=make_draft(), max_new_tokens=4, speculation_type="dflash"
        )


@pytest.mark.skipif(not RECORDS, reason="transformers before 5.25 records no recurrent states")
def test_one_recorded_state_too_few_is_visible_after_a_full_rejection(monkeypatch):
    """The generator must ask for a state per verified token (the last committed one too): one fewer, as
    transformers' own `AssistedCandidateGenerator` asks, restores the state before the pass after a full rejection.
    The tiny target's tokens may survive that; its logits do not (plain: equal to 1e-5; one too few: off by 1e-3)."""
    target = make_qwen3_5()
    ids = torch.randint(3, VOCAB - 1, (1, 5), generator=torch.Generator().manual_seed(1))
    reference, plain = generate_logits(target, ids)
    draft = OracleDraft(make_draft_config(block_size=6)).eval().setup(target, reference, 0)
    out, logits = generate_logits(target, ids, assistant_model=draft)
    assert torch.equal(out, reference) and (logits - plain).abs().max() < 1e-5
    generator = routing_dflash.DFlashCandidateGenerator
    monkeypatch.setattr(generator, "num_drafting_tokens", property(lambda self: self.max_block_size - 1))
    _, wrong = generate_logits(target, ids, assistant_model=draft)
    assert (wrong - plain).abs().max() > 1e-3


@pytest.mark.skipif(not RECORDS, reason="transformers before 5.25 records no recurrent states")
def test_a_target_that_records_no_states_is_named_before_a_wrong_rollback(monkeypatch):
    target = make_qwen3_5()
    monkeypatch.setattr(type(DynamicCache()), "get_recurrent_states_to_keep", lambda self, layer_idx=None: 0)
    with pytest.raises(RuntimeError, match="too few to take back .* does not honour recurrent_states_to_keep"):
        make_draft().spec_generate(target=target, input_ids=torch.tensor([[5, 6, 7]]), max_new_tokens=12)


@needs_rollback
@pytest.mark.parametrize("block_size", [2, 4, 8, 16])
def test_random_draft_is_exact_through_both_routes(block_size, rollback):
    target = make_qwen3_5(seed=block_size)
    ids = torch.randint(3, VOCAB - 1, (1, 9), generator=torch.Generator().manual_seed(block_size))
    expected = greedy_reference(target, ids, 2 * block_size + 5)
    draft = make_draft(block_size=block_size)
    assert torch.equal(draft.spec_generate(target=target, input_ids=ids, max_new_tokens=2 * block_size + 5), expected)
    assert torch.equal(run_generate(target, draft, ids, 2 * block_size + 5), expected)


@needs_rollback
def test_without_the_restore_output_diverges(monkeypatch):
    """The rollback is what makes it exact: a cache that forgets the saved states drifts from plain decoding
    (as z-lab's reference does on transformers 5.24, whose crop rewinds the conv states but not the recurrent one)."""
    use_rollback(monkeypatch, "saved")
    target = make_qwen3_5(seed=2)
    ids = torch.randint(3, VOCAB - 1, (1, 7), generator=torch.Generator().manual_seed(0))
    reference = greedy_reference(target, ids, 30)
    draft = OracleDraft(make_draft_config()).eval().setup(target, reference, 2)
    assert torch.equal(draft.spec_generate(target=target, input_ids=ids, max_new_tokens=30, block_size=8), reference)
    original = RollbackCache.save
    try:
        RollbackCache.save = lambda self, ids: (
            original(self, ids),
            setattr(self, "saved", [({}, {}) for _ in self.saved]),
        )
        out = draft.spec_generate(target=target, input_ids=ids, max_new_tokens=30, block_size=8)
    finally:
        RollbackCache.save = original
    assert not torch.equal(out, reference)


@needs_rollback
@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda d, t, ids: d.spec_generate(target=t, input_ids=ids, max_new_tokens=8, tree_budget=4),
            "cannot take; use the chain",
        ),
        (
            lambda d, t, ids: d.spec_generate(target=t, input_ids=ids, max_new_tokens=8, cache_implementation="static"),
            "rolls back in a cache of its own",
        ),
        (
            lambda d, t, ids: d.spec_generate(target=t, input_ids=ids, max_new_tokens=8, compile_verify=True),
            "rolls back in a cache of its own",
        ),
        (
            lambda d, t, ids: t.generate(ids, assistant_model=d, max_new_tokens=8, cache_implementation="static"),
            "rolls back in a cache of its own",
        ),
    ],
)
def test_what_a_recurrent_state_cannot_do_is_refused_before_compute(call, message):
    target = make_qwen3_5()
    calls, handle = passes(target)
    with pytest.raises(ValueError, match=message):
        call(make_draft(), target, torch.tensor([[5, 6, 7]]))
    handle.remove()
    assert not calls


def test_the_shipped_config_tree_yields_to_a_hybrid_target(rollback):
    if not ROLLS_BACK:
        pytest.skip("transformers 4.x refuses hybrid targets (tested below)")
    target, draft = make_qwen3_5(), make_draft()
    draft.config.tree_budget = 4
    ids = torch.tensor([[5, 6, 7]])
    assert torch.equal(
        draft.spec_generate(target=target, input_ids=ids, max_new_tokens=10), greedy_reference(target, ids, 10)
    )


def test_a_transformers_without_per_layer_linear_attention_caches_is_named(monkeypatch):
    monkeypatch.setattr(cache_dflash, "LinearAttentionCacheLayerMixin", None)
    target = make_qwen3_next()
    message = f"rolling it back needs transformers 5.24 or newer .* {transformers.__version__} is installed"
    with pytest.raises(ValueError, match=message):
        make_draft().spec_generate(target=target, input_ids=torch.tensor([[5, 6]]), max_new_tokens=4)
    with pytest.raises(ValueError, match=message):
        run_generate(target, make_draft(), torch.tensor([[5, 6]]), 4)


@needs_rollback
def test_cache_layers_that_can_neither_crop_nor_roll_back_are_refused(monkeypatch):
    class Opaque:
        pass

    monkeypatch.setattr(cache_dflash, "DynamicCache", lambda config=None: type("C", (), {"layers": [Opaque()]})())
    with pytest.raises(ValueError, match=r"cache layers \['Opaque'\] can neither be cropped nor rolled back"):
        make_draft().spec_generate(target=make_qwen3_5(), input_ids=torch.tensor([[5, 6]]), max_new_tokens=4)


@needs_rollback
def test_hybrid_targets_with_sliding_window_layers_are_refused():
    """A crop cannot bring back what a sliding layer evicted, so a rollback would not be exact."""
    target = make_qwen3_5()
    target.config.layer_types = ["linear_attention", "sliding_attention", "linear_attention", "full_attention"]
    target.config.sliding_window = 16
    with pytest.raises(ValueError, match=r"sliding-window cache layers \['DynamicSlidingWindowLayer'\] evict keys"):
        make_draft().spec_generate(target=target, input_ids=torch.tensor([[5, 6]]), max_new_tokens=4)
