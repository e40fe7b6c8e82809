"""The docs as a user reads them: every results table is its committed file's, every snippet not marked otherwise
runs as written, and the model card's metadata loads with huggingface_hub and quotes the results files."""

import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

from bench import report

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RESULTS = re.compile(r"<!-- results: (\S+) -->\n")
NOT_RUN = re.compile(r"<!-- not run in CI: (.+) -->")
FENCE = re.compile(r"^```(python|bash)\n(.*?)^```$", re.S | re.M)


def blocks(page: Path) -> list[tuple[str, str, str | None]]:
    """`(language, code, reason it is not run or None)` for every python and bash block of `page`, in order."""
    text, found = page.read_text(), []
    for match in FENCE.finditer(text):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        reason = NOT_RUN.fullmatch(before.strip())
        found.append((match[1], match[2], reason[1] if reason else None))
    return found


def runnable(page: Path) -> list[tuple[str, str]]:
    return [(language, code) for language, code, reason in blocks(page) if reason is None]


def load(name: str) -> dict:
    return json.loads((ROOT / name).read_text())


def test_every_results_table_is_its_files_table_under_its_command():
    shown = set()
    for page in PAGES:
        text = page.read_text()
        for match in RESULTS.finditer(text):
            result = load(match[1])
            expected = f"{report.caption(result)}\n\n{report.markdown(result)}\n"
            assert text[match.end() :].startswith(expected), f"{page.name}: the table of {match[1]} is not its file's"
            shown.add(match[1])
    files = {str(p.relative_to(ROOT)) for p in (ROOT / "docs" / "results").glob("*.json")}
    assert files and files <= shown, f"results files no page shows: {sorted(files - shown)}"


def test_bench_report_prints_the_table_of_a_file(capsys):
    name = sorted((ROOT / "docs" / "results").glob("*.json"))[0]
    assert report.main([str(name)]) == 0
    assert report.markdown(load(str(name.relative_to(ROOT)))) in capsys.readouterr().out


def test_the_plots_are_drawn_from_the_results_files_and_docs_holds_them_all(tmp_path, capsys):
    """`python -m bench.report docs/results/*.json --plots DIR` draws every file's plots; docs/plots holds the
    same set."""
    files = sorted((ROOT / "docs" / "results").glob("*.json"))
    assert report.main([*map(str, files), "--plots", str(tmp_path)]) == 0
    made = sorted(p.name for p in tmp_path.glob("*.png"))
    assert len(made) >= len(files) and all((tmp_path / name).read_bytes()[:4] == b"\x89PNG" for name in made)
    assert sorted(p.name for p in (ROOT / "docs" / "plots").glob("*.png")) == made


def test_every_block_runs_in_ci_or_says_why_not():
    for page in PAGES:
        for _, code, reason in blocks(page):
            assert reason is None or len(reason) > 10, f"{page.name}: a block is skipped without a reason: {code}"
    assert sum(len(runnable(page)) for page in PAGES) >= 6, "the docs must show runnable snippets"


def needs_mlx(code: str) -> bool:
    return "mlx_port" in code or "mlx_lm" in code


@pytest.mark.slow
@pytest.mark.parametrize("page", [p for p in PAGES if runnable(p)], ids=lambda p: p.name)
def test_the_snippets_of_a_page_run_as_written(page, monkeypatch, capsys):
    """A page's python blocks run in order in one namespace and its bash blocks in a shell, from the repo root, with
    this interpreter first on PATH (so `python` is the project's)."""
    if any(needs_mlx(code) for _, code in runnable(page)) and not os.environ.get("DFLASH_REQUIRE_MLX"):
        pytest.importorskip("mlx.core", reason="mlx is not installed; CI installs it and runs these")
    monkeypatch.chdir(ROOT)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    namespace: dict = {}
    for language, code in runnable(page):
        if language == "python":
            exec(compile(code, str(page), "exec"), namespace)
            continue
        done = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", code], cwd=ROOT, env=env, capture_output=True, text=True
        )
        assert done.returncode == 0, f"{page.name}: {code}\n{done.stderr[-3000:]}"
    printed = capsys.readouterr().out
    if page.name == "README.md":
        assert printed.strip() and "<|im_end|>" not in printed, "the streamed answer ends at the EOS, unprinted"


def test_the_model_card_metadata_loads_and_quotes_the_results_files():
    ModelCard = importlib.import_module("huggingface_hub").ModelCard
    card = ModelCard.load(ROOT / "README.md")
    data = card.data
    assert data.library_name == "transformers" and data.pipeline_tag == "text-generation"
    assert data.license == "apache-2.0" and data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert {"dflash", "speculative-decoding"} <= set(data.tags)
    results = data.eval_results
    assert results, "a model-index with measured results"
    for result in results:
        source = load(result.source_url)  # each metric names the committed file it came from
        (row,) = [
            r for r in source["summary"] if r["dataset"] == result.dataset_type and r["method"] == "spec-generate"
        ]
        key = {"mean_acceptance_length": "mean_acceptance_length", "speedup": "speedup"}[result.metric_type]
        assert result.metric_value == round(row[key], 2), (result.dataset_type, result.metric_type)
