"""DFlash block-diffusion draft: Qwen3-style layers whose keys and values also see projected target hidden states."""

import dataclasses
from collections.abc import Callable

import torch
from torch import nn
from transformers import DynamicCache, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    eager_attention_forward,
    rotate_half,
)

try:
    from .configuration_dflash import DFlashConfig, dflash2_settings
    from .generation_dflash import DFlashDecodingMixin
except ImportError:  # imported as a top-level module from the repo root or an installed project
    from configuration_dflash import DFlashConfig, dflash2_settings
    from generation_dflash import DFlashDecodingMixin

try:  # transformers 4.x copies a local folder's remote code by this file's own relative imports: one line per file
    from .batch_dflash import batched_spec_generate  # noqa: F401
    from .cache_dflash import RollbackCache  # noqa: F401
    from .candidates_dflash import DFlashCandidateGenerator  # noqa: F401
    from .cost_dflash import verify_costs  # noqa: F401
    from .decoding_dflash import decode_row  # noqa: F401
    from .head_dflash import DraftHead  # noqa: F401
    from .plan_dflash import TreePlan  # noqa: F401
    from .proposal_dflash import propose  # noqa: F401
    from .routing_dflash import assisted_generate  # noqa: F401
    from .tree_dflash import DraftTree  # noqa: F401
except ImportError:  # a top-level import finds them by itself
    pass

# transformers 5.x names the cache `cache`, 4.x `past_key_values`
_CACHE_FIELD = (
    "cache" if "cache" in {f.name for f in dataclasses.fields(BaseModelOutputWithPast)} else "past_key_values"
)


_STRICT_KEYS = ("missing_keys", "unexpected_keys", "mismatched_keys")


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style rotary embedding; `cos`/`sin` are `[batch, seq, head_dim]` for the last `seq` positions of `x`."""
    cos, sin = cos[:, None, -x.shape[-2] :], sin[:, None, -x.shape[-2] :]
    return x * cos + rotate_half(x) * sin


def key_padding_mask(attention_mask: torch.Tensor | None, query_len: int, dtype: torch.dtype) -> torch.Tensor | None:
    """Turns a `[batch, kv_len]` 0/1 mask into an additive `[batch, 1, query_len, kv_len]` one; None when all ones."""
    if attention_mask is None or attention_mask.dim() == 4:
        return attention_mask
    if bool(attention_mask.all()):
        return None
    blocked = (attention_mask == 0)[:, None, None, :].expand(-1, 1, query_len, -1)
    return torch.zeros(blocked.shape, dtype=dtype, device=blocked.device).masked_fill(blocked, torch.finfo(dtype).min)


def draft_attention_mask(
    query_len: int, key_len: int, causal: bool, window: int | None, dtype, device
) -> torch.Tensor | None:
    """Additive `[1, 1, q, k]` mask of one draft layer, as z-lab's reference defines it: the block's query `i` sits at
    key index `key_len - query_len + i`; a causal layer hides later keys; a window hides keys `window` or more before
    the query, and, in a non-causal layer, as far after it. None when nothing is hidden."""
    if not causal and window is None:
        return None
    offset = (
        torch.arange(key_len - query_len, key_len, device=device)[:, None] - torch.arange(key_len, device=device)[None]
    )
    hidden = offset < 0 if causal else torch.zeros_like(offset, dtype=torch.bool)
    if window is not None:
        hidden |= (offset >= window) if causal else (offset.abs() >= window)
    return torch.zeros(hidden.shape, dtype=dtype, device=device).masked_fill(hidden, torch.finfo(dtype).min)[None, None]


def layer_is_causal(config, layer_type: str) -> bool:
    """A `sliding_attention` layer is causal and a full one is not, unless a top-level `is_causal` says otherwise for
    all layers (z-lab's reference, vLLM and SGLang)."""
    is_causal = getattr(config, "is_causal", None)
    return bool(is_causal) if is_causal is not None else layer_type == "sliding_attention"


class DFlashAttention(nn.Module):
    """Queries from the block; keys/values from `[context ; block]`; non-causal unless the layer type makes it
    causal."""

    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.is_causal = False  # what transformers' attention functions read; the layer's own mask says it all
        layer_types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
        self.sliding_window = config.sliding_window if layer_types[layer_idx] == "sliding_attention" else None
        self.causal = layer_is_causal(config, layer_types[layer_idx])
        bias = getattr(config, "attention_bias", False)
        q_dim, kv_dim = config.num_attention_heads * self.head_dim, config.num_key_value_heads * self.head_dim
        self.q_proj = nn.Linear(config.hidden_size, q_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_dim, bias=bias)
        self.o_proj = nn.Linear(q_dim, config.hidden_size, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(*x.shape[:-1], -1, self.head_dim).transpose(1, 2)

    def forward(self, hidden_states, context, position_embeddings, attention_mask=None, cache=None):
        cos, sin = position_embeddings
        # the context skips `input_layernorm`: it was normed by `hidden_norm` already
        kv_input = torch.cat([context, hidden_states], dim=1)
        query = apply_rope(self.q_norm(self._heads(self.q_proj(hidden_states))), cos, sin)
        key = apply_rope(self.k_norm(self._heads(self.k_proj(kv_input))), cos, sin)
        value = self._heads(self.v_proj(kv_input))
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx)
        own = draft_attention_mask(
            query.shape[-2], key.shape[-2], self.causal, self.sliding_window, query.dtype, query.device
        )
        if own is not None:
            attention_mask = own if attention_mask is None else attention_mask + own
        impl = self.config._attn_implementation
        attention: Callable = eager_attention_forward if impl in (None, "eager") else ALL_ATTENTION_FUNCTIONS[impl]
        out, _ = attention(self, query, key, value, attention_mask, dropout=0.0, scaling=self.scaling)
        return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = DFlashAttention(config, layer_idx)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = Qwen3MLP(config)

    def forward(self, hidden_states, context, position_embeddings, attention_mask=None, cache=None):
        attn_in = self.input_layernorm(hidden_states)
        hidden_states = hidden_states + self.self_attn(attn_in, context, position_embeddings, attention_mask, cache)
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class DFlashPreTrainedModel(PreTrainedModel):
    config_class = DFlashConfig
    base_model_prefix = "model"
    main_input_name = "noise_embeds"
    _no_split_modules = ["DFlashDecoderLayer"]
    _supports_sdpa = True
    _supports_attention_backend = True


class DFlashDraftModel(DFlashDecodingMixin, DFlashPreTrainedModel):
    """The DFlash draft. It has no embedding and no head: callers embed with the target's table and read logits
    through the target's `lm_head`. Its decoding (`spec_generate`, `int8_copy`) comes from `DFlashDecodingMixin`."""

    decoder_layer_class = DFlashDecoderLayer
    has_selector = False

    def __init__(self, config: DFlashConfig):
        super().__init__(config)
        num_features = len(config.target_layer_ids) * config.hidden_size
        self.fc = nn.Linear(num_features, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(self.decoder_layer_class(config, i) for i in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config=config)
        if self.has_selector:
            self.candidate_selector = CandidateSelector(config)
        self.post_init()

    def save_pretrained(self, save_directory, *args, **kwargs):
        if getattr(self, "_int8_weights", False):  # refused before any file is written
            raise ValueError(
                "an int8_copy() cannot be saved (its packed fbgemm weights are not safetensors): save the "
                "float draft and call int8_copy() after loading it"
            )
        return super().save_pretrained(save_directory, *args, **kwargs)

    @property
    def compute_dtype(self) -> torch.dtype:
        # read off a norm: an int8_copy()'s linear layers hold packed int8 weights
        return self.norm.weight.dtype

    def project_context(self, context_hidden_states: torch.Tensor) -> torch.Tensor:
        """`[batch, ctx, len(target_layer_ids) * hidden]` target features -> `[batch, ctx, hidden]`."""
        return self.hidden_norm(self.fc(context_hidden_states.to(self.compute_dtype)))

    def forward(
        self,
        noise_embeds: torch.Tensor,
        context_hidden_states: torch.Tensor,
        position_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: DynamicCache | None = None,
        use_cache: bool | None = None,
        cache: DynamicCache | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        r"""
        noise_embeds: `[batch, block, hidden]`, the target's embedding of `[last token, mask, ..., mask]`.
        context_hidden_states: `[batch, ctx, len(target_layer_ids) * hidden]`, target features of the tokens committed
            since the last call (all prompt tokens on the first call).
        position_ids: `[batch, ctx + block]`, absolute positions of the context tokens then the block.
        attention_mask: optional `[batch, cached + ctx + block]` 0/1 mask over keys.
        past_key_values / cache: a `DynamicCache` holding earlier context keys/values; this call appends the new
            context and the block, so callers crop the block (`cache.crop(-block)`) afterwards.

        Returns `last_hidden_state` of shape `[batch, block, hidden]` in the dtype of `noise_embeds`.
        """
        cache = cache if cache is not None else past_key_values
        if use_cache and cache is None:
            cache = DynamicCache()
        hidden_states = noise_embeds.to(self.compute_dtype)
        context = self.project_context(context_hidden_states)
        if position_ids is None:
            start = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(start, start + context.shape[1] + hidden_states.shape[1], device=context.device)
            position_ids = position_ids[None].expand(hidden_states.shape[0], -1)
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        mask = key_padding_mask(attention_mask, hidden_states.shape[1], hidden_states.dtype)
        for layer in self.layers:
            hidden_states = layer(hidden_states, context, position_embeddings, mask, cache)
        hidden_states = self.norm(hidden_states).to(noise_embeds.dtype)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, **{_CACHE_FIELD: cache})

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """Loads strictly: a missing, unexpected or mis-shaped tensor is an error, not a warning."""
        path = args[0] if args else kwargs.get("pretrained_model_name_or_path")
        check_architecture(cls, kwargs.get("config") or DFlashConfig.from_pretrained(path, **hub_kwargs(kwargs)))
        return_info = kwargs.pop("output_loading_info", False)
        model, info = super().from_pretrained(*args, output_loading_info=True, **kwargs)
        problems = {k: v for k, v in info.items() if k in _STRICT_KEYS and v}
        if problems:
            raise ValueError(f"DFlash checkpoint does not match {cls.__name__}: {problems}")
        return (model, info) if return_info else model


# ---------------------------------------------------------------------------------------------------------------------
# DFlash 2: a grouped dynamic causal convolution around each sublayer, and a candidate selector after the head.


def hub_kwargs(kwargs: dict) -> dict:
    """The `from_pretrained` arguments that also locate a config."""
    names = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder")
    return {k: kwargs[k] for k in names if k in kwargs}


def check_architecture(cls, config) -> None:
    """A DFlash 2 checkpoint loaded as a v1 draft (or the reverse) is named, not reported as a pile of tensor names."""
    architectures = set(getattr(config, "architectures", None) or [])
    wanted = "DFlash2DraftModel" if "DFlash2DraftModel" in architectures else "DFlashDraftModel"
    if architectures & {"DFlashDraftModel", "DFlash2DraftModel"} and cls.__name__ != wanted:
        raise ValueError(f"this checkpoint is a {wanted} (config.architectures); load it with modeling_dflash.{wanted}")


class BlockConvolution(nn.Module):
    """Grouped dynamic causal convolution along the block (context features are not convolved), wrapped around a
    sublayer: `before` convolves the sublayer's normed input, `after` its output, each with
    `w[i, t, c] = base_kernel[side, t, c] + dynamic[i, side, t, c // conv_group_size]` over taps `t` (tap 0 is the
    position itself; taps before the block's first position read zeros). One projection of the normed input gives
    the dynamic part of both."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        settings = dflash2_settings(config)
        self.taps, self.group_size = settings["conv_kernel_size"], settings["conv_group_size"]
        base = torch.zeros(2, self.taps, config.hidden_size)
        base[:, 0] = 1.0  # an identity until trained
        self.base_kernel = nn.Parameter(base)
        self.kernel_projection = nn.Linear(
            config.hidden_size, 2 * self.taps * (config.hidden_size // self.group_size), bias=False
        )

    def before(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The convolved input and the kernels `after` will use, both `[batch, block, ...]`."""
        dynamic = (
            self.kernel_projection(x).view(*x.shape[:-1], 2, self.taps, -1).repeat_interleave(self.group_size, dim=-1)
        )
        kernels = self.base_kernel.to(x.dtype) + dynamic
        return self.convolve(x, kernels[..., 0, :, :]), kernels[..., 1, :, :]

    def after(self, x: torch.Tensor, kernels: torch.Tensor) -> torch.Tensor:
        return self.convolve(x, kernels)

    @staticmethod
    def convolve(x: torch.Tensor, kernels: torch.Tensor) -> torch.Tensor:
        """`out[i] = sum_t kernels[i, t] * x[i - t]`; `kernels`: `[batch, block, taps, hidden]`."""
        out = kernels[:, :, 0] * x
        for tap in range(1, min(kernels.shape[2], x.shape[1])):
            out[:, tap:] += kernels[:, tap:, tap] * x[:, :-tap]
        return out


class DFlash2DecoderLayer(DFlashDecoderLayer):
    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.attention_conv, self.mlp_conv = BlockConvolution(config), BlockConvolution(config)

    def forward(self, hidden_states, context, position_embeddings, attention_mask=None, cache=None):
        attn_in, kernels = self.attention_conv.before(self.input_layernorm(hidden_states))
        attn_out = self.self_attn(attn_in, context, position_embeddings, attention_mask, cache)
        hidden_states = hidden_states + self.attention_conv.after(attn_out, kernels)
        mlp_in, kernels = self.mlp_conv.before(self.post_attention_layernorm(hidden_states))
        return hidden_states + self.mlp_conv.after(self.mlp(mlp_in), kernels)


class CandidateSelector(nn.Module):
    """Picks the block's tokens among the head's `selector_top_k` best at each position, walking left to right from
    the last committed token: candidate `c` after predecessor `p` scores
    `logit[c] + sum_r predecessor_codebook[p, r] * (hidden_projection(h))[r] * successor_codebook[c, r]`.
    The codebooks are plain parameters, stored without a `.weight` suffix as the published checkpoints store them."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        settings = dflash2_settings(config)
        rank, self.top_k = settings["selector_rank"], settings["selector_top_k"]
        self.predecessor_codebook = nn.Parameter(torch.randn(config.vocab_size, rank) * config.initializer_range)
        self.successor_codebook = nn.Parameter(torch.zeros(config.vocab_size, rank))  # a no-op until trained
        self.hidden_projection = nn.Linear(config.hidden_size, rank, bias=False)

    def scores(self, logits: torch.Tensor, hidden: torch.Tensor, predecessor: torch.Tensor) -> torch.Tensor:
        """`[batch, vocab]` scores at one position, -inf outside its top-k; `logits` `[batch, vocab]`, `hidden`
        `[batch, hidden]`, `predecessor` `[batch]` token ids."""
        unary, candidates = logits.topk(self.top_k, dim=-1)
        context = self.predecessor_codebook[predecessor] * self.hidden_projection(hidden)
        pair = torch.einsum("br,bkr->bk", context, self.successor_codebook[candidates]).to(unary.dtype)
        return torch.full_like(logits, float("-inf")).scatter_(-1, candidates, unary + pair)

    def walk(
        self, logits: torch.Tensor, hidden: torch.Tensor, anchor: torch.Tensor, choose=None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's tokens `[batch, n]` and each position's scores `[batch, n, vocab]` given the chosen
        predecessor. `logits` `[batch, n, vocab]`, `hidden` `[batch, n, hidden]`, `anchor` `[batch, 1]`;
        `choose(scores) -> [batch]` picks a token from one position's scores (default: the best)."""
        choose = choose or (lambda scores: scores.argmax(dim=-1))
        tokens, all_scores, predecessor = [], [], anchor[:, 0]
        for i in range(logits.shape[1]):
            scores = self.scores(logits[:, i], hidden[:, i], predecessor)
            predecessor = choose(scores)
            tokens.append(predecessor)
            all_scores.append(scores)
        return torch.stack(tokens, dim=1), torch.stack(all_scores, dim=1)


class DFlash2DraftModel(DFlashDraftModel):
    """A DFlash 2 draft (`architectures: ["DFlash2DraftModel"]`): v1 layers with `attention_conv` and `mlp_conv`,
    and a `candidate_selector` that chooses the block's tokens from the target head's top-k (greedy at temperature
    0, sampled from its scores above it). Both decoding routes run it; draft trees need per-position distributions
    and refuse it."""

    _no_split_modules = ["DFlash2DecoderLayer"]
    decoder_layer_class = DFlash2DecoderLayer
    has_selector = True

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, BlockConvolution):  # the convolutions start as identities
            nn.init.zeros_(module.kernel_projection.weight)
            with torch.no_grad():
                module.base_kernel.zero_()[:, 0] = 1.0


DFlashConfig.register_for_auto_class("AutoConfig")
DFlashDraftModel.register_for_auto_class("AutoModel")
DFlash2DraftModel.register_for_auto_class("AutoModel")

__all__ = [
    "DFlashDraftModel",
    "DFlash2DraftModel",
    "DFlashPreTrainedModel",
    "DFlashConfig",
]
