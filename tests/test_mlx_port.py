"""mlx_port: conversion, losslessness against mlx-lm's own greedy decoding, partial acceptance, torch parity,
quantized drafts, hybrid-target rollback, hook cleanup, the command-line tools and the error cases.

Targets and drafts are tiny fp32 models (MLX matmul is slow on this CPU). The llama target and the draft are the
torch models of conftest.py, saved and loaded through mlx-lm, so torch and MLX hold the same weights.
"""

import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

if os.environ.get("DFLASH_REQUIRE_MLX"):  # CI installs mlx: a failed install must fail these tests, not skip them
    mx = importlib.import_module("mlx.core")
else:
    mx = pytest.importorskip("mlx.core", reason="mlx is not installed (pip install mlx mlx-lm, plus mlx-cpu on Linux)")

from conftest import (  # noqa: E402
    MASK_ID,
    MISMATCHES,
    ROOT,
    VOCAB,
    OracleDraft,
    SecondChoiceDraft,
    chi_square_p_value,
    make_draft,
    make_draft_config,
    make_target,
)
from mlx.utils import tree_flatten  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.models import qwen3_5  # noqa: E402
from mlx_lm.models.cache import RotatingKVCache  # noqa: E402
from mlx_lm.tokenizer_utils import TokenizerWrapper  # noqa: E402
from mlx_lm.utils import load_model  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

import tree_dflash  # noqa: E402
from mlx_port import load_draft, stream_generate  # noqa: E402
from mlx_port.convert import convert  # noqa: E402
from mlx_port.generate import LayerCapture, decoder_layers, target_head  # noqa: E402
from mlx_port.model import Model, ModelArgs  # noqa: E402
from modeling_dflash import DFlashDraftModel  # noqa: E402

PROMPT = [5, 6, 7]


# ---------------------------------------------------------------------------------------------------------------------
# Fixtures: tiny targets, drafts and a word-level tokenizer, built in code.


def make_tokenizer(eos_token: str | None = None) -> PreTrainedTokenizerFast:
    """Token `i` is the word `w{i}`; no BOS, and no EOS unless asked, so runs go to `max_tokens`."""
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w3"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w3", eos_token=eos_token)


def wrap(eos_ids: list[int] | None = None) -> TokenizerWrapper:
    return TokenizerWrapper(make_tokenizer(), eos_token_ids=eos_ids)


def save_torch_target(path: Path, **overrides) -> Path:
    """A conftest llama target whose MASK embedding points at token 2, which the target often repeats: the random
    draft then proposes 2 at mask positions and real drafts get accepted (acceptance lengths above 1)."""
    target = make_target("llama", **overrides)
    with torch.no_grad():
        target.model.embed_tokens.weight[MASK_ID] = target.lm_head.weight[2] * 10
    target.save_pretrained(path)
    make_tokenizer(eos_token="w2").save_pretrained(path)
    return path


def to_mlx_draft(torch_draft: DFlashDraftModel, path: Path) -> Model:
    torch_draft.save_pretrained(path)
    return load_draft(str(path))


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Torch's intra-op threads spin against MLX's on a shared 2-core machine (30 tokens took 22 s instead of 0.3 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("mlx_port")


@pytest.fixture(scope="module")
def target_dir(work) -> Path:
    return save_torch_target(work / "target")


@pytest.fixture(scope="module")
def target(target_dir):
    return load_model(target_dir)[0]


@pytest.fixture(scope="module")
def draft_dir(work) -> Path:
    make_draft().save_pretrained(work / "draft")
    return work / "draft"


@pytest.fixture(scope="module")
def draft(draft_dir, work) -> Model:
    return load_draft(str(convert(str(draft_dir), str(work / "draft-mlx"))))


def mlx_greedy(model, prompt: list[int], n: int) -> list[int]:
    """mlx-lm's own greedy decoding of the target."""
    return [t for t, _ in generate_step(mx.array(prompt, dtype=mx.uint32), model, max_tokens=n)]


def run(model, draft, prompt, **kwargs) -> tuple[list[int], list[int]]:
    """All generated tokens and the acceptance length (tau, counting the bonus) of every round after the prefill."""
    responses = list(stream_generate(model, draft, kwargs.pop("tokenizer", wrap()), prompt, **kwargs))
    tokens = [t for r in responses for t in r.tokens]
    assert responses[-1].generation_tokens == len(tokens)
    return tokens, [r.accepted + 1 for r in responses[1:]]


class MlxOracleDraft(Model):
    """The MLX twin of conftest's OracleDraft, with its rule: right for exactly `k` tokens per block, then wrong.

    It runs the real draft layers (so the context cache is exercised), then returns hidden states that the target's
    square head maps to the torch oracle's logits at each block position.
    """

    right_token, logits_at = OracleDraft.right_token, OracleDraft.logits_at  # one rule for both frameworks

    def setup(self, target, reference: list[int], k: int) -> "MlxOracleDraft":
        head = np.array(target_head(target).weight, dtype=np.float64)
        self.head_pinv = mx.array(np.linalg.pinv(head).T.astype(np.float32))
        self.reference, self.k, self.calls, self.cache_sizes = reference, k, [], []
        return self

    def __call__(self, noise_embeds, target_hidden, cache=None):
        super().__call__(noise_embeds, target_hidden, cache)
        block, start = noise_embeds.shape[1], cache[0].offset  # the cache holds every committed token before the block
        self.calls.append((target_hidden.shape[1], start))
        self.cache_sizes.append(cache[0].keys_and_values()[0].shape[2])
        logits = torch.stack([self.logits_at(start + i, i) for i in range(block)]).numpy()
        return (mx.array(logits) @ self.head_pinv)[None]


class MlxSecondChoiceDraft(MlxOracleDraft):
    """The MLX twin of conftest's SecondChoiceDraft: a chain accepts `k` drafted tokens a round, a tree `k + 1`."""

    logits_at = SecondChoiceDraft.logits_at


def oracle(draft_dir: Path, target, reference: list[int], k: int, kind=MlxOracleDraft, **load_kwargs) -> MlxOracleDraft:
    model = load_draft(str(draft_dir), **load_kwargs)
    oracle_draft = kind(model.args)
    oracle_draft.update(model.parameters())
    oracle_draft.sliding_window_size = model.sliding_window_size
    return oracle_draft.setup(target, reference, k)


# ---------------------------------------------------------------------------------------------------------------------
# Conversion and loading.


def test_convert_round_trip(draft_dir, work):
    """torch weights -> MLX folder -> torch again: every tensor equal, DFlash fields kept, nothing half-written."""
    out = convert(str(draft_dir), str(work / "round-trip"))
    original = DFlashDraftModel.from_pretrained(draft_dir).state_dict()
    back = DFlashDraftModel.from_pretrained(out).state_dict()  # strict: a missing or extra tensor would raise
    assert back.keys() == original.keys()
    assert all(torch.equal(back[k], original[k]) for k in original)
    mlx_weights = dict(tree_flatten(load_draft(str(out)).parameters()))
    assert mlx_weights.keys() == original.keys()
    assert all(np.array_equal(np.array(mlx_weights[k]), original[k].numpy()) for k in original)
    config = json.loads((out / "config.json").read_text())
    assert config["dflash_config"] == {"mask_token_id": MASK_ID, "target_layer_ids": [0, 2]}
    assert config["block_size"] == 8 and config["num_target_layers"] == 4
    with pytest.raises(ValueError, match="already exists"):
        convert(str(draft_dir), str(out))
    assert sorted(p.name for p in work.iterdir() if p.name.startswith(".")) == [], "a temporary folder was left"


def test_convert_dtype(draft_dir, work):
    out = convert(str(draft_dir), str(work / "bf16"), dtype="bfloat16")
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert {v.dtype for _, v in tree_flatten(load_draft(str(out)).parameters())} == {mx.bfloat16}


def edit_config(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    edit(config)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_loads_zlab_and_transformers5_configs(draft_dir, draft, work):
    """A z-lab style config (transformers 4: top-level `rope_theta`, `torch_dtype`, no `layer_types`) and a
    transformers-5 config with only `rope_parameters` load to the same draft."""

    def zlab(config):
        for key in ("rope_parameters", "layer_types", "dtype", "auto_map"):
            config.pop(key, None)
        config.update(rope_theta=10000.0, torch_dtype="float32")

    def transformers5(config):
        config.pop("rope_theta", None)
        assert "rope_theta" in config["rope_parameters"]

    for name, edit in (("zlab", zlab), ("tf5", transformers5)):
        loaded = load_draft(str(edit_config(draft_dir, work / name, edit)))
        assert loaded.layers[0].self_attn.rope.base == draft.layers[0].self_attn.rope.base
        assert loaded.args.layer_types == ["full_attention"] * 2


def test_strict_load_refuses_missing_and_extra_weights(draft_dir, work):
    weights = mx.load(str(draft_dir / "model.safetensors"))
    for name, change in (("missing", lambda w: w.pop("norm.weight")), ("extra", lambda w: w.update(extra=mx.zeros(2)))):
        folder = work / f"{name}-weight"
        shutil.copytree(draft_dir, folder)
        edited = dict(weights)
        change(edited)
        mx.save_safetensors(str(folder / "model.safetensors"), edited)
        message = "Missing 1 parameters" if name == "missing" else "parameters not in model"
        with pytest.raises(ValueError, match=f"does not match the draft architecture.*{message}"):
            load_draft(str(folder))


def test_target_folder_is_not_a_draft(target_dir):
    with pytest.raises(ValueError, match="not a DFlash draft config"):
        load_draft(str(target_dir))


# ---------------------------------------------------------------------------------------------------------------------
# Losslessness.


@pytest.mark.parametrize("block_size", [2, 4, 8, 16])
def test_greedy_equals_mlx_lm_greedy(target, draft, block_size):
    for prompt in ([9], PROMPT, list(range(3, 43))):
        max_tokens = 3 * block_size + 1  # not a multiple of the block size
        tokens, _ = run(target, draft, prompt, block_size=block_size, max_tokens=max_tokens)
        assert tokens == mlx_greedy(target, prompt, max_tokens), f"B={block_size} prompt={len(prompt)}"


@pytest.mark.parametrize("block_size", [4, 8])
def test_forced_partial_acceptance_at_every_k(target, draft_dir, block_size):
    """A draft right for exactly k tokens per block: output stays exact and every round accepts k + 1."""
    max_tokens = 24
    reference = PROMPT + mlx_greedy(target, PROMPT, max_tokens + block_size)
    for k in range(block_size):
        oracle_draft = oracle(draft_dir, target, reference, k)
        tokens, taus = run(target, oracle_draft, PROMPT, block_size=block_size, max_tokens=max_tokens)
        assert tokens == reference[3 : 3 + max_tokens], f"k={k}"
        assert taus[:-1] == [k + 1] * (len(taus) - 1), f"k={k}: {taus}"
        # the draft sees the whole prompt first, then exactly the tokens committed by the previous round
        assert oracle_draft.calls[0] == (3, 3) and all(n == k + 1 for n, _ in oracle_draft.calls[1:])


def test_stops_at_eos_inside_a_block_and_honours_max_tokens(target, draft_dir):
    reference = PROMPT + mlx_greedy(target, PROMPT, 40)
    stop = reference[3 + 10]
    first = reference[3:].index(stop)
    oracle_draft = oracle(draft_dir, target, reference, 7)
    responses = list(stream_generate(target, oracle_draft, wrap([stop]), PROMPT, block_size=8, max_tokens=40))
    assert [t for r in responses for t in r.tokens] == reference[3 : 3 + first + 1]
    assert responses[-1].finish_reason == "stop" and all(r.finish_reason is None for r in responses[:-1])
    text = "".join(r.text for r in responses)
    assert text.split() == [f"w{t}" for t in reference[3 : 3 + first]], "the stop token is not part of the text"
    for max_tokens in (1, 5, 16, 17):
        responses = list(stream_generate(target, oracle_draft, wrap(), PROMPT, block_size=8, max_tokens=max_tokens))
        assert sum(len(r.tokens) for r in responses) == max_tokens and responses[-1].finish_reason == "length"


def test_text_prompt_and_mx_array_prompt(target, draft):
    tokenizer = wrap()
    expected = mlx_greedy(target, PROMPT, 6)
    for prompt in ("w5 w6 w7", mx.array(PROMPT, dtype=mx.uint32)):
        assert run(target, draft, prompt, tokenizer=tokenizer, max_tokens=6, block_size=4)[0] == expected
    text = "".join(r.text for r in stream_generate(target, draft, tokenizer, "w5 w6 w7", max_tokens=6, block_size=4))
    assert text.split() == [f"w{t}" for t in expected]


def test_real_tokens_equal_to_mask_id_are_kept(target_dir, draft):
    """A target that likes the mask token must still see it in the output (z-lab bug #73)."""
    model = load_model(target_dir)[0]
    head = model.lm_head.weight
    model.lm_head.weight = mx.concatenate([head[:MASK_ID], model.model.norm.weight[None] * 5, head[MASK_ID + 1 :]])
    expected = mlx_greedy(model, PROMPT, 20)
    assert MASK_ID in expected
    assert run(model, draft, PROMPT, block_size=4, max_tokens=20)[0] == expected


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_drafts_stay_lossless(target, draft_dir, work, bits):
    out = convert(str(draft_dir), str(work / f"q{bits}"), quantize=True, q_bits=bits, q_group_size=32)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"] == {"group_size": 32, "bits": bits, "mode": "affine"}
    quantized = load_draft(str(out))
    assert quantized.fc.bits == bits and quantized.layers[1].mlp.down_proj.bits == bits
    for block_size in (4, 16):
        tokens, taus = run(target, quantized, PROMPT, block_size=block_size, max_tokens=30)
        assert tokens == mlx_greedy(target, PROMPT, 30)
        assert max(taus) > 1, "the quantized draft should still get some blocks accepted"


def test_sliding_window_size_bounds_the_draft_cache(target, draft_dir):
    reference = PROMPT + mlx_greedy(target, PROMPT, 48)
    oracle_draft = oracle(draft_dir, target, reference, 2, sliding_window_size=8)
    tokens, _ = run(target, oracle_draft, PROMPT, block_size=4, max_tokens=40)
    assert tokens == reference[3:43]
    assert max(oracle_draft.cache_sizes) == 8 and oracle_draft.calls[-1][1] > 30


def exact_two_token_distribution(model, prompt: list[int], temperature: float) -> np.ndarray:
    """p(t1, t2 | prompt) of the MLX target at `temperature`, as a `[V, V]` table."""
    p1 = mx.softmax(model(mx.array([prompt]))[0, -1] / temperature)
    seqs = mx.concatenate([mx.array([prompt] * VOCAB), mx.arange(VOCAB)[:, None]], axis=1)
    p2 = mx.softmax(model(seqs)[:, -1] / temperature, axis=-1)
    return np.array(p1[:, None] * p2, dtype=np.float64)


@pytest.mark.parametrize("tree_budget", [0, 4])
def test_sampling_matches_target_distribution(work, draft_dir, tree_budget):
    """Chi-square test of the first two sampled tokens against the exact target distribution.

    The draft proposes the target's greedy tokens, so blocks are often accepted; a verifier that kept draft tokens
    too eagerly would over-weight the greedy path. Cells below an expected count of 5 are pooled; the test fails
    at p < 1e-4.
    """
    model = load_model(save_torch_target(work / "peaky", initializer_range=0.5))[0]
    n, temperature = 1000, 1.0
    exact = exact_two_token_distribution(model, PROMPT, temperature).ravel()
    oracle_draft = oracle(draft_dir, model, PROMPT + mlx_greedy(model, PROMPT, 8), 3)
    tokenizer, counts, accepted = wrap(), np.zeros(VOCAB * VOCAB), 0
    mx.random.seed(0)
    for _ in range(n):
        responses = list(
            stream_generate(
                model,
                oracle_draft,
                tokenizer,
                PROMPT,
                max_tokens=2,
                temperature=temperature,
                block_size=4,
                tree_budget=tree_budget,
            )
        )
        t1, t2 = [t for r in responses for t in r.tokens]
        counts[t1 * VOCAB + t2] += 1
        accepted += responses[1].accepted > 0
    assert accepted > n // 5, "the test needs drafted tokens to be accepted"
    p_value, chi2, dof = chi_square_p_value(
        torch.from_numpy(counts), torch.from_numpy(np.asarray(exact, dtype=np.float64))
    )
    assert p_value > 1e-4, f"chi2={chi2:.1f} dof={dof} p={p_value:.2e}"


# ---------------------------------------------------------------------------------------------------------------------
# Torch parity.


def torch_and_mlx_hidden(torch_draft: DFlashDraftModel, mlx_draft: Model, steps: list[tuple[int, int]]):
    """Runs both drafts over rounds of `(context_len, block)` with their caches; yields both hidden states."""
    from transformers import DynamicCache

    rng, torch_cache, mlx_cache, start = np.random.default_rng(0), DynamicCache(), mlx_draft.make_cache(), 0
    num_features = len(torch_draft.config.target_layer_ids) * torch_draft.config.hidden_size
    for n_ctx, block in steps:
        noise = rng.standard_normal((1, block, torch_draft.config.hidden_size)).astype(np.float32)
        ctx = rng.standard_normal((1, n_ctx, num_features)).astype(np.float32)
        positions = torch.arange(start, start + n_ctx + block)[None]
        with torch.no_grad():
            out = torch_draft(
                torch.from_numpy(noise), torch.from_numpy(ctx), position_ids=positions, past_key_values=torch_cache
            )
        torch_cache.crop(-block)
        start += n_ctx
        yield out.last_hidden_state[0].numpy(), np.array(mlx_draft(mx.array(noise), mx.array(ctx), cache=mlx_cache)[0])


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"attention_bias": True},
        {"use_sliding_window": True, "sliding_window": 6, "layer_types": ["sliding_attention", "full_attention"]},
        {
            "use_sliding_window": True,
            "sliding_window": 3,
            "layer_types": ["sliding_attention", "full_attention"],
            "is_causal": False,
        },
        {"is_causal": True},
    ],
    ids=["qwen3", "attention_bias", "sliding_layer", "non_causal_window_3", "all_causal"],
)
def test_hidden_states_match_torch(work, overrides):
    torch_draft = make_draft(**overrides)
    if overrides.get("attention_bias"):
        with torch.no_grad():  # the random init leaves biases at zero; make them count
            for name, p in torch_draft.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, 0.5)
    mlx_draft = to_mlx_draft(torch_draft, work / f"parity-{len(list(work.iterdir()))}")
    if "layer_types" in overrides:
        window = overrides["sliding_window"]
        assert (
            mlx_draft.layers[0].self_attn.sliding_window == window
            and mlx_draft.layers[1].self_attn.sliding_window is None
        )
    assert [layer.self_attn.causal for layer in mlx_draft.layers] == [
        layer.self_attn.causal for layer in torch_draft.layers
    ]
    for i, (expected, got) in enumerate(torch_and_mlx_hidden(torch_draft, mlx_draft, [(5, 4), (3, 4), (1, 8), (4, 4)])):
        diff = float(np.abs(expected - got).max())
        assert diff < 1e-4, f"round {i}: max |torch - mlx| = {diff:.3g}"


@pytest.mark.parametrize("block_size", [4, 8])
def test_tokens_and_acceptance_match_torch(target_dir, target, draft_dir, draft, block_size):
    """The same fp32 weights: torch `spec_generate` and MLX give identical tokens and acceptance lengths at T=0."""
    from transformers import AutoModelForCausalLM

    torch_target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    torch_draft = DFlashDraftModel.from_pretrained(draft_dir).eval()
    all_taus = []
    for prompt in (PROMPT, list(range(10, 30))):
        stats = torch_draft.spec_generate(
            target=torch_target,
            input_ids=torch.tensor([prompt]),
            max_new_tokens=30,
            block_size=block_size,
            return_stats=True,
        )
        tokens, taus = run(target, draft, prompt, block_size=block_size, max_tokens=30)
        assert tokens == stats.output_ids[0, len(prompt) :].tolist(), f"prompt {prompt}"
        assert taus == stats.acceptance_lengths, f"prompt {prompt}"
        all_taus += taus
    assert max(all_taus) > 1, "the test needs real acceptance, not only rejections"


def test_draft_vocab_matches_torch(target_dir, target, draft_dir, work):
    """A draft with `dflash_config.draft_vocab` proposes from that subset in both frameworks: same tokens and
    acceptance lengths as torch, and output equal to mlx-lm's greedy decoding."""
    from transformers import AutoModelForCausalLM

    vocab = [t for t in range(VOCAB) if t % 3 != 1]
    folder = edit_config(draft_dir, work / "draft-vocab", lambda c: c["dflash_config"].update(draft_vocab=vocab))
    torch_target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    torch_draft = DFlashDraftModel.from_pretrained(folder).eval()
    assert torch_draft.config.draft_vocab == vocab
    stats = torch_draft.spec_generate(
        torch_target, torch.tensor([PROMPT]), max_new_tokens=30, block_size=8, return_stats=True
    )
    tokens, taus = run(target, load_draft(str(folder)), PROMPT, block_size=8, max_tokens=30)
    assert tokens == stats.output_ids[0, 3:].tolist() == mlx_greedy(target, PROMPT, 30)
    assert taus == stats.acceptance_lengths


def test_oracle_acceptance_matches_torch(target_dir, target, draft_dir):
    """Both loops accept the same number of tokens per round when the draft is right for exactly k tokens."""
    from transformers import AutoModelForCausalLM

    torch_target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    reference = PROMPT + mlx_greedy(target, PROMPT, 40)
    for k in (0, 2, 5):
        torch_oracle = OracleDraft(make_draft_config()).eval().setup(torch_target, torch.tensor([reference]), k)
        stats = torch_oracle.spec_generate(
            target=torch_target, input_ids=torch.tensor([PROMPT]), max_new_tokens=30, block_size=8, return_stats=True
        )
        tokens, taus = run(target, oracle(draft_dir, target, reference, k), PROMPT, block_size=8, max_tokens=30)
        assert tokens == stats.output_ids[0, 3:].tolist() and taus == stats.acceptance_lengths, f"k={k}"


# ---------------------------------------------------------------------------------------------------------------------
# Draft trees.

REPEATING = list(range(10, 30)) + list(range(10, 20))  # the lookup branch finds its continuation


# t(n) in units far above a draft pass's seconds, so torch and MLX cut each round to the same width
LINEAR_COSTS = {1: 1000.0, 64: 4000.0}


@pytest.mark.parametrize(
    "budget, lookup, costs",
    [
        (1, 0, None),
        (4, 0, None),
        (16, 0, None),
        (4, 5, None),
        (0, 5, None),
        (16, 0, LINEAR_COSTS),
        (8, 5, LINEAR_COSTS),
    ],
)
def test_tree_tokens_and_acceptance_match_torch(target_dir, target, draft_dir, draft, budget, lookup, costs):
    """The same draft and target: the MLX tree (and lookup branch) verify gives torch's tokens and acceptance
    lengths, and mlx-lm's greedy output; with `costs`, both cut every round by the same cost rule."""
    from transformers import AutoModelForCausalLM

    torch_target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    torch_draft = DFlashDraftModel.from_pretrained(draft_dir).eval()
    sizing = dict(tree_sizing="cost", verify_costs=costs) if costs else {}
    for prompt in (PROMPT, REPEATING):
        stats = torch_draft.spec_generate(
            torch_target,
            torch.tensor([prompt]),
            max_new_tokens=30,
            block_size=8,
            tree_budget=budget,
            prompt_lookup_num_tokens=lookup,
            return_stats=True,
            **sizing,
        )
        assert len(stats.expected_acceptance_lengths) == (len(stats.acceptance_lengths) if costs else 0)
        tokens, taus = run(
            target,
            draft,
            prompt,
            block_size=8,
            max_tokens=30,
            tree_budget=budget,
            prompt_lookup_num_tokens=lookup,
            **sizing,
        )
        assert tokens == stats.output_ids[0, len(prompt) :].tolist() == mlx_greedy(target, prompt, 30), f"{prompt}"
        assert taus == stats.acceptance_lengths, f"prompt {prompt}"


def test_every_loop_follows_tree_dflashs_one_lookup_rule_and_one_accept_walk(
    target_dir, target, draft_dir, draft, monkeypatch
):
    """A rule changed in `tree_dflash` changes every loop: torch's one row (chain and tree), torch's batch and MLX
    (chain and tree). With the lookup made an oracle (the true continuation), every tree round accepts its 5 tokens
    at least; with the accept walk then capped at two drafted nodes, every round's tau is 3; every output stays plain
    greedy."""
    from transformers import AutoModelForCausalLM

    torch_target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    torch_draft = DFlashDraftModel.from_pretrained(draft_dir).eval()
    reference = PROMPT + mlx_greedy(target, PROMPT, 50)
    monkeypatch.setattr(tree_dflash, "prompt_lookup", lambda tokens, n, *_: reference[len(tokens) : len(tokens) + n])
    torch_oracle = OracleDraft(make_draft_config()).eval().setup(torch_target, torch.tensor([reference]), 7)
    lookup = dict(tree_budget=0, prompt_lookup_num_tokens=5)

    def torch_taus(model, rows: int, **kwargs) -> list[int]:
        out = model.spec_generate(
            torch_target, torch.tensor([PROMPT] * rows), max_new_tokens=30, block_size=8, return_stats=True, **kwargs
        )
        assert all(row[3:].tolist() == reference[3:33] for row in out.output_ids)
        return [tau for row in out.acceptance_lengths for tau in (row if rows > 1 else [row])]

    def mlx_taus(model, **kwargs) -> list[int]:
        tokens, taus = run(target, model, PROMPT, block_size=8, max_tokens=30, **kwargs)
        assert tokens == reference[3:33]
        return taus

    def every_loop() -> dict[str, list[int]]:
        return {
            "torch row, chain": torch_taus(torch_oracle, 1, tree_budget=0),
            "torch row, tree": torch_taus(torch_draft, 1, **lookup),
            "torch batch": torch_taus(torch_draft, 2, **lookup),
            "mlx, chain": mlx_taus(oracle(draft_dir, target, reference, 7), tree_budget=0),
            "mlx, tree": mlx_taus(draft, **lookup),
        }

    for loop, taus in every_loop().items():  # a chain right for 7 tokens; a tree holding the lookup's 5 at least
        assert min(taus) == 8 if "chain" in loop else min(taus) >= 6, f"{loop}: {taus}"
    walk = tree_dflash.DraftTree.accept
    monkeypatch.setattr(tree_dflash.DraftTree, "accept", lambda tree, chosen: walk(tree, chosen)[:3])
    for loop, taus in every_loop().items():
        assert set(taus) == {3}, f"{loop}: {taus}"


def test_cost_sizing_follows_the_verify_cost(target, draft, monkeypatch):
    """A verify whose every extra token costs more than it can return is cut to the plain decode step (tau 1 every
    round), and drafts only in rounds 1, 3, 6, 11 and 20 (the back-off), each pass reading the features of every
    token committed since the last; a flat one keeps the whole tree, as fixed sizing does; all stay mlx-lm's greedy
    output."""
    reference = mlx_greedy(target, REPEATING, 30)
    settings = dict(block_size=8, max_tokens=30, tree_budget=8, prompt_lookup_num_tokens=5)
    reads, forward = [], type(draft).__call__

    def counted(self, noise_embeds, target_hidden, cache=None):
        reads.append((cache[0].offset, target_hidden.shape[1]))
        return forward(self, noise_embeds, target_hidden, cache)

    monkeypatch.setattr(type(draft), "__call__", counted)
    steep, steep_taus = run(target, draft, REPEATING, tree_sizing="cost", verify_costs={1: 1.0, 64: 1000.0}, **settings)
    assert [offset + read for offset, read in reads] == [len(REPEATING) + r - 1 for r in (1, 3, 6, 11, 20)]
    assert all(offset == sum(read for _, read in reads[:i]) for i, (offset, _) in enumerate(reads))
    monkeypatch.undo()
    flat, flat_taus = run(target, draft, REPEATING, tree_sizing="cost", verify_costs={1: 1.0, 64: 1.0}, **settings)
    fixed, fixed_taus = run(target, draft, REPEATING, tree_sizing="fixed", **settings)
    assert steep == flat == fixed == reference
    assert set(steep_taus) == {1} and len(steep_taus) == 29
    assert flat_taus == fixed_taus and max(fixed_taus) > 1


def test_runs_with_torch_unimportable(target_dir, target, draft, work):
    """The port imports no torch at run time: with torch unimportable, a cost-sized tree with a lookup branch (the
    verify costs measured on the spot) still gives mlx-lm's greedy output."""
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from mlx_lm.utils import load_model\n"
        "from mlx_port import load_draft\n"
        "from mlx_port.generate import dflash_generate_step\n"
        "import mlx.core as mx\n"
        "from pathlib import Path\n"
        f"model = load_model(Path({str(target_dir)!r}))[0]\n"
        f"draft = load_draft({str(work / 'draft-mlx')!r})\n"
        f"prompt = mx.array({REPEATING!r}, dtype=mx.uint32)\n"
        "steps = dflash_generate_step(prompt, model, draft, block_size=8, tree_budget=8, prompt_lookup_num_tokens=5,"
        " tree_sizing='cost')\n"
        "tokens = []\n"
        "while len(tokens) < 30:\n"
        "    tokens += next(steps)[0]\n"
        "print(tokens[:30])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[-2] == str(mlx_greedy(target, REPEATING, 30))


@pytest.mark.parametrize("budget", [1, 4, 16])
@pytest.mark.parametrize("k", [0, 2, 5])
def test_oracle_trees_are_exact_and_trees_of_16_commit_more_per_target_pass(target_dir, target, draft_dir, k, budget):
    """A draft whose first choice is right for k tokens and whose second choice is right after them: at every
    budget the MLX tree gives the torch reference's tokens and acceptance; the chain accepts k drafted tokens a
    round and a tree of 16 nodes k + 1."""
    from transformers import AutoModelForCausalLM

    torch_target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    reference = PROMPT + mlx_greedy(target, PROMPT, 48)
    second_choice = oracle(draft_dir, target, reference, k, kind=MlxSecondChoiceDraft)
    chain, chain_taus = run(target, second_choice, PROMPT, block_size=8, max_tokens=30, tree_budget=0)
    tree, tree_taus = run(target, second_choice, PROMPT, block_size=8, max_tokens=30, tree_budget=budget)
    torch_oracle = SecondChoiceDraft(make_draft_config()).eval().setup(torch_target, torch.tensor([reference]), k)
    stats = torch_oracle.spec_generate(
        torch_target, torch.tensor([PROMPT]), max_new_tokens=30, block_size=8, tree_budget=budget, return_stats=True
    )
    assert tree == chain == reference[3:33] == stats.output_ids[0, 3:].tolist()
    assert tree_taus == stats.acceptance_lengths
    assert chain_taus[:-1] == [k + 1] * (len(chain_taus) - 1)
    if budget < 16:
        return
    assert tree_taus[:-1] == [k + 2] * (len(tree_taus) - 1)
    per_pass = lambda taus: sum(taus[:-1]) / len(taus[:-1])  # noqa: E731  (the last round is cut by max_tokens)
    assert per_pass(tree_taus) >= 1.10 * per_pass(chain_taus), f"tree {tree_taus} chain {chain_taus}"


def test_a_config_tree_is_followed_without_an_argument_as_in_torch(target_dir, target, draft_dir, work):
    from transformers import AutoModelForCausalLM

    folder = edit_config(
        draft_dir, work / "draft-tree", lambda c: c["dflash_config"].update(tree_budget=4, prompt_lookup_num_tokens=5)
    )
    configured = load_draft(str(folder))
    default = run(target, configured, REPEATING, block_size=8, max_tokens=30)
    explicit = run(
        target, configured, REPEATING, block_size=8, max_tokens=30, tree_budget=4, prompt_lookup_num_tokens=5
    )
    chain = run(target, configured, REPEATING, block_size=8, max_tokens=30, tree_budget=0, prompt_lookup_num_tokens=0)
    torch_target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    stats = (
        DFlashDraftModel.from_pretrained(folder)
        .eval()
        .spec_generate(torch_target, torch.tensor([REPEATING]), max_new_tokens=30, block_size=8, return_stats=True)
    )
    assert default == explicit and default[1] == stats.acceptance_lengths
    assert default[0] == chain[0] and default[1] != chain[1], "the tree and lookup branch changed acceptance"


def test_a_tree_the_target_cannot_verify_is_refused_or_stepped_aside(target_dir, target, draft_dir, work, monkeypatch):
    """An explicit tree is refused before compute, with the reason; the config's tree yields to the chain with a
    warning."""

    generation = importlib.import_module("mlx_port.generate")  # the package's `generate` is the function

    broken = load_model(target_dir)[0]
    broken.model.layers[1].self_attn.rope = None
    with pytest.raises(ValueError, match="tree_budget=4 needs a tree verify, but layer 1 .* has no self_attn.rope"):
        run(broken, load_draft(str(draft_dir)), PROMPT, max_tokens=4, tree_budget=4)
    scaled = load_model(target_dir)[0]
    scaled.args.rope_parameters = {"llama_4_scaling_beta": 0.1}  # as mlx-lm's ministral3 and mistral4 read it
    with pytest.raises(ValueError, match=r"scales attention by cache offset \(llama_4_scaling_beta\)"):
        run(scaled, load_draft(str(draft_dir)), PROMPT, max_tokens=4, tree_budget=4)
    for bad in (-1, True, 2.5):
        with pytest.raises(ValueError, match="must be a non-negative integer"):
            run(target, load_draft(str(draft_dir)), PROMPT, max_tokens=4, tree_budget=bad)
    folder = edit_config(draft_dir, work / "draft-tree4", lambda c: c["dflash_config"].update(tree_budget=4))
    monkeypatch.setattr(generation, "tree_problem", lambda model: "no rope here")
    with pytest.warns(UserWarning, match="argmax chain instead of the draft config's tree_budget=4: no rope here"):
        tokens, _ = run(target, load_draft(str(folder)), PROMPT, max_tokens=12, block_size=4)
    assert tokens == mlx_greedy(target, PROMPT, 12)


def test_keep_path_compacts_every_cache_kind_to_the_accepted_path():
    from mlx_lm.models.cache import ConcatenateKVCache, KVCache, QuantizedKVCache

    from mlx_port.generate import keep_path

    start, size, path = 5, 6, [0, 2, 5]
    values = mx.arange(1 * 2 * (start + size) * 32, dtype=mx.float32).reshape(1, 2, start + size, 32) / 100
    expected = mx.concatenate([values[..., :start, :], values[..., [start + n for n in path], :]], axis=2)
    for cache in (KVCache(), ConcatenateKVCache(), QuantizedKVCache(group_size=32, bits=8)):
        cache.update_and_fetch(values[..., :start, :], values[..., :start, :])
        cache.update_and_fetch(values[..., start:, :], values[..., start:, :])
        keep_path([cache], start, path, size)
        keys, _ = cache.state if isinstance(cache, ConcatenateKVCache) else (cache.keys, cache.values)
        if isinstance(cache, QuantizedKVCache):
            keys = mx.dequantize(*keys, group_size=32, bits=8)
        got = keys[..., : cache.offset, :]
        assert cache.offset == start + len(path), type(cache).__name__
        assert float(mx.abs(got - expected).max()) < 0.02, type(cache).__name__  # 8-bit keys round
        more = values[..., :1, :]  # the next round's update must attend to the kept keys and itself only
        fetched, _ = cache.update_and_fetch(more, more)
        if isinstance(cache, QuantizedKVCache):
            fetched = fetched[0]
        assert cache.offset == fetched.shape[-2] == start + len(path) + 1, type(cache).__name__


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_target_and_draft_trees_equal_their_chain(target_dir, draft_dir, work, bits):
    import mlx.nn as nn

    model = load_model(target_dir)[0]
    nn.quantize(model, group_size=32, bits=bits)
    quantized = load_draft(
        str(convert(str(draft_dir), str(work / f"tree-q{bits}"), quantize=True, q_bits=bits, q_group_size=32))
    )
    chain, _ = run(model, quantized, PROMPT, block_size=8, max_tokens=30, tree_budget=0)
    assert chain == mlx_greedy(model, PROMPT, 30)
    for budget in (4, 16):
        assert run(model, quantized, PROMPT, block_size=8, max_tokens=30, tree_budget=budget)[0] == chain


# ---------------------------------------------------------------------------------------------------------------------
# Hybrid targets.


def make_qwen3_5(seed: int = 0):
    """A tiny random mlx-lm `qwen3_5` target: gated-delta (ArraysCache) layers 0-2, full attention in layer 3."""
    mx.random.seed(seed)
    text_config = dict(
        model_type="qwen3_5",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=VOCAB,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        full_attention_interval=4,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    )
    model = qwen3_5.Model(qwen3_5.ModelArgs(model_type="qwen3_5", text_config=text_config))
    mx.eval(model.parameters())
    return model


def hybrid_draft(work: Path, name: str) -> Path:
    folder = work / name
    if not folder.exists():
        make_draft(target_layer_ids=[0, 1]).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("block_size, ks", [(4, range(4)), (8, (0, 3, 6, 7))])
def test_hybrid_target_rolls_back_its_recurrent_state(work, block_size, ks):
    """Rejections at every position restore the gated-delta state and re-run the kept prefix: output stays exact."""
    model = make_qwen3_5()
    assert {type(c).__name__ for c in model.make_cache()} == {"ArraysCache", "KVCache"}
    folder = hybrid_draft(work, "hybrid-draft")
    reference = PROMPT + mlx_greedy(model, PROMPT, 40)
    for k in ks:
        tokens, taus = run(model, oracle(folder, model, reference, k), PROMPT, block_size=block_size, max_tokens=30)
        assert tokens == reference[3:33], f"k={k}"
        assert taus[:-1] == [k + 1] * (len(taus) - 1), f"k={k}: {taus}"
    assert run(model, load_draft(str(folder)), PROMPT, block_size=block_size, max_tokens=30)[0] == reference[3:33]


def test_hybrid_targets_keep_the_chain(work):
    """A config's tree yields to the chain on a recurrent target, as in torch; an explicit tree is refused."""
    model = make_qwen3_5()
    folder = edit_config(
        hybrid_draft(work, "hybrid-draft"),
        work / "hybrid-tree",
        lambda c: c["dflash_config"].update(tree_budget=4, prompt_lookup_num_tokens=5),
    )
    assert run(model, load_draft(str(folder)), PROMPT, block_size=4, max_tokens=12)[0] == mlx_greedy(model, PROMPT, 12)
    with pytest.raises(ValueError, match="tree_budget=4 needs a tree verify, but the target's recurrent state"):
        run(model, load_draft(str(folder)), PROMPT, max_tokens=4, tree_budget=4)


def test_unsupported_target_cache_is_refused(target, draft, monkeypatch):
    monkeypatch.setattr(
        type(target), "make_cache", lambda self: [RotatingKVCache(64) for _ in self.layers], raising=False
    )
    with pytest.raises(ValueError, match="cannot roll back the target's RotatingKVCache cache"):
        run(target, draft, PROMPT, max_tokens=4)


# ---------------------------------------------------------------------------------------------------------------------
# Hooks.


def assert_untouched(model, before: list) -> None:
    layers = decoder_layers(model)
    assert len(layers) == len(before) and all(a is b for a, b in zip(layers, before))
    assert not any(isinstance(layer, LayerCapture) for layer in layers)


def test_hooks_are_removed_after_finish_exception_and_early_close(target, draft):
    before = list(decoder_layers(target))
    weights = {k: np.array(v) for k, v in tree_flatten(target.parameters())}
    run(target, draft, PROMPT, max_tokens=10, block_size=4)
    assert_untouched(target, before)

    gen = stream_generate(target, draft, wrap(), PROMPT, max_tokens=50, block_size=4)
    next(gen)
    assert isinstance(decoder_layers(target)[0], LayerCapture), "hooks are installed while generating"
    gen.close()
    assert_untouched(target, before)

    calls = []

    def failing_sampler(logprobs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("sampler failed")
        return mx.argmax(logprobs, axis=-1)

    with pytest.raises(RuntimeError, match="sampler failed"):
        run(target, draft, PROMPT, max_tokens=50, block_size=4, sampler=failing_sampler)
    assert_untouched(target, before)
    after = {k: np.array(v) for k, v in tree_flatten(target.parameters())}
    assert after.keys() == weights.keys() and all(np.array_equal(after[k], weights[k]) for k in weights)
    assert run(target, draft, PROMPT, max_tokens=10, block_size=4)[0] == mlx_greedy(target, PROMPT, 10)


# ---------------------------------------------------------------------------------------------------------------------
# Errors, all before any compute.


@pytest.fixture
def count_target_calls(target, monkeypatch) -> list:
    calls, inner_class = [], type(target.model)
    original = inner_class.__call__
    monkeypatch.setattr(inner_class, "__call__", lambda self, *a, **k: calls.append(1) or original(self, *a, **k))
    return calls


@pytest.mark.parametrize("change, message", MISMATCHES)
def test_mismatched_draft_is_refused(target, count_target_calls, change, message):
    mismatched = Model(ModelArgs.from_dict(make_draft_config(**change).to_dict()))
    with pytest.raises(ValueError, match=message):
        run(target, mismatched, PROMPT, max_tokens=4)
    assert not count_target_calls, "the target ran before the error"


@pytest.mark.parametrize(
    "prompt, kwargs, message",
    [
        ([], {}, "prompt is empty"),
        ("", {}, "prompt is empty"),
        (PROMPT, {"block_size": 1}, "block_size must be at least 2"),
        (PROMPT, {"max_tokens": 0}, "max_tokens must be at least 1"),
    ],
)
def test_bad_arguments_fail_before_compute(target, draft, count_target_calls, prompt, kwargs, message):
    with pytest.raises(ValueError, match=message):
        run(target, draft, prompt, **{"max_tokens": 4} | kwargs)
    assert not count_target_calls, "the target ran before the error"


def test_bad_sliding_window_size_is_refused(draft_dir):
    with pytest.raises(ValueError, match="sliding_window_size must be at least 1"):
        load_draft(str(draft_dir), sliding_window_size=0)


# ---------------------------------------------------------------------------------------------------------------------
# Command line.


def test_cli_convert_and_generate_end_to_end(target_dir, target, draft_dir, work):
    """`python -m mlx_port convert -q` then `python -m mlx_port generate` (a tree of 3 and a lookup branch), run as
    `__main__` in one subprocess (one import of mlx-lm), print what mlx-lm's own greedy decoding makes, with no runpy
    warning."""
    out = work / "cli-draft"
    convert_argv = ["--hf-path", str(draft_dir), "--mlx-path", str(out), "-q", "--q-bits", "8", "--q-group-size", "32"]
    generate_argv = [
        "--model",
        str(target_dir),
        "--draft-model",
        str(out),
        "--prompt",
        "w5 w6 w7",
        "--max-tokens",
        "12",
    ]
    generate_argv += [
        "--temp",
        "0",
        "--block-size",
        "4",
        "--compare",
        "--tree-budget",
        "3",
        "--prompt-lookup-num-tokens",
        "2",
    ]
    script = (
        "import runpy, sys\n"
        f"sys.argv = ['mlx_port', 'convert'] + {convert_argv!r}\n"
        "runpy.run_module('mlx_port', run_name='__main__', alter_sys=True)\n"
        "print('=== generate')\n"
        f"sys.argv = ['mlx_port', 'generate'] + {generate_argv!r}\n"
        "runpy.run_module('mlx_port', run_name='__main__', alter_sys=True)\n"
    )
    done = subprocess.run(
        [sys.executable, "-W", "default", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert "RuntimeWarning" not in done.stderr, done.stderr
    assert json.loads((out / "config.json").read_text())["quantization"]["bits"] == 8
    generated = done.stdout.split("=== generate\n")[1]
    text, summary, plain = generated.rstrip("\n").rsplit("\n", 2)
    expected = mlx_greedy(target, PROMPT, 12)
    expected = expected[: expected.index(2)] if 2 in expected else expected  # the saved tokenizer stops at w2
    assert text.split() == [f"w{t}" for t in expected], done.stdout
    assert summary.startswith("DFlash: ") and "mean acceptance length" in summary, done.stdout
    assert plain.startswith("mlx-lm: ") and "speed-up" in plain and plain.endswith("output identical"), done.stdout


def test_draft_head_and_embedding_match_torch():
    """`output_multiplier`, `final_logit_softcapping`, `draft_vocab` and `input_embedding_scale` shape the MLX
    proposals exactly as the torch ones."""
    import mlx.nn as nn

    from head_dflash import DraftHead as TorchDraftHead
    from mlx_port.generate import draft_embedding, draft_head

    torch_draft = make_draft(input_embedding_scale=1.5, final_logit_softcapping=2.0)
    torch_draft.config.dflash_config = {
        **torch_draft.config.dflash_config,
        "output_multiplier": 0.5,
        "draft_vocab": [3, 9, 11],
    }
    args = ModelArgs.from_dict(torch_draft.config.to_dict())
    mlx_draft = Model(args)
    weight = torch.randn(VOCAB, torch_draft.config.hidden_size)
    lm_head = torch.nn.Linear(torch_draft.config.hidden_size, VOCAB, bias=False)
    lm_head.weight.data = weight
    hidden = torch.randn(1, 3, torch_draft.config.hidden_size) * 10
    with torch.no_grad():
        expected = TorchDraftHead(torch_draft, lm_head)(hidden).numpy()
    got = np.array(draft_head(mlx_draft, lambda h: h @ mx.array(weight.numpy()).T)(mx.array(hidden.numpy())))
    finite = np.isfinite(expected)
    assert (finite == np.isfinite(got)).all() and finite.sum() == 9
    assert np.abs(expected[finite] - got[finite]).max() < 1e-5
    table = nn.Embedding(VOCAB, torch_draft.config.hidden_size)
    ids = mx.array([[4, MASK_ID]])
    assert np.allclose(np.array(draft_embedding(mlx_draft, table)(ids)), np.array(table(ids)) * 1.5)


@pytest.mark.parametrize("prompt_len, step", [(1, 4), (9, 4), (8, 4), (5, 2048)])
def test_chunked_prefill_matches_mlx_lm_greedy(target, draft, prompt_len, step):
    """The prompt but its last token is prefilled in `prefill_step_size` chunks (no logits), the last token alone."""
    prompt = list(range(10, 10 + prompt_len))
    tokens, _ = run(target, draft, prompt, block_size=4, max_tokens=16, prefill_step_size=step)
    assert tokens == mlx_greedy(target, prompt, 16)


# ---------------------------------------------------------------------------------------------------------------------
# DFlash 2 drafts and the sampling flags.


@pytest.fixture(scope="module")
def dflash2_dir(work) -> Path:
    from test_dflash2 import make_dflash2

    make_dflash2().save_pretrained(work / "dflash2")
    return work / "dflash2"


def test_dflash2_converts_and_matches_torch(dflash2_dir, work):
    """Converted and raw DFlash 2 folders load as `DFlash2Model` (strict, the published names); hidden states and
    the selector's scores and walk match torch within 1e-4."""
    from mlx_port.model import DFlash2Model
    from modeling_dflash import DFlash2DraftModel

    torch_draft = DFlash2DraftModel.from_pretrained(dflash2_dir).eval()
    converted = load_draft(str(convert(str(dflash2_dir), str(work / "dflash2-mlx"))))
    assert isinstance(converted, DFlash2Model) and isinstance(load_draft(str(dflash2_dir)), DFlash2Model)
    assert {k for k, _ in tree_flatten(converted.parameters())} == set(torch_draft.state_dict())
    for i, (expected, got) in enumerate(torch_and_mlx_hidden(torch_draft, converted, [(5, 4), (3, 4), (1, 8)])):
        assert float(np.abs(expected - got).max()) < 1e-4, f"round {i}"
    rng = np.random.default_rng(0)
    logits, hidden = (
        rng.standard_normal((1, 7, VOCAB)).astype(np.float32),
        rng.standard_normal((1, 7, 64)).astype(np.float32),
    )
    with torch.no_grad():
        tokens, scores = torch_draft.candidate_selector.walk(
            torch.from_numpy(logits), torch.from_numpy(hidden), torch.tensor([[5]])
        )
    mlx_scores = converted.candidate_selector.scores(mx.array(logits[:, 0]), mx.array(hidden[:, 0]), mx.array([5]))
    finite = np.isfinite(scores[0, 0].numpy())
    assert (finite == np.isfinite(np.array(mlx_scores[0]))).all() and finite.sum() == converted.candidate_selector.top_k
    assert np.abs(scores[0, 0].numpy()[finite] - np.array(mlx_scores[0])[finite]).max() < 1e-4
    walk = converted.candidate_selector.walk(
        mx.array(logits), mx.array(hidden), mx.array([5]), lambda s: mx.argmax(s, axis=-1)
    )
    assert np.array(walk).tolist() == tokens.tolist()


def test_dflash2_greedy_equals_mlx_lm_and_torch(target_dir, target, dflash2_dir, work):
    from transformers import AutoModelForCausalLM

    from modeling_dflash import DFlash2DraftModel

    draft = load_draft(str(dflash2_dir))
    torch_target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    torch_draft = DFlash2DraftModel.from_pretrained(dflash2_dir).eval()
    for block_size in (2, 4, 8, 16):
        tokens, taus = run(target, draft, PROMPT, block_size=block_size, max_tokens=30)
        stats = torch_draft.spec_generate(
            torch_target, torch.tensor([PROMPT]), max_new_tokens=30, block_size=block_size, return_stats=True
        )
        assert tokens == mlx_greedy(target, PROMPT, 30) == stats.output_ids[0, 3:].tolist(), f"B={block_size}"
        assert taus == stats.acceptance_lengths, f"B={block_size}"
    quantized = load_draft(
        str(convert(str(dflash2_dir), str(work / "dflash2-q8"), quantize=True, q_bits=8, q_group_size=32))
    )
    assert run(target, quantized, PROMPT, block_size=4, max_tokens=30)[0] == mlx_greedy(target, PROMPT, 30)


def test_dflash2_forced_partial_acceptance_at_every_k(target, dflash2_dir):
    """Right for exactly k tokens per block through the DFlash 2 layers and the selector's walk (its pair scores
    live but below the oracle's margins): exact, and every round accepts k + 1."""
    from mlx_port.model import DFlash2Model

    reference = PROMPT + mlx_greedy(target, PROMPT, 32)
    oracle_class = type("MlxOracleDFlash2", (MlxOracleDraft, DFlash2Model), {})
    for k in range(8):
        model = load_draft(str(dflash2_dir))
        oracle_draft = oracle_class(model.args)
        oracle_draft.update(model.parameters())
        selector = oracle_draft.candidate_selector
        selector.hidden_projection.weight = (
            selector.hidden_projection.weight * 1e-3
        )  # the oracle's hidden states are large
        oracle_draft.setup(target, reference, k)
        tokens, taus = run(target, oracle_draft, PROMPT, block_size=8, max_tokens=24)
        assert tokens == reference[3:27] and taus[:-1] == [k + 1] * (len(taus) - 1), f"k={k}: {taus}"


def test_dflash2_sampling_matches_target_distribution(work, dflash2_dir):
    """The selector's walk samples with the call's sampler; the one-hot rule keeps the target's distribution
    (chi-square, fails at p < 1e-4)."""
    model = load_model(save_torch_target(work / "peaky2", initializer_range=0.5))[0]
    draft = load_draft(str(dflash2_dir))
    n, temperature = 800, 1.0
    exact = exact_two_token_distribution(model, PROMPT, temperature).ravel()
    tokenizer, counts = wrap(), np.zeros(VOCAB * VOCAB)
    mx.random.seed(0)
    for _ in range(n):
        responses = list(
            stream_generate(model, draft, tokenizer, PROMPT, max_tokens=2, temperature=temperature, block_size=4)
        )
        t1, t2 = [t for r in responses for t in r.tokens]
        counts[t1 * VOCAB + t2] += 1
    p_value, chi2, dof = chi_square_p_value(
        torch.from_numpy(counts), torch.from_numpy(np.asarray(exact, dtype=np.float64))
    )
    assert p_value > 1e-4, f"chi2={chi2:.1f} dof={dof} p={p_value:.2e}"


def test_cli_sampling_flags_and_quantized_block_default(target, draft, work, draft_dir):
    from mlx_port.generate import QUANTIZED_BLOCK_SIZE, configure_parser, default_block_size

    args = configure_parser().parse_args(
        ["--model", "t", "--draft-model", "d", "--top-p", "0.9", "--top-k", "20", "--min-p", "0.05"]
    )
    assert (args.top_p, args.top_k, args.min_p) == (0.9, 20, 0.05)
    assert "4-5" in configure_parser().format_help().replace("\n", " ").replace("  ", " ")
    assert default_block_size(target, draft) == draft.args.block_size == 8
    quantized = load_draft(
        str(convert(str(draft_dir), str(work / "q-default"), quantize=True, q_bits=8, q_group_size=32))
    )
    assert default_block_size(target, quantized) == QUANTIZED_BLOCK_SIZE == 4


def copy_without_top_level_rope(source: Path, destination: Path) -> Path:
    """`source` with its config as transformers 5 writes it: the RoPE base only inside `rope_parameters`."""
    destination.mkdir()
    for file in source.iterdir():
        (destination / file.name).symlink_to(file.resolve())
    config = json.loads((source / "config.json").read_text())
    config.pop("rope_theta")
    (destination / "config.json").unlink()
    (destination / "config.json").write_text(json.dumps(config))
    return destination


@pytest.mark.slow
def test_real_default_target_mlx_greedy_equals_torch(tmp_path):
    """The real default target (RoPE base 100000) decodes the same greedy tokens in MLX as in torch (fp32), through
    stock mlx-lm on the folder as written and through `mlx_port.load` on a transformers-5 config, which stock mlx-lm's
    llama misreads with base 10000."""
    import mlx_lm

    import mlx_port
    from default_target import default_target_path, load_default_target

    torch_target, tokenizer = load_default_target()
    t5_dir = copy_without_top_level_rope(default_target_path(), tmp_path / "t5-config")
    stock = mlx_lm.load(str(default_target_path()))[0]
    port = mlx_port.load(str(t5_dir))[0]
    misread = mlx_lm.load(str(t5_dir))[0]  # stock mlx-lm on a transformers-5 config
    assert port.args.rope_theta == stock.args.rope_theta == 100000.0 and misread.args.rope_theta == 10000
    differs = 0
    for text in ["What is the capital of France?", "Explain speculative decoding in one paragraph."]:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
        expected = torch_target.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1] :].tolist()
        prompt = ids[0].tolist()
        assert mlx_greedy(stock, prompt, 8) == expected, text
        assert mlx_greedy(port, prompt, 8) == expected, text
        differs += mlx_greedy(misread, prompt, 8) != expected
    assert differs, "the misread base must change the output, or this test proves nothing"


@pytest.mark.slow
def test_real_default_target_and_shipped_draft_decode_chat_prompts_exactly_through_the_config_tree(monkeypatch):
    """The shipped draft, raw from the repo root, on the real default target with chat prompts and no tree argument:
    the config's tree and lookup branch verify every round, and the text, ending at the EOS or the limit, is mlx-lm's
    own greedy text."""
    import mlx_lm

    import mlx_port
    from default_target import default_target_path

    generation = importlib.import_module("mlx_port.generate")
    model, tokenizer = mlx_port.load(str(default_target_path()))
    draft = load_draft(str(ROOT))
    trees = []
    verify = generation.tree_attention
    monkeypatch.setattr(generation, "tree_attention", lambda *args: trees.append(args[2]) or verify(*args))
    rounds, endings = 0, set()
    for text in ["Name three colours.", "What is 12 times 7? Answer with the number.", "Write a haiku about rain."]:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        expected = list(mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=48))
        responses = list(mlx_port.stream_generate(model, draft, tokenizer, prompt, max_tokens=48))
        assert [t for r in responses for t in r.tokens] == [r.token for r in expected], text
        assert "".join(r.text for r in responses) == "".join(r.text for r in expected), text
        assert responses[-1].finish_reason == expected[-1].finish_reason, text
        rounds, endings = rounds + len(responses) - 1, endings | {responses[-1].finish_reason}
    assert len(trees) == rounds and max(len(tree.tokens) for tree in trees) > 4, "the tree of 4 + lookup never ran"
    assert endings == {"stop", "length"}, "the prompts must end both at the EOS and at the limit"


def test_mlx_draft_reads_rope_base_from_transformers5_config(tmp_path):
    """The draft side: a draft config with the base only in `rope_parameters` gets that base, not mlx-lm's default."""
    make_draft(rope_parameters={"rope_type": "default", "rope_theta": 12345.0}).save_pretrained(tmp_path / "draft")
    config = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert "rope_theta" not in config or config["rope_theta"] == 12345.0
    config.pop("rope_theta", None)
    (tmp_path / "draft" / "config.json").write_text(json.dumps(config))
    assert load_draft(str(tmp_path / "draft")).args.rope_theta == 12345.0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--temp", "-1"], "temperature must be at least 0, got -1.0"),
        (["--top-p", "0"], "top_p must be in (0, 1], got 0.0"),
        (["--min-p", "2"], "--min-p must be in [0, 1], got 2.0"),
        (["--max-tokens", "0"], "--max-tokens must be at least 1, got 0"),
        (["--model", "/no/such/target"], "--model /no/such/target: no such folder"),
        (["--draft-model", "/no/such/draft"], "--draft-model /no/such/draft: no such folder"),
    ],
)
def test_cli_generate_refuses_bad_settings_in_one_line_before_loading(argv, message, monkeypatch, capsys):
    generation, loads = importlib.import_module("mlx_port.generate"), []
    monkeypatch.setattr("mlx_port.utils.load", lambda *args, **kwargs: loads.append(args))
    monkeypatch.setattr(sys, "argv", ["python -m mlx_port generate", "--model", str(ROOT), *argv])
    with pytest.raises(SystemExit) as stopped:
        generation.main()
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and message in err.splitlines()[-1] and "Traceback" not in err and not loads


def test_cli_generate_defaults_to_the_embedded_target_and_this_repos_draft(capsys):
    from default_target import default_target_path
    from mlx_port.generate import check_cli_args, configure_parser

    parser = configure_parser()
    args = parser.parse_args([])
    check_cli_args(parser, args)
    assert args.model == str(default_target_path()) and Path(args.draft_model) == ROOT
    assert f"target: {default_target_path()}" in capsys.readouterr().err, "the default target's path is said"


def test_cli_help_lists_the_commands():
    done = subprocess.run(
        [sys.executable, "-m", "mlx_port", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and "convert" in done.stdout and "generate" in done.stdout
    done = subprocess.run([sys.executable, "-m", "mlx_port"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "usage: python -m mlx_port" in done.stderr
