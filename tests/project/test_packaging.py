"""What ``pip install lightning-skrull`` installs: the wheel built from this tree.

The tests elsewhere import the package from the source tree (an editable install), so a module,
a data file or a marker that the wheel leaves out would pass them and break every user. Here the
wheel is built with setuptools, as pip builds it, and checked:

- every module of the package, the bundled dataset and ``py.typed`` (PEP 561: without it mypy
  treats the installed package as untyped and reports every import of it in a user's code) are
  in it, with the metadata and the ``skrull-finetune`` entry point;
- unpacked on its own and imported in a fresh process outside the tree, every module imports
  and the bundled dataset loads, and importing the package and its CLI does not import peft
  (the ``[peft]`` extra is optional).

Time: about 10 s (the wheel build, then one process importing every module).
"""

from __future__ import annotations

import configparser
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from helpers import run_python_tool

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("lightning_skrull", "setup.cfg", "pyproject.toml", "README.md")
"""What setuptools reads to build the wheel (a copy of these, so the tree gets no build/)."""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tree = tmp_path_factory.mktemp("tree")
    for name in SOURCES:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(
                source, tree / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
            )
        else:
            shutil.copy2(source, tree / name)
    out = tree / "dist"
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from setuptools import build_meta; print(build_meta.build_wheel(sys.argv[1]))",
            str(out),
        ],
        cwd=tree,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, f"wheel build failed:\n{result.stdout}{result.stderr}"
    return out / result.stdout.strip().splitlines()[-1]


def _package_files() -> set[str]:
    """The package's files that a user needs, relative to the tree: every module, the bundled
    data, and the typing marker."""
    package = ROOT / "lightning_skrull"
    files = {p for p in package.rglob("*.py") if "__pycache__" not in p.parts}
    files |= set((package / "data" / "bundled").glob("*.jsonl"))
    files.add(package / "py.typed")
    return {p.relative_to(ROOT).as_posix() for p in files}


def test_the_wheel_holds_every_module_the_data_and_the_typing_marker(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = _package_files()
    assert "lightning_skrull/py.typed" in expected
    assert "lightning_skrull/data/bundled/mixed_tiny.jsonl" in expected
    assert expected <= names, f"missing from the wheel: {sorted(expected - names)}"


def test_the_wheel_metadata_matches_setup_cfg(wheel: Path) -> None:
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    with zipfile.ZipFile(wheel) as archive:
        info = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = archive.read(info).decode()
        entry_points = archive.read(info.replace("METADATA", "entry_points.txt")).decode()
    python = config["options"]["python_requires"].strip()
    assert f"Requires-Python: {python}" in metadata
    assert "Classifier: Typing :: Typed" in metadata
    for requirement in config["options"]["install_requires"].split():
        name = requirement.split(">")[0].split("[")[0]
        assert f"Requires-Dist: {name}" in metadata, requirement
    assert "skrull-finetune = lightning_skrull.cli:main" in entry_points


def test_every_module_imports_from_the_unpacked_wheel(wheel: Path, tmp_path: Path) -> None:
    """The wheel alone, first on the path of a process started outside the tree: the package
    it imports is the unpacked one, every module of it imports, and the bundled dataset loads
    through ``importlib.resources``."""
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    probe = (
        "import importlib, pkgutil, sys, lightning_skrull, lightning_skrull.cli\n"
        "print('peft' in sys.modules)\n"
        "from lightning_skrull.data.bundled import load_bundled_dataset\n"
        "print(lightning_skrull.__file__)\n"
        "names = [m.name for m in pkgutil.walk_packages(lightning_skrull.__path__, "
        "'lightning_skrull.')]\n"
        "for name in names: importlib.import_module(name)\n"
        "print(len(names), len(load_bundled_dataset('mixed_tiny')))\n"
    )
    result = run_python_tool([sys.executable, "-c", probe], cwd=tmp_path, pythonpath=str(site))
    assert result.returncode == 0, result.stderr
    peft, location, counts = result.stdout.strip().splitlines()[-3:]
    assert peft == "False"  # the [peft] extra is optional: the package and its CLI work without
    assert Path(location).is_relative_to(site), location
    modules, samples = map(int, counts.split())
    in_tree = {p for p in _package_files() if p.endswith(".py")}
    assert modules == len(in_tree) - 1  # every module but the package's own __init__
    assert samples == 384
