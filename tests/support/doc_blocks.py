"""The command blocks of README.md and docs/ that show what a command prints, for the tests that check them.

A block "claims an output" when the next block of its section shows what it prints (after a sentence, maybe),
when it is a ``console`` block of ``$``-prompted commands followed by their output, or when it says ``# prints:``.
The last marker above such a block in its section names the test that runs it (``<!-- checked by
tests/...py::test_x -->``) or marks it as an example (``<!-- illustration -->``: figures of one run, timing,
random weights).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[2]
FENCED = re.compile(r"^(```|~~~)([^\n]*)\n(.*?)^\1[ \t]*$", re.MULTILINE | re.DOTALL)
HEADING = re.compile(r"^#{1,6}\s", re.MULTILINE)
COMMAND = re.compile(
    r"^(\$ )?(pdserve (generate|serve|status|demo|bench|sim|tokenizer)"
    r"|(python3?|bash|curl|grpcurl|grpc_health_probe|ray|lm_eval|aiperf|guidellm) |HF_\w+=)"
)
MARKER = re.compile(r"<!--\s*(illustration|checked by (\S+?)::(\w+))\s*-->\s*$")
NUMBER = re.compile(r"\d[\d,]*(\.\d+)?")


class OutputBlock(NamedTuple):
    path: Path
    line: int
    command: str  # the command block's text
    output: str  # what the page shows it printing
    marker: str | None  # the last marker above it in its section: illustration, or the test that runs it


def doc_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def _command_block(info: str, body: str) -> bool:
    first = body.strip().splitlines()[0] if body.strip() else ""
    return info in ("bash", "sh", "shell", "console") or (info == "" and bool(COMMAND.match(first)))


def output_blocks(path: Path) -> list[OutputBlock]:
    text = path.read_text()
    fences = list(FENCED.finditer(text))
    found = []
    for i, fence in enumerate(fences):
        info, body = fence.group(2).strip(), fence.group(3)
        following = fences[i + 1] if i + 1 < len(fences) else None
        output = None
        if following is not None and (info == "python" or _command_block(info, body)):
            between = text[fence.end() : following.start()]
            shown = following.group(2).strip() in ("", "text", "json") and not _command_block("", following.group(3))
            if shown and not HEADING.search(between):
                output = following.group(3)
        if output is None and _command_block(info, body):
            lines = body.splitlines()
            prompted = [k for k, line in enumerate(lines) if line.startswith("$ ")]
            if prompted and any(
                not line.startswith(("$ ", "  ", "\t")) and line.strip() for line in lines[prompted[0] :]
            ):
                output = body
            elif "# prints:" in body:
                output = body.split("# prints:", 1)[1]
        if output is None:
            continue
        section = HEADING.split(FENCED.sub("", text[: fence.start()]))[-1]  # its prose since the last heading
        markers = [m for m in (MARKER.search(line) for line in section.splitlines()) if m]
        marker = markers[-1] if markers else None
        line = text[: fence.start()].count("\n") + 1
        found.append(OutputBlock(path, line, body, output, marker.group(1) if marker else None))
    return found


def block(page: str, starts: str) -> OutputBlock:
    """The output block of ``page`` (relative to the repository) whose command starts with ``starts``."""
    matches = [b for b in output_blocks(REPO / page) if b.command.lstrip("$ ").startswith(starts)]
    if len(matches) != 1:
        raise LookupError(f"{page}: {len(matches)} output blocks start with {starts!r}")
    return matches[0]


def console(body: str) -> list[tuple[str, str]]:
    """A ``console`` block's ``(command, output)`` pairs; a command's continuation lines join it."""
    pairs: list[tuple[str, list[str]]] = []
    for line in body.splitlines():
        if line.startswith("$ "):
            pairs.append((line[2:], []))
        elif pairs and pairs[-1][0].endswith("\\") and not pairs[-1][1]:
            pairs[-1] = (pairs[-1][0][:-1] + line.strip(), [])
        elif pairs:
            pairs[-1][1].append(line)
    return [(command, "\n".join(out)) for command, out in pairs]


def shape(text: str) -> list[str]:
    """``text``'s lines with every number as ``#`` and runs of spaces as one: what a page shows of an output
    whose figures differ from run to run."""
    return [" ".join(NUMBER.sub("#", line).split()) for line in text.strip().splitlines()]
