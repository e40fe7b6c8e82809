"""Throughput by batch size (`python -m bench --batch-size 1,4,16`): batched DFlash (`spec_generate` on left-padded
prompts) against plain batched `target.generate` on the same batches, and against `spec_generate` called one prompt
at a time (its shipped defaults), all on the same prompts (first turns) in one run.

The batched DFlash loop is measured twice: with the draft config's trees as shipped (a fixed size), and with each
round's trees cut to what their verify costs on this machine (`tree_sizing="cost"`).

Tokens per second count each row's new tokens up to its end (its first stop token, or `max_new_tokens`), never
the padding after it. Every DFlash row is compared with plain batched `generate`'s row and with the same prompt's
one-at-a-time `spec_generate` output: in float32 all three are plain greedy decoding, so the run exits 1 on any
difference; in bfloat16 a row may leave plain batched decoding only at a rounding tie (`common.exactness`, as the
single-row bench checks it), and the run exits 1 on any other difference.
"""

import datetime
import functools
import sys
import time

import torch

from bench.datasets import load_prompts
from bench.harness import encode, truncate
from bench.report import first_call, save_figure, tau_estimate
from common.exactness import explained
from common.io import write_json_atomic, write_text_atomic


def left_padded(prompts: list[torch.Tensor], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(p.shape[1] for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - p.shape[1] :], mask[row, width - p.shape[1] :] = p[0], 1
    return ids, mask


def timed(call, *args, **kwargs) -> tuple[object, float]:
    start = time.perf_counter()
    out = call(*args, **kwargs)
    return out, time.perf_counter() - start


def one_at_a_time(draft, target, prompts, max_new_tokens, stops) -> tuple[list[list[int]], float]:
    outputs, seconds = [], 0.0
    for ids in prompts:
        out, took = timed(draft.spec_generate, target, ids, max_new_tokens=max_new_tokens)
        outputs.append(truncate(out[0, ids.shape[1] :].tolist(), stops, max_new_tokens))
        seconds += took
    return outputs, seconds


def batched(draft, target, prompts, batch_size, max_new_tokens, stops, pad) -> dict:
    """Plain batched `generate` and both DFlash sizings over `prompts` in groups of `batch_size`: each one's new
    rows and seconds, each timed after a first two-token call per row count (a cost-sized call measures t(n) for
    its row count there, once per process), whose seconds are kept apart."""
    result = {"plain": [[], 0.0], "dflash": [[], 0.0], "cost": [[], 0.0], "row_lengths": [], "first_call_seconds": {}}
    result["cost_rounds"] = []  # the cost-sized call's (estimate, acceptance) of each round that verified nodes
    spec_generate = functools.partial(draft.spec_generate, target)
    methods = (
        ("plain", target.generate, {"do_sample": False, "pad_token_id": pad}),
        ("dflash", spec_generate, {}),
        ("cost", spec_generate, {"tree_sizing": "cost", "tree_budget": cost_budget(draft), "return_stats": True}),
    )
    groups = [prompts[first : first + batch_size] for first in range(0, len(prompts), batch_size)]
    for group in {len(group): group for group in groups}.values():  # each row count's one-off work, untimed
        ids, mask = left_padded(group, pad)
        for name, call, kwargs in methods:
            _, took = timed(call, ids, attention_mask=mask, max_new_tokens=2, **kwargs)
            result["first_call_seconds"].setdefault(name, []).append(took)
    for group in groups:
        ids, mask = left_padded(group, pad)
        for name, call, kwargs in methods:
            out, took = timed(call, ids, attention_mask=mask, max_new_tokens=max_new_tokens, **kwargs)
            if name == "cost":
                result["cost_rounds"] += verified_rounds(out)
                out = out.output_ids
            rows = [truncate(row, stops, max_new_tokens) for row in out[:, ids.shape[1] :].tolist()]
            result[name][0] += rows
            result[name][1] += took
        result["row_lengths"].append([len(r) for r in result["dflash"][0][-len(group) :]])
    return result


def per_row(values: list) -> list[list]:
    """A call's per-round stats as one list per row: one row's call gives its rounds' list itself."""
    return [values] if values and not isinstance(values[0], list) else values


def pad_token(tokenizer, stops: list[int]) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]


def verified_rounds(stats) -> list[tuple[float, int]]:
    """Each row's rounds that verified drafted nodes, as (expected, measured) acceptance length: those whose estimate
    is above the bonus token's 1 (a plain step is 1 and 1, which would flatter the estimate)."""
    accepted, expected = per_row(stats.acceptance_lengths), per_row(stats.expected_acceptance_lengths)
    return [(e, a) for row, row_expected in zip(accepted, expected) for a, e in zip(row, row_expected) if e > 1]


def cost_budget(draft) -> int:
    """The most nodes a cost-sized tree may keep: the config's tree, or a block's worth where it verifies chains."""
    return draft.config.tree_budget or draft.config.block_size - 1


def untied(target, prompts, rows: list[list[int]], reference: list[list[int]]) -> int:
    """How many rows leave `reference` other than at a rounding tie (in float32 every difference counts)."""
    if target.dtype == torch.float32:
        return differing(rows, reference)
    return sum(
        not explained(target, ids[0].tolist(), row, ref)[1]
        for ids, row, ref in zip(prompts, rows, reference)
        if row != ref
    )


def differing(rows: list[list[int]], reference: list[list[int]]) -> int:
    return sum(a != b for a, b in zip(rows, reference, strict=True))


def mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def tokens_per_second(rows: list[list[int]], seconds: float) -> float:
    return sum(map(len, rows)) / seconds


def measure(target, tokenizer, draft, args, stops: list[int]) -> dict:
    pad = pad_token(tokenizer, stops)
    prompts = [
        encode(tokenizer, [{"role": "user", "content": row["turns"][0]}])
        for name in args.dataset.split(",")
        for row in load_prompts(name, args.max_samples or None)
    ]
    draft.spec_generate(target, prompts[0], max_new_tokens=8)  # warm-up
    alone, alone_seconds = one_at_a_time(draft, target, prompts, args.max_new_tokens, stops)
    rows = []
    for size in args.batch_size:
        run = batched(draft, target, prompts, size, args.max_new_tokens, stops, pad)
        sized = [run["dflash"][0], run["cost"][0]]
        rows.append(
            {
                "batch_size": size,
                "dflash_tokens_per_second": tokens_per_second(*run["dflash"]),
                "cost_sized_tokens_per_second": tokens_per_second(*run["cost"]),
                "plain_tokens_per_second": tokens_per_second(*run["plain"]),
                "one_at_a_time_tokens_per_second": tokens_per_second(alone, alone_seconds),
                "rows_differing_from_plain": sum(differing(r, run["plain"][0]) for r in sized),
                "rows_differing_from_one_at_a_time": sum(differing(r, alone) for r in sized),
                "rows_differing_from_plain_not_at_a_tie": sum(
                    untied(target, prompts, r, run["plain"][0]) for r in sized
                ),
                "row_lengths": run["row_lengths"],
                "first_call_seconds": run["first_call_seconds"],
                "cost_sized_rounds_with_nodes": len(run["cost_rounds"]),
                "cost_sized_expected_tau": mean([e for e, _ in run["cost_rounds"]]),
                "cost_sized_measured_tau": mean([a for _, a in run["cost_rounds"]]),
            }
        )
    return {"prompts": len(prompts), "rows": rows}


def table(result: dict) -> str:
    lines = [
        "batch | DFlash tok/s | cost-sized tok/s | plain batched tok/s | DFlash vs plain | cost-sized vs plain | "
        "DFlash vs one prompt at a time | rows differing from plain (not at a tie) / from one at a time | "
        "shortest / longest row | first call, s: plain / fixed / cost-sized | "
        "cost-sized rounds with nodes: tau estimated / measured (rounds)"
    ]
    for row in result["rows"]:
        lengths = [n for group in row["row_lengths"] for n in group]
        alone, plain = row["one_at_a_time_tokens_per_second"], row["plain_tokens_per_second"]
        lines.append(
            f"{row['batch_size']:>5} | {row['dflash_tokens_per_second']:12.2f} | "
            f"{row['cost_sized_tokens_per_second']:16.2f} | {plain:19.2f} | "
            f"{row['dflash_tokens_per_second'] / plain:14.2f}x | "
            f"{row['cost_sized_tokens_per_second'] / plain:18.2f}x | "
            f"{row['dflash_tokens_per_second'] / alone:29.2f}x | "
            f"{row['rows_differing_from_plain']:>5} ({row['rows_differing_from_plain_not_at_a_tie']}) / "
            f"{row['rows_differing_from_one_at_a_time']:<5} | {min(lengths)} / {max(lengths)} | {first_call(row)} | "
            f"{tau_estimate(row)}"
        )
    lines.append(
        "one prompt at a time (spec_generate, shipped defaults): "
        f"{result['rows'][0]['one_at_a_time_tokens_per_second']:.2f} tok/s"
    )
    return "\n".join(lines)


def plot(result: dict, path) -> None:
    import matplotlib.pyplot as plt

    sizes = [row["batch_size"] for row in result["rows"]]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(sizes, [r["dflash_tokens_per_second"] for r in result["rows"]], marker="o", label="DFlash, fixed trees")
    ax.plot(
        sizes, [r["cost_sized_tokens_per_second"] for r in result["rows"]], marker="o", label="DFlash, cost-sized trees"
    )
    ax.plot(sizes, [r["plain_tokens_per_second"] for r in result["rows"]], marker="o", label="plain generate, batched")
    ax.axhline(
        result["rows"][0]["one_at_a_time_tokens_per_second"],
        color="grey",
        linestyle="--",
        label="DFlash, one prompt at a time",
    )
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(s) for s in sizes])
    ax.minorticks_off()
    ax.set(xlabel="batch size", ylabel="tokens / s", title="Throughput by batch size")
    ax.legend(fontsize="small")
    save_figure(fig, path)
    plt.close(fig)


def run(args, argv: list[str], target, tokenizer, draft, stops: list[int]) -> int:
    """Measures, writes results.json, summary.txt and throughput.png to `args.out`; 1 when a row differs other than
    at a bfloat16 rounding tie."""
    from bench.run import environment  # bench.run imports this module when it runs a batch

    result = measure(target, tokenizer, draft, args, stops)
    float32 = args.dtype == "float32"
    wrong = sum(
        r["rows_differing_from_plain"] + r["rows_differing_from_one_at_a_time"]
        if float32
        else r["rows_differing_from_plain_not_at_a_tie"]
        for r in result["rows"]
    )
    result.update(
        tool="bench --batch-size",
        command=["python", "-m", "bench", *argv],
        dtype=args.dtype,
        environment=environment(),
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        exit_status=int(wrong > 0),
    )
    write_json_atomic(args.out / "results.json", result)
    write_text_atomic(args.out / "summary.txt", table(result) + "\n")
    plot(result, args.out / "throughput.png")
    print(table(result))
    if result["exit_status"]:
        what = "float32 row(s) differ from plain batched or one-at-a-time decoding"
        print(
            f"FAIL: {wrong} {what if float32 else 'row(s) leave plain batched decoding not at a tie'}", file=sys.stderr
        )
    print(f"wrote {args.out / 'results.json'}, summary.txt, throughput.png")
    return result["exit_status"]
