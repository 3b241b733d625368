"""Shared by the benchmark scripts: machine description and RESULTS.md sections."""

from __future__ import annotations

import datetime
import os
import platform
import re
import sys
from pathlib import Path

import psutil
import torch

RESULTS = Path(__file__).with_name("RESULTS.md")


def machine() -> str:
    """One line naming the machine, OS, Python and torch a figure was measured on."""
    cpu = platform.processor() or platform.machine()
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return (
        f"{os.cpu_count()} CPU cores ({cpu}), {psutil.virtual_memory().total / 2**30:.0f} GiB RAM, "
        f"{gpu}; {platform.system()} {platform.release()}, Python {platform.python_version()}, "
        f"torch {torch.__version__}"
    )


def header(command: str) -> str:
    today = datetime.date.today().isoformat()
    return f"- Machine: {machine()}\n- Date: {today}\n- Command: `{command}`\n"


def markdown_table(head: list[str], rows: list[list[object]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def write_section(title: str, body: str) -> None:
    """Replace (or append) the ``## title`` section of RESULTS.md with ``body``."""
    text = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n"
    section = f"## {title}\n\n{body.strip()}\n"
    pattern = re.compile(rf"^## {re.escape(title)}\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _: section + "\n", text)
    else:
        text = text.rstrip("\n") + "\n\n" + section
    RESULTS.write_text(text.rstrip("\n") + "\n")
    print(f"wrote section '{title}' of {RESULTS}", file=sys.stderr)
