"""`python -m bench`: DFlash against the baselines users would pick, on the same prompts, in one run."""

import argparse
import datetime
import functools
import platform
import sys
from pathlib import Path

from bench import report
from bench.datasets import BUILTIN, load_prompts
from bench.harness import build_variants, run_dataset, warm_up
from bench.methods import BLOCK_FREE, TORCH_METHODS, Context
from common.checks import check_decoding_args, check_model_path
from common.io import write_json_atomic, write_text_atomic
from default_target import DTYPES, resolve_dtype

REPO_ROOT = Path(__file__).resolve().parents[1]
BASELINE = {"torch": "plain", "mlx": "mlx-plain"}
NO_DRAFT = {"plain", "prompt-lookup", "mlx-plain"}
TREE = {"torch": "spec-generate-tree", "mlx": "mlx-dflash-tree"}  # one method per --tree-budget
CONFIDENT = "spec-generate-confident"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    epilog = (
        f"methods (torch):\n  {', '.join(TORCH_METHODS)}\nmethods (mlx):\n  "
        "mlx-plain, mlx-dflash, mlx-dflash-chain, mlx-dflash-tree"
    )
    p = argparse.ArgumentParser(
        prog="python -m bench", description=__doc__, epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--target", help="target model folder (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--draft", help="DFlash draft folder (default: this repository's root)")
    p.add_argument("--dataset", default="mt-bench", help=f"comma-separated: {', '.join(BUILTIN)} or JSONL paths")
    p.add_argument("--max-samples", type=int, default=20, help="prompts per dataset (default 20; 0 for all)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="new tokens per assistant turn (default 256)")
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0 for greedy, the default (outputs are then checked against plain)",
    )
    p.add_argument("--block-size", type=int, help="draft block size (default: the draft's config)")
    p.add_argument("--sweep-block-size", help="comma-separated block sizes to compare, e.g. 2,4,8,16")
    p.add_argument(
        "--methods",
        help="comma-separated methods, listed below (default: all for the backend; the baseline is always run)",
    )
    p.add_argument(
        "--tree-budget",
        default="16",
        help="comma-separated draft-tree budgets for spec-generate-tree and mlx-dflash-tree (default 16)",
    )
    p.add_argument(
        "--tree-min-prob", type=float, default=0.2, help="spec-generate-confident's tree_min_prob (default 0.2)"
    )
    p.add_argument(
        "--batch-size",
        help="comma-separated batch sizes, e.g. 1,4,16: throughput of batched DFlash and "
        "plain batched generate instead of the methods (bench.batch)",
    )
    p.add_argument(
        "--backend", choices=sorted(BASELINE), default="torch", help="torch (default), or mlx for the MLX port"
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path("results"),
        help="output folder for results.json and the plots (default results)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed reset before every generation (default 0)")
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default="float32",
        help="torch dtype of target and draft (default "
        "float32, where greedy output must be token-identical); auto: bfloat16 where the hardware multiplies "
        "it natively",
    )
    p.add_argument(
        "--device", default="cpu", help="torch device of target and draft, e.g. cuda (torch backend; default cpu)"
    )
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    args = p.parse_args(argv)
    check_args(p, args)
    return args


def positive_ints(parser: argparse.ArgumentParser, flag: str, text: str, minimum: int) -> list[int]:
    values = text.split(",")
    if not all(v.isdigit() and int(v) >= minimum for v in values):
        parser.error(f"{flag} takes comma-separated integers of at least {minimum}, got {text!r}")
    return [int(v) for v in values]


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every argument error, before any model loads, as argparse reports its own (`error: ...`, exit status 2)."""
    check_decoding_args(parser, args)
    if args.max_samples < 0:
        parser.error(f"--max-samples must be at least 0 (0 for all), got {args.max_samples}")
    args.sweep_block_size = args.sweep_block_size and positive_ints(
        parser, "--sweep-block-size", args.sweep_block_size, 2
    )
    args.tree_budget = positive_ints(parser, "--tree-budget", args.tree_budget, 1)
    args.batch_size = args.batch_size and positive_ints(parser, "--batch-size", args.batch_size, 1)
    if args.batch_size and (args.backend != "torch" or args.temperature > 0):
        parser.error("--batch-size measures greedy decoding with the torch backend")
    if not 0 < args.tree_min_prob < 1:
        parser.error(f"--tree-min-prob must be in (0, 1), got {args.tree_min_prob}")
    args.dtype = resolve_dtype(args.dtype, args.device)
    for name in args.dataset.split(","):
        try:
            load_prompts(name, 1)  # a bad name or file is said before any model loads
        except (OSError, ValueError) as error:
            parser.error(f"--dataset: {error}")
    check_model_path(parser, "--target", args.target, draft=False)
    check_model_path(parser, "--draft", args.draft, draft=True)


def method_table(backend: str, tree_budgets: list[int], tree_min_prob: float = 0.2) -> dict:
    """Factories by method name; the tree method becomes one `<tree method><N>` per budget, and
    `spec-generate-confident` gets `tree_min_prob`."""
    if backend == "mlx":
        from bench.mlx_methods import MLX_METHODS as methods
    else:
        methods = TORCH_METHODS | {CONFIDENT: functools.partial(TORCH_METHODS[CONFIDENT], tree_min_prob=tree_min_prob)}
    tree = TREE[backend]
    table = {name: factory for name, factory in methods.items() if name != tree}
    return table | {f"{tree}{n}": functools.partial(methods[tree], tree_budget=n) for n in tree_budgets}


def selected_methods(args: argparse.Namespace, factories: dict) -> list[str]:
    """The requested methods, baseline first; the tree method stands for every budget; unknown names are an error."""
    names, tree = args.methods.split(",") if args.methods else list(factories), TREE[args.backend]
    names = [m for n in names for m in ([k for k in factories if k.startswith(tree)] if n == tree else [n])]
    unknown = sorted(set(names) - set(factories))
    if unknown:
        raise SystemExit(f"unknown method(s) {unknown}; choose from {sorted(factories)}")
    baseline = BASELINE[args.backend]
    return [baseline] + [n for n in names if n != baseline]


def load_torch_models(args: argparse.Namespace, need_draft: bool) -> tuple:
    """(target, tokenizer, draft); the draft is our `DFlashDraftModel`, which reads z-lab checkpoints too."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if args.target:
        target, tokenizer = (
            AutoModelForCausalLM.from_pretrained(args.target, dtype=args.dtype).eval(),
            AutoTokenizer.from_pretrained(args.target),
        )
    else:
        from default_target import load_default_target

        target, tokenizer = load_default_target(args.dtype)
    target = target.to(args.device)
    if not need_draft:
        return target, tokenizer, None
    from modeling_dflash import DFlashDraftModel

    draft_path = args.draft or REPO_ROOT
    try:
        draft = DFlashDraftModel.from_pretrained(draft_path, dtype=args.dtype).eval()
    except OSError as error:
        raise SystemExit(f"cannot load a DFlash draft from {draft_path}: {error}") from error
    return target, tokenizer, draft.to(args.device)


def load_mlx_models(args: argparse.Namespace, need_draft: bool) -> tuple:
    from bench.mlx_methods import load_mlx

    target_path = args.target
    if target_path is None:
        from default_target import default_target_path

        target_path = str(default_target_path())
    return load_mlx(target_path, str(args.draft or REPO_ROOT) if need_draft else None)


def stop_token_ids(target, tokenizer) -> list[int]:
    """EOS ids of the target's generation config and of the tokenizer."""
    ids = getattr(getattr(target, "generation_config", None), "eos_token_id", None)
    ids = list(ids) if isinstance(ids, (list, tuple)) else [ids]
    return sorted({i for i in ids + [getattr(tokenizer, "eos_token_id", None)] if i is not None})


def cpu_name() -> str:
    """The CPU's model name (Linux), else what `platform` knows."""
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def environment() -> dict:
    """Versions that matter for the numbers."""
    import torch
    import transformers

    env = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu": cpu_name(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch_threads": torch.get_num_threads(),
    }
    try:
        import mlx.core as mx

        env["mlx"] = mx.__version__
    except ImportError:
        env["mlx"] = None
    return env


def block_sizes(args: argparse.Namespace, draft) -> list[int]:
    if args.sweep_block_size:
        return args.sweep_block_size
    config = getattr(draft, "config", None) or getattr(draft, "args", None)  # torch config, or the MLX port's ModelArgs
    return [args.block_size or getattr(config, "block_size", None) or 16]


def parameter_count(model) -> int | None:
    if model is None:
        return None
    params = model.parameters()
    if isinstance(params, dict):  # MLX gives a nested dict of arrays
        from mlx.utils import tree_flatten

        return sum(v.size for _, v in tree_flatten(params))
    return sum(p.numel() for p in params)


def run_config(args: argparse.Namespace, sizes: list[int], methods: list[str]) -> dict:
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    return dict(
        config, block_sizes=sizes, methods=methods, datasets=args.dataset.split(","), baseline=BASELINE[args.backend]
    )


def write_outputs(out: Path, result: dict) -> None:
    """results.json, summary.txt and the two plots, each written atomically."""
    rows = result["summary"]
    write_json_atomic(out / "results.json", result)
    write_text_atomic(out / "summary.txt", report.table(rows) + "\n")
    report.plot_histograms(rows, out / "acceptance_histogram.png")
    report.plot_speedup(rows, out / "speedup.png")


def benchmark(args: argparse.Namespace, argv: list[str]) -> dict:
    """Loads models, measures every method on every dataset and returns the JSON-ready result."""
    factories = method_table(args.backend, args.tree_budget, args.tree_min_prob)
    methods = selected_methods(args, factories)
    need_draft = any(m not in NO_DRAFT for m in methods)
    load = load_mlx_models if args.backend == "mlx" else load_torch_models
    target, tokenizer, draft = load(args, need_draft)
    device = args.device if args.backend == "torch" else "cpu"  # MLX methods take host ids
    ctx = Context(target, tokenizer, draft, args.temperature, stop_token_ids(target, tokenizer), args.seed, device)
    sizes, baseline = block_sizes(args, draft), BASELINE[args.backend]
    variants, skipped = build_variants(ctx, factories, methods, sizes, BLOCK_FREE)
    prompts = {name: load_prompts(name, args.max_samples or None) for name in args.dataset.split(",")}
    variants, failed = warm_up(ctx, variants, next(iter(prompts.values()))[0], baseline)
    for reason in skipped + failed:
        print(f"skipped {reason['method']} (block {reason['block_size']}): {reason['reason']}", file=sys.stderr)
    records = [
        r for name, ps in prompts.items() for r in run_dataset(ctx, variants, name, ps, args.max_new_tokens, baseline)
    ]
    summary = report.summarize(records, baseline)
    return {
        "schema_version": report.SCHEMA_VERSION,
        "tool": "bench",
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": ["python", "-m", "bench", *argv],
        # a method asked for by name that could not run fails the run, as a differing output does
        "exit_status": int(report.total_failures(summary) > 0 or bool(args.methods and skipped + failed)),
        "config": run_config(args, sizes, methods),
        "environment": environment(),
        "models": {
            "target": args.target,
            "draft": args.draft,
            "target_parameters": parameter_count(target),
            "draft_parameters": parameter_count(draft),
        },
        "skipped": skipped + failed,
        "summary": summary,
        "records": records,
    }


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark; returns 1 when any output differs from plain greedy decoding at temperature 0."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.batch_size:
        from bench import batch

        target, tokenizer, draft = load_torch_models(args, need_draft=True)
        return batch.run(args, argv, target, tokenizer, draft, stop_token_ids(target, tokenizer))
    result = benchmark(args, argv)
    write_outputs(args.out, result)
    print(report.table(result["summary"]))
    for row in result["summary"]:
        print(report.one_line(row))
    if failures := report.total_failures(result["summary"]):
        print(
            f"FAIL: {failures} output(s) differ from plain greedy decoding other than at a rounding tie",
            file=sys.stderr,
        )
    if args.methods and result["skipped"]:
        names = sorted({s["method"] for s in result["skipped"]})
        print(
            f"FAIL: requested method(s) {', '.join(names)} could not run (reasons above and in results.json)",
            file=sys.stderr,
        )
    print(f"wrote {args.out / 'results.json'}, summary.txt, acceptance_histogram.png, speedup.png")
    return result["exit_status"]
