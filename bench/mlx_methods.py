"""The MLX backend: mlx-lm's plain `stream_generate` against the DFlash port, `mlx_port.stream_generate`.

Imported only with `--backend mlx`; every import of mlx happens inside a function, so a machine without MLX gets a
clean `Unavailable` instead of an ImportError.
"""

import inspect
import time

from bench.methods import Context, Generation, Run, Unavailable, require_draft


def import_mlx_port():
    try:
        import mlx_port
    except ImportError as error:
        raise Unavailable(f"mlx_port is not importable ({error})") from error
    missing = [name for name in ("load", "load_draft", "stream_generate") if not hasattr(mlx_port, name)]
    if missing:
        raise Unavailable(f"mlx_port has no {', '.join(missing)} yet")
    return mlx_port


def load_mlx(target_path: str, draft_path: str | None):
    """(target, tokenizer, draft) through the port; `draft` is None when `draft_path` is None."""
    port = import_mlx_port()
    target, tokenizer = port.load(target_path)
    return target, tokenizer, port.load_draft(draft_path) if draft_path else None


def acceptance_from_flags(from_draft: list[bool]) -> list[int]:
    """Per-step acceptance lengths from per-token `from_draft` flags: each step is drafted tokens then one target token.

    The first token comes from the prefill and is not a step, as in the torch methods.
    """
    lengths, run = [], 0
    for flag in from_draft[1:]:
        run += 1
        if not flag:
            lengths.append(run)
            run = 0
    return lengths + ([run] if run else [])


def mlx_stream(ctx: Context, stream_generate, **extra) -> Run:
    """Collects every token of a `stream_generate` call, noting when the first one arrived."""
    from mlx_lm.sample_utils import make_sampler

    sampler = make_sampler(temp=ctx.temperature)

    def run(input_ids, max_new_tokens: int) -> Generation:
        import mlx.core as mx

        mx.random.seed(ctx.seed)
        tokens, flags, first = [], [], None
        for response in stream_generate(ctx.target, ctx.tokenizer, input_ids[0].tolist(), max_tokens=max_new_tokens, sampler=sampler, **extra):
            first = first or time.perf_counter()
            tokens.append(int(response.token))
            flags.append(bool(getattr(response, "from_draft", False)))
        return Generation(tokens, acceptance_from_flags(flags), first)

    return run


def mlx_plain(ctx: Context, block_size: int | None) -> Run:
    """The MLX baseline: mlx-lm's own `stream_generate` without a draft."""
    from mlx_lm import stream_generate

    return mlx_stream(ctx, stream_generate)


def mlx_dflash(ctx: Context, block_size: int | None) -> Run:
    """The DFlash port; `block_size` is passed when its `stream_generate` takes one."""
    require_draft(ctx)
    port = import_mlx_port()
    extra = {"block_size": block_size} if "block_size" in inspect.signature(port.stream_generate).parameters else {}
    return mlx_stream(ctx, port.stream_generate, draft_model=ctx.draft, **extra)


MLX_METHODS = {"mlx-plain": mlx_plain, "mlx-dflash": mlx_dflash}
