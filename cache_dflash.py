"""The target's cache across DFlash rounds: which cache a call gets, how a verify pass is taken back to the accepted
tokens (a crop, a gather along a tree path, or a hybrid target's rollback), and the name `forward` takes it by.

Kept apart from the decoding loops as transformers keeps `cache_utils` apart from its candidate generators.
"""

import inspect

import torch
import transformers
from transformers import DynamicCache, StaticCache
from transformers.cache_utils import CacheLayerMixin, DynamicLayer

ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention"}
try:  # transformers 5.24+: linear-attention (gated delta, ...) layers keep their states in the cache, per layer
    from transformers.cache_utils import LinearAttentionCacheLayerMixin
except ImportError:
    LinearAttentionCacheLayerMixin = None


def records_recurrent_states() -> bool:
    """Whether transformers' own cache rolls a linear-attention layer back: it records the recurrent state after each
    token of a verify pass (`activate_past_recording(recurrent_states_to_keep=)`, 5.25+) and its crop restores one."""
    if LinearAttentionCacheLayerMixin is None:
        return False
    recording = inspect.signature(LinearAttentionCacheLayerMixin.activate_past_recording).parameters
    return "recurrent_states_to_keep" in recording


def cache_kwarg(model) -> str:
    """The name `model.forward` takes its cache by: `cache` on transformers 5.24+, `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def is_hybrid(target) -> bool:
    """Whether the target keeps a recurrent state (linear-attention layers, or a stateful model)."""
    layer_types = set(getattr(target.config.get_text_config(), "layer_types", None) or [])
    return bool(getattr(target, "_is_stateful", False) or layer_types - ATTENTION_LAYER_TYPES)


def check_target_supported(target) -> None:
    """Refuses targets whose cache can neither be cropped back to an accepted prefix nor rolled back by
    `RollbackCache` (whose every layer must be an attention layer or a linear-attention one)."""
    if not is_hybrid(target):
        return
    name = type(target).__name__
    if LinearAttentionCacheLayerMixin is None:
        raise ValueError(
            f"{name} keeps a recurrent state that cannot be cropped after a rejected draft; rolling it back needs "
            "transformers 5.24 or newer (its per-layer linear-attention caches); "
            f"{transformers.__version__} is installed"
        )
    layers = DynamicCache(config=target.config).layers
    others = sorted(
        {
            type(layer).__name__
            for layer in layers
            if not isinstance(layer, (CacheLayerMixin, LinearAttentionCacheLayerMixin))
        }
    )
    if others:
        raise ValueError(
            f"{name}'s cache layers {others} can neither be cropped nor rolled back after a rejected draft"
        )
    sliding = sorted({type(layer).__name__ for layer in layers if getattr(layer, "is_sliding", False)})
    if sliding:  # a crop neither brings back the keys a sliding layer evicted nor rewinds its length
        raise ValueError(
            f"{name}'s sliding-window cache layers {sliding} evict keys that no rollback after a rejected draft can "
            "restore; DFlash refuses hybrid targets with sliding-window layers"
        )


class RollbackCache(DynamicCache):
    """The cache of a hybrid target, whose linear-attention layers keep a recurrent state that no crop can rewind.

    `save(verify_ids)` keeps those states before a verify pass; `crop(-n)` then restores them, crops the attention
    layers to before the pass, and runs the target over the accepted tokens only, which advances every layer
    exactly as plain decoding would (as `mlx_port` does). Both decoding routes use it; to transformers' assisted
    loop it is a croppable cache.
    """

    def __init__(self, target):
        super().__init__(config=target.config)
        self.target, self.cache_name, self.pending, self.saved = target, cache_kwarg(target), None, []

    @property
    def is_croppable(self) -> bool:
        return True

    def activate_past_recording(self, **kwargs) -> None:
        """A no-op: the states are saved whole before each verify, so they need no recorded past (which would make
        the linear-attention conv states grow until a crop, and the verify compute one state per token)."""

    def save(self, verify_ids: torch.Tensor) -> None:
        """Before a verify pass over `verify_ids` (`[1, n]`, all new to the cache)."""
        clone = lambda states: {i: s.clone() for i, s in states.items() if s is not None}  # noqa: E731
        self.pending = verify_ids
        self.saved = [(clone(layer.conv_states), clone(layer.recurrent_states)) for layer in recurrent_layers(self)]

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove == 0:
            return
        if tokens_to_remove > 0 or self.pending is None or -tokens_to_remove > self.pending.shape[1]:
            raise RuntimeError(
                f"a hybrid target's cache rolls back only within its last verify pass (crop {tokens_to_remove})"
            )
        verified, kept = self.pending.shape[1], self.pending[:, : self.pending.shape[1] + tokens_to_remove]
        for layer, (conv, recurrent) in zip(recurrent_layers(self), self.saved):
            for states, saved in ((layer.conv_states, conv), (layer.recurrent_states, recurrent)):
                for i, state in saved.items():
                    states[i].copy_(state)
        for layer in self.layers:
            if hasattr(layer, "cumulative_length_linear"):  # 5.25+: a linear layer counts its own tokens
                layer.cumulative_length_linear.sub_(verified)
            if isinstance(layer, LinearAttentionCacheLayerMixin) and isinstance(layer, DynamicLayer):
                DynamicLayer.crop(layer, -verified)  # a layer holding both: its own crop would refuse
            elif isinstance(layer, CacheLayerMixin):
                layer.crop(-verified)
        self.pending = None
        if kept.shape[1]:
            self.target(input_ids=kept, use_cache=True, logits_to_keep=1, **{self.cache_name: self})


def refuse_caller_cache(target, passed: bool) -> None:
    """A hybrid target rolls back in a cache DFlash builds itself; a static or passed cache is refused."""
    if passed:
        raise ValueError(
            f"{type(target).__name__} keeps a recurrent state, which DFlash rolls back in a cache of its own: "
            "leave cache_implementation and past_key_values unset (a static or passed cache is not supported)"
        )


def hybrid_cache(target) -> DynamicCache:
    """A hybrid target's cache: transformers' own where it can roll a recurrent state back (5.25+), else a
    `RollbackCache`, which saves the states and re-runs the accepted tokens."""
    return DynamicCache(config=target.config) if records_recurrent_states() else RollbackCache(target)


def record_verify_states(cache, verify_tokens: int) -> None:
    """After the prefill, has transformers' own hybrid cache record the states of each verify pass of up to
    `verify_tokens` tokens (all of them, so that a crop can go back to any accepted prefix, the empty one included)."""
    if not isinstance(cache, RollbackCache) and recurrent_layers(cache):
        cache.activate_past_recording(recurrent_states_to_keep=verify_tokens)


def recurrent_layers(cache) -> list:
    if LinearAttentionCacheLayerMixin is None:
        return []
    layers = getattr(cache, "layers", None) or []
    return [layer for layer in layers if isinstance(layer, LinearAttentionCacheLayerMixin)]


def crop_recorded(cache, tokens_to_remove: int) -> None:
    """Crops a recording hybrid cache, always (a crop of 0 still ends the pass's recording), after checking that the
    target recorded a state for each token to take back (a model that ignores the request would roll back wrongly)."""
    for layer in recurrent_layers(cache):
        history = getattr(layer, "recurrent_states_history", {}).get(0)
        if tokens_to_remove and layer.is_recurrent_states_initialized[0] and len(history or []) < tokens_to_remove:
            raise RuntimeError(
                f"{type(layer).__name__} recorded {len(history or [])} recurrent states in the last verify pass, too "
                f"few to take back {tokens_to_remove} tokens: the target does not honour recurrent_states_to_keep"
            )
    cache.crop(-tokens_to_remove)


def static_length(cache) -> int | None:
    """The slots of a preallocated cache (its keys span them all), or None for a growing one."""
    lengths = {getattr(layer, "max_cache_len", None) for layer in getattr(cache, "layers", None) or []}
    if len(lengths) > 1:
        raise ValueError(f"a cache whose layers differ in length ({sorted(lengths, key=str)}) is not supported")
    return next(iter(lengths), None)


def target_cache_for(
    target, cache_implementation: str | None, past_key_values, max_length: int, slots: int | None = None
):
    """The target cache of one call: a new `DynamicCache`, a new `StaticCache` of `slots` (default `max_length`)
    slots, or the caller's empty cache, checked before any compute to be one whose every layer can be cropped."""
    if past_key_values is not None and cache_implementation is not None:
        raise ValueError("pass either cache_implementation or past_key_values, not both")
    if cache_implementation not in (None, "dynamic", "static"):
        raise ValueError(f"cache_implementation={cache_implementation!r} is not supported; use 'dynamic' or 'static'")
    if is_hybrid(target):
        refuse_caller_cache(target, past_key_values is not None or cache_implementation == "static")
        return hybrid_cache(target)
    if past_key_values is None and cache_implementation != "static":
        return DynamicCache()
    cache = (
        past_key_values
        if past_key_values is not None
        else StaticCache(config=target.config, max_cache_len=slots or max_length)
    )
    if int(cache.get_seq_length()) > 0:
        raise ValueError("past_key_values must be empty: the draft needs the target features of every prompt token")
    layers = getattr(cache, "layers", None) or []
    if not isinstance(cache, DynamicCache) and not (
        layers and all(getattr(layer, "is_croppable", False) for layer in layers)
    ):
        raise ValueError(
            f"{type(cache).__name__} cannot be cropped back to an accepted prefix with transformers "
            f"{transformers.__version__}; DFlash needs a dynamic cache, or a static one on transformers 5 or newer"
        )
    if (static_length(cache) or max_length) < max_length:
        raise ValueError(f"the cache holds {static_length(cache)} tokens; this call may need {max_length}")
    return cache


def drop_last(cache: DynamicCache, num_tokens: int) -> None:
    """Removes the last `num_tokens` cached tokens; `crop(0)` would empty the cache on transformers 4.x."""
    if num_tokens > 0:
        cache.crop(-num_tokens)


def compact_cache(cache: DynamicCache, first: int, path: list[int]) -> None:
    """Keeps, after the first `first` cached tokens, only the tree nodes on `path`, moved to consecutive slots."""
    total = int(cache.get_seq_length())  # a static cache, and a linear-attention layer (5.25+), count in a tensor
    if path != list(range(len(path))):  # a chain prefix needs no gather
        keep = torch.tensor(path) + first
        for layer in cache.layers:
            keep = keep.to(layer.keys.device)
            layer.keys[..., first : first + len(path), :] = layer.keys[..., keep, :]
            layer.values[..., first : first + len(path), :] = layer.values[..., keep, :]
    if recurrent_layers(cache) and not isinstance(cache, RollbackCache):
        crop_recorded(cache, total - first - len(path))
    elif total > first + len(path):
        cache.crop(first + len(path) - total)


def select_cache_rows(cache: DynamicCache, rows: torch.Tensor) -> None:
    """Keeps the cache's batch rows `rows` (a bool mask, or indices, which may repeat a row)."""
    for layer in cache.layers:
        if getattr(layer, "keys", None) is not None:  # transformers 5 may hold layers not yet written
            layer.keys, layer.values = layer.keys[rows], layer.values[rows]
