"""Routes `target.generate(ids, assistant_model=draft)` to `DFlashCandidateGenerator`, with per-token stopping.

transformers picks a candidate generator from a fixed if/elif chain and has no argument for a custom one. Importing
this module wraps three `GenerationMixin` methods once:
- `generate` binds the call's arguments by the original signature; a call whose assistant is a DFlash draft goes to
  that draft's own `_dflash_assisted_generate` (its own copy of this code: remote code loads one copy per revision).
- `_get_candidate_generator` and `_get_stopping_criteria` return the DFlash generator and per-token stopping inside
  such a call, and only in its thread and for its target; everywhere else they are the originals. Concurrent calls
  in other threads, with or without a draft, are unaffected.
"""

import contextlib
import dataclasses
import functools
import inspect
import threading

import torch
import transformers
from transformers import GenerationConfig, GenerationMixin, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria
from transformers.generation.streamers import BaseStreamer
from transformers.generation.utils import GenerateDecoderOnlyOutput

try:
    from .cache_dflash import (
        RollbackCache,
        cache_kwarg,
        drop_last,
        is_hybrid,
        records_recurrent_states,
        refuse_caller_cache,
    )
    from .candidates_dflash import DFlashCandidateGenerator
    from .plan_dflash import (
        check_context,
        check_draft_fits_target,
        check_generation_inputs,
        check_schedule,
        tree_plan,
    )
except ImportError:  # imported as a top-level module from the repo root or an installed project
    from cache_dflash import (
        RollbackCache,
        cache_kwarg,
        drop_last,
        is_hybrid,
        records_recurrent_states,
        refuse_caller_cache,
    )
    from candidates_dflash import DFlashCandidateGenerator
    from plan_dflash import (
        check_context,
        check_draft_fits_target,
        check_generation_inputs,
        check_schedule,
        tree_plan,
    )

logger = transformers.utils.logging.get_logger(__name__)
ROUTED = ("generate", "_get_candidate_generator", "_get_stopping_criteria")
# what each wrapped method must still take for the routing to work
NEEDED_PARAMETERS = {
    "generate": {"inputs", "generation_config", "assistant_model", "streamer"},
    "_get_candidate_generator": {"generation_config", "logits_processor"},
    "_get_stopping_criteria": {"generation_config", "stopping_criteria"},
}


class TokenStopping(StoppingCriteria):
    """Checks the call's criteria at each prefix a step added (never inside the prompt), streams the tokens that
    plain decoding would have produced, and records the length at which plain decoding would have stopped.

    transformers 4.x also asks whether the unverified candidates would stop (`is_done_candidate`), only to keep one
    token fewer; while `verifying()` is true the answer is "no", since the committed check truncates at the stop anyway.
    """

    def __init__(
        self,
        criteria: StoppingCriteriaList,
        prompt_len: int,
        streamer: BaseStreamer | None = None,
        verifying=lambda: False,
    ):
        self.criteria, self.checked, self.streamer, self.verifying = criteria, prompt_len, streamer, verifying
        self.stop_length = None

    def first_stop(self, input_ids: torch.LongTensor, scores=None) -> int | None:
        """The shortest new prefix at which the criteria stop, if any."""
        for length in range(self.checked + 1, input_ids.shape[1] + 1):
            if bool(self.criteria(input_ids[:, :length], scores).all()):
                return length
        return None

    def __call__(self, input_ids: torch.LongTensor, scores=None, **kwargs) -> torch.BoolTensor:
        if self.verifying():
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        stop = self.first_stop(input_ids, scores)
        done = torch.full((input_ids.shape[0],), stop is not None, dtype=torch.bool, device=input_ids.device)
        self.stop_length, end = stop, stop or input_ids.shape[1]
        if self.streamer is not None and end > self.checked:
            self.streamer.put(input_ids[0, self.checked : end].cpu())
        self.checked = input_ids.shape[1]
        return done


class PromptStreamer(BaseStreamer):
    """Hands transformers' first `put` (the prompt) and `end` to the user's streamer; `TokenStopping` streams the
    rest."""

    def __init__(self, streamer: BaseStreamer):
        self.streamer, self.prompt_sent = streamer, False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_sent:
            self.prompt_sent = True
            self.streamer.put(value)

    def end(self) -> None:
        self.streamer.end()


class DFlashCall:
    """One `target.generate` call with a DFlash assistant: builds its candidate generator and its stopping."""

    def __init__(
        self,
        target,
        draft,
        prompt_len: int,
        streamer: BaseStreamer | None,
        *,
        block_size: int,
        builtin: bool,
        rollback=None,
    ):
        self.target, self.draft, self.prompt_len, self.streamer = target, draft, prompt_len, streamer
        self.block_size, self.builtin, self.rollback = block_size, builtin, rollback
        self.generators: list[DFlashCandidateGenerator] = []
        self.stopping: TokenStopping | None = None

    def get_candidate_generator(self, original, target, *args, **kwargs):
        if self.builtin:  # transformers' own `speculation_type="dflash"` generator
            return original(target, *args, **kwargs)
        bound = bind(original, target, args, kwargs)
        proposal = getattr(self.draft, "dflash_proposal", "argmax")  # `draft.dflash_proposal = "sample"` to compare
        generator = DFlashCandidateGenerator(
            target,
            self.draft,
            bound["generation_config"],
            bound["logits_processor"],
            proposal=proposal,
            block_size=self.block_size,
            rollback=self.rollback,
        )
        self.generators.append(generator)
        return generator

    def get_stopping_criteria(self, original, target, *args, **kwargs):
        verifying = lambda: any(g.proposed for g in self.generators)  # noqa: E731
        self.stopping = TokenStopping(original(target, *args, **kwargs), self.prompt_len, self.streamer, verifying)
        return StoppingCriteriaList([self.stopping])

    def close(self) -> None:
        for generator in self.generators:
            generator.close()


def bind(method, self, args: tuple, kwargs: dict) -> dict:
    """The call's arguments by name, as `method` would see them, with its `**kwargs` merged in."""
    signature = inspect.signature(method)
    bound = signature.bind(self, *args, **kwargs).arguments
    var_kw = next((p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), None)
    return {**{k: v for k, v in bound.items() if k != var_kw}, **bound.get(var_kw, {})}


def is_dflash_draft(model) -> bool:
    """Duck-typed: remote code loads its own copy of our classes, so `isinstance` would miss them."""
    return callable(getattr(model, "_dflash_assisted_generate", None))


def requested_block_size(draft, call: dict) -> int:
    """`num_assistant_tokens` drafted tokens plus the last token, when the call sets it; else the draft's block size."""
    drafted = call.get("num_assistant_tokens")
    config = call.get("generation_config")
    if (
        drafted is None
        and config is not None
        and config.num_assistant_tokens != GenerationConfig().num_assistant_tokens
    ):
        drafted = config.num_assistant_tokens
    return draft.config.block_size if drafted is None else int(drafted) + 1


def prompt_ids(call: dict) -> torch.Tensor:
    ids = call.get("inputs") if call.get("inputs") is not None else call.get("input_ids")
    if ids is None or call.get("inputs_embeds") is not None:
        raise ValueError(
            "DFlash needs the prompt as input_ids: the draft embeds token ids and reads target features of every "
            "prompt token, so a call with inputs_embeds (or with no prompt) is not supported"
        )
    return ids


def check_assisted_call(target, draft, call: dict) -> None:
    """Refuses, before any compute, what transformers' assisted loop or DFlash cannot do."""
    config = call.get("generation_config") or target.generation_config
    setting = lambda name: call.get(name, getattr(config, name, None))  # noqa: E731
    prompt_ids(call)
    if (setting("num_return_sequences") or 1) > 1:
        raise ValueError("num_return_sequences > 1 is not supported with a DFlash assistant")
    if (setting("num_beams") or 1) > 1:
        raise ValueError("beam search (num_beams > 1) is not supported with a DFlash assistant")
    if call.get("assistant_tokenizer") is not None:
        raise ValueError(
            "assistant_tokenizer is not supported with a DFlash assistant: a DFlash draft shares the target's tokenizer"
        )
    if requested_block_size(draft, call) < 2:
        raise ValueError(
            "num_assistant_tokens must be at least 1 with a DFlash assistant, "
            f"got {requested_block_size(draft, call) - 1}"
        )
    check_schedule(setting("num_assistant_tokens_schedule"))
    if setting("tree_budget") is not None:
        raise ValueError(
            "tree_budget is not supported by target.generate: transformers' assisted loop verifies candidates as one "
            "sequence under the causal mask and crops the cache to a prefix, so it cannot verify a tree; use "
            "draft.spec_generate(target=..., tree_budget=N)"
        )
    if setting("prompt_lookup_num_tokens") is not None:
        raise ValueError(
            "prompt_lookup_num_tokens is not supported with a DFlash assistant in target.generate: DFlash verifies the "
            "lookup continuation as a branch of its draft tree, which the assisted loop cannot verify; use "
            "draft.spec_generate(target=..., prompt_lookup_num_tokens=N)"
        )
    if setting("cache_implementation") not in (None, "dynamic", "static"):
        raise ValueError(
            f"cache_implementation={setting('cache_implementation')!r} cannot be cropped; "
            "DFlash needs a dynamic or static cache"
        )
    cache = call.get("past_key_values", call.get("cache"))
    if cache is not None and cache.get_seq_length() > 0:
        raise ValueError(
            "a pre-filled past_key_values is not supported with a DFlash assistant: the draft needs the target "
            "features of every prompt token; pass the whole prompt without a cache"
        )
    check_draft_fits_target(draft, target)
    for name in ("tree_budget", "prompt_lookup_num_tokens"):  # spec_generate defaults, not something asked here
        if getattr(draft.config, name, None) is not None:
            logger.info_once(
                f"the draft's config sets {name}={getattr(draft.config, name)}, which only spec_generate "
                "honours; target.generate verifies the argmax chain"
            )


def routing_problem() -> str | None:
    """What, if anything, in the installed transformers breaks the routing."""
    for name, params in NEEDED_PARAMETERS.items():
        method = getattr(GenerationMixin, name, None)
        original = getattr(method, "__wrapped__", method)
        if original is None or not params <= set(inspect.signature(original).parameters):
            return (
                f"transformers {transformers.__version__} changed GenerationMixin.{name}, "
                "which DFlash routing relies on"
            )
    return None


def assisted_generate(generate, target, call: dict):
    """`generate` with the DFlash candidate generator and per-token stopping active for this call only."""
    draft = call["assistant_model"]
    check_assisted_call(target, draft, call)
    builtin = call.get("speculation_type") is not None
    if builtin and not hasattr(GenerationConfig(), "speculation_type"):
        raise ValueError(f"speculation_type needs transformers 5.15 or newer; {transformers.__version__} is installed")
    if (problem := routing_problem()) is not None:
        raise RuntimeError(problem + "; use draft.spec_generate(target=...) instead")
    if prompt_ids(call).shape[0] > 1:  # transformers' assisted loop takes one sequence; the batched loop takes them
        if builtin:
            raise ValueError("transformers' own speculation_type='dflash' generator takes one sequence at a time")
        return generate_batch(target, draft, call, requested_block_size(draft, call))
    prompt_len = prompt_ids(call).shape[1]
    rollback = call_rollback_cache(target, call, builtin)
    dflash = DFlashCall(
        target,
        draft,
        prompt_len,
        call.get("streamer"),
        block_size=requested_block_size(draft, call),
        builtin=builtin,
        rollback=rollback,
    )
    if dflash.streamer is not None:
        call["streamer"] = PromptStreamer(dflash.streamer)
    calls = active_calls()
    previous, calls.current = getattr(calls, "current", None), dflash
    try:
        with stateless(target, rollback is not None):
            result = generate(target, **call)
    finally:
        calls.current = previous
        dflash.close()
    if dflash.stopping is None or not (builtin or dflash.generators):
        raise RuntimeError(
            f"transformers {transformers.__version__} did not build the DFlash candidate generator and stopping"
        )
    sequences = result if isinstance(result, torch.Tensor) else result.sequences
    return truncate_output(result, dflash.stopping.stop_length or sequences.shape[1], prompt_len)


def call_rollback_cache(target, call: dict, builtin: bool) -> RollbackCache | None:
    """For a hybrid target on a transformers whose cache cannot roll its states back, the `RollbackCache` this call
    runs on (put into the call); None otherwise (where it can, its assisted loop records `num_drafting_tokens`
    states per verify and crops back to one of them)."""
    if not is_hybrid(target):
        return None
    passed = call.get("past_key_values", call.get("cache")) is not None or call.get("cache_implementation") is not None
    refuse_caller_cache(target, passed)
    if records_recurrent_states():
        return None
    if builtin:
        raise ValueError(
            f"{type(target).__name__} keeps a recurrent state, which transformers {transformers.__version__}'s own "
            "DFlash generator cannot roll back (5.25+ can); leave speculation_type unset to use this project's"
        )
    call[cache_kwarg(target)] = rollback = RollbackCache(target)
    return rollback


@contextlib.contextmanager
def stateless(target, active: bool):
    """transformers before 5.25 refuses assisted decoding for stateful models (`_is_stateful`), whose state it cannot
    roll back; with a `RollbackCache` it can, so the flag is lifted for this call."""
    active = active and bool(getattr(target, "_is_stateful", False))
    own = "_is_stateful" in vars(target)
    previous = vars(target).get("_is_stateful")
    if active:
        target._is_stateful = False
    try:
        yield
    finally:
        if active:
            if own:
                target._is_stateful = previous
            else:
                del target._is_stateful


def truncate_output(result, length: int, prompt_len: int):
    """Cuts the sequences, and per-token scores or logits, where plain decoding would have stopped."""
    if isinstance(result, torch.Tensor):
        return result[:, :length]
    result.sequences = result.sequences[:, :length]
    for name in ("scores", "logits", "hidden_states", "attentions"):  # one entry per new token
        if getattr(result, name, None) is not None:
            setattr(result, name, getattr(result, name)[: length - prompt_len])
    # the field's own name: transformers 5.24 logs a deprecation for the `past_key_values` alias, however it is read
    fields = {field.name for field in dataclasses.fields(result)}
    if (cache := getattr(result, "cache" if "cache" in fields else "past_key_values", None)) is not None:
        drop_last(cache, int(cache.get_seq_length()) - (length - 1))
    return result


def active_calls() -> threading.local:
    """Running DFlash calls per thread, shared by every copy of this module."""
    return GenerationMixin._dflash_calls


def install_generate_routing() -> None:
    """Wraps `GenerationMixin.generate` and the two methods it consults, once per process."""
    if getattr(GenerationMixin.generate, "_dflash_routing", False):
        return
    GenerationMixin._dflash_calls = threading.local()
    original_generate = GenerationMixin.generate

    @functools.wraps(original_generate)
    def generate(self, *args, **kwargs):
        try:
            call = bind(original_generate, self, args, kwargs)
        except TypeError:  # let transformers report its own argument errors
            return original_generate(self, *args, **kwargs)
        draft = call.get("assistant_model")
        if not is_dflash_draft(draft):
            return original_generate(self, *args, **kwargs)
        call.pop("self")
        return draft._dflash_assisted_generate(original_generate, self, call)

    generate._dflash_routing = True
    GenerationMixin.generate = generate
    for name in ROUTED[1:]:
        setattr(GenerationMixin, name, routed(getattr(GenerationMixin, name), name))


def routed(original, name: str):
    """`original`, except inside a DFlash call on this thread and target, where the call's own method answers."""

    @functools.wraps(original)
    def method(self, *args, **kwargs):
        call = getattr(active_calls(), "current", None)
        if call is None or call.target is not self:
            return original(self, *args, **kwargs)
        return getattr(call, name.lstrip("_"))(original, self, *args, **kwargs)

    return method


# ---------------------------------------------------------------------------------------------------------------------
# `target.generate(ids, attention_mask=mask, assistant_model=draft)` with a batch: transformers' assisted loop takes
# one sequence, so the call runs the batched loop instead.

# generation settings the batched loop cannot honour, with the values that are off, and why
UNSUPPORTED_SETTINGS = {
    "guidance_scale": ((None, 1.0), "classifier-free guidance runs a second, unconditional model per row"),
    "num_assistant_tokens_schedule": ((None, "constant"), "the heuristic schedule sizes one row's block"),
    "output_scores": ((None, False), "a batch returns sequences only"),
    "output_logits": ((None, False), "a batch returns sequences only"),
    "output_attentions": ((None, False), "a batch returns sequences only"),
    "output_hidden_states": ((None, False), "a batch returns sequences only"),
}


# call arguments the batched loop cannot honour, and why
UNSUPPORTED_ARGUMENTS = {
    "streamer": "a streamer takes one sequence: transformers refuses streaming a batch, and so does DFlash",
    "prefix_allowed_tokens_fn": "its batch index would be lost: the loop calls processors one row at a time",
    "negative_prompt_ids": "classifier-free guidance runs a second, unconditional model per row",
}


CALL_ONLY = {
    "inputs",
    "input_ids",
    "attention_mask",
    "generation_config",
    "assistant_model",
    "streamer",
    "logits_processor",
    "stopping_criteria",
    "tokenizer",
    "generator",
}


def generation_settings(target, call: dict):
    """The call's generation config as `generate` builds it (`_prepare_generation_config`): its `generation_config`,
    unset fields filled from the target's and then from the global defaults, updated with its keyword settings."""
    settings = {k: v for k, v in call.items() if k not in CALL_ONLY}
    config, _ = target._prepare_generation_config(call.get("generation_config"), **settings)
    return config


def check_batch_call(call: dict, config) -> None:
    """Refuses, before compute, what a batch through `target.generate` cannot take, each with its reason."""
    for name, reason in UNSUPPORTED_ARGUMENTS.items():
        if call.get(name) is not None:
            raise ValueError(f"{name} is not supported with a batch and a DFlash assistant: {reason}")
    for name, (off, reason) in UNSUPPORTED_SETTINGS.items():
        if getattr(config, name, None) not in off:
            raise ValueError(
                f"{name}={getattr(config, name)!r} is not supported with a batch and a DFlash assistant: {reason}; "
                "decode the prompts one at a time"
            )
    if config.cache_implementation not in (None, "dynamic") or call.get("past_key_values") is not None:
        raise ValueError("a batch with a DFlash assistant builds its own ragged dynamic cache: leave the cache unset")


def processors_and_criteria(target, call: dict, config, ids: torch.Tensor):
    """The logits processors (warpers included when sampling) plain `generate` builds for this call, one list per
    row, each built for that row alone (transformers 5 sizes some to the batch, e.g. the repetition penalty's
    per-row padding), and its stopping criteria, less the EOS and length criteria the loop applies itself."""
    mask = call.get("attention_mask")
    target._prepare_special_tokens(config, mask is not None, device=ids.device)
    rows = [
        target._get_logits_processor(
            generation_config=config,
            input_ids_seq_length=ids.shape[1],
            encoder_input_ids=ids[row : row + 1],
            logits_processor=call.get("logits_processor") or LogitsProcessorList(),
            device=ids.device,
            model_kwargs={} if mask is None else {"attention_mask": torch.as_tensor(mask)[row : row + 1]},
        )
        for row in range(ids.shape[0])
    ]
    criteria = target._get_stopping_criteria(
        generation_config=config,
        stopping_criteria=call.get("stopping_criteria") or StoppingCriteriaList(),
        tokenizer=call.get("tokenizer"),
    )
    own = (MaxLengthCriteria, EosTokenCriteria)
    return rows, StoppingCriteriaList(c for c in criteria if not isinstance(c, own))


def new_token_count(target, call: dict, config, prompt_len: int) -> int:
    """How many tokens plain `generate` makes: `max_new_tokens`; else a `max_length` the call or a config set, less
    the prompt; else 20, within the target's `max_position_embeddings`."""
    if config.max_new_tokens is not None:
        return config.max_new_tokens
    preset = (call.get("generation_config") or target.generation_config).max_length  # before defaults fill it
    if call.get("max_length") is not None or preset not in (None, GenerationConfig().max_length):
        return config.max_length - prompt_len
    context = getattr(target.config, "max_position_embeddings", None) or prompt_len + 20
    return min(prompt_len + 20, context) - prompt_len


def generate_batch(target, draft, call: dict, block_size: int):
    """`target.generate` for a left-padded batch with a DFlash assistant: the batched loop with the call's greedy or
    sampling settings, logits processors and stopping criteria applied per row as plain batched `generate` applies
    them, `max_new_tokens` (or `max_length`), `eos_token_id` and `pad_token_id`."""
    ids = call.get("inputs") if call.get("inputs") is not None else call.get("input_ids")
    config = generation_settings(target, call)
    check_batch_call(call, config)
    max_new_tokens = new_token_count(target, call, config, ids.shape[1])
    check_generation_inputs(ids, max_new_tokens, block_size)
    check_context(target, ids, max_new_tokens)
    config.max_length = ids.shape[1] + max_new_tokens  # what generate's processors and criteria count against
    processors, criteria = processors_and_criteria(target, call, config, ids)
    plan = tree_plan(draft, target, ids.shape[1], max_new_tokens, block_size, "constant", None, 0.0, None, 2)
    sequences = draft._batched_spec_generate(
        target,
        ids,
        call.get("attention_mask"),
        max_new_tokens=max_new_tokens,
        stop_token_ids=config.eos_token_id,
        temperature=1.0 if config.do_sample else 0.0,  # the processors carry the call's temperature
        top_p=1.0,
        top_k=0,
        block_size=block_size,
        return_stats=False,
        generator=None,
        pad_token_id=config.pad_token_id,
        row_processors=processors,
        stopping_criteria=criteria,
        plan=plan,
    )
    return GenerateDecoderOnlyOutput(sequences=sequences) if config.return_dict_in_generate else sequences


install_generate_routing()
