"""benchmarks/RESULTS.md, one part at a time: a benchmark run alone (``--write``) replaces its
own section and leaves the others as they are (``run_all.py`` rewrites the whole file)."""
from __future__ import annotations

import os
import re

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md")


def put_section(heading: str, body: str) -> None:
    """Replace the section that starts with the line ``heading`` (up to the next top-level
    heading) by ``heading`` + ``body``, or append it when the file has none."""
    with open(PATH) as f:
        text = f.read()
    section = f"{heading}\n\n{body}"
    m = re.search(rf"^{re.escape(heading)}\n.*?(?=^# |\Z)", text, flags=re.S | re.M)
    text = text[:m.start()] + section + "\n" + text[m.end():] if m else text.rstrip("\n") + "\n\n" + section
    with open(PATH, "w") as f:
        f.write(text)
