"""Configuration of a DFlash block-diffusion draft: a Qwen3 config plus the DFlash fields."""

import dataclasses
import json
import re

from transformers import Qwen3Config


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The published default: target layers spread evenly, skipping the first and the last few."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = (num_target_layers - 4) / (num_draft_layers - 1)
    return [round(1 + j * span) for j in range(num_draft_layers)]


def check_sampling(temperature: float, top_p: float, top_k: int) -> None:
    """The sampling settings every route takes (torch and MLX), refused before any compute."""
    if temperature < 0:
        raise ValueError(f"temperature must be at least 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be a non-negative integer (0: off), got {top_k!r}")


def first_stop(tokens: list[int], stop_token_ids, start: int = 0) -> int | None:
    """Index just after the first stop token in `tokens[start:]`, or None. Shared by the torch and MLX loops, the
    benchmark and training data, which all cut an output after its first stop token."""
    return next((i + 1 for i in range(start, len(tokens)) if tokens[i] in stop_token_ids), None)


def check_fits_target(config, *, num_layers: int, hidden_size: int, vocab_size: int) -> None:
    """Raises a ValueError naming the first mismatch between a draft config (torch or MLX) and the target's shapes."""
    if config.hidden_size != hidden_size:
        raise ValueError(f"draft hidden_size {config.hidden_size} does not match the target's {hidden_size}")
    if config.vocab_size != vocab_size:
        raise ValueError(f"draft vocab_size {config.vocab_size} does not match the target's {vocab_size}")
    if config.num_target_layers is not None and config.num_target_layers != num_layers:
        raise ValueError(f"draft num_target_layers {config.num_target_layers} does not match the target's {num_layers}")
    ids = config.target_layer_ids
    # the last layer's entry in `hidden_states` is after the final norm, so it is not a layer output
    if not ids or ids != sorted(set(ids)) or ids[0] < 0 or ids[-1] >= num_layers - 1:
        raise ValueError(
            f"target_layer_ids {ids} must be sorted, unique and in [0, {num_layers - 1}) "
            f"for a {num_layers}-layer target"
        )
    if config.mask_token_id is None or not 0 <= config.mask_token_id < vocab_size:
        raise ValueError(f"mask_token_id {config.mask_token_id} is outside the target's vocab of {vocab_size}")
    vocab = (config.dflash_config or {}).get("draft_vocab")  # MLX args and torch configs both keep it here
    if vocab is not None and (not vocab or min(vocab) < 0 or max(vocab) >= vocab_size):
        raise ValueError(f"dflash_config.draft_vocab must hold token ids in [0, {vocab_size}), got {len(vocab)} ids")


def legacy_rope_fields(config: dict) -> dict:
    """The top-level `rope_theta` (and, for a scaled RoPE, `rope_scaling`) that older readers (mlx-lm's llama, z-lab's
    MLX loader) expect, taken from the `rope_parameters` a transformers-5 config writes instead; empty where the
    config already has them."""
    params = config.get("rope_parameters")
    if not isinstance(params, dict) or "rope_theta" not in params or "rope_theta" in config:
        return {}
    fields = {"rope_theta": params["rope_theta"]}
    if params.get("rope_type", "default") != "default" and config.get("rope_scaling") is None:
        fields["rope_scaling"] = {k: v for k, v in params.items() if k != "rope_theta"}
    return fields


def check_draft_config(config: dict) -> None:
    """Refuses in one line a `config.json` that is not a DFlash draft's (a target folder given as the draft, say),
    before any weight loads; torch and MLX alike."""
    if not (config.get("dflash_config") or {}).get("target_layer_ids"):
        raise ValueError(
            f"not a DFlash draft config (model_type {config.get('model_type')!r}): "
            "`dflash_config.target_layer_ids` is missing"
        )


DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def dflash2_settings(config) -> dict[str, int]:
    """A DFlash 2 draft's convolution and selector settings, read by `config.dflash_field` (torch and MLX) and
    checked before any weight is built."""
    values = {name: config.dflash_field(name) for name in DFLASH2_FIELDS}
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(
                f"a DFlash 2 draft needs a positive integer {name} (dflash_config or top level), got {value!r}"
            )
    if config.hidden_size % values["conv_group_size"]:
        raise ValueError(f"conv_group_size {values['conv_group_size']} must divide hidden_size {config.hidden_size}")
    if values["selector_top_k"] > config.vocab_size:
        raise ValueError(
            f"selector_top_k {values['selector_top_k']} is larger than the vocabulary ({config.vocab_size} tokens)"
        )
    return values


class DFlashConfig(Qwen3Config):
    """A `Qwen3Config` with the DFlash fields, stored as the published z-lab checkpoints store them.

    `model_type` stays `"qwen3"` so that vLLM and SGLang read the config without remote code. The DFlash settings live
    in `block_size`, `num_target_layers` and `dflash_config = {"mask_token_id", "target_layer_ids"}`, and are also
    readable as `config.mask_token_id` and `config.target_layer_ids` (what transformers' DFlash generator reads).
    """

    block_size: int = 16
    num_target_layers: int | None = None
    dflash_config: dict | None = None

    if dataclasses.is_dataclass(Qwen3Config):  # transformers 5.x: configs are dataclasses

        def __post_init__(self, **kwargs):
            target_layer_ids = kwargs.pop("target_layer_ids", None)
            mask_token_id = kwargs.pop("mask_token_id", None)
            super().__post_init__(**kwargs)
            self._fill_dflash_config(target_layer_ids, mask_token_id)

    else:  # transformers 4.x

        def __init__(self, block_size=16, num_target_layers=None, dflash_config=None, **kwargs):
            target_layer_ids = kwargs.pop("target_layer_ids", None)
            mask_token_id = kwargs.pop("mask_token_id", None)
            super().__init__(**kwargs)
            self.block_size, self.num_target_layers, self.dflash_config = block_size, num_target_layers, dflash_config
            self._fill_dflash_config(target_layer_ids, mask_token_id)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs):
        check_draft_config(cls.get_config_dict(pretrained_model_name_or_path, **dict(kwargs))[0])
        return super().from_pretrained(pretrained_model_name_or_path, **kwargs)

    def _fill_dflash_config(self, target_layer_ids, mask_token_id) -> None:
        dflash = dict(self.dflash_config or {})
        if target_layer_ids is not None:
            dflash["target_layer_ids"] = list(target_layer_ids)
        if mask_token_id is not None:
            dflash["mask_token_id"] = mask_token_id
        if "target_layer_ids" not in dflash and self.num_target_layers is not None:
            # vLLM has no fallback for a missing list, so it is always written
            dflash["target_layer_ids"] = build_target_layer_ids(self.num_target_layers, self.num_hidden_layers)
        self.dflash_config = dflash

    @property
    def target_layer_ids(self) -> list[int]:
        return list(self.dflash_config.get("target_layer_ids") or [])

    @target_layer_ids.setter
    def target_layer_ids(self, value: list[int]) -> None:
        self.dflash_config = {**self.dflash_config, "target_layer_ids": list(value)}

    @property
    def draft_vocab(self) -> list[int] | None:
        """Sorted token ids the draft was trained to propose (FR-Spec style); None: the whole vocabulary.

        Kept in `dflash_config`, which the serving engines read by key, so they load the checkpoint and use the full
        head.
        """
        return self.dflash_config.get("draft_vocab")

    @draft_vocab.setter
    def draft_vocab(self, value: list[int] | None) -> None:
        dflash = {k: v for k, v in self.dflash_config.items() if k != "draft_vocab"}
        self.dflash_config = dflash if value is None else {**dflash, "draft_vocab": sorted(int(t) for t in value)}

    def dflash_field(self, name: str, default=None):
        """A DFlash setting as z-lab's reference reads it: from `dflash_config` first, then from the top level
        (`input_embedding_scale`, `output_multiplier`, `final_logit_softcapping`, ...)."""
        value = self.dflash_config.get(name)
        return value if value is not None else getattr(self, name, default)

    @property
    def tree_budget(self) -> int | None:
        """Draft-tree nodes `spec_generate` verifies per round by default; None: the argmax chain. In `dflash_config`,
        which the serving engines ignore (they verify chains)."""
        return self.dflash_config.get("tree_budget")

    @tree_budget.setter
    def tree_budget(self, value: int | None) -> None:
        dflash = {k: v for k, v in self.dflash_config.items() if k != "tree_budget"}
        self.dflash_config = dflash if value is None else {**dflash, "tree_budget": int(value)}

    @property
    def tree_sizing(self) -> str | None:
        """How `spec_generate` sizes each round's tree by default: "cost" (the nodes that pay for their verify on this
        machine, at most `tree_budget`) or "fixed" (`tree_budget` nodes; also when unset). In `dflash_config`."""
        return self.dflash_config.get("tree_sizing")

    @tree_sizing.setter
    def tree_sizing(self, value: str | None) -> None:
        dflash = {k: v for k, v in self.dflash_config.items() if k != "tree_sizing"}
        self.dflash_config = dflash if value is None else {**dflash, "tree_sizing": value}

    @property
    def prompt_lookup_num_tokens(self) -> int | None:
        """Tokens of a prompt-lookup continuation `spec_generate` adds to every round's draft tree by default; None:
        no lookup branch. In `dflash_config`, which the serving engines ignore."""
        return self.dflash_config.get("prompt_lookup_num_tokens")

    @prompt_lookup_num_tokens.setter
    def prompt_lookup_num_tokens(self, value: int | None) -> None:
        dflash = {k: v for k, v in self.dflash_config.items() if k != "prompt_lookup_num_tokens"}
        self.dflash_config = dflash if value is None else {**dflash, "prompt_lookup_num_tokens": int(value)}

    @property
    def mask_token_id(self) -> int | None:
        return self.dflash_config.get("mask_token_id")

    @mask_token_id.setter
    def mask_token_id(self, value: int) -> None:
        self.dflash_config = {**self.dflash_config, "mask_token_id": value}

    def to_json_string(self, use_diff: bool = True) -> str:
        """transformers' JSON, with `draft_vocab` (thousands of ids) on one line rather than one id per line."""
        text = super().to_json_string(use_diff)
        if self.draft_vocab is None:
            return text
        return re.sub(
            r'"draft_vocab": \[[^\]]*\]', lambda _: f'"draft_vocab": {json.dumps(self.draft_vocab)}', text, count=1
        )

    def to_dict(self) -> dict:
        out = super().to_dict()
        rope = out.get("rope_parameters") or {}
        if "rope_theta" in rope:
            out.setdefault("rope_theta", rope["rope_theta"])  # z-lab's MLX loader and older engines read it here
        return out


__all__ = [
    "DFlashConfig",
    "build_target_layer_ids",
    "check_draft_config",
    "check_fits_target",
    "check_sampling",
    "dflash2_settings",
    "first_stop",
    "legacy_rope_fields",
]
