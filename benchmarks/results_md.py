"""benchmarks/RESULTS.md, one part at a time: a benchmark run alone (``--write``) replaces its
own section and leaves the others as they are (``run_all.py`` rewrites the whole file)."""
from __future__ import annotations

import argparse
import json
import os
import re
from collections.abc import Callable

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


def main(heading: str, run: Callable[[bool], dict], markdown: Callable[[dict], str], quick_help: str) -> None:
    """The command line of a benchmark with one part: ``--quick`` (``quick_help``), ``--json FILE``
    (the figures, for run_all.py), ``--write`` (its section into RESULTS.md); prints the section."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help=quick_help)
    ap.add_argument("--json", help="write the figures here (benchmarks/run_all.py reads them)")
    ap.add_argument("--write", action="store_true", help="put the section into benchmarks/RESULTS.md")
    a = ap.parse_args()
    r = run(a.quick)
    print(markdown(r))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=1)
    if a.write:
        put_section(heading, markdown(r))
