"""`default_target`: the dtype rule the tools share, and the MLX-facing field in the converted target's config."""

import json

import pytest

import default_target
from default_target import add_top_level_rope_theta, resolve_dtype


@pytest.mark.parametrize("native, expected", [(True, "bfloat16"), (False, "float32")])
def test_auto_picks_bfloat16_only_where_the_cpu_multiplies_it(monkeypatch, native, expected):
    monkeypatch.setattr(default_target, "cpu_multiplies_bf16", lambda: native)
    assert resolve_dtype("auto") == expected
    assert resolve_dtype("float32") == "float32" and resolve_dtype("bfloat16") == "bfloat16"
    with pytest.raises(ValueError, match="dtype must be one of auto, float32, bfloat16, float16"):
        resolve_dtype("fp8")


def test_this_cpus_flags_are_read():
    flags = open("/proc/cpuinfo").read()
    assert default_target.cpu_multiplies_bf16() == ("avx512_bf16" in flags or "amx_bf16" in flags)


def test_rope_theta_is_copied_to_the_top_level(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps({"model_type": "llama", "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}})
    )
    add_top_level_rope_theta(config)
    assert json.loads(config.read_text())["rope_theta"] == 100000.0
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]  # no temporary file left


def test_processes_adding_the_field_at_once_each_write_a_temporary_file_of_their_own(tmp_path, monkeypatch):
    """`default_target_path()` adds the field on every first use; two processes must not share a temporary name."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "rope_parameters": {"rope_theta": 100000.0}}))
    names, replace = [], default_target.os.replace

    def second_process_meanwhile(src, dst):
        names.append(src)
        if len(names) == 1:
            add_top_level_rope_theta(config)  # starts and finishes while the first has written but not renamed
        replace(src, dst)

    monkeypatch.setattr(default_target.os, "replace", second_process_meanwhile)
    add_top_level_rope_theta(config)
    assert len(set(names)) == 2 and json.loads(config.read_text())["rope_theta"] == 100000.0
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]


def test_a_concurrent_conversion_keeps_the_finished_folder(tmp_path):
    from default_target import install_folder

    destination, first, second = tmp_path / "target", tmp_path / ".a", tmp_path / ".b"
    for folder, text in [(first, "first"), (second, "second")]:
        folder.mkdir()
        (folder / "config.json").write_text(text)
    install_folder(first, destination)
    install_folder(second, destination)  # the slower process: no error, the finished folder stays
    assert (destination / "config.json").read_text() == "first"
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "stray").write_text("")  # a folder without a config is not a finished conversion
    with pytest.raises(OSError):
        install_folder(second, broken)
