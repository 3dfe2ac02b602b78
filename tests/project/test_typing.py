"""The package type-checks under mypy with the project's settings ([tool.mypy] in pyproject.toml),
and so does every Python snippet of README.md and docs/*.md, as a user's code.

Guards the annotations users and the modules rely on (plan types, layouts, the strategy's and
the data module's signatures) against drifting from the code: a wrong ``X | None``, a call with
the wrong argument type or an attribute that does not exist fails here, not at run time. The
package ships ``py.typed``, so a user's mypy reads these annotations: the documented calls
(``prepare_model(Qwen2ForCausalLM(...)).config``, the data module's and strategies' arguments)
must type-check as written. The same mypy run checks each snippet, written to a file named after
its place. mypy is a dev extra; CI installs it.

Time: a few seconds with a warm ``.mypy_cache``; with a cold one (a fresh checkout, as in CI)
mypy first reads the annotations of torch and Lightning: about 29 s on two cores with mypy's
parallel workers, 37-42 s without (56 s when it also read transformers', which pyproject.toml
now leaves out: its names are ``Any`` to mypy).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from doc_pages import SNIPPETS

ROOT = Path(__file__).resolve().parents[2]


def _write_snippets(folder: Path) -> list[Path]:
    """Each documented snippet as a module of ``folder``, named after its first place
    (``docs/models.md:606#2`` becomes ``doc_models_606.py``)."""
    files = []
    for places, code in SNIPPETS:
        doc, line = places.split("+")[0].split("#")[0].split(":")
        path = folder / f"doc_{Path(doc).stem.lower()}_{line}.py"
        path.write_text(code)
        files.append(path)
    return files


def test_package_and_documented_snippets_type_check_without_errors(tmp_path: Path) -> None:
    pytest.importorskip("mypy")
    snippets = _write_snippets(tmp_path)
    assert len(snippets) == len(SNIPPETS) > 0
    # mypy's command line in a child process, not mypy.api.run in this one: the API leaves the
    # whole build (about 1.7 GB with torch and transformers) in the test process, and tearing
    # it down adds about 45 s at exit; the command line exits without that teardown.
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--num-workers",  # mypy's parallel checking: 37 s -> 30 s cold on two cores
            "auto",
            "--config-file",
            str(ROOT / "pyproject.toml"),
            "--cache-dir",
            str(ROOT / ".mypy_cache"),
            str(ROOT / "lightning_skrull"),
            *map(str, snippets),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    # Status 1 lists the errors; 2 is a crash or a bad invocation (no report at all). Either
    # fails, with mypy's output in the message.
    assert result.returncode == 0, (
        f"mypy exit status {result.returncode}:\n{result.stdout}{result.stderr}"
    )
