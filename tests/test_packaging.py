"""`pip install .` puts `empatheia_jax` and nothing else at the top of site-packages.

The wheel is built from the working tree (setuptools, no build isolation, no dependencies fetched), and
its top-level names are read from the archive: a `data`, `converters` or `configs` package there would
shadow any other package of that name in a user's environment.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

from helpers import REPO


def _build_wheel(out: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(out), str(REPO)], check=True, capture_output=True, text=True)
    (wheel,) = out.glob("empatheia_jax-*.whl")
    return wheel


def top_level_names(wheel: Path) -> set[str]:
    """First path components of the wheel's files, less its own .dist-info folder."""
    with zipfile.ZipFile(wheel) as z:
        names = {n.split("/", 1)[0] for n in z.namelist()}
    return {n for n in names if not n.endswith((".dist-info", ".data"))}


def test_the_wheel_installs_the_library_and_nothing_else(tmp_path):
    wheel = _build_wheel(tmp_path)
    assert top_level_names(wheel) == {"empatheia_jax"}
    with zipfile.ZipFile(wheel) as z:
        files = set(z.namelist())
    # the packaged resources travel with it: the emotion maps, the reference model's weights and card, and
    # the page of `empatheia serve`
    for name in ("resources/ed_emotion_projection.json", "resources/reference/card.json",
                 "resources/reference/adapter_model.safetensors", "generators/registry.py",
                 "train/objective.py", "serve/load.py", "serve/static/index.html", "serve/static/app.js",
                 "serve/static/style.css"):
        assert f"empatheia_jax/{name}" in files, name
    entry = next(n for n in files if n.endswith("entry_points.txt"))
    with zipfile.ZipFile(wheel) as z:
        assert "empatheia = empatheia_jax.cli:main" in z.read(entry).decode()


def test_top_level_names_sees_a_stray_package(tmp_path):
    wheel = tmp_path / "x-0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("empatheia_jax/__init__.py", "")
        z.writestr("data/__init__.py", "")
        z.writestr("x-0.dist-info/METADATA", "")
    assert top_level_names(wheel) == {"empatheia_jax", "data"}


def test_a_config_file_loads_from_any_directory_without_configs_installed(tmp_path):
    """configs/ is not installed; the `empatheia` script makes a config file's package importable, so
    `configs/smollm2_demo.py` (which imports `configs.base`) loads from another working directory."""
    script = Path(sys.executable).parent / "empatheia"
    cmd = [str(script), "train", "--config", str(REPO / "configs" / "smollm2_demo.py"), "--workdir",
           str(tmp_path / "run"), "--config.no_such_field=1"]
    r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 2, r.stderr
    assert "config has no field 'no_such_field'" in r.stderr  # the file loaded: only the override is wrong
    assert "Traceback" not in r.stderr


def test_ci_run_sets_ci_unless_the_runner_did(tmp_path):
    """`.ci/run` exports CI=true when the runner leaves it unset (so `require` fails instead of skipping),
    and keeps a value the runner set. A stand-in `make` reports what the test command would see."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "make").write_text('#!/bin/sh\necho "CI=$CI target=$1"\n')
    (bin_dir / "make").chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin"}
    unset = subprocess.run(["bash", str(REPO / ".ci" / "run")], env=env, capture_output=True, text=True)
    assert unset.returncode == 0 and unset.stdout.strip() == "CI=true target=test", unset.stderr
    kept = subprocess.run(["bash", str(REPO / ".ci" / "run")], env={**env, "CI": "1"}, capture_output=True,
                          text=True)
    assert kept.stdout.strip() == "CI=1 target=test"
