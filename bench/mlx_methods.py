"""The MLX backend: mlx-lm's plain `stream_generate` against the DFlash port, `mlx_port.stream_generate`.

Imported only with `--backend mlx`; every import of mlx happens inside a function, so a machine without MLX gets a
clean `Unavailable` instead of an ImportError.
"""

import functools
import time
from collections.abc import Callable, Iterator

from bench.methods import Context, Generation, Run, Unavailable, require_draft


def import_mlx_port():
    try:
        import mlx_port
    except ImportError as error:
        raise Unavailable(f"mlx_port is not importable ({error})") from error
    return mlx_port


def load_mlx(target_path: str, draft_path: str | None) -> tuple:
    """(target, tokenizer, draft) through the port; `draft` is None when `draft_path` is None."""
    port = import_mlx_port()
    target, tokenizer = port.load(target_path)
    return target, tokenizer, port.load_draft(draft_path) if draft_path else None


def collect(ctx: Context, stream: Callable[[list[int], int], Iterator]) -> Run:
    """Gathers a stream of responses into a `Generation`. The first response carries the prefill's token, so it
    starts no verify step; mlx-lm yields one token per response (`token`), the port one round (`tokens`, `accepted`)."""

    def run(input_ids, max_new_tokens: int) -> Generation:
        import mlx.core as mx

        mx.random.seed(ctx.seed)
        tokens, lengths, first = [], [], None
        for index, response in enumerate(stream(input_ids[0].tolist(), max_new_tokens)):
            first = first or time.perf_counter()
            tokens += getattr(response, "tokens", None) or [response.token]
            if index:
                lengths.append(getattr(response, "accepted", 0) + 1)
        return Generation(tokens, lengths, first)

    return run


def sampler(ctx: Context):
    from mlx_lm.sample_utils import make_sampler

    return make_sampler(temp=ctx.temperature)


def mlx_plain(ctx: Context, block_size: int | None) -> Run:
    """The MLX baseline: mlx-lm's own `stream_generate` without a draft."""
    from mlx_lm import stream_generate

    sample = sampler(ctx)
    return collect(ctx, lambda ids, n: stream_generate(ctx.target, ctx.tokenizer, ids, max_tokens=n, sampler=sample))


def mlx_dflash(ctx: Context, block_size: int | None, **options) -> Run:
    """The DFlash port at `block_size`; `options` (`tree_budget`, `prompt_lookup_num_tokens`) go to its
    `stream_generate`, where None follows the draft's config, as the shipped defaults."""
    require_draft(ctx)
    port, sample = import_mlx_port(), sampler(ctx)
    return collect(
        ctx,
        lambda ids, n: port.stream_generate(
            ctx.target, ctx.draft, ctx.tokenizer, ids, block_size=block_size, max_tokens=n, sampler=sample, **options
        ),
    )


MLX_METHODS = {
    "mlx-plain": mlx_plain,
    "mlx-dflash": mlx_dflash,
    "mlx-dflash-chain": functools.partial(mlx_dflash, tree_budget=0, prompt_lookup_num_tokens=0),
    # one method per --tree-budget, named mlx-dflash-tree<N>: the draft's tree alone, no lookup branch
    "mlx-dflash-tree": functools.partial(mlx_dflash, prompt_lookup_num_tokens=0),
}
