"""The demo's argument checks: one-line `error: ...` (exit status 2) before any model loads."""

import pytest
from conftest import ROOT, make_target

from demo.__main__ import parse_args

BAD = [
    (["--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
    (["--temperature", "-1"], "--temperature must be at least 0"),
    (["--block-size", "1"], "--block-size must be at least 2"),
    (["--draft", "/nonexistent"], "--draft /nonexistent: no such folder"),
    (["  "], "the prompt is empty"),
]


@pytest.mark.parametrize("argv, message", BAD)
def test_bad_arguments_are_one_line_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and f"python -m demo: error: {message}" in err and "Traceback" not in err


def test_a_target_folder_as_the_draft_is_named(tmp_path, capsys):
    make_target("llama").save_pretrained(tmp_path)
    with pytest.raises(SystemExit):
        parse_args(["--draft", str(tmp_path)])
    assert "not a DFlash draft config (model_type 'llama')" in capsys.readouterr().err


def test_defaults_are_accepted():
    args = parse_args([])
    assert args.draft == str(ROOT) and args.max_new_tokens >= 1 and args.draft_int8
    assert not parse_args(["--no-draft-int8"]).draft_int8
