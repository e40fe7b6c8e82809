"""The model repo: config fields, the z-lab layout, strict loading, remote code, and the serving engines' checklist."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import HIDDEN, MASK_ID, ROOT, TARGET_LAYERS, VOCAB, make_draft, make_draft_config, make_target
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, DynamicCache

from configuration_dflash import DFlashConfig, build_target_layer_ids
from modeling_dflash import DFlashDraftModel

ZLAB_CONFIG = {
    "architectures": ["DFlashDraftModel"],
    "model_type": "qwen3",
    "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
    "block_size": 16,
    "num_target_layers": TARGET_LAYERS,
    "num_hidden_layers": 2,
    "dflash_config": {"mask_token_id": MASK_ID, "target_layer_ids": [0, 2]},
    "hidden_size": HIDDEN,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000,
    "vocab_size": VOCAB,
    "max_position_embeddings": 40960,
    "hidden_act": "silu",
    "attention_bias": False,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}


def zlab_weights(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random tensors under exactly the published weight names (reference section 2)."""
    g = torch.Generator().manual_seed(seed)
    h, hd, inter = config["hidden_size"], config["head_dim"], config["intermediate_size"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    n_ctx = len(config["dflash_config"]["target_layer_ids"])
    shapes = {"fc.weight": (h, n_ctx * h), "hidden_norm.weight": (h,), "norm.weight": (h,)}
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "self_attn.q_norm.weight": (hd,),
            p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        }
    return {
        k: (1 + 0.1 * torch.randn(s, generator=g)) if len(s) == 1 else 0.1 * torch.randn(s, generator=g)
        for k, s in shapes.items()
    }


@pytest.fixture
def zlab_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(ZLAB_CONFIG))
    save_file(zlab_weights(ZLAB_CONFIG), str(tmp_path / "model.safetensors"))
    return tmp_path


def reference_forward(w, cfg, noise_embeds, ctx_features, positions):
    """DFlash draft semantics written out from reference section 1, independent of modeling_dflash."""

    def rms(x, weight, eps=cfg["rms_norm_eps"]):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    hd, nh, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    inv_freq = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, hd, 2).float() / hd))
    angles = positions[:, None].float() * inv_freq[None]
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()

    def rope(x, pos_slice):  # x: [heads, seq, hd]
        x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
        return x * cos[pos_slice] + torch.cat([-x2, x1], -1) * sin[pos_slice]

    ctx = rms(ctx_features[0] @ w["fc.weight"].T, w["hidden_norm.weight"])
    h = noise_embeds[0]
    n_ctx, n_blk = ctx.shape[0], h.shape[0]
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        x = rms(h, w[p + "input_layernorm.weight"])
        kv_in = torch.cat([ctx, x])
        q = (x @ w[p + "self_attn.q_proj.weight"].T).view(n_blk, nh, hd).transpose(0, 1)
        k = (kv_in @ w[p + "self_attn.k_proj.weight"].T).view(n_ctx + n_blk, nkv, hd).transpose(0, 1)
        v = (kv_in @ w[p + "self_attn.v_proj.weight"].T).view(n_ctx + n_blk, nkv, hd).transpose(0, 1)
        q = rope(rms(q, w[p + "self_attn.q_norm.weight"]), slice(n_ctx, None))
        k = rope(rms(k, w[p + "self_attn.k_norm.weight"]), slice(None))
        k, v = k.repeat_interleave(nh // nkv, 0), v.repeat_interleave(nh // nkv, 0)
        attn = torch.softmax(q @ k.transpose(1, 2) / hd**0.5, -1) @ v  # non-causal
        h = h + attn.transpose(0, 1).reshape(n_blk, -1) @ w[p + "self_attn.o_proj.weight"].T
        x = rms(h, w[p + "post_attention_layernorm.weight"])
        mlp = torch.nn.functional.silu(x @ w[p + "mlp.gate_proj.weight"].T) * (x @ w[p + "mlp.up_proj.weight"].T)
        h = h + mlp @ w[p + "mlp.down_proj.weight"].T
    return rms(h, w["norm.weight"])[None]


def test_build_target_layer_ids_matches_published_default():
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert build_target_layer_ids(30, 1) == [15]


def test_dflash_fields_readable_both_ways():
    config = make_draft_config()
    assert config.target_layer_ids == config.dflash_config["target_layer_ids"] == [0, 2]
    assert config.mask_token_id == config.dflash_config["mask_token_id"] == MASK_ID
    config.mask_token_id = 5
    assert config.to_dict()["dflash_config"]["mask_token_id"] == 5


def test_zlab_layout_loads_and_matches_reference_semantics(zlab_dir):
    draft = DFlashDraftModel.from_pretrained(zlab_dir).eval()
    assert draft.config.block_size == 16 and draft.config.target_layer_ids == [0, 2]
    torch.manual_seed(0)
    noise, ctx = torch.randn(1, 16, HIDDEN), torch.randn(1, 5, 2 * HIDDEN)
    positions = torch.arange(21)
    ours = draft(noise_embeds=noise, context_hidden_states=ctx, position_ids=positions[None]).last_hidden_state
    expected = reference_forward(load_file(zlab_dir / "model.safetensors"), ZLAB_CONFIG, noise, ctx, positions)
    assert torch.allclose(ours, expected, atol=1e-5), f"max diff {(ours - expected).abs().max():.2e}"


def test_context_cache_equals_one_shot_context(draft):
    """Feeding context in two steps through the cache gives the same block output as feeding it at once."""
    torch.manual_seed(0)
    noise, ctx = torch.randn(1, 8, HIDDEN), torch.randn(1, 10, 2 * HIDDEN)
    full = draft(noise_embeds=noise, context_hidden_states=ctx, position_ids=torch.arange(18)[None]).last_hidden_state
    cache = DynamicCache()
    draft(
        noise_embeds=noise, context_hidden_states=ctx[:, :6], position_ids=torch.arange(14)[None], past_key_values=cache
    )
    cache.crop(-8)
    assert cache.get_seq_length() == 6
    stepped = draft(
        noise_embeds=noise,
        context_hidden_states=ctx[:, 6:],
        position_ids=torch.arange(6, 18)[None],
        past_key_values=cache,
    )
    assert torch.allclose(full, stepped.last_hidden_state, atol=1e-5)


def test_transformers_contract_dtype_and_kwargs(draft):
    """transformers' DFlash generator reads plain attributes and applies lm_head in the target's dtype."""
    assert draft.config.block_size == 8 and draft.config.mask_token_id == MASK_ID
    noise = torch.randn(1, 8, HIDDEN, dtype=torch.bfloat16)
    out = draft(
        noise_embeds=noise,
        context_hidden_states=torch.randn(1, 3, 2 * HIDDEN, dtype=torch.bfloat16),
        position_ids=torch.arange(11)[None],
        attention_mask=torch.ones(1, 11),
        past_key_values=DynamicCache(),
    )
    assert out.last_hidden_state.shape == (1, 8, HIDDEN) and out.last_hidden_state.dtype == torch.bfloat16


def test_save_writes_engine_compatible_checkpoint(tmp_path, draft):
    draft.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    keys = set(load_file(tmp_path / "model.safetensors"))
    published = set(zlab_weights({**ZLAB_CONFIG, "num_hidden_layers": 2}))
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["model_type"] == "qwen3" and AutoConfig.for_model("qwen3").model_type == "qwen3"
    ids = config["dflash_config"]["target_layer_ids"]
    assert ids == sorted(set(ids)) and max(ids) < config["num_target_layers"] - 1
    assert 0 <= config["dflash_config"]["mask_token_id"] < config["vocab_size"]
    assert config["block_size"] == 8 and config["num_target_layers"] == TARGET_LAYERS
    assert config["hidden_size"] == HIDDEN and config["vocab_size"] == VOCAB
    assert config["rope_theta"] == draft.config.to_dict()["rope_theta"]
    assert not {"partial_rotary_factor", "mrope_section"} & set(config) and config.get("rope_scaling") is None
    assert config["use_sliding_window"] is False and set(config.get("layer_types") or ["full_attention"]) == {
        "full_attention"
    }
    assert keys == published, f"extra {keys - published}, missing {published - keys}"
    assert not any(k.startswith(("eagle_", "speculators_config", "sample_from_anchor")) for k in config)
    assert config["auto_map"] == {
        "AutoConfig": "configuration_dflash.DFlashConfig",
        "AutoModel": "modeling_dflash.DFlashDraftModel",
    }
    assert {p.name for p in ROOT.glob("*_dflash.py")} <= {p.name for p in tmp_path.iterdir()}


def test_engines_read_saved_config_without_remote_code(tmp_path, draft):
    draft.save_pretrained(tmp_path)
    config = AutoConfig.from_pretrained(tmp_path)  # what vLLM and SGLang do
    assert type(config).__name__ == "Qwen3Config"
    assert config.dflash_config["target_layer_ids"] == [0, 2] and config.block_size == 8


def test_draft_vocab_is_saved_where_engines_ignore_it(tmp_path, draft):
    """The FR-Spec subset lives in `dflash_config`, which the engines read by key: they load the checkpoint as it is
    and use the full head; our loader gets the subset back."""
    draft.config.draft_vocab = [9, 3, 40]
    try:
        draft.save_pretrained(tmp_path)
    finally:
        draft.config.draft_vocab = None
    engine = AutoConfig.from_pretrained(tmp_path)
    assert type(engine).__name__ == "Qwen3Config" and engine.dflash_config["target_layer_ids"] == [0, 2]
    assert set(load_file(tmp_path / "model.safetensors")) == set(zlab_weights({**ZLAB_CONFIG, "num_hidden_layers": 2}))
    assert DFlashConfig.from_pretrained(tmp_path).draft_vocab == [3, 9, 40]
    assert '"draft_vocab": [3, 9, 40]' in (tmp_path / "config.json").read_text()  # one line, not one id per line


def test_remote_code_round_trip_in_fresh_process(tmp_path, draft):
    draft.save_pretrained(tmp_path / "draft")
    torch.manual_seed(0)
    noise, ctx = torch.randn(1, 8, HIDDEN), torch.randn(1, 4, 2 * HIDDEN)
    torch.save({"noise": noise, "ctx": ctx}, tmp_path / "inputs.pt")
    expected = draft(noise_embeds=noise, context_hidden_states=ctx).last_hidden_state
    script = (
        "import sys, torch\n"
        "from transformers import AutoModel\n"
        "d = AutoModel.from_pretrained(sys.argv[1], trust_remote_code=True).eval()\n"
        "x = torch.load(sys.argv[2])\n"
        "torch.save(d(noise_embeds=x['noise'], context_hidden_states=x['ctx']).last_hidden_state, sys.argv[3])\n"
        "assert type(d).__module__.startswith('transformers_modules'), type(d).__module__\n"
        # a file left out of the module cache would fall back to a top-level import of an installed copy
        "assert not [m for m in sys.modules if m.endswith('_dflash') and '.' not in m], sorted(sys.modules)\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""}
    subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "draft"), str(tmp_path / "inputs.pt"), str(tmp_path / "out.pt")],
        check=True,
        cwd=tmp_path,
        env=env,
    )
    assert torch.equal(torch.load(tmp_path / "out.pt"), expected)


def test_copied_repo_folder_loads_with_remote_code_from_its_own_files(tmp_path):
    folder = tmp_path / "repo"
    folder.mkdir()
    for path in [ROOT / "config.json", ROOT / "model.safetensors", *ROOT.glob("*_dflash.py")]:
        shutil.copy(path, folder / path.name)
    script = (
        "import sys\n"
        "from transformers import AutoModel\n"
        "d = AutoModel.from_pretrained(sys.argv[1], trust_remote_code=True)\n"
        "assert type(d).__module__.startswith('transformers_modules'), type(d).__module__\n"
        "assert callable(d.spec_generate) and callable(d.int8_copy)\n"
        "assert not [m for m in sys.modules if m.endswith('_dflash') and '.' not in m], sorted(sys.modules)\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""}
    subprocess.run([sys.executable, "-c", script, str(folder)], check=True, cwd=tmp_path, env=env)


def test_repo_root_config_loads_as_draft_for_default_target():
    config = DFlashConfig.from_pretrained(ROOT)
    assert config.hidden_size == 576 and config.vocab_size == 49152 and config.num_target_layers == 30
    assert config.auto_map["AutoModel"] == "modeling_dflash.DFlashDraftModel"


@pytest.mark.parametrize("change", ["missing", "unexpected", "shape"])
def test_strict_loading_refuses_bad_checkpoint(zlab_dir, change):
    weights = load_file(zlab_dir / "model.safetensors")
    if change == "missing":
        del weights["layers.1.mlp.up_proj.weight"]
    elif change == "unexpected":
        weights["embed_tokens.weight"] = torch.zeros(VOCAB, HIDDEN)
    else:
        weights["fc.weight"] = torch.zeros(HIDDEN, 3 * HIDDEN)
    save_file(weights, str(zlab_dir / "model.safetensors"))
    # transformers itself raises on a shape mismatch; missing and unexpected tensors only warn there
    expected = {"missing": "missing_keys", "unexpected": "unexpected_keys", "shape": "mismatch"}[change]
    with pytest.raises((ValueError, RuntimeError), match=expected):
        DFlashDraftModel.from_pretrained(zlab_dir)


# ---------------------------------------------------------------------------------------------------------------------
# The newer v1 options (z-lab's reference @ 07ebd93): attention semantics of `layer_types`, fields in `dflash_config`.


def test_draft_attention_mask_matches_the_reference_rule():
    from modeling_dflash import draft_attention_mask

    def visible(causal, window):
        mask = draft_attention_mask(3, 6, causal, window, torch.float32, "cpu")
        return None if mask is None else (mask[0, 0] == 0).int().tolist()

    # queries sit at key indices 3, 4, 5
    assert visible(False, None) is None
    assert visible(True, None) == [[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]]
    assert visible(True, 2) == [[0, 0, 1, 1, 0, 0], [0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 1, 1]]
    assert visible(False, 2) == [[0, 0, 1, 1, 1, 0], [0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 1, 1]]


@pytest.mark.parametrize(
    "overrides, causal",
    [
        (
            {
                "layer_types": ["sliding_attention", "sliding_attention"],
                "use_sliding_window": True,
                "sliding_window": 64,
            },
            True,
        ),
        (
            {
                "layer_types": ["sliding_attention", "sliding_attention"],
                "use_sliding_window": True,
                "sliding_window": 64,
                "is_causal": False,
            },
            False,
        ),
        ({"is_causal": True}, True),
        ({}, False),
    ],
    ids=["sliding-is-causal", "is_causal-false", "is_causal-true-for-full-layers", "full-is-not"],
)
def test_causal_layers_do_not_see_later_block_positions(overrides, causal):
    draft = make_draft(**overrides)
    noise, ctx = torch.randn(1, 6, HIDDEN), torch.randn(1, 5, 2 * HIDDEN)
    later = noise.clone()
    later[:, 4:] += 1.0  # change the last two block positions only
    with torch.no_grad():
        a, b = (draft(noise_embeds=x, context_hidden_states=ctx).last_hidden_state for x in (noise, later))
    assert torch.allclose(a[:, :4], b[:, :4], atol=1e-6) == causal


def test_v1_fields_are_read_from_dflash_config_first_then_the_top_level(tmp_path):
    config = make_draft_config(input_embedding_scale=2.0, final_logit_softcapping=30.0)
    config.dflash_config = {**config.dflash_config, "output_multiplier": 0.5, "final_logit_softcapping": 20.0}
    DFlashDraftModel(config).save_pretrained(tmp_path)
    loaded = DFlashConfig.from_pretrained(tmp_path)
    assert loaded.dflash_field("input_embedding_scale") == 2.0  # top level only
    assert loaded.dflash_field("output_multiplier") == 0.5  # dflash_config only
    assert loaded.dflash_field("final_logit_softcapping") == 20.0  # both: dflash_config wins
    assert make_draft_config().dflash_field("output_multiplier") is None


def test_a_target_folder_is_refused_as_a_draft_in_one_line(tmp_path):
    """Before transformers warns about the architecture and lists every missing weight."""
    make_target("llama").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"^not a DFlash draft config \(model_type 'llama'\)"):
        DFlashDraftModel.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="not a DFlash draft config"):
        DFlashConfig.from_pretrained(tmp_path)
