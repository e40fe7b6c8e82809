"""Summaries, the printed table, the JSON file and the PNG plots.

JSON schema (`schema_version` 2; keys are only ever added, under a new version; 2 added the divergence fields):
- `schema_version` (int), `tool` ("bench"), `created` (UTC ISO time), `command` (argv), `exit_status` (0, or 1 when
  an output differs from plain greedy decoding at temperature 0 other than at a rounding tie in bfloat16/float16, or
  a method asked for by name could not run);
- `config`: the run's settings, including `seed`, `temperature`, `block_sizes`, `max_new_tokens`, `max_samples`;
- `environment`: python, torch, transformers and mlx versions, platform, CPU threads;
- `models`: `target` and `draft` paths (null for the embedded default) and parameter counts;
- `skipped`: `[{method, block_size, reason}]` for methods that could not run here;
- `summary`: one row per dataset, method and block size: `dataset`, `method`, `block_size` (null for block-free
  methods), `samples`, `output_tokens`, `seconds`, `tokens_per_second` (total tokens / total seconds), `speedup`
  (against the baseline on the same dataset), `mean_acceptance_length` (tau, counting the bonus token),
  `acceptance_histogram` (entry i counts verify steps with tau = i + 1), `mean_ttft_seconds`, `peak_rss_mib` (max
  over calls), `mismatches` (outputs differing from the baseline; null when sampling), `failures` (those not at a
  rounding tie: every one in float32), `first_divergence` (the earliest differing token index, or null),
  `max_logit_gap` (the largest top-2 logit gap at a divergence, or null);
- `records`: one per dataset, method, block size, prompt and turn: `dataset`, `method`, `block_size`, `prompt_id`,
  `turn`, `input_tokens`, `output_tokens`, `seconds`, `tokens_per_second`, `ttft_seconds`, `acceptance_lengths`
  (per verify step), `peak_rss_mib`, `output_sha1`, `matches_plain`, `first_mismatch`, `logit_gap` (the target's
  gap between the two tokens at the first mismatch, one full pass over the shared prefix in its dtype) and
  `rounding_tie` (that gap is within a few ulps in bfloat16/float16, and so is every later token of ours below the
  target's argmax, teacher-forced over our whole output; `common.exactness`). The comparison fields are
  null when sampling, and for a later turn whose conversation already left the baseline's.
"""

import io
from collections import defaultdict
from pathlib import Path

from common.io import write_bytes_atomic

SCHEMA_VERSION = 2
SUMMARY_KEYS = (
    "dataset",
    "method",
    "block_size",
    "samples",
    "output_tokens",
    "seconds",
    "tokens_per_second",
    "speedup",
    "mean_acceptance_length",
    "acceptance_histogram",
    "mean_ttft_seconds",
    "peak_rss_mib",
    "mismatches",
    "failures",
    "first_divergence",
    "max_logit_gap",
)


def histogram(lengths: list[int], block_size: int | None) -> list[int]:
    """Counts of each acceptance length 1..max(block_size, longest seen)."""
    counts = [0] * max(block_size or 1, max(lengths, default=1))
    for length in lengths:
        counts[length - 1] += 1
    return counts


def summarize_group(records: list[dict]) -> dict:
    """Totals of one dataset, method and block size."""
    first = records[0]
    lengths = [n for r in records for n in (r["acceptance_lengths"] or [])]
    ttfts = [r["ttft_seconds"] for r in records if r["ttft_seconds"] is not None]
    compared = [r for r in records if r["matches_plain"] is not None]
    differing = [r for r in compared if not r["matches_plain"]]
    gaps = [r["logit_gap"] for r in differing if r["logit_gap"] is not None]
    tokens, seconds = sum(r["output_tokens"] for r in records), sum(r["seconds"] for r in records)
    return {
        "dataset": first["dataset"],
        "method": first["method"],
        "block_size": first["block_size"],
        "samples": len(records),
        "output_tokens": tokens,
        "seconds": seconds,
        "tokens_per_second": tokens / seconds if seconds > 0 else 0.0,
        "speedup": None,
        "mean_acceptance_length": sum(lengths) / len(lengths) if lengths else None,
        "acceptance_histogram": histogram(lengths, first["block_size"]),
        "mean_ttft_seconds": sum(ttfts) / len(ttfts) if ttfts else None,
        "peak_rss_mib": max(r["peak_rss_mib"] for r in records),
        "mismatches": len(differing) if compared else None,
        "failures": sum(not r["rounding_tie"] for r in differing) if compared else None,
        "first_divergence": min((r["first_mismatch"] for r in differing), default=None),
        "max_logit_gap": max(gaps, default=None),
    }


def summarize(records: list[dict], baseline: str) -> list[dict]:
    """Summary rows in first-seen order, with speedups against the baseline of the same dataset."""
    groups = defaultdict(list)
    for record in records:
        groups[record["dataset"], record["method"], record["block_size"]].append(record)
    rows = [summarize_group(group) for group in groups.values()]
    base = {r["dataset"]: r["tokens_per_second"] for r in rows if r["method"] == baseline}
    for row in rows:
        row["speedup"] = row["tokens_per_second"] / base[row["dataset"]] if base.get(row["dataset"]) else None
    return rows


def total_failures(rows: list[dict]) -> int:
    """Outputs that differ from the baseline's other than at a rounding tie."""
    return sum(row["failures"] or 0 for row in rows)


# ---------------------------------------------------------------------------------------------------------------------
# Text


def fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def differ(row: dict) -> str:
    """Outputs that differ from the baseline's (those beyond a rounding tie in brackets), or 'sampled' where sampled
    outputs are not compared."""
    if row["mismatches"] is None:
        return "sampled"
    failed = f" ({row['failures']} not ties)" if row["failures"] else ""
    return f"{row['mismatches']}/{row['samples']}{failed}"


def one_line(row: dict) -> str:
    """gpt-fast-style summary of one method."""
    label = row["method"] if row["block_size"] is None else f"{row['method']} (block {row['block_size']})"
    return (
        f"{row['dataset']} | {label}: {fmt(row['tokens_per_second'], '.2f')} tok/s, "
        f"{fmt(row['speedup'], '.2f')}x vs plain, tokens per target pass {fmt(row['mean_acceptance_length'], '.2f')}, "
        f"TTFT {fmt(row['mean_ttft_seconds'], '.3f')} s, "
        f"peak RSS {row['peak_rss_mib']:.0f} MiB, outputs differing: {differ(row)}, first at token "
        f"{fmt(row['first_divergence'], 'd')}, largest logit gap there {fmt(row['max_logit_gap'], '.3g')}"
    )


def table(rows: list[dict]) -> str:
    """A fixed-width table of the summary rows."""
    header = (
        "dataset",
        "method",
        "block",
        "tok/s",
        "speedup",
        "tok/pass",
        "TTFT s",
        "RSS MiB",
        "differ",
        "1st div",
        "max gap",
    )
    lines = [
        (
            r["dataset"],
            r["method"],
            fmt(r["block_size"], "d"),
            fmt(r["tokens_per_second"], ".2f"),
            fmt(r["speedup"], ".2f"),
            fmt(r["mean_acceptance_length"], ".2f"),
            fmt(r["mean_ttft_seconds"], ".3f"),
            f"{r['peak_rss_mib']:.0f}",
            differ(r),
            fmt(r["first_divergence"], "d"),
            fmt(r["max_logit_gap"], ".3g"),
        )
        for r in rows
    ]
    widths = [max(len(str(c)) for c in col) for col in zip(header, *lines)]
    return "\n".join("  ".join(str(c).rjust(w) for c, w in zip(line, widths)) for line in [header, *lines])


def caption(result: dict) -> str:
    """What a docs table was measured with: the command, the dtype, the CPU and threads, the versions."""
    env = result["environment"]
    dtype = result.get("dtype") or result["config"]["dtype"]
    return (
        f"`{' '.join(result['command'])}`: {dtype}, {env['cpu']}, {env['torch_threads']} torch thread(s), "
        f"torch {env['torch']}, transformers {env['transformers']}"
    )


def markdown(result: dict) -> str:
    """The docs' table of a result file: one row per dataset and method (`bench`), or per batch size
    (`bench --batch-size`)."""
    if result.get("tool") == "bench --batch-size":
        return batch_markdown(result)
    lines = [
        "| dataset | method | tok/s | vs plain | tokens per target pass | outputs differing from plain |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["summary"]:
        method = r["method"] if r["block_size"] is None else f"{r['method']} (block {r['block_size']})"
        lines.append(
            f"| {r['dataset']} | {method} | {fmt(r['tokens_per_second'], '.2f')} | {fmt(r['speedup'], '.2f')}x | "
            f"{fmt(r['mean_acceptance_length'], '.2f')} | {differ(r)} |"
        )
    return "\n".join(lines)


def batch_markdown(result: dict) -> str:
    lines = [
        "| batch | DFlash tok/s | cost-sized tok/s | plain batched tok/s | DFlash vs plain | cost-sized vs plain | "
        "vs one prompt at a time | rows differing from plain (not at a tie) / one at a time | "
        "first call, s: plain / fixed / cost-sized | cost-sized rounds with nodes: tau estimated / measured (rounds) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        alone, dflash, plain = (
            r["one_at_a_time_tokens_per_second"],
            r["dflash_tokens_per_second"],
            r["plain_tokens_per_second"],
        )
        cost = r["cost_sized_tokens_per_second"]
        lines.append(
            f"| {r['batch_size']} | {dflash:.2f} | {cost:.2f} | {plain:.2f} | {dflash / plain:.2f}x | "
            f"{cost / plain:.2f}x | {dflash / alone:.2f}x | {r['rows_differing_from_plain']} "
            f"({r['rows_differing_from_plain_not_at_a_tie']}) / {r['rows_differing_from_one_at_a_time']} | "
            f"{first_call(r)} | {tau_estimate(r)} |"
        )
    return "\n".join(lines)


FIRST_CALLS = ("plain", "dflash", "cost")  # the batch bench's methods, in its table's order


def first_call(row: dict) -> str:
    """The untimed first call's seconds per row count, plain / fixed / cost-sized (the prefill included; a
    cost-sized call also measures t(n) there); "-" for a run that timed it with the rest."""
    seconds = row.get("first_call_seconds")
    if not seconds:
        return "-"
    return ", ".join(" / ".join(f"{s:.1f}" for s in calls) for calls in zip(*(seconds[m] for m in FIRST_CALLS)))


def tau_estimate(row: dict) -> str:
    """The cost sizer's mean estimate of tau against the measured mean, over its rounds that verified nodes, and
    their count; "-" for a run that did not record them."""
    if row.get("cost_sized_measured_tau") is None:
        return "-"
    return (
        f"{row['cost_sized_expected_tau']:.2f} / {row['cost_sized_measured_tau']:.2f} "
        f"({row['cost_sized_rounds_with_nodes']})"
    )


def main(argv: list[str] | None = None) -> int:
    """`python -m bench.report FILE.json ... [--plots DIR]`: each file's docs table, under the command that measured
    it; with `--plots`, its plots too."""
    import argparse
    import json

    parser = argparse.ArgumentParser(prog="python -m bench.report", description=main.__doc__.split(": ")[1])
    parser.add_argument("files", nargs="+", help="results.json files written by `python -m bench`")
    parser.add_argument("--plots", type=Path, help="write each file's plots here, named after the file")
    args = parser.parse_args(argv)
    for path in map(Path, args.files):
        result = json.loads(path.read_text(encoding="utf-8"))
        print(f"{caption(result)}\n\n{markdown(result)}\n")
        if args.plots:
            for written in plot_result(result, args.plots, path.stem):
                print(f"wrote {written}")
    return 0


def plot_result(result: dict, folder: Path, stem: str) -> list[Path]:
    """A result file's plots, as the bench run drew them: throughput by batch size (`bench --batch-size`), or the
    speed-up and acceptance histograms (`bench`)."""
    folder.mkdir(parents=True, exist_ok=True)
    if result.get("tool") == "bench --batch-size":
        from bench.batch import plot  # bench.batch imports this module

        plot(result, folder / f"{stem}-throughput.png")
        return [folder / f"{stem}-throughput.png"]
    plot_speedup(result["summary"], folder / f"{stem}-speedup.png")
    plot_histograms(result["summary"], folder / f"{stem}-acceptance.png")
    return [folder / f"{stem}-speedup.png", folder / f"{stem}-acceptance.png"]


# ---------------------------------------------------------------------------------------------------------------------
# Plots


def save_figure(fig, path) -> None:
    """PNG bytes in memory first, then an atomic write."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=120, bbox_inches="tight")
    write_bytes_atomic(path, buffer.getvalue())


def plot_histograms(rows: list[dict], path) -> None:
    """Share of verify steps by acceptance length, one panel per dataset, one bar group per speculative method."""
    import matplotlib.pyplot as plt

    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    fig, axes = plt.subplots(len(datasets), 1, figsize=(8, 3 * len(datasets)), squeeze=False)
    for ax, dataset in zip(axes[:, 0], datasets):
        spec = [
            r
            for r in rows
            if r["dataset"] == dataset and r["block_size"] is not None and sum(r["acceptance_histogram"])
        ]
        width = 0.8 / max(len(spec), 1)
        for i, row in enumerate(spec):
            counts, total = row["acceptance_histogram"], sum(row["acceptance_histogram"])
            offset = (i - (len(spec) - 1) / 2) * width  # bar groups centred on each integer length
            ax.bar(
                [k + 1 + offset for k in range(len(counts))],
                [c / total for c in counts],
                width,
                label=f"{row['method']} b{row['block_size']}",
            )
        ax.set_xticks(range(1, max((len(r["acceptance_histogram"]) for r in spec), default=1) + 1))
        ax.set(
            title=f"{dataset}: acceptance length (tokens per verify step, counting the bonus)",
            xlabel="acceptance length",
            ylabel="share of steps",
        )
        if spec:
            ax.legend(fontsize="small")
    save_figure(fig, path)
    plt.close(fig)


def plot_speedup(rows: list[dict], path) -> None:
    """Speedup against plain decoding by block size, one line per dataset and method."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    lines = defaultdict(list)
    for row in rows:
        if row["block_size"] is not None and row["speedup"] is not None:
            lines[row["dataset"], row["method"]].append((row["block_size"], row["speedup"]))
    for (dataset, method), points in lines.items():
        xs, ys = zip(*sorted(points))
        ax.plot(xs, ys, marker="o", label=f"{dataset} / {method}")
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="block size", ylabel="speedup vs plain", title="Speedup by block size and dataset")
    ax.set_xticks(sorted({x for points in lines.values() for x, _ in points}) or [1])
    ax.xaxis.set_major_formatter(plt.matplotlib.ticker.ScalarFormatter())
    ax.minorticks_off()
    if lines:
        ax.legend(fontsize="small")
    save_figure(fig, path)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
