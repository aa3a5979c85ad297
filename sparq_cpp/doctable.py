"""Tables in the docs rendered from evidence files: the command-line entry of a renderer, and the block of a page
that a renderer's output fills (between `<!-- NAME: FILE ... -->` and `<!-- /NAME -->`)."""
from __future__ import annotations

import sys
from pathlib import Path

from sparq_cpp.errors import SparqError


def main(argv, markdown, usage: str) -> int:
    """Print markdown(files) for the files in argv; a usage line without files, one error line on a bad file."""
    if not argv:
        print(f"usage: {usage}", file=sys.stderr)
        return 2
    try:
        sys.stdout.write(markdown(argv))
    except (SparqError, OSError, KeyError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def markdown_table(head: list, rows: list) -> str:
    """A markdown table of the rows (lists of cell texts) under head."""
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join("---" for _ in head) + " |"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def marked_block(page: Path, name: str) -> tuple[list, str]:
    """(the files the marker names, the text between the marker and its end) of the block NAME on page."""
    text = Path(page).read_text(encoding="utf-8")
    start = text.index(f"<!-- {name}: ")
    files = text[start:text.index(" -->", start)].split(": ", 1)[1].split()
    return files, text[text.index("-->", start) + 4:text.index(f"<!-- /{name} -->", start)]
