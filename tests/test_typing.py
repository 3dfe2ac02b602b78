"""The package type-checks under mypy with the project's settings ([tool.mypy] in pyproject.toml).

Guards the annotations users and the modules rely on (plan types, layouts, the strategy's and
the data module's signatures) against drifting from the code: a wrong ``X | None``, a call with
the wrong argument type or an attribute that does not exist fails here, not at run time. mypy
is a dev extra; CI installs it.

Time: a few seconds with a warm ``.mypy_cache``; with a cold one (a fresh checkout, as in CI)
mypy first reads the annotations of torch, transformers and Lightning: 70 to 90 s on two cores.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

NOT_YET_CHECKED = ("lightning_skrull/scheduling/",)
"""Package paths whose mypy errors this test does not count yet. Empty it once they are clean."""

_ERROR_LINE = re.compile(r"^(?P<path>.+?):\d+(?::\d+)?: error: ")


def _counted(path: str) -> bool:
    posix = Path(path).as_posix()
    return not any(prefix in posix for prefix in NOT_YET_CHECKED)


def test_package_type_checks_without_errors() -> None:
    pytest.importorskip("mypy")
    # mypy's command line in a child process, not mypy.api.run in this one: the API leaves the
    # whole build (about 1.7 GB with torch and transformers) in the test process, and tearing
    # it down adds about 45 s at exit; the command line exits without that teardown.
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--config-file",
            str(ROOT / "pyproject.toml"),
            "--cache-dir",
            str(ROOT / ".mypy_cache"),
            str(ROOT / "lightning_skrull"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    stdout, status = result.stdout, result.returncode
    # Status 2 is a crash or a bad invocation: no report at all, which must not pass as clean.
    assert status in (0, 1), f"mypy did not run (exit status {status}):\n{result.stderr}{stdout}"
    reported = [m for line in stdout.splitlines() if (m := _ERROR_LINE.match(line))]
    assert status == 0 or reported, f"mypy failed without reporting an error:\n{stdout}"
    errors = [m.string for m in reported if _counted(m["path"])]
    assert not errors, f"mypy reports {len(errors)} error(s):\n" + "\n".join(errors)
