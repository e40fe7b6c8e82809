"""Decoding methods as small callables sharing one interface: `run(input_ids, max_new_tokens) -> Generation`.

A factory builds each method for a block size from a `Context`; an unavailable method raises `Unavailable` with the
reason, which the harness prints and records. Acceptance lengths of methods that do not report them are recovered by
`TargetTracer` from the target's own forward calls, so every method is measured the same way.
"""

import contextlib
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch


class Unavailable(RuntimeError):
    """This method cannot run with the installed packages or models; the message says why."""


@dataclass
class Generation:
    """New tokens of one call (after the prompt) and, when the method reports them, per-step acceptance lengths."""

    new_tokens: list[int]
    acceptance_lengths: list[int] | None = None
    first_token_time: float | None = None  # perf_counter() when the first new token was known


@dataclass
class Context:
    """Everything a method factory may need. `draft` is None when no draft is loaded."""

    target: object
    tokenizer: object
    draft: object = None
    temperature: float = 0.0
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int = 0
    device: str = "cpu"


def synchronize(device) -> None:
    """Waits for queued accelerator work, so a timer read afterwards counts it; a no-op on the CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


Run = Callable[[object, int], Generation]


class TargetTracer:
    """Forward hooks on the target: cache length at each call (hence acceptance lengths) and the first call's end.

    A verify step that starts with `s` cached tokens commits `s_next - s` tokens (the last committed token is not yet
    in the cache, hence the `- 1` for the final step).
    """

    def __init__(self, target):
        self.target, self.starts, self.first_end = target, [], None

    def __enter__(self):
        self.handles = [
            self.target.register_forward_pre_hook(self._before, with_kwargs=True),
            self.target.register_forward_hook(self._after),
        ]
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()

    def _before(self, module, args, kwargs):
        cache = kwargs.get("past_key_values", kwargs.get("cache"))
        self.starts.append(cache.get_seq_length() if cache is not None else 0)

    def _after(self, module, args, output):
        if self.first_end is None:
            synchronize(module.device)
            self.first_end = time.perf_counter()

    def acceptance_lengths(self, final_length: int) -> list[int]:
        """Tokens committed by each call after the prefill; `final_length` counts prompt plus new tokens."""
        steps = self.starts[1:] + [final_length - 1]
        return [b - a for a, b in zip(self.starts[1:], steps[1:])]


def traced(ctx: Context, call: Callable[[torch.Tensor, int], torch.Tensor]) -> Run:
    """Wraps `call(input_ids, max_new_tokens) -> output ids` with the tracer; the global seed is reset per call."""

    def run(input_ids: torch.Tensor, max_new_tokens: int) -> Generation:
        torch.manual_seed(ctx.seed)
        with TargetTracer(ctx.target) as tracer, torch.inference_mode():
            output = call(input_ids, max_new_tokens)
        new = output[0, input_ids.shape[1] :].tolist()
        return Generation(new, tracer.acceptance_lengths(output.shape[1]), tracer.first_end)

    return run


def hf_generate(ctx: Context, **extra) -> Run:
    """`target.generate` with the run's sampling settings plus `extra` (assistant, prompt lookup, ...)."""
    sampling = {"do_sample": True, "temperature": ctx.temperature} if ctx.temperature > 0 else {"do_sample": False}
    pad = ctx.stop_token_ids[0] if ctx.stop_token_ids else 0

    def call(input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        return ctx.target.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            pad_token_id=pad,
            **sampling,
            **extra,
        )

    return traced(ctx, call)


@contextlib.contextmanager
def draft_block_size(draft, block_size: int):
    """Temporarily sets the draft's configured block size, which the `assistant_model` routes read."""
    old = draft.config.block_size
    draft.config.block_size = block_size
    try:
        yield
    finally:
        draft.config.block_size = old


def with_block_size(ctx: Context, block_size: int, run: Run) -> Run:
    def sized(input_ids: torch.Tensor, max_new_tokens: int) -> Generation:
        with draft_block_size(ctx.draft, block_size):
            return run(input_ids, max_new_tokens)

    return sized


def require_draft(ctx: Context) -> None:
    if ctx.draft is None:
        raise Unavailable("no draft loaded")


# ---------------------------------------------------------------------------------------------------------------------
# torch methods


def plain(ctx: Context, block_size: int | None) -> Run:
    """The baseline: the target's own `generate`."""
    return hf_generate(ctx)


def spec_generate(
    ctx: Context, block_size: int | None, schedule: str = "constant", tree_budget: int | None = None, **options
) -> Run:
    """Our hand-written loop, `draft.spec_generate` (its config's defaults unless told); it reports acceptance
    lengths itself. `tree_budget`: 0 for the argmax chain, N for a draft tree of N nodes; `options` go to the call
    (a static cache, a compiled verify)."""
    require_draft(ctx)
    generator = torch.Generator(device=ctx.device)  # sampling on an accelerator needs a generator there

    def run(input_ids: torch.Tensor, max_new_tokens: int) -> Generation:
        generator.manual_seed(ctx.seed)
        with TargetTracer(ctx.target) as tracer:
            out = ctx.draft.spec_generate(
                target=ctx.target,
                input_ids=input_ids,
                max_new_tokens=max_new_tokens,
                stop_token_ids=ctx.stop_token_ids,
                temperature=ctx.temperature,
                block_size=block_size,
                return_stats=True,
                generator=generator,
                block_size_schedule=schedule,
                tree_budget=tree_budget,
                **options,
            )
        return Generation(out.output_ids[0, input_ids.shape[1] :].tolist(), out.acceptance_lengths, tracer.first_end)

    return run


def assisted(ctx: Context, block_size: int | None) -> Run:
    """`target.generate(assistant_model=draft)` through our `DFlashCandidateGenerator`, where it has landed."""
    require_draft(ctx)
    return with_block_size(ctx, block_size, hf_generate(ctx, assistant_model=ctx.draft))


def assisted_sample(ctx: Context, block_size: int | None) -> Run:
    """Our route with the other proposal rule: sample each draft position, verify with `_speculative_sampling`."""
    run = assisted(ctx, block_size)

    def sampled(input_ids: torch.Tensor, max_new_tokens: int) -> Generation:
        ctx.draft.dflash_proposal = "sample"
        try:
            return run(input_ids, max_new_tokens)
        finally:
            del ctx.draft.dflash_proposal

    return sampled


def hf_dflash(ctx: Context, block_size: int | None) -> Run:
    """transformers' built-in generator, `speculation_type="dflash"` (transformers >= 5.15)."""
    require_draft(ctx)
    from transformers.generation import candidate_generator

    if not hasattr(candidate_generator, "DFlashTokenCandidateGenerator"):
        raise Unavailable("the installed transformers has no speculation_type='dflash'")
    return with_block_size(ctx, block_size, hf_generate(ctx, assistant_model=ctx.draft, speculation_type="dflash"))


def spec_generate_lookup(ctx: Context, block_size: int | None) -> Run:
    """`spec_generate` (the config's tree) with a prompt-lookup branch of `block_size - 1` tokens in every round."""
    return spec_generate(ctx, block_size, prompt_lookup_num_tokens=max(block_size - 1, 1))


def spec_generate_confident(ctx: Context, block_size: int | None, tree_min_prob: float = 0.2) -> Run:
    """`spec_generate` with the config's tree (else `block_size - 1` nodes) cut to the nodes whose path the draft
    gives at least `tree_min_prob` (bench `--tree-min-prob`), without a lookup branch."""
    require_draft(ctx)
    budget = ctx.draft.config.tree_budget or max((block_size or ctx.draft.config.block_size) - 1, 1)
    return spec_generate(ctx, block_size, tree_budget=budget, prompt_lookup_num_tokens=0, tree_min_prob=tree_min_prob)


def spec_generate_int8(ctx: Context, block_size: int | None) -> Run:
    """`spec_generate` at the config's defaults with the draft's int8 copy (`draft.int8_copy()`, CPU only)."""
    require_draft(ctx)
    if torch.device(ctx.device).type != "cpu":
        raise Unavailable(f"int8_copy() quantizes for CPUs; this run is on {ctx.device}")
    return spec_generate(replace(ctx, draft=ctx.draft.int8_copy()), block_size)


def prompt_lookup(ctx: Context, block_size: int | None) -> Run:
    """transformers' prompt-lookup decoding, proposing `block_size - 1` tokens like a DFlash block."""
    return hf_generate(ctx, prompt_lookup_num_tokens=max(block_size - 1, 1))


TORCH_METHODS: dict[str, Callable[[Context, int | None], Run]] = {
    "plain": plain,
    "spec-generate": spec_generate,
    "spec-generate-heuristic": functools.partial(spec_generate, schedule="heuristic"),
    "spec-generate-chain": functools.partial(spec_generate, tree_budget=0, prompt_lookup_num_tokens=0),
    # one method per --tree-budget, named spec-generate-tree<N>: the draft's tree alone, no lookup branch
    "spec-generate-tree": functools.partial(spec_generate, prompt_lookup_num_tokens=0),
    "spec-generate-static": functools.partial(spec_generate, cache_implementation="static"),
    "spec-generate-compiled": functools.partial(spec_generate, compile_verify=True),  # compiled in the warm-up
    "spec-generate-lookup": spec_generate_lookup,
    "spec-generate-fixed": functools.partial(spec_generate, tree_sizing="fixed"),  # the config's tree, every round
    "spec-generate-cost": functools.partial(spec_generate, tree_sizing="cost"),  # cut to what each verify costs
    "spec-generate-confident": spec_generate_confident,
    "spec-generate-int8": spec_generate_int8,
    "assisted": assisted,
    "assisted-sample": assisted_sample,
    "hf-dflash": hf_dflash,
    "prompt-lookup": prompt_lookup,
}
BLOCK_FREE = {"plain", "mlx-plain"}  # methods measured once, whatever the block sizes swept
