"""The DFlash draft in MLX: Qwen3-style layers whose keys and values also see projected target hidden states.

Module names equal the checkpoint keys of the torch `DFlashDraftModel` (`fc`, `hidden_norm`, `layers.{i}.*`, `norm`),
so a raw Hugging Face draft folder and a converted one load through the same `Model` with a tiny `sanitize`.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import qwen3
from mlx_lm.models.cache import ChunkedKVCache, KVCache
from mlx_lm.models.qwen3 import MLP
from mlx_lm.models.rope_utils import initialize_rope

from configuration_dflash import dflash2_settings


@dataclass
class ModelArgs(qwen3.ModelArgs):
    """A Qwen3 config plus the DFlash fields, read as the published checkpoints store them."""

    head_dim: int | None = None
    tie_word_embeddings: bool = False
    block_size: int = 16
    num_target_layers: int | None = None
    dflash_config: dict | None = None
    attention_bias: bool = False
    use_sliding_window: bool = False
    sliding_window: int | None = None
    max_window_layers: int = 28
    layer_types: list | None = None
    is_causal: bool | None = None  # top level, for all layers; absent: sliding layers causal, full ones not
    input_embedding_scale: float | None = None  # these three may also sit in `dflash_config` (`dflash_field`)
    output_multiplier: float | None = None
    final_logit_softcapping: float | None = None
    architectures: list | None = None
    conv_kernel_size: int | None = None  # DFlash 2; these four usually sit in `dflash_config`
    conv_group_size: int | None = None
    selector_rank: int | None = None
    selector_top_k: int | None = None

    def __post_init__(self):
        super().__post_init__()  # reads `rope_theta` from `rope_parameters` in transformers-5 configs
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        self.dflash_config = dict(self.dflash_config or {})
        # transformers' Qwen3Config drops `sliding_window` unless `use_sliding_window` is set; so does the torch draft
        self.sliding_window = self.sliding_window if self.use_sliding_window else None
        if self.layer_types is None:
            sliding = self.sliding_window is not None
            self.layer_types = [
                "sliding_attention" if sliding and i >= self.max_window_layers else "full_attention"
                for i in range(self.num_hidden_layers)
            ]

    @property
    def target_layer_ids(self) -> list[int]:
        return list(self.dflash_config.get("target_layer_ids") or [])

    def dflash_field(self, name: str, default=None):
        """A DFlash setting read as the torch config's `dflash_field`: `dflash_config` first, then the top level."""
        value = self.dflash_config.get(name)
        return value if value is not None else getattr(self, name, default)

    @property
    def mask_token_id(self) -> int | None:
        return self.dflash_config.get("mask_token_id")


def draft_attention_mask(query_len: int, key_len: int, causal: bool, window: int | None) -> mx.array | None:
    """Boolean `[q, k]` mask (True = visible) of one draft layer, as the torch draft's `draft_attention_mask`: the
    block's query `i` sits at key index `key_len - query_len + i`; causal layers hide later keys; a window hides keys
    `window` or more before the query, and as far after it in a non-causal layer. None when all are visible."""
    if not causal and window is None:
        return None
    offset = mx.arange(key_len - query_len, key_len)[:, None] - mx.arange(key_len)[None, :]
    visible = offset >= 0 if causal else mx.ones(offset.shape, dtype=mx.bool_)
    if window is not None:
        visible = visible & ((offset < window) if causal else (mx.abs(offset) < window))
    return visible


class DFlashAttention(nn.Module):
    """Queries from the block; keys/values from `[cached context ; new context ; block]`; non-causal unless the layer
    type makes it causal (`layer_is_causal`)."""

    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        dim, head_dim, bias = args.hidden_size, args.head_dim, args.attention_bias
        self.n_heads, self.n_kv_heads = args.num_attention_heads, args.num_key_value_heads
        self.scale = head_dim**-0.5
        is_sliding = args.layer_types[layer_idx] == "sliding_attention"
        self.sliding_window = args.sliding_window if is_sliding else None
        self.causal = args.is_causal if args.is_causal is not None else is_sliding
        self.q_proj = nn.Linear(dim, self.n_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * head_dim, dim, bias=bias)
        self.q_norm = nn.RMSNorm(head_dim, eps=args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(head_dim, eps=args.rms_norm_eps)
        self.rope = initialize_rope(
            head_dim,
            base=args.rope_theta,
            traditional=False,
            scaling_config=args.rope_scaling,
            max_position_embeddings=args.max_position_embeddings,
        )

    def _heads(self, x: mx.array, n_heads: int) -> mx.array:
        return x.reshape(*x.shape[:2], n_heads, -1).transpose(0, 2, 1, 3)

    def __call__(self, x: mx.array, context: mx.array, cache: Any | None = None) -> mx.array:
        B, L, _ = x.shape
        n_ctx, start = context.shape[1], cache.offset if cache is not None else 0
        # the context skips `input_layernorm`: `hidden_norm` normed it already
        kv_input = mx.concatenate([context, x], axis=1)
        queries = self.rope(self.q_norm(self._heads(self.q_proj(x), self.n_heads)), offset=start + n_ctx)
        keys = self.rope(self.k_norm(self._heads(self.k_proj(kv_input), self.n_kv_heads)), offset=start)
        values = self._heads(self.v_proj(kv_input), self.n_kv_heads)
        if cache is not None:
            # the cache keeps committed context only; the block is re-drafted next round
            ctx_keys, ctx_values = cache.update_and_fetch(keys[:, :, :n_ctx], values[:, :, :n_ctx])
            if isinstance(cache, ChunkedKVCache):
                cache.maybe_trim_front()  # bounded memory: keep the newest `chunk_size` context tokens
                ctx_keys, ctx_values = cache.keys_and_values()
            keys = mx.concatenate([ctx_keys, keys[:, :, n_ctx:]], axis=2)
            values = mx.concatenate([ctx_values, values[:, :, n_ctx:]], axis=2)
        mask = draft_attention_mask(L, keys.shape[2], self.causal, self.sliding_window)
        out = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.self_attn = DFlashAttention(args, layer_idx)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.mlp = MLP(args.hidden_size, args.intermediate_size)

    def __call__(self, x: mx.array, context: mx.array, cache: Any | None = None) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), context, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Model(nn.Module):
    """The DFlash draft. It has no embedding and no head: callers embed with the target's table and read logits
    through the target's head. Decoding lives in `mlx_port.generate`."""

    layer_class = DFlashDecoderLayer
    has_selector = False

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.fc = nn.Linear(len(args.target_layer_ids) * args.hidden_size, args.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.layers = [self.layer_class(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.sliding_window_size: int | None = None  # set by `load_draft`; bounds the context cache

    def __call__(self, noise_embeds: mx.array, target_hidden: mx.array, cache: list | None = None) -> mx.array:
        """
        noise_embeds: `[batch, block, hidden]`, the target's embedding of `[last token, mask, ..., mask]`.
        target_hidden: `[batch, ctx, len(target_layer_ids) * hidden]`, target features of the tokens committed since
            the last call (all prompt tokens on the first call); their positions continue the cache's offset.
        cache: from `make_cache`; it gains the new context and never the block.

        Returns the normed hidden states `[batch, block, hidden]`.
        """
        dtype = self.hidden_norm.weight.dtype  # never quantized, so it is the draft's compute dtype
        context = self.hidden_norm(self.fc(target_hidden.astype(dtype)))
        h = noise_embeds.astype(dtype)
        for layer, c in zip(self.layers, cache or [None] * len(self.layers)):
            h = layer(h, context, c)
        return self.norm(h)

    def make_cache(self, sliding_window_size: int | None = None) -> list:
        """One context cache per layer, bounded by `sliding_window_size` and by a sliding layer's own window."""
        window = sliding_window_size or self.sliding_window_size
        caches = []
        for layer in self.layers:
            bounds = [w for w in (window, layer.self_attn.sliding_window) if w]
            caches.append(ChunkedKVCache(min(bounds)) if bounds else KVCache())
        return caches

    def sanitize(self, weights: dict) -> dict:
        """Accepts a `model.` prefix (some exports) and drops rotary buffers; other names load as they are."""
        weights = {k.removeprefix("model."): v for k, v in weights.items()}
        return {k: v for k, v in weights.items() if "rotary_emb" not in k}

    @property
    def mask_token_id(self) -> int | None:
        return self.args.mask_token_id

    @property
    def target_layer_ids(self) -> list[int]:
        return self.args.target_layer_ids


# ---------------------------------------------------------------------------------------------------------------------
# DFlash 2: the torch `DFlash2DraftModel`'s convolutions and candidate selector, with the same names.


class BlockConvolution(nn.Module):
    """Grouped dynamic causal convolution along the block, as the torch `BlockConvolution`: `before` convolves a
    sublayer's normed input, `after` its output, with `base_kernel[side] + dynamic[side]` per group of channels."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        settings = dflash2_settings(args)
        self.taps, self.group_size = settings["conv_kernel_size"], settings["conv_group_size"]
        self.base_kernel = mx.zeros((2, self.taps, args.hidden_size))
        self.kernel_projection = nn.Linear(
            args.hidden_size, 2 * self.taps * (args.hidden_size // self.group_size), bias=False
        )

    def before(self, x: mx.array) -> tuple[mx.array, mx.array]:
        dynamic = self.kernel_projection(x).reshape(*x.shape[:-1], 2, self.taps, -1)
        kernels = self.base_kernel.astype(x.dtype) + mx.repeat(dynamic, self.group_size, axis=-1)
        return self.convolve(x, kernels[..., 0, :, :]), kernels[..., 1, :, :]

    def after(self, x: mx.array, kernels: mx.array) -> mx.array:
        return self.convolve(x, kernels)

    @staticmethod
    def convolve(x: mx.array, kernels: mx.array) -> mx.array:
        """`out[i] = sum_t kernels[i, t] * x[i - t]`, zeros before the block.

        `kernels`: `[batch, block, taps, hidden]`."""
        out = kernels[:, :, 0] * x
        for tap in range(1, min(kernels.shape[2], x.shape[1])):
            out = out + kernels[:, :, tap] * mx.pad(x[:, :-tap], [(0, 0), (tap, 0), (0, 0)])
        return out


class DFlash2DecoderLayer(DFlashDecoderLayer):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__(args, layer_idx)
        self.attention_conv, self.mlp_conv = BlockConvolution(args), BlockConvolution(args)

    def __call__(self, x: mx.array, context: mx.array, cache: Any | None = None) -> mx.array:
        attn_in, kernels = self.attention_conv.before(self.input_layernorm(x))
        h = x + self.attention_conv.after(self.self_attn(attn_in, context, cache), kernels)
        mlp_in, kernels = self.mlp_conv.before(self.post_attention_layernorm(h))
        return h + self.mlp_conv.after(self.mlp(mlp_in), kernels)


class CandidateSelector(nn.Module):
    """The torch `CandidateSelector`: the head's `selector_top_k` best per position, walked left to right from the
    last committed token; candidate `c` after `p` scores `logit[c] + sum_r P[p, r] (H h)[r] S[c, r]`."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        settings = dflash2_settings(args)
        rank, self.top_k = settings["selector_rank"], settings["selector_top_k"]
        self.predecessor_codebook = mx.zeros((args.vocab_size, rank))
        self.successor_codebook = mx.zeros((args.vocab_size, rank))
        self.hidden_projection = nn.Linear(args.hidden_size, rank, bias=False)

    def scores(self, logits: mx.array, hidden: mx.array, predecessor: mx.array) -> mx.array:
        """`[batch, vocab]` scores at one position, -inf outside its top-k."""
        candidates = mx.argpartition(-logits, self.top_k - 1, axis=-1)[..., : self.top_k]
        unary = mx.take_along_axis(logits, candidates, axis=-1)
        context = self.predecessor_codebook[predecessor] * self.hidden_projection(hidden)
        pair = (context[:, None, :] * self.successor_codebook[candidates]).sum(axis=-1)
        return mx.put_along_axis(
            mx.full(logits.shape, -mx.inf, dtype=logits.dtype), candidates, unary + pair.astype(logits.dtype), axis=-1
        )

    def walk(
        self, logits: mx.array, hidden: mx.array, anchor: mx.array, choose: Callable[[mx.array], mx.array]
    ) -> mx.array:
        """The block's tokens `[batch, n]`, each chosen by `choose(scores) -> [batch]` given the one chosen before."""
        tokens, predecessor = [], anchor
        for i in range(logits.shape[1]):
            predecessor = choose(self.scores(logits[:, i], hidden[:, i], predecessor))
            tokens.append(predecessor)
        return mx.stack(tokens, axis=1)


class DFlash2Model(Model):
    """A DFlash 2 draft (`architectures: ["DFlash2DraftModel"]`): v1 layers with convolutions, and a selector."""

    layer_class = DFlash2DecoderLayer
    has_selector = True

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.candidate_selector = CandidateSelector(args)
