"""The training recipe on tiny random targets; one slow test checks the shipped root draft against SmolLM2."""

import importlib
import json
import os
import signal

import pytest
import torch
from conftest import MASK_ID, ROOT, TARGET_LAYERS, VOCAB, greedy_reference, make_draft, make_target

from configuration_dflash import DFlashConfig
from modeling_dflash import DFlashDraftModel
from training import (
    TrainConfig,
    anchor_attention_mask,
    block_inputs,
    block_loss,
    build_draft_config,
    check_output_dir,
    loss_weights,
    new_draft,
    regenerate_responses,
    sample_anchors,
    save_draft,
    tokenize_examples,
    train,
)
from training.data import Sequence, disjoint_sources, iter_json_array, load_examples
from training.trainer import collate


class TinyTokenizer:
    """Enough of a tokenizer for the data helpers: one token per character, a ChatML-like template."""

    eos_token_id, pad_token_id, unk_token_id = 2, 0, 3

    def encode(self, text, add_special_tokens=False):
        return [4 + ord(c) % (VOCAB - 8) for c in text]

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        return [1] + [t for m in messages for t in self.encode(m["content"])] + [5]

    def convert_tokens_to_ids(self, token):
        return 2 if token == "<|im_end|>" else self.unk_token_id


def random_sequences(n: int, length: int = 40, seed: int = 0) -> list[Sequence]:
    g = torch.Generator().manual_seed(seed)
    return [Sequence(f"s{i}", torch.randint(4, VOCAB - 1, (length,), generator=g).tolist(), 6) for i in range(n)]


def tiny_draft(target, **overrides):
    config = build_draft_config(target, num_layers=2, target_layer_ids=[0, 2], block_size=4, mask_token_id=MASK_ID)
    for k, v in overrides.items():
        setattr(config, k, v)
    return new_draft(target, config, init="random", seed=1)


def quick_config(**overrides) -> TrainConfig:
    kwargs = dict(num_anchors=4, batch_size=2, learning_rate=3e-3, warmup_ratio=0.0, eval_every=0, save_every=2, seed=0)
    return TrainConfig(**{**kwargs, **overrides})


# ---------------------------------------------------------------------------------------------------------------------
# Anchors and mask.


def test_anchor_mask_sees_exactly_the_context_before_its_anchor_and_its_own_block():
    anchors = torch.tensor([[3, 7, 8], [1, 5, 9]])
    block, context_len = 4, 12
    mask = anchor_attention_mask(anchors, context_len, block)
    assert mask.shape == (2, 3 * block, context_len + 3 * block)
    for b in range(2):
        for q in range(3 * block):
            j = q // block
            allowed_ctx = {c for c in range(context_len) if c < int(anchors[b, j])}
            allowed_blk = {context_len + j * block + i for i in range(block)}
            assert set(mask[b, q].nonzero().flatten().tolist()) == allowed_ctx | allowed_blk


def test_block_sparse_pass_equals_one_block_at_a_time():
    """All anchors in one masked pass give the same hidden states as drafting each block alone, as at decode time."""
    target = make_target("llama")
    draft = tiny_draft(target)
    ids = torch.randint(4, VOCAB - 1, (1, 24), generator=torch.Generator().manual_seed(0))
    anchors, block = torch.tensor([[5, 9, 17]]), draft.config.block_size
    from training.anchors import additive_mask
    from training.trainer import target_pass

    features, _ = target_pass(target, ids, torch.tensor([24]), draft.config.target_layer_ids)
    tokens, _, _ = block_inputs(
        ids, anchors, torch.ones_like(anchors, dtype=torch.bool), torch.tensor([24]), block, MASK_ID
    )
    embed = target.get_input_embeddings()
    positions = torch.cat([torch.arange(24)[None], (anchors[..., None] + torch.arange(block)).flatten(1)], dim=1)
    mask = additive_mask(anchor_attention_mask(anchors, 24, block), torch.float32)
    with torch.no_grad():
        together = draft(
            noise_embeds=embed(tokens.flatten(1)),
            context_hidden_states=features,
            position_ids=positions,
            attention_mask=mask,
        ).last_hidden_state
        for j, a in enumerate(anchors[0].tolist()):
            alone = draft(
                noise_embeds=embed(tokens[:, j]),
                context_hidden_states=features[:, :a],
                position_ids=torch.arange(a + block)[None],
            ).last_hidden_state
            torch.testing.assert_close(together[:, j * block : (j + 1) * block], alone, atol=1e-5, rtol=1e-5)


def test_anchors_stay_in_the_response_and_labels_inside_the_sequence():
    g = torch.Generator().manual_seed(0)
    anchors, valid = sample_anchors(torch.tensor([6, 3]), torch.tensor([12, 5]), 4, g)
    assert valid.tolist() == [[True] * 4, [True, False, False, False]]
    assert all(6 <= a <= 10 for a in anchors[0].tolist()) and anchors[1, 0] == 3
    ids = torch.arange(12).repeat(2, 1)
    tokens, labels, label_mask = block_inputs(ids, anchors, valid, torch.tensor([12, 5]), 4, MASK_ID)
    assert (tokens[..., 1:] == MASK_ID).all() and torch.equal(tokens[..., 0], ids.gather(1, anchors))
    assert labels[1, 0].tolist()[:1] == [4] and label_mask[1, 0].tolist() == [True, False, False]
    assert loss_weights(8, 4.0)[0] == 1 and torch.allclose(loss_weights(8, 4.0)[3], torch.exp(torch.tensor(-0.75)))


def test_dpace_weights_are_the_papers_suffix_sums_of_smoothed_prefix_products():
    """w_k = sum_{j>=k} prod_{i<=j} ((1-a) q_i + a) over trained positions (arXiv 2605.18810, eq. for D-PACE)."""
    from training.anchors import dpace_weights

    q = torch.tensor([[0.9, 0.5, 0.2, 0.7], [0.3, 0.8, 0.6, 0.1]])
    trained = torch.tensor([[True, True, True, True], [True, True, False, False]])
    alpha = 0.25
    w = dpace_weights(q, trained, alpha)
    for row in range(2):
        n = int(trained[row].sum())
        s = [(1 - alpha) * float(q[row, i]) + alpha for i in range(n)]
        prefix = [torch.tensor(s[: j + 1]).prod().item() for j in range(n)]
        expected = [sum(prefix[k:]) for k in range(n)] + [0.0] * (4 - n)
        assert w[row].tolist() == pytest.approx(expected, rel=1e-6)
    assert w[0, 0] > w[0, 1] > w[0, 2] > w[0, 3] > 0  # earlier positions gate every later one
    assert torch.equal(dpace_weights(q, trained, 1.0)[0], torch.tensor([4.0, 3.0, 2.0, 1.0]))  # alpha 1: positions only
    with pytest.raises(ValueError, match="alpha"):
        dpace_weights(q, trained, 1.5)


def test_dpace_loss_weights_each_label_by_the_drafts_own_confidence():
    """With D-PACE, `block_loss` is sum_k w_k * CE_k per block, w from the draft's probability of each label."""
    from training.anchors import dpace_weights

    target = make_target("llama")
    draft = tiny_draft(target)
    batch = collate(random_sequences(2), pad_id=0)
    run = lambda **kw: block_loss(
        draft,
        target,
        batch,
        num_anchors=3,
        generator=torch.Generator().manual_seed(0),
        weights=loss_weights(4, 4.0),
        distill_weight=0.0,
        **kw,
    )
    captured, original = {}, torch.Tensor.log_softmax

    def spy(logits, dim):  # the draft's log-probabilities, as the loss saw them
        captured["log_probs"] = original(logits, dim)
        return captured["log_probs"]

    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.Tensor, "log_softmax", spy)
        loss, _ = run(dpace_alpha=0.5)
    log_probs = captured["log_probs"]
    from training.trainer import target_pass

    features, final = target_pass(target, batch["input_ids"], batch["lengths"], draft.config.target_layer_ids)
    anchors, valid = sample_anchors(batch["loss_starts"], batch["lengths"], 3, torch.Generator().manual_seed(0), 4)
    _, _, trained = block_inputs(batch["input_ids"], anchors, valid, batch["lengths"], 4, MASK_ID)
    source = (anchors[..., None] + torch.arange(3)).clamp(max=39).flatten(1)
    labels = target.lm_head(final).argmax(-1).gather(1, source).view(trained.shape).masked_fill(~trained, 0)
    ce = -log_probs.gather(-1, labels[..., None])[..., 0]
    w = dpace_weights(torch.exp(-ce), trained, 0.5)
    assert float(loss) == pytest.approx(float((ce * w).sum() / trained.any(-1).sum()), rel=1e-5)
    with torch.no_grad():
        assert float(loss) != pytest.approx(float(run()[0]), rel=1e-3)  # the fixed decay gives another loss


# ---------------------------------------------------------------------------------------------------------------------
# Training.


def test_one_training_step_reduces_the_loss():
    target = make_target("llama", initializer_range=0.2)
    draft = tiny_draft(target)
    batch = collate(random_sequences(2), pad_id=0)
    weights = loss_weights(4, 4.0)
    optimizer = torch.optim.AdamW(draft.parameters(), lr=3e-3)

    def loss_now():
        return block_loss(
            draft,
            target,
            batch,
            num_anchors=8,
            generator=torch.Generator().manual_seed(0),
            weights=weights,
            distill_weight=0.5,
        )[0]

    before = loss_now()
    before.backward()
    optimizer.step()
    with torch.no_grad():
        assert float(loss_now()) < float(before)
    assert all(p.grad is None for p in target.parameters())


def test_loss_vocabulary_keeps_the_most_frequent_response_tokens():
    from training.trainer import frequent_tokens, full_to_subset

    seqs = [Sequence("a", [9, 9, 5, 5, 5, 7], 2), Sequence("b", [1, 5, 7, 8], 1)]
    vocab = frequent_tokens(seqs, 2)
    assert vocab.tolist() == [5, 7]  # prompt tokens (9) do not count
    index, mask = full_to_subset(torch.tensor([7, 8, 5]), torch.tensor([True, True, True]), vocab)
    assert index[mask].tolist() == [1, 0] and mask.tolist() == [True, False, True]
    target = make_target("llama", initializer_range=0.2)
    loss, metrics = block_loss(
        tiny_draft(target),
        target,
        collate(random_sequences(2), 0),
        num_anchors=4,
        generator=torch.Generator().manual_seed(0),
        weights=loss_weights(4, 4.0),
        distill_weight=0.5,
        vocab=torch.arange(10, 40),
    )
    assert torch.isfinite(loss) and 0 <= metrics["accuracy_1"] <= 1


class Wrapped(torch.nn.Module):
    """What DDP makes of the draft under `accelerate launch` with several processes: no `.config`, the draft at
    `.module`, and `forward` passed through."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def test_block_loss_takes_a_wrapped_draft():
    target = make_target("llama", initializer_range=0.2)
    draft = tiny_draft(target)
    batch = collate(random_sequences(2), 0)
    kwargs = dict(num_anchors=4, weights=loss_weights(4, 4.0), distill_weight=0.5)
    plain, _ = block_loss(draft, target, batch, generator=torch.Generator().manual_seed(0), **kwargs)
    wrapped, _ = block_loss(Wrapped(draft), target, batch, generator=torch.Generator().manual_seed(0), **kwargs)
    assert torch.equal(plain, wrapped)


class TeacherOracle(torch.nn.Module):
    """A "draft" whose hidden state at block position p is the target's own final hidden state at p - 1, so the
    shared head gives exactly the target's next-token choice there."""

    def __init__(self, config, final_hidden: torch.Tensor):
        super().__init__()
        self.config, self.final_hidden = config, final_hidden

    def forward(self, noise_embeds, context_hidden_states, position_ids, attention_mask):
        block_positions = position_ids[:, context_hidden_states.shape[1] :]
        source = (block_positions - 1).clamp(0, self.final_hidden.shape[1] - 1)
        hidden = self.final_hidden.gather(1, source[..., None].expand(-1, -1, self.final_hidden.shape[-1]))
        return type("Out", (), {"last_hidden_state": hidden})()


@pytest.mark.parametrize("vocab", [None, torch.arange(VOCAB)])
def test_a_draft_that_copies_the_target_scores_full_blocks(vocab):
    """Pins the teacher offset: the label at block position k is the target's choice after position a + k - 1."""
    from training.trainer import target_pass

    target = make_target("llama", initializer_range=0.2)
    batch = collate(random_sequences(2, length=40), pad_id=0)
    config = tiny_draft(target).config
    _, final_hidden = target_pass(target, batch["input_ids"], batch["lengths"], config.target_layer_ids)
    _, metrics = block_loss(
        TeacherOracle(config, final_hidden),
        target,
        batch,
        num_anchors=8,
        generator=torch.Generator().manual_seed(0),
        weights=loss_weights(4, 4.0),
        distill_weight=0.5,
        vocab=vocab,
    )
    assert metrics["blocks"] > 0 and metrics["accuracy_1"] == 1.0 and metrics["tau"] == config.block_size


def test_labels_outside_the_loss_vocabulary_are_misses():
    """With a subset, the hard label stays the target's choice over all tokens: outside the subset it is a miss."""
    from training.trainer import target_greedy, target_pass

    target = make_target("llama", initializer_range=0.2)
    batch = collate(random_sequences(2, length=40), pad_id=0)
    config = tiny_draft(target).config
    _, final_hidden = target_pass(target, batch["input_ids"], batch["lengths"], config.target_layer_ids)
    written = target_greedy(target, final_hidden)[:, 6:-1].flatten().tolist()
    common = max(set(written), key=written.count)
    vocab = torch.tensor([t for t in range(VOCAB) if t != common])
    _, metrics = block_loss(
        TeacherOracle(config, final_hidden),
        target,
        batch,
        num_anchors=30,
        generator=torch.Generator().manual_seed(0),
        weights=loss_weights(4, 4.0),
        distill_weight=0.5,
        vocab=vocab,
    )
    assert metrics["blocks"] > 0 and metrics["accuracy_1"] < 1.0 and metrics["tau"] < config.block_size


ROPE_LAYOUTS = {
    "flat": (
        {"rope_parameters": {"rope_type": "linear", "rope_theta": 5e5, "factor": 2.0}},
        {"rope_type": "linear", "rope_theta": 5e5, "factor": 2.0},
    ),
    "per layer type (Gemma 3)": (
        {
            "rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            }
        },
        {"rope_type": "default", "rope_theta": 1e6},
    ),
    "top-level fields (transformers 4)": (
        {"rope_theta": 2e4, "rope_scaling": {"type": "linear", "factor": 4.0}},
        {"rope_type": "linear", "rope_theta": 2e4, "factor": 4.0},
    ),
    "none": ({}, {"rope_type": "default", "rope_theta": 10000.0}),
}


@pytest.mark.parametrize("layout", ROPE_LAYOUTS)
def test_draft_rope_comes_from_every_layout_a_target_config_uses(layout):
    from types import SimpleNamespace

    from training.trainer import draft_rope_parameters

    fields, expected = ROPE_LAYOUTS[layout]
    assert draft_rope_parameters(SimpleNamespace(**fields)) == expected


def test_a_draft_trains_and_decodes_exactly_for_a_sliding_window_gemma3_target(tmp_path):
    """Gemma 3 keeps one RoPE per layer type; the draft is built from it, trains, and decodes past the window."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=TARGET_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=8,
        max_position_embeddings=512,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    config._attn_implementation = "sdpa"
    target = Gemma3ForCausalLM(config).eval()
    target.generation_config.eos_token_id = None
    draft_config = build_draft_config(
        target, num_layers=2, target_layer_ids=[0, 2], block_size=4, mask_token_id=MASK_ID
    )
    draft = new_draft(target, draft_config, init="target")
    summary = train(draft, target, random_sequences(4), tmp_path, quick_config(max_steps=2), progress=False)
    assert summary["step"] == 2
    ids = torch.randint(4, VOCAB - 1, (1, 6), generator=torch.Generator().manual_seed(1))
    stats = draft.eval().spec_generate(target, ids, max_new_tokens=20, return_stats=True)  # 26 tokens > the window of 8
    assert torch.equal(stats.output_ids, greedy_reference(target, ids, 20))
    assert len(stats.acceptance_lengths) >= 1  # the draft proposed at least one block


def test_train_with_dpace_weights_reduces_the_training_loss(tmp_path):
    target = make_target("llama", initializer_range=0.2)
    draft, data = tiny_draft(target), random_sequences(4)
    batch = collate(data, pad_id=0)

    def loss_now():
        with torch.no_grad():
            return float(
                block_loss(
                    draft,
                    target,
                    batch,
                    num_anchors=4,
                    generator=torch.Generator().manual_seed(0),
                    weights=loss_weights(4, 4.0),
                    distill_weight=0.5,
                    dpace_alpha=0.5,
                )[0]
            )

    before = loss_now()
    summary = train(draft, target, data, tmp_path, quick_config(max_steps=6, position_weights="dpace"), progress=False)
    assert summary["step"] == 6 and loss_now() < before
    with pytest.raises(ValueError, match="position_weights"):
        train(
            tiny_draft(target), target, data, tmp_path / "bad", quick_config(position_weights="linear"), progress=False
        )


def test_train_records_the_loss_vocabulary_in_the_draft_config(tmp_path):
    target = make_target("llama")
    draft = tiny_draft(target)
    train(draft, target, random_sequences(4), tmp_path, quick_config(max_steps=1, train_vocab_size=12), progress=False)
    assert len(draft.config.draft_vocab) == 12 and draft.config.draft_vocab == sorted(draft.config.draft_vocab)


def test_resume_refuses_changed_settings_or_data(tmp_path):
    target = make_target("llama")
    data = random_sequences(8)
    train(tiny_draft(target), target, data, tmp_path, quick_config(max_steps=6, stop_after=2), progress=False)
    for config, seqs, changed in (
        (quick_config(max_steps=6, batch_size=4), data, "batch_size"),
        (quick_config(max_steps=8), data, "max_steps"),
        (quick_config(max_steps=6), random_sequences(8, seed=9), "data"),
    ):
        with pytest.raises(ValueError, match=f"other training settings or data \\({changed}\\)"):
            train(tiny_draft(target), target, seqs, tmp_path, config, progress=False)
    summary = train(
        tiny_draft(target),
        target,
        data,
        tmp_path,
        quick_config(max_steps=8),
        progress=False,
        allow_changed_settings=True,
    )
    assert summary["step"] == 8


def test_init_from_a_draft_folder_starts_from_its_weights(tmp_path):
    from training.__main__ import initial_draft, parse_args

    target = make_target("llama")
    draft = tiny_draft(target)
    draft.save_pretrained(tmp_path / "draft")
    args = parse_args(["--output", str(tmp_path / "out"), "--init", str(tmp_path / "draft"), "--block-size", "8"])
    loaded = initial_draft(args, target)
    assert loaded.config.block_size == 8 and loaded.training
    for (name, a), b in zip(draft.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name
    with pytest.raises(SystemExit, match="the draft there has num_layers=2"):
        initial_draft(parse_args(["--output", "o", "--init", str(tmp_path / "draft"), "--num-layers", "3"]), target)
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit):
        parse_args(["--output", "o", "--init", str(tmp_path / "empty")])  # no config.json: said by argparse


def test_cli_reports_its_refusals_in_one_line(tmp_path, capsys):
    from training.__main__ import cli

    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    assert cli(["--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert (
        "python -m training: error: output folder" in err and "refusing to overwrite" in err and "Traceback" not in err
    )


@pytest.mark.parametrize(
    "module, argv, message",
    [
        ("training.__main__", ["--output", "o", "--target", "/no/such/target"], "--target /no/such/target: no such"),
        ("training.__main__", ["--output", "o", "--init", "/no/such/draft"], "--init /no/such/draft: no such folder"),
        ("training.export", ["--draft", "runs/missing"], "--draft runs/missing: no such folder"),
        ("training.export", ["--draft", ".", "--repo", "/no/such/repo"], "--repo /no/such/repo: no such folder"),
        ("training.export", ["--draft", ".", "--target", "/no/t"], "--target /no/t: no such folder"),
    ],
)
def test_a_missing_folder_is_named_in_one_line_before_anything_loads(module, argv, message, capsys):
    main = importlib.import_module(module).main
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and message in err.splitlines()[-1] and "Traceback" not in err


def test_cached_responses_only_selects_what_the_cache_holds(tmp_path):
    from training.__main__ import cached_examples

    cache = tmp_path / "responses.jsonl"
    cache.write_text(json.dumps({"id": "p/1", "response_ids": [7, 8]}) + "\n")
    examples = [{"id": f"p/{i}", "messages": [], "response": None, "source": "p"} for i in range(3)]
    kept, responses = cached_examples(examples, cache)
    assert [e["id"] for e in kept] == ["p/1"] and responses == {"p/1": [7, 8]}
    with pytest.raises(SystemExit, match="holds no response for the 2 selected prompts"):
        cached_examples(examples[2:] + examples[:1], tmp_path / "missing.jsonl")


def test_export_refuses_a_draft_that_scores_below_the_shipped_one(tmp_path):
    from training.export import install_if_better

    target = make_target("llama")
    repo, better, worse = tmp_path / "repo", tmp_path / "better", tmp_path / "worse"
    repo.mkdir()
    (repo / "modeling_dflash.py").write_text("# a model repo\n")
    tiny_draft(target).save_pretrained(better)
    config = build_draft_config(target, num_layers=1, target_layer_ids=[0, 2], block_size=8, mask_token_id=MASK_ID)
    new_draft(target, config, init="random").save_pretrained(worse)
    seen = []
    # the policy under test; the scoring itself is `evaluate`, tested above
    score = lambda d: (
        seen.append((d.config.num_hidden_layers, d.config.block_size)) or {2: 1.5, 1: 1.2}[d.config.num_hidden_layers]
    )
    assert install_if_better(better, repo, score) == {"new": 1.5}  # an empty repo takes any draft
    shipped = (repo / "model.safetensors").read_bytes()
    with pytest.raises(SystemExit, match="scores 1.200, below the shipped draft's 1.500; nothing was replaced"):
        install_if_better(worse, repo, score)
    assert (repo / "model.safetensors").read_bytes() == shipped
    shipped_config = DFlashConfig.from_pretrained(repo)
    shipped_config.tree_budget = 4  # decode settings chosen by measurement, which a re-export must keep
    shipped_config.prompt_lookup_num_tokens = 7
    shipped_config.save_pretrained(repo)
    assert install_if_better(worse, repo, score, force=True) == {"new": 1.2, "shipped": 1.5}
    installed = json.loads((repo / "config.json").read_text())
    assert installed["num_hidden_layers"] == 1 and installed["dflash_config"]["tree_budget"] == 4
    assert installed["dflash_config"]["prompt_lookup_num_tokens"] == 7
    assert DFlashDraftModel.from_pretrained(repo).config.block_size == 8
    assert seen[-2:] == [(1, 8), (2, 8)]  # the shipped draft (block 4) is scored at the new draft's block size
    with pytest.raises(SystemExit, match="not a DFlash model repo"):
        install_if_better(better, tmp_path, score)


def test_preconditioned_fc_keeps_the_function_and_saves_the_published_layout(tmp_path):
    """`--precondition-fc` trains fc in units of each feature channel's RMS; the draft computes the same function
    before and after, and what training returns and saves is a plain `fc.weight`."""
    from safetensors.torch import load_file

    from training.trainer import feature_scale, fold_fc, precondition_fc

    target = make_target("llama")
    draft, data = tiny_draft(target), random_sequences(4)
    noise, ctx = torch.randn(1, 4, 64), torch.randn(1, 6, 128) * torch.logspace(-1, 2, 128)
    before = draft(noise_embeds=noise, context_hidden_states=ctx).last_hidden_state
    scale = feature_scale(target, data, draft.config.target_layer_ids, 0)
    assert scale.shape == (128,) and bool((scale > 0).all())
    precondition_fc(draft, scale)
    torch.testing.assert_close(draft(noise_embeds=noise, context_hidden_states=ctx).last_hidden_state, before)
    fold_fc(draft)
    torch.testing.assert_close(draft(noise_embeds=noise, context_hidden_states=ctx).last_hidden_state, before)

    trained = tiny_draft(target)
    train(trained, target, data, tmp_path / "run", quick_config(max_steps=3, precondition_fc=True), progress=False)
    assert not torch.nn.utils.parametrize.is_parametrized(trained.fc)
    save_draft(trained, tmp_path / "out")
    assert "fc.weight" in load_file(tmp_path / "out" / "model.safetensors")
    loaded = type(trained).from_pretrained(tmp_path / "out").eval()
    torch.testing.assert_close(
        loaded(noise_embeds=noise, context_hidden_states=ctx).last_hidden_state,
        trained.eval()(noise_embeds=noise, context_hidden_states=ctx).last_hidden_state,
    )
    assert not torch.equal(loaded.fc.weight, tiny_draft(target).fc.weight)  # fc did train


@pytest.mark.parametrize("precondition_fc", [False, True])
def test_resume_after_interruption_gives_identical_state(tmp_path, precondition_fc):
    target = make_target("llama")
    data = random_sequences(8)
    straight = tiny_draft(target)
    train(
        straight,
        target,
        data,
        tmp_path / "straight",
        quick_config(max_steps=6, updates_per_batch=2, precondition_fc=precondition_fc),
        progress=False,
    )

    resumed = tiny_draft(target)  # stopped in the middle of a batch's two updates
    summary = train(
        resumed,
        target,
        data,
        tmp_path / "resumed",
        quick_config(max_steps=6, updates_per_batch=2, precondition_fc=precondition_fc, stop_after=3),
        progress=False,
    )
    assert {k: summary[k] for k in ("step", "finished", "history")} == {"step": 3, "finished": False, "history": []}
    again = tiny_draft(target)  # a fresh process: everything comes from the checkpoint
    summary = train(
        again,
        target,
        data,
        tmp_path / "resumed",
        quick_config(max_steps=6, updates_per_batch=2, precondition_fc=precondition_fc),
        progress=False,
    )
    assert summary["step"] == 6
    for (name, a), b in zip(straight.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), name
    s, r = (torch.load(p / "checkpoint.pt", weights_only=False) for p in (tmp_path / "straight", tmp_path / "resumed"))
    assert s["scheduler"] == r["scheduler"]
    for x, y in zip(s["optimizer"]["state"].values(), r["optimizer"]["state"].values()):
        assert all(torch.equal(x[k], y[k]) for k in x)


def test_ctrl_c_stops_at_the_next_step_checkpointed_and_the_run_resumes_there(tmp_path, monkeypatch):
    """A real SIGINT in the middle of step 3: the step finishes, is checkpointed, and the run says so; resumed, it
    ends where an uninterrupted run ends. A second Ctrl-C would stop at once (the handler is put back)."""
    import training.trainer as trainer
    from training.__main__ import stopped_early

    target, data = make_target("llama"), random_sequences(8)
    straight = tiny_draft(target)
    train(straight, target, data, tmp_path / "straight", quick_config(max_steps=6), progress=False)
    calls, loss = [], trainer.block_loss
    ctrl_c = lambda *a, **k: (calls.append(1), len(calls) == 3 and os.kill(os.getpid(), signal.SIGINT))[0]
    monkeypatch.setattr(trainer, "block_loss", lambda *a, **k: ctrl_c() or loss(*a, **k))
    handler = signal.getsignal(signal.SIGINT)
    summary = train(tiny_draft(target), target, data, tmp_path / "run", quick_config(max_steps=6), progress=False)
    assert signal.getsignal(signal.SIGINT) is handler
    assert (summary["step"], summary["finished"], summary["interrupted"]) == (3, False, True)
    assert torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)["step"] == 3
    message = stopped_early(summary, tmp_path / "run", tmp_path / "out")
    assert "Ctrl-C at step 3 of 6" in message and str(tmp_path / "run" / "checkpoint.pt") in message
    assert "resume, run the same command with --overwrite" in message
    monkeypatch.undo()
    again = tiny_draft(target)
    assert train(again, target, data, tmp_path / "run", quick_config(max_steps=6), progress=False)["step"] == 6
    for (name, a), b in zip(straight.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), name


def test_periodic_held_out_evaluation_is_recorded(tmp_path):
    target = make_target("llama")
    summary = train(
        tiny_draft(target),
        target,
        random_sequences(4),
        tmp_path,
        quick_config(max_steps=2, eval_every=1),
        eval_sequences={"held": random_sequences(2, seed=5)},
        progress=False,
    )
    assert [h["step"] for h in summary["history"]] == [0, 1, 2]
    assert all(1.0 <= h["held/tau"] <= 4.0 for h in summary["history"])


# ---------------------------------------------------------------------------------------------------------------------
# Data.


def test_regenerated_responses_are_cached_and_reused(tmp_path, monkeypatch):
    target = make_target("llama")
    tok = TinyTokenizer()
    examples = [
        {"id": f"p/{i}", "messages": [{"role": "user", "content": f"hi {i}"}], "response": None, "source": "p"}
        for i in range(3)
    ]
    cache = tmp_path / "responses.jsonl"
    first = regenerate_responses(target, tok, examples[:2], cache, batch_size=2, max_new_tokens=5, progress=False)
    assert len(first) == 2 and all(1 <= len(v) <= 5 for v in first.values())

    calls = []
    original = target.generate
    monkeypatch.setattr(target, "generate", lambda *a, **k: calls.append(a[0].shape[0]) or original(*a, **k))
    second = regenerate_responses(target, tok, examples, cache, batch_size=2, max_new_tokens=5, progress=False)
    assert calls == [1]  # only the new prompt is generated
    assert {k: second[k] for k in first} == first
    assert len(cache.read_text().splitlines()) == 3
    seqs = tokenize_examples(tok, examples, regenerated=second, max_length=64)
    assert [s.loss_start for s in seqs] == [len(tok.apply_chat_template(e["messages"])) for e in examples]


def test_processes_regenerate_disjoint_shares_that_join(tmp_path):
    """Under `accelerate launch`, each process generates every world-th prompt into its own shard; reading the cache
    afterwards joins them into what one process would have written."""
    from training.data import read_response_cache

    target, tok = make_target("llama"), TinyTokenizer()
    examples = [
        {"id": f"p/{i}", "messages": [{"role": "user", "content": f"hi {i}"}], "response": None, "source": "p"}
        for i in range(5)
    ]
    alone = regenerate_responses(
        target, tok, examples, tmp_path / "one" / "responses.jsonl", batch_size=1, max_new_tokens=4, progress=False
    )
    for rank in (0, 1):
        regenerate_responses(
            target,
            tok,
            examples,
            tmp_path / "two" / "responses.jsonl",
            batch_size=1,
            max_new_tokens=4,
            progress=False,
            rank=rank,
            world=2,
        )
    shards = [read_response_cache(tmp_path / "two" / f"responses.rank{r}.jsonl") for r in (0, 1)]
    assert sorted(shards[0]) == ["p/0", "p/2", "p/4"] and sorted(shards[1]) == ["p/1", "p/3"]
    assert read_response_cache(tmp_path / "two" / "responses.jsonl") == alone


def test_jsonl_sources_and_truncated_json_arrays(tmp_path):
    path = tmp_path / "mine.jsonl"
    lines = [
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
        {"text": "plain"},
        {"prompt": "p"},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines))
    examples = load_examples(str(path))
    assert [e["response"] for e in examples] == ["a", "plain", None]
    assert list(iter_json_array('[{"a": 1}, {"b": 2}, {"c": [1, 2')) == [{"a": 1}, {"b": 2}]
    with pytest.raises(ValueError, match="different sources"):
        disjoint_sources(examples, [{"id": "x", "source": "mine"}])


# ---------------------------------------------------------------------------------------------------------------------
# Bad input.


def test_target_without_the_expected_layers_is_refused():
    target = make_target("llama")
    with pytest.raises(ValueError, match="target_layer_ids"):
        new_draft(
            target, build_draft_config(target, num_layers=2, target_layer_ids=[0, TARGET_LAYERS], mask_token_id=MASK_ID)
        )
    with pytest.raises(ValueError, match="model.layers"):
        build_draft_config(torch.nn.Linear(2, 2), mask_token_id=MASK_ID)


def test_mask_token_outside_the_vocab_is_refused():
    target = make_target("llama")
    with pytest.raises(ValueError, match="mask_token_id .* outside"):
        new_draft(target, build_draft_config(target, num_layers=2, target_layer_ids=[0, 2], mask_token_id=VOCAB))


def test_empty_dataset_is_refused(tmp_path):
    target = make_target("llama")
    with pytest.raises(ValueError, match="dataset is empty"):
        train(tiny_draft(target), target, [], tmp_path, quick_config(max_steps=1), progress=False)


def test_causal_or_sliding_draft_is_refused(tmp_path):
    target = make_target("llama")
    draft = make_draft(is_causal=True)
    with pytest.raises(ValueError, match="non-causal full attention"):
        train(draft, target, [object()], tmp_path, quick_config(max_steps=1), progress=False)


def test_output_folder_with_other_files_is_never_overwritten(tmp_path):
    target = make_target("llama")
    draft = tiny_draft(target)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="holds other files"):
        save_draft(draft, tmp_path / "other", overwrite=True)
    assert (tmp_path / "other" / "notes.txt").read_text() == "keep me"
    save_draft(draft, tmp_path / "draft")
    with pytest.raises(FileExistsError, match="--overwrite"):
        check_output_dir(tmp_path / "draft")
    save_draft(draft, tmp_path / "draft", overwrite=True)
    assert (tmp_path / "draft" / "model.safetensors").exists()


# ---------------------------------------------------------------------------------------------------------------------
# The shipped draft.


@pytest.mark.slow
def test_shipped_root_draft_fits_smollm2_and_is_lossless():
    from transformers import AutoModel

    from default_target import load_default_target
    from plan_dflash import check_draft_fits_target

    torch.set_num_threads(2)
    target, tokenizer = load_default_target()
    target.generation_config.eos_token_id = None  # both routes run to max_new_tokens
    draft = AutoModel.from_pretrained(ROOT, trust_remote_code=True).eval()
    check_draft_fits_target(draft, target)
    assert any(float(p.detach().abs().sum()) > 0 for p in draft.parameters())
    for prompt in ["What is 12 times 7?", "Write a Python function that reverses a string."]:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt"
        )
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        expected = greedy_reference(target, ids, 24)
        stats = draft.spec_generate(target, ids, max_new_tokens=24, return_stats=True)
        assert torch.equal(stats.output_ids, expected), prompt
        assert stats.mean_acceptance_length >= 1.0


# ---------------------------------------------------------------------------------------------------------------------
# Dense anchors, cached target features, mixed precision.


def test_dense_anchors_take_one_block_per_block_size_response_tokens():
    g = torch.Generator().manual_seed(0)
    loss_starts, lengths = torch.tensor([6, 3, 10]), torch.tensor([40, 12, 11])
    anchors, valid = sample_anchors(loss_starts, lengths, 0, g, block_size=4)
    assert valid.sum(1).tolist() == [9, 2, 0]  # ceil(33 / 4), ceil(8 / 4), no candidate
    assert sample_anchors(loss_starts, lengths, 0, g, block_size=4, stride=2)[1].sum(1).tolist() == [
        17,
        4,
        0,
    ]  # ceil(33 / 2), ceil(8 / 2)
    for row, (lo, length) in enumerate(zip(loss_starts.tolist(), lengths.tolist())):
        picked = anchors[row][valid[row]].tolist()
        assert picked == sorted(set(picked)) and all(lo <= a <= length - 2 for a in picked)
    with pytest.raises(ValueError, match="block size"):
        sample_anchors(loss_starts, lengths, 0, g)


def draft_block_hidden(draft, target, ids: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """`[m, B, H]` hidden states of every anchored block in one masked pass, as `block_loss` builds it."""
    from training.anchors import additive_mask
    from training.trainer import target_pass

    block, length = draft.config.block_size, ids.shape[1]
    features, _ = target_pass(target, ids, torch.tensor([length]), draft.config.target_layer_ids)
    tokens, _, _ = block_inputs(
        ids, anchors, torch.ones_like(anchors, dtype=torch.bool), torch.tensor([length]), block, MASK_ID
    )
    positions = torch.cat([torch.arange(length)[None], (anchors[..., None] + torch.arange(block)).flatten(1)], dim=1)
    mask = additive_mask(anchor_attention_mask(anchors, length, block), torch.float32)
    with torch.no_grad():
        hidden = draft(
            noise_embeds=target.get_input_embeddings()(tokens.flatten(1)),
            context_hidden_states=features,
            position_ids=positions,
            attention_mask=mask,
        ).last_hidden_state
    return hidden.view(anchors.shape[1], block, -1)


def test_no_block_sees_a_token_at_or_after_its_anchor_outside_its_own_block():
    """Perturbation (the context leak of SpecForge PR #472): overlapping dense blocks, every later token changed in
    turn; each block's output moves only when its own first token changes."""
    target = make_target("llama")
    draft = tiny_draft(target)
    ids = torch.randint(4, VOCAB - 1, (1, 24), generator=torch.Generator().manual_seed(0))
    anchors = torch.tensor([[5, 6, 8, 9, 15, 20]])  # closer than the block size of 4: blocks overlap
    base = draft_block_hidden(draft, target, ids, anchors)
    for p in range(6, 24):
        changed = ids.clone()
        changed[0, p] = (ids[0, p] + 1) % (VOCAB - 1)
        moved = draft_block_hidden(draft, target, changed, anchors)
        for j, a in enumerate(anchors[0].tolist()):
            if p > a:
                torch.testing.assert_close(moved[j], base[j], atol=0, rtol=0, msg=f"block at {a} saw position {p}")
            elif p == a:
                assert not torch.equal(moved[j], base[j])


@pytest.mark.parametrize("draft_vocab", [False, True])
@pytest.mark.parametrize("cached", [False, True])
def test_training_labels_and_proposals_match_the_decode_path(tmp_path, draft_vocab, cached):
    """The label offset, the shared head (with a draft vocabulary) and the embedding as decoding uses them (PR #473):
    `block_loss`'s first-token accuracy and teacher-forced tau equal those of `draft_step` block by block."""
    from cache_dflash import DynamicCache
    from decoding_dflash import draft_step
    from head_dflash import DraftHead, draft_embedding
    from training.features import build_feature_cache
    from training.trainer import target_greedy, target_pass

    target = make_target("llama", initializer_range=0.2)
    draft = tiny_draft(target)
    seqs = random_sequences(2, length=30)
    train(
        draft,
        target,
        seqs,
        tmp_path / "fit",
        quick_config(max_steps=30, num_anchors=0, learning_rate=1e-2),
        progress=False,
    )
    if draft_vocab:
        draft.config.draft_vocab = list(range(0, VOCAB, 2))
    batch = collate(seqs, pad_id=0)
    kwargs = {}
    if cached:
        cache = build_feature_cache(target, seqs, tmp_path / "features", draft.config.target_layer_ids, progress=False)
        found = cache.batch([0, 1], pad_id=0)
        batch, kwargs = found.batch, {"target_out": found.target_out, "greedy": found.greedy}
    vocab = None if not draft_vocab else torch.tensor(draft.config.draft_vocab)
    _, metrics = block_loss(
        draft,
        target,
        batch,
        num_anchors=0,
        generator=torch.Generator().manual_seed(3),
        weights=loss_weights(4, 4.0),
        distill_weight=0.0,
        vocab=vocab,
        **kwargs,
    )
    anchors, valid = sample_anchors(
        batch["loss_starts"], batch["lengths"], 0, torch.Generator().manual_seed(3), block_size=4
    )
    embed, head = draft_embedding(draft, target), DraftHead(draft, target.get_output_embeddings())
    firsts, taus = [], []
    for row, s in enumerate(seqs):
        ids = torch.tensor([s.input_ids])
        features, final = target_pass(target, ids, torch.tensor([len(s.input_ids)]), draft.config.target_layer_ids)
        greedy = target_greedy(target, final)[0]
        for a in anchors[row][valid[row]].tolist():
            with torch.no_grad():
                logits, _ = draft_step(draft, embed, head, ids[:, a], features[:, :a], a, DynamicCache(), 4)
            right = (logits[0].argmax(-1) == greedy[a : a + 3]).long()
            firsts.append(float(right[0]))
            if a + 3 < len(s.input_ids):
                taus.append(1 + float(right.cumprod(0).sum()))
    assert metrics["trained_blocks"] == int(valid.sum())
    assert metrics["accuracy_1"] == pytest.approx(sum(firsts) / len(firsts))
    assert metrics["tau"] == pytest.approx(sum(taus) / len(taus))
    assert 0 < sum(firsts) < len(firsts)  # the comparison saw hits and misses


def test_feature_cache_holds_the_target_pass_and_resumes_after_interruption(tmp_path, monkeypatch):
    import training.features as features
    from training.trainer import target_greedy, target_pass

    target = make_target("llama")
    seqs = [
        Sequence(
            f"s{i}", torch.randint(4, VOCAB - 1, (12 + 5 * i,), generator=torch.Generator().manual_seed(i)).tolist(), 4
        )
        for i in range(6)
    ]
    straight = features.build_feature_cache(
        target, seqs, tmp_path / "straight", [0, 2], shard_tokens=40, progress=False
    )
    assert len(straight.manifest["shards"]) > 2
    for i, s in enumerate(seqs):
        ids = torch.tensor([s.input_ids])
        feats, final = target_pass(target, ids, torch.tensor([len(s.input_ids)]), [0, 2])
        got = straight.sequence(i)
        assert got["input_ids"].tolist() == s.input_ids
        torch.testing.assert_close(got["features"], feats[0].to(torch.bfloat16), atol=0, rtol=0)
        torch.testing.assert_close(got["final_hidden"], final[0].to(torch.bfloat16), atol=0, rtol=0)
        assert got["greedy"][: s.loss_start - 1].eq(-1).all()
        assert (
            got["greedy"][s.loss_start - 1 :].tolist() == target_greedy(target, final)[0, s.loss_start - 1 :].tolist()
        )

    calls = []
    real = features.shard_tensors

    def interrupted(*args, **kwargs):
        if len(calls) == 2:
            raise KeyboardInterrupt
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(features, "shard_tensors", interrupted)
    with pytest.raises(KeyboardInterrupt):
        features.build_feature_cache(target, seqs, tmp_path / "resumed", [0, 2], shard_tokens=40, progress=False)
    with pytest.raises(ValueError, match="incomplete"):
        features.FeatureCache(tmp_path / "resumed")
    monkeypatch.setattr(features, "shard_tensors", real)
    built = []
    monkeypatch.setattr(features, "shard_tensors", lambda *a, **k: built.append(1) or real(*a, **k))
    resumed = features.open_feature_cache(target, seqs, tmp_path / "resumed", [0, 2], shard_tokens=25, progress=False)
    assert (
        len(built) == len(straight.manifest["shards"]) - 2
    )  # only the missing shards ran, sized as the manifest records
    assert resumed.manifest["shard_tokens"] == 40 and resumed.manifest["shards"] == straight.manifest["shards"]
    assert not list((tmp_path / "resumed").glob(".*"))  # no temporary file left behind
    for i in range(len(seqs)):
        for name, tensor in straight.sequence(i).items():
            assert torch.equal(resumed.sequence(i)[name], tensor), name


def test_feature_cache_refuses_shards_that_do_not_tile_the_sequences(tmp_path):
    import json

    import training.features as features

    seqs = random_sequences(6)
    cache = features.build_feature_cache(
        make_target("llama"), seqs, tmp_path / "c", [0, 2], shard_tokens=40, progress=False
    )
    shards = cache.manifest["shards"]
    assert len(shards) >= 3
    for broken in (shards[:1] + shards[2:], shards[:-1], [{**shards[0], "end": shards[0]["end"] + 1}] + shards[1:]):
        (tmp_path / "c" / features.MANIFEST).write_text(json.dumps({**cache.manifest, "shards": broken}))
        with pytest.raises(ValueError, match="corrupt"):
            features.FeatureCache(tmp_path / "c")


def test_two_feature_cache_builders_at_once_build_one_valid_cache(tmp_path, monkeypatch, capsys):
    import threading

    import training.features as features

    target, seqs = make_target("llama"), random_sequences(6)
    straight = features.build_feature_cache(
        target, seqs, tmp_path / "straight", [0, 2], shard_tokens=40, progress=False
    )
    real, calls, first_running, release = features.shard_tensors, [], threading.Event(), threading.Event()

    def held(*args, **kwargs):
        calls.append(threading.current_thread().name)
        if len(calls) == 1:  # the first builder pauses mid-build, holding the folder
            first_running.set()
            assert release.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(features, "shard_tensors", held)
    results = {}

    def build(name):
        results[name] = features.build_feature_cache(
            target, seqs, tmp_path / "c", [0, 2], shard_tokens=40, progress=False
        )

    first = threading.Thread(target=build, args=("first",), name="first")
    second = threading.Thread(target=build, args=("second",), name="second")
    first.start()
    assert first_running.wait(30)
    second.start()
    second.join(1.0)
    assert second.is_alive()  # waits on the lock instead of writing the same shards
    release.set()
    first.join(30)
    second.join(30)
    assert set(results) == {"first", "second"}
    assert calls == ["first"] * len(straight.manifest["shards"])  # the second builder found the work done
    assert "being built by another process" in capsys.readouterr().err
    cache = features.FeatureCache(tmp_path / "c")
    assert cache.manifest["shards"] == straight.manifest["shards"]
    for i in range(len(seqs)):
        for name, tensor in straight.sequence(i).items():
            assert torch.equal(cache.sequence(i)[name], tensor), name
    assert not list((tmp_path / "c").glob(".*"))


def test_feature_cache_refuses_another_run_and_a_short_disk(tmp_path, monkeypatch):
    import shutil

    import training.features as features

    target = make_target("llama")
    seqs = random_sequences(3)
    cache = features.build_feature_cache(target, seqs, tmp_path / "c", [0, 2], progress=False)
    cache.check(make_target("llama").to(torch.bfloat16), seqs, [0, 2])  # the same target loaded in bf16 is accepted
    with pytest.raises(ValueError, match="data"):
        cache.check(target, random_sequences(3, seed=9), [0, 2])
    with pytest.raises(ValueError, match="target_layer_ids"):
        cache.check(target, seqs, [0, 1])
    with pytest.raises(ValueError, match="target"):
        cache.check(make_target("llama", seed=5), seqs, [0, 2])
    with pytest.raises(ValueError, match="data"):  # the build refuses a folder holding another run's cache too
        features.build_feature_cache(target, random_sequences(3, seed=9), tmp_path / "c", [0, 2], progress=False)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9 - 100, 100))
    with pytest.raises(ValueError, match="GB free|is free"):
        features.build_feature_cache(target, seqs, tmp_path / "new", [0, 2], progress=False)
    assert not list((tmp_path / "new").glob("*.safetensors"))
    with pytest.raises(ValueError, match="no feature cache"):
        features.FeatureCache(tmp_path / "empty")


def test_training_from_the_feature_cache_runs_no_target_forward(tmp_path, monkeypatch):
    import training.trainer as trainer
    from training.features import build_feature_cache

    target = make_target("llama")
    data = random_sequences(6)
    cache = build_feature_cache(target, data, tmp_path / "features", [0, 2], progress=False)
    batch, weights = collate(data[:2], pad_id=0), loss_weights(4, 4.0)
    found = cache.batch([0, 1], pad_id=0)

    def loss(draft, **kwargs):
        return float(
            block_loss(
                draft,
                target,
                kwargs.pop("batch", batch),
                num_anchors=0,
                generator=torch.Generator().manual_seed(0),
                weights=weights,
                distill_weight=0.5,
                **kwargs,
            )[0].detach()
        )

    before = loss(tiny_draft(target))  # the same loss from bf16-rounded features, to bf16's precision
    assert loss(
        tiny_draft(target), batch=found.batch, target_out=found.target_out, greedy=found.greedy
    ) == pytest.approx(before, rel=1e-3)
    online_summary = train(
        tiny_draft(target), target, data, tmp_path / "online", quick_config(max_steps=3, num_anchors=0), progress=False
    )

    def no_forward(*args, **kwargs):
        raise AssertionError("the target ran a forward while training from its feature cache")

    monkeypatch.setattr(trainer, "target_pass", no_forward)
    monkeypatch.setattr(trainer, "target_greedy", no_forward)
    from_cache = tiny_draft(target)
    summary = train(
        from_cache,
        target,
        data,
        tmp_path / "cached",
        quick_config(max_steps=3, num_anchors=0),
        progress=False,
        feature_cache=cache,
    )
    assert summary["step"] == 3 and summary["throughput"]["blocks_per_s"] > 0
    monkeypatch.undo()
    assert loss(from_cache) < before
    assert online_summary["throughput"]["steps"] == 2  # the first step warms up and is not timed


def test_bf16_autocast_keeps_fp32_master_weights_and_follows_the_fp32_loss(tmp_path):
    target = make_target("llama", initializer_range=0.2)
    data = random_sequences(8)
    batch = collate(data[:4], pad_id=0)

    def held_loss(draft):
        generator = torch.Generator().manual_seed(0)
        kwargs = dict(num_anchors=8, generator=generator, weights=loss_weights(4, 4.0), distill_weight=0.5)
        return float(block_loss(draft, target, batch, **kwargs)[0].detach())

    untrained = held_loss(tiny_draft(target))
    drops = {}
    for precision in ("no", "bf16"):
        draft = tiny_draft(target)
        config = quick_config(max_steps=8, mixed_precision=precision, save_every=8)
        train(draft, target, data, tmp_path / precision, config, progress=False)
        state = torch.load(tmp_path / precision / "checkpoint.pt", weights_only=False)
        assert all(p.dtype == torch.float32 for p in draft.parameters())
        assert all(
            v.dtype == torch.float32 for s in state["optimizer"]["state"].values() for v in s.values() if v.dim()
        )
        drops[precision] = untrained - held_loss(draft)
    assert drops["no"] > 0.5 and drops["bf16"] > 0.5, (untrained, drops)
    assert abs(drops["bf16"] - drops["no"]) <= 0.2 * drops["no"], drops
    with pytest.raises(ValueError, match="mixed_precision"):
        train(tiny_draft(target), target, data, tmp_path / "x", quick_config(mixed_precision="fp8"), progress=False)


def test_length_buckets_cover_every_sequence_once_with_less_padding():
    from training.trainer import batch_order

    lengths = torch.randint(10, 400, (256,), generator=torch.Generator().manual_seed(0)).tolist()
    plain = batch_order(256, 4, 0, 0)
    bucketed = batch_order(256, 4, 0, 0, lengths=lengths)
    assert sorted(i for b in bucketed for i in b) == list(range(256))
    assert bucketed == batch_order(256, 4, 0, 0, lengths=lengths)  # seeded: a resumed run sees the same batches

    def padding(batches):
        return sum(max(lengths[i] for i in b) * len(b) - sum(lengths[i] for i in b) for b in batches)

    assert padding(bucketed) < padding(plain) / 4


def test_num_anchors_flag_takes_a_count_or_dense(capsys):
    from training.__main__ import parse_args

    assert parse_args(["--output", "x", "--num-anchors", "dense", "--anchor-stride", "2"]).num_anchors == 0
    assert parse_args(["--output", "x", "--num-anchors", "12"]).num_anchors == 12
    for bad in ("0", "-3", "many"):
        with pytest.raises(SystemExit):
            parse_args(["--output", "x", "--num-anchors", bad])
    with pytest.raises(SystemExit):
        parse_args(["--data", "sharegpt"])  # training needs --output
    with pytest.raises(SystemExit):
        parse_args(["--output", "x"], features_only=True)  # building needs --feature-cache
    assert "expected a positive integer or 'dense'" in capsys.readouterr().err


def test_resume_accepts_the_same_draft_loaded_from_another_folder(tmp_path):
    target = make_target("llama")
    data = random_sequences(4)
    for name in ("a", "b"):
        save_draft(tiny_draft(target), tmp_path / name)
    first = DFlashDraftModel.from_pretrained(tmp_path / "a")
    train(first, target, data, tmp_path / "run", quick_config(max_steps=4, stop_after=2), progress=False)
    again = DFlashDraftModel.from_pretrained(tmp_path / "b")  # the same config, another path
    assert train(again, target, data, tmp_path / "run", quick_config(max_steps=4), progress=False)["step"] == 4
    other = tiny_draft(target, num_hidden_layers=1)
    with pytest.raises(ValueError, match="different draft config"):
        train(other, target, data, tmp_path / "run", quick_config(max_steps=6), progress=False)
