"""Throughput by batch size (`python -m bench --batch-size 1,4,16`): batched DFlash (`spec_generate` on left-padded
prompts) against plain batched `target.generate` on the same batches, and against `spec_generate` called one prompt
at a time (its shipped defaults), all on the same prompts (first turns) in one run.

The batched DFlash loop is measured twice: as shipped (each row keeps its own acceptance, rejected keys become
holes) and with every row held to the batch's shortest acceptance (no holes), the simple alternative.

Tokens per second count each row's new tokens up to its end (its first stop token, or `max_new_tokens`), never
the padding after it. Every DFlash row is compared with plain batched `generate`'s row and with the same prompt's
one-at-a-time `spec_generate` output; in float32 all three are plain greedy decoding, so the run exits 1 on any
difference.
"""

import datetime
import sys
import time

import torch

from bench.datasets import load_prompts
from bench.harness import encode, truncate
from bench.report import save_figure
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
    """Both batched methods over `prompts` in groups of `batch_size`: new rows and seconds of each."""
    result = {"dflash": [[], 0.0], "aligned": [[], 0.0], "plain": [[], 0.0], "row_lengths": []}
    for first in range(0, len(prompts), batch_size):
        group = prompts[first : first + batch_size]
        ids, mask = left_padded(group, pad)
        plain, took = timed(
            target.generate, ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad
        )
        result["plain"][0] += [truncate(row, stops, max_new_tokens) for row in plain[:, ids.shape[1] :].tolist()]
        result["plain"][1] += took
        out, took = timed(draft.spec_generate, target, ids, attention_mask=mask, max_new_tokens=max_new_tokens)
        rows = [truncate(row, stops, max_new_tokens) for row in out[:, ids.shape[1] :].tolist()]
        result["dflash"][0] += rows
        result["dflash"][1] += took
        result["row_lengths"].append([len(r) for r in rows])
        out, took = timed(
            draft._batched_spec_generate,  # the simple design: no holes, shortest acceptance
            target,
            ids,
            mask,
            max_new_tokens=max_new_tokens,
            stop_token_ids=stops,
            temperature=0.0,
            top_p=1.0,
            top_k=0,
            block_size=draft.config.block_size,
            return_stats=False,
            generator=None,
            align_rows=True,
        )
        result["aligned"][0] += [truncate(row, stops, max_new_tokens) for row in out[:, ids.shape[1] :].tolist()]
        result["aligned"][1] += took
    return result


def differing(rows: list[list[int]], reference: list[list[int]]) -> int:
    return sum(a != b for a, b in zip(rows, reference, strict=True))


def tokens_per_second(rows: list[list[int]], seconds: float) -> float:
    return sum(map(len, rows)) / seconds


def measure(target, tokenizer, draft, args, stops: list[int]) -> dict:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
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
        dflash, plain = run["dflash"], run["plain"]
        rows.append(
            {
                "batch_size": size,
                "dflash_tokens_per_second": tokens_per_second(*dflash),
                "aligned_tokens_per_second": tokens_per_second(*run["aligned"]),
                "plain_tokens_per_second": tokens_per_second(*plain),
                "one_at_a_time_tokens_per_second": tokens_per_second(alone, alone_seconds),
                "rows_differing_from_plain": differing(dflash[0], plain[0]) + differing(run["aligned"][0], plain[0]),
                "rows_differing_from_one_at_a_time": differing(dflash[0], alone) + differing(run["aligned"][0], alone),
                "row_lengths": run["row_lengths"],
            }
        )
    return {"prompts": len(prompts), "rows": rows}


def table(result: dict) -> str:
    lines = [
        "batch | DFlash tok/s | shortest-acceptance tok/s | plain batched tok/s | DFlash vs plain | "
        "DFlash vs one prompt at a time | rows differing from plain / from one at a time | shortest / longest row"
    ]
    for row in result["rows"]:
        lengths = [n for group in row["row_lengths"] for n in group]
        alone = row["one_at_a_time_tokens_per_second"]
        lines.append(
            f"{row['batch_size']:>5} | {row['dflash_tokens_per_second']:12.2f} | "
            f"{row['aligned_tokens_per_second']:25.2f} | {row['plain_tokens_per_second']:19.2f} | "
            f"{row['dflash_tokens_per_second'] / row['plain_tokens_per_second']:14.2f}x | "
            f"{row['dflash_tokens_per_second'] / alone:29.2f}x | "
            f"{row['rows_differing_from_plain']:>5} / {row['rows_differing_from_one_at_a_time']:<5} | "
            f"{min(lengths)} / {max(lengths)}"
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
    ax.plot(sizes, [r["dflash_tokens_per_second"] for r in result["rows"]], marker="o", label="DFlash, batched")
    ax.plot(
        sizes,
        [r["aligned_tokens_per_second"] for r in result["rows"]],
        marker="o",
        label="DFlash, batched, shortest acceptance",
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
    """Measures, writes results.json, summary.txt and throughput.png to `args.out`; 1 when a float32 row differs."""
    from bench.run import environment  # bench.run imports this module when it runs a batch

    result = measure(target, tokenizer, draft, args, stops)
    wrong = sum(r["rows_differing_from_plain"] + r["rows_differing_from_one_at_a_time"] for r in result["rows"])
    result.update(
        tool="bench --batch-size",
        command=["python", "-m", "bench", *argv],
        dtype=args.dtype,
        environment=environment(),
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        exit_status=int(args.dtype == "float32" and wrong > 0),
    )
    write_json_atomic(args.out / "results.json", result)
    write_text_atomic(args.out / "summary.txt", table(result) + "\n")
    plot(result, args.out / "throughput.png")
    print(table(result))
    if result["exit_status"]:
        print(f"FAIL: {wrong} float32 row(s) differ from plain batched or one-at-a-time decoding", file=sys.stderr)
    print(f"wrote {args.out / 'results.json'}, summary.txt, throughput.png")
    return result["exit_status"]
