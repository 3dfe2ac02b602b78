"""The package keeps its import direction: the import-linter contracts of setup.cfg hold.

scheduling <- attention <- models <- data <- runtime <- strategies <- the public face, the CLI
and the callbacks (docs/architecture.md). ``lint-imports`` reads the contracts from
setup.cfg's ``[importlinter]`` sections; a broken contract fails here with its report, which
names the importing module, the imported one and the line.

Time: about 1 s per ``lint-imports`` run (it parses the imports, it imports nothing).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from helpers import run_python_tool

ROOT = Path(__file__).resolve().parents[2]
CONTRACTS = 7
"""Contracts in setup.cfg; a contract dropped from the file fails the count."""


def _lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` on the package under ``root`` with that tree's setup.cfg."""
    scripts = Path(sysconfig.get_path("scripts"))
    exe = scripts / "lint-imports"
    if not exe.exists():  # a venv whose scripts sit next to the interpreter
        exe = Path(sys.executable).parent / "lint-imports"
    return run_python_tool(
        [str(exe), "--no-cache", str(root / "setup.cfg")], cwd=root, pythonpath=str(root)
    )


def test_import_contracts_hold() -> None:
    result = _lint_imports(ROOT)
    report = result.stdout + result.stderr
    assert result.returncode == 0, f"lint-imports exit status {result.returncode}:\n{report}"
    assert f"Contracts: {CONTRACTS} kept, 0 broken." in report, report


def test_a_back_edge_breaks_the_contracts(tmp_path: Path) -> None:
    # The contracts can fail: the same tree with one upward import (data -> runtime) is refused,
    # and the report names the offending import.
    shutil.copytree(ROOT / "lightning_skrull", tmp_path / "lightning_skrull")
    shutil.copy(ROOT / "setup.cfg", tmp_path / "setup.cfg")
    sampler = tmp_path / "lightning_skrull" / "data" / "sampler.py"
    sampler.write_text(sampler.read_text() + "\nimport lightning_skrull.runtime.engine\n")
    result = _lint_imports(tmp_path)
    report = result.stdout + result.stderr
    assert result.returncode == 1, report
    assert "lightning_skrull.data.sampler -> lightning_skrull.runtime.engine" in report, report
    assert "data and models never import runtime or strategies" in report, report


def test_attention_and_scheduling_import_without_lightning_or_transformers() -> None:
    # The lower layers are importable on their own: the attention package (layout, backends,
    # kernels) needs torch only, scheduling not even that. The package face, which registers
    # the strategy names with Lightning, is left out by importing the subpackages under a bare
    # stand-in for it.
    code = (
        "import sys, types\n"
        "face = types.ModuleType('lightning_skrull')\n"
        f"face.__path__ = [{str(ROOT / 'lightning_skrull')!r}]\n"
        "sys.modules['lightning_skrull'] = face\n"
        "import lightning_skrull.scheduling\n"
        "assert 'torch' not in sys.modules, 'scheduling imported torch'\n"
        "import lightning_skrull.attention.layout, lightning_skrull.attention\n"
        "bad = sorted({m.split('.')[0] for m in sys.modules} & {'lightning', 'transformers'})\n"
        "assert not bad, f'attention imported {bad}'\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
