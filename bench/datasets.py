"""Offline prompt sets: `load_prompts(name)` gives `[{"id": str, "turns": [str, ...], "source": str}, ...]`.

Built-in names read the JSONL files committed in `bench/data/` (see its README for sources and licences); any other
name is taken as a path to a user JSONL file with the same fields (`id` and `source` are optional there).
"""

import json
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent / "data"
BUILTIN = {"mt-bench": "mt-bench.jsonl", "humaneval": "humaneval.jsonl", "gsm": "gsm.jsonl"}
EXPECTED_COUNTS = {"mt-bench": 80, "humaneval": 164, "gsm": 200}


def dataset_path(name: str) -> Path:
    """The JSONL file behind a built-in name, or `name` itself as a path."""
    if name in BUILTIN:
        return DATA_DIR / BUILTIN[name]
    path = Path(name)
    if not path.is_file():
        raise ValueError(f"unknown dataset {name!r}: use one of {sorted(BUILTIN)} or a path to a JSONL file")
    return path


def normalize_prompt(row: dict, index: int, source: str) -> dict:
    """Checks one record and fills in the optional fields."""
    turns = row.get("turns")
    if isinstance(row.get("prompt"), str) and turns is None:
        turns = [row["prompt"]]  # user files may give a single `prompt` instead of `turns`
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
        raise ValueError(f"{source} line {index + 1}: `turns` must be a non-empty list of non-empty strings")
    return {"id": str(row.get("id", index)), "turns": turns, "source": str(row.get("source", source))}


def load_prompts(name: str, limit: int | None = None) -> list[dict]:
    """Prompts of a built-in set ("mt-bench", "humaneval", "gsm") or a user JSONL path, in file order."""
    path = dataset_path(name)
    rows = []
    with open(path, encoding="utf-8") as f:
        for index, line in enumerate(f):
            if line.strip():
                rows.append(normalize_prompt(json.loads(line), index, path.stem))
            if limit is not None and len(rows) >= limit:
                break
    return rows
