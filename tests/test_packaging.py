"""What `pip install` puts into site-packages: the model-repo modules and the two libraries, no generic tooling
names."""

import subprocess
import sys
import zipfile

from conftest import ROOT


def test_wheel_installs_no_generic_top_level_packages(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", str(ROOT), "-w", str(tmp_path)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("dflash-*.whl")
    top_level = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist() if not name.startswith("dflash-")}
    assert top_level == {
        "configuration_dflash.py",
        "modeling_dflash.py",
        "generation_dflash.py",
        "cache_dflash.py",
        "routing_dflash.py",
        "tree_dflash.py",
        "batch_dflash.py",
        "cost_dflash.py",
        "proposal_dflash.py",
        "default_target",
        "mlx_port",
    }


def test_model_repo_files_keep_lines_within_120_characters():
    files = [
        "configuration_dflash.py",
        "modeling_dflash.py",
        "generation_dflash.py",
        "cache_dflash.py",
        "routing_dflash.py",
        "tree_dflash.py",
        "batch_dflash.py",
        "cost_dflash.py",
        "proposal_dflash.py",
    ]
    long = [
        f"{f}:{i}" for f in files for i, line in enumerate((ROOT / f).read_text().splitlines(), 1) if len(line) > 120
    ]
    assert not long, long
