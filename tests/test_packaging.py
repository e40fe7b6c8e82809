"""What `pip install` puts into site-packages: the model-repo modules and the two libraries, no generic tooling
names."""

import subprocess
import sys
import zipfile

from conftest import ROOT

MODEL_REPO_FILES = sorted(ROOT.glob("*_dflash.py"))  # the model repo's code, flat at the root


def test_wheel_installs_no_generic_top_level_packages(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", str(ROOT), "-w", str(tmp_path)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("dflash-*.whl")
    top_level = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist() if not name.startswith("dflash-")}
    assert top_level == {path.name for path in MODEL_REPO_FILES} | {"default_target", "mlx_port"}


def test_model_repo_files_keep_lines_within_120_characters():
    long = [
        f"{f}:{i}" for f in MODEL_REPO_FILES for i, line in enumerate(f.read_text().splitlines(), 1) if len(line) > 120
    ]
    assert not long, long


def test_modeling_file_names_every_model_repo_file_by_a_direct_relative_import():
    # transformers 4.x copies a local folder's remote code by the modeling file's own relative imports only
    from transformers.dynamic_module_utils import get_relative_imports

    direct = set(get_relative_imports(str(ROOT / "modeling_dflash.py")))
    assert direct == {path.stem for path in MODEL_REPO_FILES} - {"modeling_dflash"}
