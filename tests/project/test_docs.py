"""Every Python snippet in README.md and docs/*.md runs, so the docs cannot rot.

Each ```python block is written to a file and run as ``__main__`` in a process of its own,
forked from a process that imported torch, transformers, Lightning and the package (so Lightning
may launch its other ranks by re-running that script, exactly as it would for a user), two at a
time.
A block whose script ends with a non-zero exit status fails the test with its output.
Blocks that belong together are written as one block; nothing is skipped. A block that appears
verbatim in several places (the README's example is also the docs' front page) runs once, under
the names of all its places. Every relative link of those pages must point at a file that
exists, and a ``#fragment`` at a heading of the page; no wrapped line may start a block quote by
accident; setup.cfg's version floors are the lowest the suite ran on.
"""

from __future__ import annotations

import functools
import itertools
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from doc_pages import DOC_FILES, ROOT, SNIPPETS

_LINK = re.compile(r"\]\(([^)#\s]*)(#[^)\s]*)?\)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")


def _prose_lines(text: str) -> list[str]:
    """The lines of a Markdown page outside fenced code blocks (a ``# comment`` in a block is
    not a heading, nor a ``](x)`` in it a link)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


@functools.cache  # every link into a page reads the same headings
def _anchors(path: Path) -> frozenset[str]:
    """The ``#fragment`` names of a page's headings, as GitHub makes them: links unwrapped to
    their text, lower case, every character but letters, digits, ``_``, ``-`` and spaces
    dropped, spaces made ``-``, and ``-1``, ``-2``, ... after repeats."""
    repeats: dict[str, int] = {}
    names = set()
    for line in _prose_lines(path.read_text()):
        heading = _HEADING.match(line)
        if heading is None:
            continue
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading[1]).strip().lower()
        slug = re.sub(r"[^\w\- ]", "", text).replace(" ", "-")
        count = repeats.get(slug, 0)
        repeats[slug] = count + 1
        names.add(slug if count == 0 else f"{slug}-{count}")
    return frozenset(names)


def test_docs_have_python_snippets() -> None:
    # The README's runnable example at least; an empty list would make the test below vacuous.
    assert any("README.md" in name for name, _ in SNIPPETS)


@pytest.mark.parametrize("path", DOC_FILES, ids=[str(p.relative_to(ROOT)) for p in DOC_FILES])
def test_relative_links_resolve(path: Path) -> None:
    """Every relative link points at a file that exists and, with a ``#fragment`` into a
    Markdown page, at one of that page's headings."""
    missing = []
    for line in _prose_lines(path.read_text()):
        for target, fragment in _LINK.findall(line):
            if "://" in target or target.startswith("mailto:"):
                continue
            file = path.parent / target if target else path
            if not file.exists():
                missing.append(target)
            elif fragment and file.suffix == ".md" and fragment[1:] not in _anchors(file):
                missing.append(target + fragment)
    assert not missing, f"{path.relative_to(ROOT)} links to missing files or headings: {missing}"


@pytest.mark.parametrize("path", DOC_FILES, ids=[str(p.relative_to(ROOT)) for p in DOC_FILES])
def test_no_paragraph_line_starts_a_quote(path: Path) -> None:
    """A wrapped line that begins with ``>`` (``>= 3.0``, say) interrupts its paragraph and
    renders as a block quote."""
    lines = _prose_lines(path.read_text())
    quoted = [
        line
        for before, line in itertools.pairwise(lines)
        if line.startswith(">") and before.strip() and not before.startswith(">")
    ]
    assert not quoted, f"{path.relative_to(ROOT)}: lines that would start a quote: {quoted}"


def _exec_snippet(script: str, env: dict[str, str], log: str) -> None:
    """The body of a snippet's process: ``script`` run as ``__main__`` from its folder, its
    stdout and stderr (and those of any process it starts) written to ``log``. An exception's
    traceback and the exit status are multiprocessing's (status 1, or the ``SystemExit``
    code)."""
    import runpy

    os.environ.clear()
    os.environ.update(env)
    os.chdir(os.path.dirname(script))
    sys.argv = [script]
    sys.path[0:0] = [os.path.dirname(script)]
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    runpy.run_path(script, run_name="__main__")


def _run(code: str, directory: Path, port: int) -> subprocess.CompletedProcess[str]:
    """Run ``code`` as the script ``snippet.py`` in ``directory``, in a process of its own; a
    snippet launching several ranks gets its own ``MASTER_PORT``, since two snippets run at
    once.

    The process is forked from the fork server of ``lightning_skrull.runtime.launch.spawn``,
    which imported torch, transformers, Lightning and the package once (their imports are most
    of a snippet's time: about 7 s a process on two cores); the snippet then runs as
    ``__main__`` with ``sys.argv == [script]``, so Lightning starts any other ranks by running
    ``python snippet.py`` afresh, as it would for a user.
    """
    from lightning_skrull.runtime.launch import _context

    script = directory / "snippet.py"
    script.write_text(code)
    log = directory / "output.log"
    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        PYTHONUNBUFFERED="1",
        MPLBACKEND="Agg",
        MASTER_PORT=str(port),
    )
    process = _context("forkserver").Process(
        target=_exec_snippet, args=(str(script), env, str(log))
    )
    process.start()
    process.join(timeout=300)
    if process.is_alive():
        process.kill()
        process.join()
    output = log.read_text() if log.exists() else ""
    return subprocess.CompletedProcess([str(script)], process.exitcode or 0, output, output)


@pytest.fixture(scope="module")
def snippet_runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, subprocess.CompletedProcess[str]]:
    """The processes of the selected snippets, two at a time (most of each is the start-up's
    imports, on one core): half the wall time of running them one by one on two cores."""
    selected = {
        item.callspec.params["name"]
        for item in request.session.items
        if getattr(item, "originalname", None) == "test_snippet_runs"
    }
    jobs = [(name, code) for name, code in SNIPPETS if name in selected]
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {
            name: pool.submit(_run, code, tmp_path_factory.mktemp("snippet"), 29_600 + i)
            for i, (name, code) in enumerate(jobs)
        }
        return {name: future.result() for name, future in futures.items()}


@pytest.mark.parametrize(("name", "code"), SNIPPETS, ids=[n for n, _ in SNIPPETS])
def test_snippet_runs(
    name: str, code: str, snippet_runs: dict[str, subprocess.CompletedProcess[str]]
) -> None:
    proc = snippet_runs[name]
    assert proc.returncode == 0, (
        f"snippet {name} exited with {proc.returncode}\n--- stdout ---\n{proc.stdout[-4000:]}"
        f"\n--- stderr ---\n{proc.stderr[-4000:]}"
    )


_FLOOR = re.compile(r"^\s+([A-Za-z0-9_-]+)(?:\[[^\]]*\])?>=([0-9][0-9a-z.]*)", re.MULTILINE)


def test_version_floors_are_the_lowest_tested() -> None:
    """Every lower bound of setup.cfg's install_requires is the release series of the
    'lowest' column of docs/quickstart.md's version table, where the whole suite passed: a
    floor moved without that run (or the table without the floor) fails here."""
    requires = (ROOT / "setup.cfg").read_text().split("install_requires =", 1)[1]
    floors = dict(_FLOOR.findall(requires.split("\n\n", 1)[0]))
    assert {"torch", "transformers", "lightning"} <= floors.keys()
    section = (ROOT / "docs" / "quickstart.md").read_text().split("## Versions", 1)[1]
    rows = {
        cells[0]: cells
        for line in section.split("\n## ", 1)[0].splitlines()
        if line.startswith("| ")
        for cells in [[c.strip() for c in line.strip("|").split("|")]]
    }
    for package, floor in floors.items():
        lowest = rows[package][3]
        assert lowest == floor or lowest.startswith(floor + "."), (package, floor, lowest)
    # Python: python_requires is the lowest version the suite ran on, and every version a
    # classifier names ran the whole suite (it appears in the table's Python row).
    setup = (ROOT / "setup.cfg").read_text()
    python_floor = re.search(r"python_requires\s*=\s*>=\s*([0-9.]+)", setup)
    assert python_floor is not None
    python_row = rows["Python"]
    assert python_row[1] == f">= {python_floor[1]}", python_row
    assert python_row[3].startswith(python_floor[1]), python_row
    tested = set(re.findall(r"\b3\.[0-9]+\b", " ".join(python_row[2:])))
    classified = set(re.findall(r"Programming Language :: Python :: (3\.[0-9]+)", setup))
    assert classified and classified <= tested, (sorted(classified), sorted(tested))
    assert min(classified, key=lambda v: int(v.split(".")[1])) == python_floor[1]
