"""One timing harness for every method: warm-up, interleaved prompts, per-turn records.

A record is one assistant turn of one prompt under one method and block size; MT-Bench's second turn is asked
after the method's own first answer, so each method holds its own conversation.
"""

import hashlib
import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from bench.methods import Context, Generation, Run, Unavailable, synchronize
from common.exactness import explained, first_difference
from configuration_dflash import first_stop

WARMUP_TOKENS = 16
Turn = tuple[dict, list[int], list[int]]  # a record, its output tokens and its input ids


@dataclass
class Variant:
    """A method at one block size (None for methods that have none)."""

    method: str
    block_size: int | None
    run: Run

    @property
    def label(self) -> str:
        return self.method if self.block_size is None else f"{self.method}@b{self.block_size}"


# ---------------------------------------------------------------------------------------------------------------------
# Measurements


def reset_peak_rss() -> None:
    """Resets the kernel's peak-RSS counter (VmHWM) to the current RSS (Linux >= 4.0); a no-op elsewhere."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_rss_mib() -> float:
    """Peak resident memory since the last reset, from /proc (else the process-lifetime peak from getrusage)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024
    except (OSError, StopIteration):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def truncate(tokens: list[int], stop_token_ids: list[int], max_new_tokens: int) -> list[int]:
    """Output as a user sees it: up to and including the first stop token, at most `max_new_tokens`."""
    return tokens[: min(first_stop(tokens, set(stop_token_ids)) or len(tokens), max_new_tokens)]


def encode(tokenizer, messages: list[dict], device="cpu") -> torch.Tensor:
    """`[1, L]` ids of a conversation under the target's chat template, ready for the assistant's turn."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return torch.tensor([tokenizer.encode(text, add_special_tokens=False)], device=device)


def timed(run: Run, input_ids: torch.Tensor, max_new_tokens: int) -> tuple[Generation, float, float]:
    """(generation, seconds, peak RSS MiB) of one call, with the device's queued work inside the timer."""
    reset_peak_rss()
    synchronize(input_ids.device)
    start = time.perf_counter()
    generation = run(input_ids, max_new_tokens)
    synchronize(input_ids.device)
    seconds = time.perf_counter() - start
    if generation.first_token_time is not None:
        generation.first_token_time -= start
    return generation, seconds, peak_rss_mib()


def token_hash(tokens: list[int]) -> str:
    return hashlib.sha1(",".join(map(str, tokens)).encode()).hexdigest()[:16]


def measure_turn(
    ctx: Context, variant: Variant, input_ids: torch.Tensor, max_new_tokens: int
) -> tuple[dict, list[int]]:
    """One record (every per-turn figure) and the output tokens."""
    generation, seconds, peak = timed(variant.run, input_ids, max_new_tokens)
    tokens = truncate(generation.new_tokens, ctx.stop_token_ids, max_new_tokens)
    record = {
        "method": variant.method,
        "block_size": variant.block_size,
        "input_tokens": int(input_ids.shape[1]),
        "output_tokens": len(tokens),
        "seconds": seconds,
        "tokens_per_second": len(tokens) / seconds if seconds > 0 else 0.0,
        "ttft_seconds": generation.first_token_time,
        "acceptance_lengths": generation.acceptance_lengths,
        "peak_rss_mib": peak,
        "output_sha1": token_hash(tokens),
    }
    return record, tokens


def run_conversation(ctx: Context, variant: Variant, prompt: dict, max_new_tokens: int) -> list[Turn]:
    """All turns of one prompt as one conversation; the method's own answers become the history."""
    messages, results = [], []
    for turn, text in enumerate(prompt["turns"]):
        messages.append({"role": "user", "content": text})
        input_ids = encode(ctx.tokenizer, messages, ctx.device)
        record, tokens = measure_turn(ctx, variant, input_ids, max_new_tokens)
        record.update(prompt_id=prompt["id"], turn=turn)
        results.append((record, tokens, input_ids[0].tolist()))
        messages.append({"role": "assistant", "content": ctx.tokenizer.decode(tokens, skip_special_tokens=True)})
    return results


# ---------------------------------------------------------------------------------------------------------------------
# The loop


def warm_up(ctx: Context, variants: list[Variant], prompt: dict, baseline: str) -> tuple[list[Variant], list[dict]]:
    """Runs each variant once on a short generation; optional methods that fail are skipped with the reason."""
    ready, skipped = [], []
    ids = encode(ctx.tokenizer, [{"role": "user", "content": prompt["turns"][0]}], ctx.device)
    for variant in tqdm(variants, desc="warm-up", leave=False):
        try:
            variant.run(ids, WARMUP_TOKENS)
            ready.append(variant)
        except Exception as error:  # noqa: BLE001 - any failure of an optional method is reported, not fatal
            if variant.method == baseline:
                raise
            skipped.append(
                {
                    "method": variant.method,
                    "block_size": variant.block_size,
                    "reason": f"warm-up failed: {type(error).__name__}: {error}",
                }
            )
    return ready, skipped


def rotated(items: list, shift: int) -> list:
    """Interleaving: each prompt starts with a different method, so no method always runs first."""
    shift %= max(len(items), 1)
    return items[shift:] + items[:shift]


def mark_mismatches(ctx: Context, results: list[Turn], baseline: str) -> None:
    """Sets `matches_plain`, `first_mismatch`, `logit_gap` and `rounding_tie` on every record (see `bench.report`).

    None when sampling, and for a later turn whose conversation already left the baseline's (its input differs)."""
    reference = {(r["prompt_id"], r["turn"]): (t, i) for r, t, i in results if r["method"] == baseline}
    for record, tokens, input_ids in results:
        record.update(matches_plain=None, first_mismatch=None, logit_gap=None, rounding_tie=None)
        ref_tokens, ref_input = reference.get((record["prompt_id"], record["turn"]), (None, None))
        if ctx.temperature > 0 or ref_tokens is None or input_ids != ref_input:
            continue
        record.update(matches_plain=tokens == ref_tokens, first_mismatch=first_difference(tokens, ref_tokens))
        if tokens != ref_tokens and isinstance(ctx.target, torch.nn.Module):  # MLX targets: any difference fails
            found, tie = explained(ctx.target, input_ids, tokens, ref_tokens)
            record.update(logit_gap=found.gap, rounding_tie=tie)


def run_dataset(
    ctx: Context, variants: list[Variant], dataset: str, prompts: list[dict], max_new_tokens: int, baseline: str
) -> list[dict]:
    """Every variant on every prompt, interleaved; returns the records of this dataset."""
    results = []
    bar = tqdm(total=len(prompts) * len(variants), desc=dataset, unit="run")
    for index, prompt in enumerate(prompts):
        for variant in rotated(variants, index):
            bar.set_postfix_str(variant.label)
            results += run_conversation(ctx, variant, prompt, max_new_tokens)
            bar.update()
    bar.close()
    mark_mismatches(ctx, results, baseline)
    return [dict(record, dataset=dataset) for record, _, _ in results]


def build_variants(
    ctx: Context, factories: dict, methods: list[str], block_sizes: list[int], block_free: set[str]
) -> tuple[list[Variant], list[dict]]:
    """One variant per method and block size; methods that cannot run here are skipped with the reason."""
    variants, skipped = [], []
    for method in methods:
        for block_size in [None] if method in block_free else block_sizes:
            try:
                variants.append(Variant(method, block_size, factories[method](ctx, block_size)))
            except Unavailable as reason:
                skipped.append({"method": method, "block_size": block_size, "reason": str(reason)})
    return variants, skipped
