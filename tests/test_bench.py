"""The benchmark harness end to end on a tiny random target and draft (seconds, CPU, no network)."""

import json

import pytest
import torch
from conftest import ROOT, VOCAB, OracleDraft, greedy_reference, make_draft, make_draft_config, make_target
from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import GenerationConfig, PreTrainedTokenizerFast

import cache_dflash
from bench import methods, report
from bench.datasets import EXPECTED_COUNTS, load_prompts
from bench.harness import first_difference, truncate
from bench.methods import Generation, TargetTracer
from bench.mlx_methods import MLX_METHODS
from bench.run import main
from modeling_dflash import DFlashDraftModel

CHARS = " abcdefghijklmnopqrstuvwxyz.,?!'\n<>/0123456789"
TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level tokenizer inside the tiny vocab, with a chat template; unknown characters map to `[UNK]`."""
    vocab = {"[PAD]": 0, "[UNK]": 1, **{c: i + 3 for i, c in enumerate(CHARS)}}
    assert len(vocab) < VOCAB - 1  # the last id is the draft's mask token
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]")
    fast.chat_template = TEMPLATE
    return fast


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """A tiny target (with tokenizer) and draft saved to disk, as a user would pass them."""
    root = tmp_path_factory.mktemp("models")
    target = make_target("llama", initializer_range=0.2)
    target.save_pretrained(root / "target")
    tiny_tokenizer().save_pretrained(root / "target")
    make_draft().save_pretrained(root / "draft")
    return root / "target", root / "draft"


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    """Two prompts, one of them two-turn, in the user JSONL format."""
    path = tmp_path_factory.mktemp("data") / "mine.jsonl"
    rows = [{"id": "a", "turns": ["hello there, how are you?", "and now?"]}, {"prompt": "count to ten."}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def bench_args(model_dirs, prompts_file, out, *extra) -> list[str]:
    target, draft = model_dirs
    return [
        "--target",
        str(target),
        "--draft",
        str(draft),
        "--dataset",
        str(prompts_file),
        "--max-new-tokens",
        "12",
        "--out",
        str(out),
        "--threads",
        "1",
        *extra,
    ]


@pytest.fixture(scope="module")
def sweep_result(model_dirs, prompts_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("results")
    status = main(
        bench_args(
            model_dirs,
            prompts_file,
            out,
            "--sweep-block-size",
            "2,4",
            "--methods",
            "plain,spec-generate,spec-generate-static,spec-generate-tree,spec-generate-confident,prompt-lookup,hf-dflash,assisted",
            "--tree-budget",
            "2,8",
            "--tree-min-prob",
            "0.3",
            "--device",
            "cpu",
        )
    )
    return status, out, json.loads((out / "results.json").read_text())


def test_end_to_end_lossless(sweep_result):
    status, out, result = sweep_result
    assert status == 0 and result["exit_status"] == 0
    rows = {(r["method"], r["block_size"]): r for r in result["summary"]}
    assert {("plain", None), ("spec-generate", 2), ("spec-generate", 4), ("prompt-lookup", 2)} <= set(rows)
    assert {("spec-generate-tree2", 4), ("spec-generate-tree8", 4)} <= set(rows)  # one method per --tree-budget
    assert ("spec-generate-confident", 4) in set(rows)
    assert {("spec-generate-static", 2), ("spec-generate-static", 4)} <= set(rows)
    assert result["config"]["device"] == "cpu" and all(r["ttft_seconds"] > 0 for r in result["records"])
    assert all(r["mismatches"] == 0 for r in result["summary"])
    assert rows["plain", None]["speedup"] == pytest.approx(1.0)
    assert rows["plain", None]["mean_acceptance_length"] == 1.0
    assert 1.0 <= rows["spec-generate", 4]["mean_acceptance_length"] <= 4
    assert len(rows["spec-generate", 4]["acceptance_histogram"]) == 4
    methods_run = {r["method"] for r in result["records"]}
    skipped = {s["method"] for s in result["skipped"]}
    assert {"assisted", "hf-dflash"} <= methods_run | skipped  # each either ran losslessly or says why not
    assert ("hf-dflash" in methods_run) == hasattr(
        GenerationConfig(), "speculation_type"
    )  # wherever transformers has it


def test_json_schema_is_stable(sweep_result):
    _, _, result = sweep_result
    assert result["schema_version"] == report.SCHEMA_VERSION == 2
    assert set(result) == {
        "schema_version",
        "tool",
        "created",
        "command",
        "exit_status",
        "config",
        "environment",
        "models",
        "skipped",
        "summary",
        "records",
    }
    assert set(result["summary"][0]) == set(report.SUMMARY_KEYS)
    assert set(result["records"][0]) == {
        "dataset",
        "method",
        "block_size",
        "prompt_id",
        "turn",
        "input_tokens",
        "output_tokens",
        "seconds",
        "tokens_per_second",
        "ttft_seconds",
        "acceptance_lengths",
        "peak_rss_mib",
        "output_sha1",
        "matches_plain",
        "first_mismatch",
        "logit_gap",
        "rounding_tie",
    }
    assert result["config"]["seed"] == 0 and result["config"]["block_sizes"] == [2, 4]
    # three turns (two-turn prompt plus one-turn prompt) per method and block size
    assert sum(1 for r in result["records"] if r["method"] == "spec-generate" and r["block_size"] == 2) == 3
    assert all(0 < r["ttft_seconds"] <= r["seconds"] for r in result["records"])


def test_plots_written(sweep_result):
    _, out, _ = sweep_result
    for name in ("acceptance_histogram.png", "speedup.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "spec-generate" in (out / "summary.txt").read_text()


def wrong_method(ctx, block_size):
    """Plain decoding with its third token changed: a deliberately lossy method."""
    run = methods.plain(ctx, block_size)

    def broken(input_ids, max_new_tokens):
        out = run(input_ids, max_new_tokens)
        tokens = out.new_tokens[:2] + [(t + 1) % VOCAB for t in out.new_tokens[2:3]] + out.new_tokens[3:]
        return Generation(tokens, out.acceptance_lengths, out.first_token_time)

    return broken


def test_mismatch_exits_nonzero(model_dirs, prompts_file, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(methods.TORCH_METHODS, "wrong", wrong_method)
    status = main(bench_args(model_dirs, prompts_file, tmp_path, "--block-size", "4", "--methods", "wrong"))
    result = json.loads((tmp_path / "results.json").read_text())
    wrong = [r for r in result["records"] if r["method"] == "wrong"]
    assert status == 1 and result["exit_status"] == 1
    assert all(r["matches_plain"] is False and r["first_mismatch"] == 2 for r in wrong)
    assert all(r["logit_gap"] > 0 and r["rounding_tie"] is False for r in wrong)  # float32: never a tie
    row = next(r for r in result["summary"] if r["method"] == "wrong")
    assert row["failures"] == row["mismatches"] == row["samples"] and row["first_divergence"] == 2
    assert row["max_logit_gap"] == max(r["logit_gap"] for r in wrong)
    assert "FAIL" in capsys.readouterr().err


@pytest.mark.parametrize("k", [0, 2])
def test_tracer_recovers_acceptance_lengths(k):
    """With a draft right for exactly k tokens per block, every route reports acceptance length k + 1 per step."""
    target = make_target("llama", initializer_range=0.2)
    ids = torch.randint(3, VOCAB - 1, (1, 7), generator=torch.Generator().manual_seed(0))
    reference = greedy_reference(target, ids, 24)
    draft = OracleDraft(make_draft_config()).eval().setup(target, reference, k)
    ctx = methods.Context(target, None, draft)
    with TargetTracer(target) as tracer:
        stats = draft.spec_generate(target=target, input_ids=ids, max_new_tokens=24, block_size=4, return_stats=True)
    traced = tracer.acceptance_lengths(stats.output_ids.shape[1])
    assert traced[:-1] == stats.acceptance_lengths[:-1] == [k + 1] * (len(traced) - 1)
    for name in ("assisted", "hf-dflash"):
        try:
            run = methods.TORCH_METHODS[name](ctx, 4)
        except methods.Unavailable:
            continue
        generation = run(ids, 24)
        assert generation.new_tokens == reference[0, 7:].tolist(), name
        assert generation.acceptance_lengths[:-1] == [k + 1] * (len(generation.acceptance_lengths) - 1), name


def test_helpers():
    assert truncate([5, 6, 2, 7], [2], 10) == [5, 6, 2]
    assert truncate([5, 6, 7], [2], 2) == [5, 6]
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 9, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2
    assert report.histogram([1, 3, 3], 4) == [1, 0, 2, 0]


@pytest.mark.parametrize("name", sorted(EXPECTED_COUNTS))
def test_prompt_sets_have_documented_counts(name):
    prompts = load_prompts(name)
    assert len(prompts) == EXPECTED_COUNTS[name]
    assert all(set(p) == {"id", "turns", "source"} and p["turns"] for p in prompts)
    assert len({p["id"] for p in prompts}) == len(prompts)
    assert all(len(p["turns"]) == 2 for p in prompts) if name == "mt-bench" else True
    assert len(load_prompts(name, limit=5)) == 5


def test_user_jsonl_and_bad_names(prompts_file, tmp_path):
    assert load_prompts(str(prompts_file)) == [
        {"id": "a", "turns": ["hello there, how are you?", "and now?"], "source": "mine"},
        {"id": "1", "turns": ["count to ten."], "source": "mine"},
    ]
    with pytest.raises(ValueError, match="unknown dataset"):
        load_prompts("no-such-set")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"turns": []}\n')
    with pytest.raises(ValueError, match="line 1"):
        load_prompts(str(bad))


def test_mlx_backend_end_to_end(model_dirs, prompts_file, tmp_path, monkeypatch, capsys):
    pytest.importorskip("mlx.core")
    port = pytest.importorskip("mlx_port")
    calls = []
    stream = port.stream_generate
    monkeypatch.setattr(
        port, "stream_generate", lambda *args, **kwargs: calls.append(kwargs) or stream(*args, **kwargs)
    )
    status = main(
        bench_args(model_dirs, prompts_file, tmp_path, "--backend", "mlx", "--block-size", "4", "--tree-budget", "2,3")
    )
    result = json.loads((tmp_path / "results.json").read_text())
    rows = {r["method"]: r for r in result["summary"]}
    methods = {"mlx-dflash", "mlx-dflash-chain", "mlx-dflash-tree2", "mlx-dflash-tree3"}
    assert status == 0 and set(rows) == {"mlx-plain"} | methods, result["skipped"]
    assert all(rows[m]["mismatches"] == 0 for m in methods) and rows["mlx-plain"]["mean_acceptance_length"] == 1.0
    trees = {(c.get("tree_budget"), c.get("prompt_lookup_num_tokens")) for c in calls}
    assert trees == {(None, None), (0, 0), (2, 0), (3, 0)}  # None: the draft config's
    assert "tok/pass" in capsys.readouterr().out


def test_batch_sizes_measure_batched_dflash_against_plain_batches(model_dirs, prompts_file, tmp_path):
    """Two prompts of different lengths in batches of 1 and 2: every DFlash row equals plain batched `generate` and
    one-at-a-time decoding in float32 (the run exits 0), and the throughput table, JSON and plot are written."""
    status = main(bench_args(model_dirs, prompts_file, tmp_path, "--batch-size", "1,2"))
    result = json.loads((tmp_path / "results.json").read_text())
    assert status == 0 == result["exit_status"] and result["prompts"] == 2
    assert [r["batch_size"] for r in result["rows"]] == [1, 2]
    for row in result["rows"]:
        assert row["rows_differing_from_plain"] == 0 == row["rows_differing_from_one_at_a_time"]
        assert row["rows_differing_from_plain_not_at_a_tie"] == 0
        assert min(row[f"{m}_tokens_per_second"] for m in ("dflash", "cost_sized", "plain")) > 0
        if row["cost_sized_rounds_with_nodes"]:
            assert row["cost_sized_measured_tau"] >= 1 and row["cost_sized_expected_tau"] > 1
        else:
            assert row["cost_sized_measured_tau"] is None is row["cost_sized_expected_tau"]
    assert [len(group) for group in result["rows"][1]["row_lengths"]] == [2], "one batch of two rows"
    assert (tmp_path / "throughput.png").stat().st_size > 0 and "DFlash vs plain" in (
        tmp_path / "summary.txt"
    ).read_text()


def test_the_tau_estimate_is_compared_over_rounds_that_verified_nodes():
    """A plain step's estimate and acceptance are both 1, so the comparison leaves them out; one row's flat lists and
    a batch's lists per row read alike."""
    from bench.batch import verified_rounds
    from bench.report import tau_estimate
    from decoding_dflash import SpecGenerateOutput

    one = SpecGenerateOutput(torch.zeros(1, 1), [3, 1, 2], expected_acceptance_lengths=[2.5, 1.0, 1.5])
    batch = SpecGenerateOutput(torch.zeros(2, 1), [[3, 1], [1]], expected_acceptance_lengths=[[2.5, 1.0], [1.2]])
    assert verified_rounds(one) == [(2.5, 3), (1.5, 2)]
    assert verified_rounds(batch) == [(2.5, 3), (1.2, 1)]
    row = {"cost_sized_expected_tau": 2.0, "cost_sized_measured_tau": 2.5, "cost_sized_rounds_with_nodes": 2}
    assert tau_estimate(row) == "2.00 / 2.50 (2)" and tau_estimate({}) == "-"


def test_batch_sizes_time_no_cost_measurement(model_dirs, prompts_file, tmp_path, monkeypatch):
    """A row count's t(n) is measured in its untimed first call, whose seconds are kept apart: no timed call
    measures."""
    import bench.batch
    import cost_dflash

    measured, timed, measure = [], bench.batch.timed, cost_dflash.measure_verify_costs
    monkeypatch.setattr(
        cost_dflash, "measure_verify_costs", lambda *a, **k: measured.append(k["rows"]) or measure(*a, **k)
    )

    def checked(call, *args, **kwargs):
        before = len(measured)
        out = timed(call, *args, **kwargs)
        assert kwargs["max_new_tokens"] == 2 or len(measured) == before, "a timed call measured t(n)"
        return out

    monkeypatch.setattr(bench.batch, "timed", checked)
    assert main(bench_args(model_dirs, prompts_file, tmp_path, "--batch-size", "1,2")) == 0
    assert measured == [1, 2], "once per row count"
    result = json.loads((tmp_path / "results.json").read_text())
    for row in result["rows"]:
        assert {name: len(seconds) for name, seconds in row["first_call_seconds"].items()} == {
            "plain": 1,
            "dflash": 1,
            "cost": 1,
        }


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batch_sizes_fail_when_a_row_differs_from_plain_batched_generate(
    model_dirs, prompts_file, tmp_path, monkeypatch, dtype
):
    """The plain batched rows are compared, not thrown away: one altered plain row (cut short, which no rounding tie
    explains) makes the run exit 1, in float32 and in bfloat16."""
    import bench.batch

    real = bench.batch.batched

    def one_plain_row_altered(*args, **kwargs):
        result = real(*args, **kwargs)
        result["plain"][0][0] = result["plain"][0][0][:-1]
        return result

    monkeypatch.setattr(bench.batch, "batched", one_plain_row_altered)
    assert main(bench_args(model_dirs, prompts_file, tmp_path, "--batch-size", "2", "--dtype", dtype)) == 1
    (row,) = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert row["rows_differing_from_plain"] == 2 == row["rows_differing_from_plain_not_at_a_tie"]  # both sizings


BAD_ARGS = [
    (["--tree-budget", "4,x"], "--tree-budget takes comma-separated integers of at least 1"),
    (["--tree-budget", "0"], "--tree-budget takes"),
    (["--tree-budget", "2.5"], "--tree-budget takes"),
    (["--tree-min-prob", "1"], "--tree-min-prob must be in"),
    (["--batch-size", "0,4"], "--batch-size takes comma-separated integers of at least 1"),
    (["--batch-size", "4", "--temperature", "0.5"], "--batch-size measures greedy decoding"),
    (["--sweep-block-size", "1,x"], "--sweep-block-size takes comma-separated integers of at least 2"),
    (["--temperature", "-1"], "--temperature must be at least 0"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
    (["--block-size", "1"], "--block-size must be at least 2"),
    (["--target", "/no/such/target"], "--target /no/such/target: no such folder"),
    (["--draft", "/no/such/draft"], "--draft /no/such/draft: no such folder"),
    (["--dataset", "mt-bench,nope"], "--dataset: unknown dataset 'nope': use one of"),
]


@pytest.mark.parametrize("extra, message", BAD_ARGS)
def test_bad_arguments_are_one_line_errors_before_loading(
    model_dirs, prompts_file, tmp_path, capsys, monkeypatch, extra, message
):
    monkeypatch.setattr(
        "bench.run.load_torch_models", lambda *a: pytest.fail("models loaded before the arguments were checked")
    )
    with pytest.raises(SystemExit) as exit_info:
        main(bench_args(model_dirs, prompts_file, tmp_path, "--methods", "spec-generate-tree", *extra))
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and f"error: {message}" in err and "Traceback" not in err
    assert not (tmp_path / "results.json").exists()


def test_a_target_folder_as_the_draft_is_named(model_dirs, prompts_file, tmp_path, capsys):
    target, _ = model_dirs
    with pytest.raises(SystemExit) as exit_info:
        main(bench_args(model_dirs, prompts_file, tmp_path) + ["--draft", str(target)])
    assert exit_info.value.code == 2 and "not a DFlash draft config (model_type 'llama')" in capsys.readouterr().err


def test_a_requested_method_that_cannot_run_fails_the_run(model_dirs, prompts_file, tmp_path, monkeypatch, capsys):
    def unavailable(ctx, block_size):
        raise methods.Unavailable("not here")

    monkeypatch.setitem(methods.TORCH_METHODS, "unavailable", unavailable)
    status = main(bench_args(model_dirs, prompts_file, tmp_path, "--block-size", "4", "--methods", "unavailable"))
    assert status == 1 and json.loads((tmp_path / "results.json").read_text())["exit_status"] == 1
    assert "requested method(s) unavailable could not run" in capsys.readouterr().err


def test_sampled_outputs_say_so_in_the_differ_column(model_dirs, prompts_file, tmp_path, capsys):
    assert (
        main(
            bench_args(
                model_dirs,
                prompts_file,
                tmp_path,
                "--block-size",
                "4",
                "--methods",
                "spec-generate",
                "--temperature",
                "0.7",
            )
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "sampled" in out and "-/" not in out


def test_the_benchmarks_guide_lists_every_method():
    guide = (ROOT / "docs" / "benchmarks.md").read_text()
    missing = [name for name in [*methods.TORCH_METHODS, *MLX_METHODS] if f"`{name}`" not in guide]
    assert not missing, missing


def test_help_lists_the_methods_and_defaults(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0 and "usage: python -m bench" in out
    assert (
        all(name in out for name in methods.TORCH_METHODS) and "(default 256)" in out and "(default: None)" not in out
    )


def test_bfloat16_divergences_fail_only_beyond_a_rounding_tie(model_dirs, prompts_file, tmp_path, monkeypatch):
    """The exit rule in reduced precision: a divergence at a rounding tie passes, any other fails (in float32 every
    divergence fails, tested above)."""
    from common import exactness
    from common.exactness import Divergence

    monkeypatch.setitem(methods.TORCH_METHODS, "wrong", wrong_method)
    argv = bench_args(
        model_dirs, prompts_file, tmp_path, "--block-size", "4", "--methods", "wrong", "--dtype", "bfloat16"
    )
    tie, far = Divergence(2, 0.125, 0.0625, "bfloat16"), Divergence(5, 2.0, 0.0625, "bfloat16")  # 2 and 32 ulps
    monkeypatch.setattr(exactness, "divergence", lambda *a: tie)
    monkeypatch.setattr(exactness, "worst_off_argmax", lambda *a: tie)
    assert main(argv) == 0
    row = next(r for r in json.loads((tmp_path / "results.json").read_text())["summary"] if r["method"] == "wrong")
    assert row["mismatches"] == row["samples"] and row["failures"] == 0 and row["max_logit_gap"] == 0.125
    monkeypatch.setattr(exactness, "worst_off_argmax", lambda *a: far)  # a later token beyond a tie fails too
    assert main(argv) == 1
    monkeypatch.setattr(exactness, "worst_off_argmax", lambda *a: tie)
    monkeypatch.setattr(exactness, "divergence", lambda *a: far)
    assert main(argv) == 1


def test_divergence_measures_the_gap_under_one_full_pass():
    from common.exactness import TIE_ULPS, Divergence, divergence, ulp

    target = make_target("llama", initializer_range=0.2)
    prompt = [5, 6, 7]
    plain = greedy_reference(target, torch.tensor([prompt]), 6)[0, 3:].tolist()
    assert divergence(target, prompt, plain, plain) is None
    with torch.no_grad():
        logits = target(torch.tensor([prompt + plain[:2]])).logits[0, -1]
    other = int(logits.argsort()[-2])  # the target's second choice at token 2
    found = divergence(target, prompt, plain[:2] + [other], plain)
    assert found.index == 2 and found.gap == pytest.approx(float(logits.max() - logits[other]), abs=1e-5)
    assert not found.rounding_tie  # float32 never ties
    assert Divergence(2, TIE_ULPS * 0.125, 0.125, "bfloat16").rounding_tie
    assert not Divergence(2, TIE_ULPS * 0.125 + 0.01, 0.125, "bfloat16").rounding_tie
    assert ulp(20.0, torch.bfloat16) == 0.125 and ulp(0.3, torch.bfloat16) == 2**-7


def tied_bf16_target(a: int, b: int):
    """A bf16 target in which tokens `a` and `b` have one embedding and one head row: they tie everywhere, and
    either leads to the same continuation."""
    target = make_target("llama", initializer_range=0.2)
    with torch.no_grad():
        target.get_input_embeddings().weight[b] = target.get_input_embeddings().weight[a]
        target.get_output_embeddings().weight[b] = target.get_output_embeddings().weight[a]
    return target.to(torch.bfloat16)


def test_the_oracle_checks_every_token_after_the_first_divergence():
    """A rounding tie at the first divergence no longer vouches for the rest: the output is teacher-forced whole, and
    a later token off the target's argmax fails."""
    from common.exactness import divergence, explained, worst_off_argmax

    prompt, probe = [5, 6, 7], make_target("llama", initializer_range=0.2).to(torch.bfloat16)
    a = greedy_reference(probe, torch.tensor([prompt]), 12)[0, 3 + 2].item()
    b = next(t for t in range(VOCAB - 1, 3, -1) if t != a)
    target = tied_bf16_target(a, b)
    plain = greedy_reference(target, torch.tensor([prompt]), 12)[0, 3:].tolist()
    k = plain.index(a)
    tied = plain[:k] + [b] + plain[k + 1 :]  # leaves plain at an exact tie, then goes on as plain does
    assert worst_off_argmax(target, prompt, plain) is None
    assert divergence(target, prompt, tied, plain).rounding_tie and explained(target, prompt, tied, plain)[1]
    with torch.no_grad():
        logits = target(torch.tensor([prompt + tied[:-1]])).logits[0, -1]
    wrong = tied[:-1] + [int(logits.argmin())]  # the same tie, then a last token the target ranks lowest
    assert divergence(target, prompt, wrong, plain).rounding_tie  # all the first-divergence check saw
    found, tie = explained(target, prompt, wrong, plain)
    worst = worst_off_argmax(target, prompt, wrong)
    assert not tie and worst.index == len(wrong) - 1 and not worst.rounding_tie


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_step_costs_prints_the_verify_curve_and_round_costs(model_dirs, capsys, dtype):
    from bench import step_costs

    target, draft = model_dirs
    threads = torch.get_num_threads()
    step_costs.main(
        [
            "--target",
            str(target),
            "--draft",
            str(draft),
            "--dtype",
            dtype,
            "--repeats",
            "1",
            "--context",
            "8",
            "--threads",
            "1",
        ]
    )
    torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert out.startswith(f"{dtype}, context 8") and "n=32:" in out and "(1.00x)" in out
    assert all(f"block {b:2d} round: draft" in out for b in (4, 8, 16))


def test_round_profile_times_every_part_of_real_rounds_and_restores_the_loop():
    from conftest import make_draft, make_target

    import decoding_dflash
    from bench.round_profile import profile, report

    target, draft = make_target("llama"), make_draft()
    draft.config.tree_budget, draft.config.prompt_lookup_num_tokens = 4, 3
    originals = {name: getattr(decoding_dflash, name) for name in ("draft_step", "propose", "verify_forward")}
    prompts = [torch.tensor([[5, 6, 7, 5, 6]]), torch.tensor([[9, 8]])]
    with torch.inference_mode():
        result = profile(target, draft, [(p, torch.ones_like(p)) for p in prompts], 12, stops=[], pad=0)
    assert {"draft", "tree", "lookup", "verify", "accept", "compaction", "rest"} <= set(result["parts"])
    assert all(result["parts"][p] > 0 for p in ("draft", "tree", "verify"))
    assert sum(result["parts"].values()) == pytest.approx(result["round"])
    assert result["tau"] >= 1 and result["decode_step"] > 0 and result["speedup"] > 0
    assert "beyond the verify" in report(torch.float32, result)
    assert all(getattr(decoding_dflash, name) is fn for name, fn in originals.items())


def test_round_profile_times_a_batch_through_the_batch_engine():
    from conftest import make_draft, make_target

    import batch_dflash
    from bench.batch import left_padded
    from bench.round_profile import profile

    target, draft = make_target("llama"), make_draft()
    draft.config.tree_budget, draft.config.prompt_lookup_num_tokens = 4, 3
    originals = {name: getattr(batch_dflash, name) for name in ("draft_block", "verify_trees", "commit_paths")}
    batch = left_padded([torch.tensor([[5, 6, 7, 5, 6]]), torch.tensor([[9, 8]])], pad=0)
    with torch.inference_mode():
        result = profile(target, draft, [batch], 12, stops=[], pad=0, tree_sizing="fixed")
    assert all(result["parts"][p] > 0 for p in ("draft", "verify", "compaction"))  # the batch engine's own parts
    assert sum(result["parts"].values()) == pytest.approx(result["round"])
    assert result["tau"] >= 2  # new tokens a round over both rows
    assert all(getattr(batch_dflash, name) is fn for name, fn in originals.items())


def test_int8_kernels_times_every_kernel_on_the_drafts_shapes(model_dirs, tmp_path):
    from bench import int8_kernels

    out = tmp_path / "int8.json"
    int8_kernels.main(["--draft", str(model_dirs[1]), "--repeats", "1", "--out", str(out)])
    result = json.loads(out.read_text())
    draft = DFlashDraftModel.from_pretrained(model_dirs[1])
    assert len(result["shapes"]) == len([m for m in draft.modules() if isinstance(m, torch.nn.Linear)]) + 1  # the head
    assert {"float32", "fbgemm dynamic int8", "_weight_int8pack_mm bfloat16"} <= set(result["ms"])
    assert all(ms > 0 for ms in result["ms"].values()) and result["command"].startswith("python -m bench.int8_kernels")


@pytest.mark.skipif(not cache_dflash.records_recurrent_states(), reason="transformers before 5.25 records no states")
def test_hybrid_rollback_compares_both_rollbacks_exactly(tmp_path):
    from bench import hybrid_rollback

    out = tmp_path / "hybrid.json"
    assert hybrid_rollback.main(["--prompts", "1", "--max-new-tokens", "8", "--out", str(out)]) == 0
    rows = {(r["route"], r["rollback"]): r for r in json.loads(out.read_text())["rows"]}
    assert len(rows) == 4 and all(r["exact"] for r in rows.values())
    for route in ("spec_generate", "generate"):  # the random draft rejects: the saved rollback re-runs the kept tokens
        assert rows[route, "recorded"]["target_passes"] < rows[route, "saved"]["target_passes"]
