"""Redraw the pictures of docs/how_it_works.md by running its Python example in docs/img/.

The example writes ``plan_skrull.png`` and ``plan_static.png`` into the folder it runs in;
running it here makes the committed pictures exactly what the documented code draws::

    python docs/img/make_pictures.py
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
DOC = HERE.parent / "how_it_works.md"


def main() -> None:
    """Run the first ``python`` block of how_it_works.md with docs/img/ as working folder."""
    blocks = re.findall(r"^```python\n(.*?)^```", DOC.read_text(), re.DOTALL | re.MULTILINE)
    if not blocks:
        raise SystemExit(f"{DOC} has no python block")
    env = dict(os.environ, MPLBACKEND="Agg")
    subprocess.run([sys.executable, "-c", blocks[0]], cwd=HERE, env=env, check=True)
    print(f"redrew {', '.join(sorted(p.name for p in HERE.glob('plan_*.png')))} in {HERE}")


if __name__ == "__main__":
    main()
