"""docs/configuration.md cannot drift from the code: its tables are generated from docstrings.

Every argument of the strategies, the data module and the plan-picture callback must be in its
class's ``Args:`` docstring section, and every field of the config dataclasses must carry a
docstring. The tables between ``<!-- generated:NAME -->`` and ``<!-- end:NAME -->`` in
docs/configuration.md must equal what this module renders from those docstrings and the
signatures' defaults. After changing a docstring, regenerate them with::

    python tests/project/test_configuration_docs.py --write
"""

from __future__ import annotations

import ast
import inspect
import itertools
import re
import sys
import textwrap
from collections.abc import Callable
from dataclasses import fields, is_dataclass
from pathlib import Path

import pytest
from lightning.pytorch.strategies import StrategyRegistry

import lightning_skrull
from lightning_skrull.callbacks import PlanPictureCallback
from lightning_skrull.config import DataConfig, SkrullConfig

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "configuration.md"
FIX = (
    "run `python tests/project/test_configuration_docs.py --write` and commit docs/configuration.md"
)

CLASSES: dict[str, type] = {
    "SkrullStrategy": lightning_skrull.SkrullStrategy,
    "SkrullZero2Strategy": lightning_skrull.SkrullZero2Strategy,
    "SkrullFSDPStrategy": lightning_skrull.SkrullFSDPStrategy,
    "SkrullDataModule": lightning_skrull.SkrullDataModule,
    "PlanPictureCallback": PlanPictureCallback,
}
DATACLASSES: dict[str, type] = {"SkrullConfig": SkrullConfig, "DataConfig": DataConfig}


# --------------------------------------------------------------------------- docstrings
def rst_to_markdown(text: str) -> str:
    """Inline reStructuredText of the docstrings as Markdown (one line)."""
    text = " ".join(text.split())
    text = re.sub(r":(?:class|func|meth|attr|data|mod):`~?([\w.]+)`", _last_part, text)
    return text.replace("``", "`").replace("|", "\\|")


def _last_part(match: re.Match[str]) -> str:
    return f"`{match.group(1).split('.')[-1]}`"


def parse_args_section(doc: str) -> list[tuple[list[str], str]]:
    """``[(names, text)]`` of a Google-style ``Args:`` section (``a, b: text`` gives two names)."""
    lines = inspect.cleandoc(doc).splitlines()
    try:
        start = lines.index("Args:") + 1
    except ValueError:
        return []
    entries: list[tuple[list[str], list[str]]] = []
    pending: list[str] | None = None  # names continued on the next line ("a, b,\n  c: text")
    for line in lines[start:]:
        if line and not line.startswith(" "):
            break  # the next section
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        body = line.strip()
        if indent == 4 and pending is None:
            head, sep, rest = body.partition(": ")
            if not sep and body.endswith(":"):
                head, sep, rest = body[:-1], ":", ""
            if sep and re.fullmatch(r"[\w*]+(, [\w*]+)*", head):
                entries.append(([n.strip() for n in head.split(",")], [rest]))
                continue
            if re.fullmatch(r"[\w*]+(, [\w*]+)*,", body):
                pending = [n.strip() for n in body.rstrip(",").split(",")]
                continue
            raise AssertionError(f"cannot parse Args line {line!r}")
        if pending is not None:
            head, sep, rest = body.partition(": ")
            names = [n.strip() for n in head.split(",") if n.strip()]
            if sep:
                entries.append((pending + names, [rest]))
                pending = None
            else:
                pending += names
            continue
        entries[-1][1].append(body)
    return [(names, " ".join(text)) for names, text in entries]


def _default(parameter: inspect.Parameter) -> str:
    if parameter.kind is inspect.Parameter.VAR_KEYWORD:
        return ""
    if parameter.default is inspect.Parameter.empty:
        return "required"
    value = parameter.default
    if isinstance(value, str):
        return f'`"{value}"`'
    return f"`{value!r}`".replace("datetime.", "")


def _parameters(cls: type) -> dict[str, inspect.Parameter]:
    out = {}
    for name, p in inspect.signature(cls.__init__).parameters.items():
        if name == "self":
            continue
        key = f"**{name}" if p.kind is inspect.Parameter.VAR_KEYWORD else name
        out[key] = p
    return out


def class_table(cls: type) -> str:
    """| argument | default | meaning | rows of ``cls``'s constructor, in signature order."""
    params = _parameters(cls)
    docs: dict[str, str] = {}
    for names, text in parse_args_section(cls.__doc__ or ""):
        for name in names:
            docs[name] = rst_to_markdown(text)
    rows = ["| argument | default | meaning |", "|---|---|---|"]
    for name, p in params.items():
        rows.append(f"| `{name}` | {_default(p)} | {docs.get(name, '**undocumented**')} |")
    return "\n".join(rows)


def field_docstrings(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass (read from its source)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    out = {}
    for node, nxt in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            out[node.target.id] = nxt.value.value
    return out


def dataclass_table(cls: type) -> str:
    """| field | default | meaning | rows of a config dataclass, from its field docstrings."""
    assert is_dataclass(cls)
    docs = field_docstrings(cls)
    rows = ["| field | default | meaning |", "|---|---|---|"]
    for f in fields(cls):
        default = _default_value(f.default)
        text = rst_to_markdown(docs.get(f.name, "**undocumented**"))
        rows.append(f"| `{f.name}` | {default} | {text} |")
    return "\n".join(rows)


def _default_value(value: object) -> str:
    from dataclasses import MISSING

    if value is MISSING:
        return "required"
    return f'`"{value}"`' if isinstance(value, str) else f"`{value!r}`"


def strategy_names() -> str:
    """The strategy names this package registers with Lightning, with their descriptions."""
    rows = ["| name | what it is |", "|---|---|"]
    for name in sorted(StrategyRegistry):
        entry = StrategyRegistry[name]
        if entry["strategy"].__module__.startswith("lightning_skrull"):
            rows.append(f'| `"{name}"` | {entry["description"]} |')
    return "\n".join(rows)


GENERATORS: dict[str, Callable[[], str]] = {
    **{name: (lambda c=cls: class_table(c)) for name, cls in CLASSES.items()},
    **{name: (lambda c=cls: dataclass_table(c)) for name, cls in DATACLASSES.items()},
    "strategy-names": strategy_names,
}


# --------------------------------------------------------------------------- the document
def _block(name: str) -> re.Pattern[str]:
    return re.compile(
        rf"(<!-- generated:{re.escape(name)} -->\n)(.*?)(<!-- end:{re.escape(name)} -->)",
        re.DOTALL,
    )


def rendered_blocks(text: str) -> dict[str, str]:
    """The generated blocks found in ``text``, by name."""
    found = {}
    for name in GENERATORS:
        match = _block(name).search(text)
        if match:
            found[name] = match.group(2)
    return found


def regenerate(text: str) -> str:
    """``text`` with every generated block rendered anew."""
    for name, generate in GENERATORS.items():
        text = _block(name).sub(lambda m, g=generate: m.group(1) + g() + "\n" + m.group(3), text)
    return text


def console_examples(text: str) -> list[tuple[str, str]]:
    """``(expression, shown output)`` of the ``>>>`` lines in the ```text blocks of ``text``."""
    pairs: list[tuple[str, list[str]]] = []
    for block in re.findall(r"^```text\n(.*?)^```", text, re.DOTALL | re.MULTILINE):
        for line in block.splitlines():
            if line.startswith(">>> "):
                pairs.append((line[4:], []))
            elif pairs:
                pairs[-1][1].append(line)
    return [(expr, "\n".join(out)) for expr, out in pairs]


# --------------------------------------------------------------------------- tests
@pytest.mark.parametrize("name", list(CLASSES))
def test_every_argument_is_in_the_docstring(name: str) -> None:
    cls = CLASSES[name]
    documented = {n for names, _ in parse_args_section(cls.__doc__ or "") for n in names}
    missing = [p for p in _parameters(cls) if p not in documented]
    assert not missing, f"{name} arguments without an Args: docstring entry: {missing}"
    extra = sorted(documented - set(_parameters(cls)))
    assert not extra, f"{name} documents arguments it does not take: {extra}"


@pytest.mark.parametrize("name", list(DATACLASSES))
def test_every_config_field_has_a_docstring(name: str) -> None:
    cls = DATACLASSES[name]
    docs = field_docstrings(cls)
    missing = [f.name for f in fields(cls) if f.name not in docs]
    assert not missing, f"{name} fields without a docstring: {missing}"


def test_configuration_md_is_generated_from_the_docstrings() -> None:
    text = DOC.read_text()
    blocks = rendered_blocks(text)
    assert sorted(blocks) == sorted(GENERATORS), (
        f"docs/configuration.md lacks generated blocks {sorted(set(GENERATORS) - set(blocks))}"
    )
    stale = [name for name, body in blocks.items() if body != GENERATORS[name]() + "\n"]
    assert not stale, f"docs/configuration.md is out of date for {stale}; {FIX}"


def test_console_examples_show_what_the_code_does() -> None:
    examples = console_examples(DOC.read_text())
    assert len(examples) >= 3  # the page's examples were found (else this test is vacuous)
    namespace = {name: getattr(lightning_skrull, name) for name in lightning_skrull.__all__}
    for expression, shown in examples:
        try:
            got = repr(eval(expression, namespace))
        except (ValueError, TypeError) as err:
            got = f"{type(err).__name__}: {err}"
        assert got == shown, (
            f"docs/configuration.md shows for {expression!r}:\n{shown}\ngot:\n{got}"
        )


def test_parser_reads_grouped_and_continued_entries() -> None:
    doc = """Summary.

    Args:
        a: first line
            continued.
        b, c: shared text.
        d, e,
            f: text after a name list broken over two lines.
        **kw: passed on.

    Raises:
        ValueError: never parsed as an argument.
    """
    assert parse_args_section(doc) == [
        (["a"], "first line continued."),
        (["b", "c"], "shared text."),
        (["d", "e", "f"], "text after a name list broken over two lines."),
        (["**kw"], "passed on."),
    ]
    assert rst_to_markdown("see :class:`~a.b.Cls` and ``x | y``") == "see `Cls` and `x \\| y`"


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        raise SystemExit("usage: python tests/project/test_configuration_docs.py --write")
    DOC.write_text(regenerate(DOC.read_text()))
    print(f"regenerated {DOC}")
