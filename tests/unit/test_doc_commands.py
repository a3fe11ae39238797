"""The commands README.md and docs/ show with their output, run as written (the cheap ones: no Ray, no server),
and compared with what the page shows. The ones that need a deployment are in
``tests/e2e/test_served_doc_commands.py``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from support.doc_blocks import REPO, block, console, shape

PDSERVE = [sys.executable, "-m", "pdserve.cli.main"]


def run(command: str, cwd: Path, merge: bool = False) -> subprocess.CompletedProcess[str]:
    """A documented ``pdserve ...`` command line, run with this interpreter's pdserve."""
    assert command.startswith("pdserve "), command
    argv = [*PDSERVE, *_split(command[len("pdserve ") :])]
    stderr = subprocess.STDOUT if merge else subprocess.PIPE
    return subprocess.run(argv, cwd=cwd, stdout=subprocess.PIPE, stderr=stderr, text=True, timeout=240)


def _split(args: str) -> list[str]:
    import shlex

    return shlex.split(args.split("  #", 1)[0].split(" #", 1)[0])


def test_pdserve_sim_demo(tmp_path):
    """README's tour, step 3, and the simulator page: what ``pdserve sim --demo`` prints."""
    readme = block("README.md", "pdserve sim --demo")
    result = run(readme.command.strip(), tmp_path)
    assert result.returncode == 0, result.stderr
    assert shape(result.stdout) == shape(readme.output)  # the simulator's own speed differs from run to run
    page = block("docs/simulator.md", "pdserve sim --demo")
    merged = run(page.command.strip().splitlines()[0], tmp_path, merge=True)
    assert shape(merged.stdout) == shape(page.output)


def test_tokenizer_export(tmp_path):
    page = block("docs/serving.md", "pdserve tokenizer export")
    command, output = console(page.command)[0]
    folder = str(tmp_path / "smollm2-tokenizer")
    result = run(command.replace("/tmp/smollm2-tokenizer", folder), REPO)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == output.replace("/tmp/smollm2-tokenizer", folder).strip()
    assert sorted(os.listdir(folder)) == ["tokenizer.json", "tokenizer_config.json"]


def test_a_token_off_loopback_without_tls_is_refused():
    page = block("docs/operations.md", "pdserve serve --host 0.0.0.0 --http-port 8443 --auth-token")
    [(command, output)] = console(page.command)
    result = run(command.replace('"$TOKEN"', "secret"), REPO)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip() == output.strip()


def test_help_lists_every_command_in_plain_text(capsys):
    import pytest

    from pdserve.cli.main import PASSTHROUGH, build_parser, main

    with pytest.raises(SystemExit):
        main(["--help"])
    top = capsys.readouterr().out
    commands = next(line for line in top.splitlines() if line.startswith("Commands:"))
    names = [*build_parser()._subparsers._group_actions[0].choices]  # type: ignore[union-attr]
    assert set(PASSTHROUGH) <= set(names) and all(name in commands for name in names), commands
    for name in PASSTHROUGH:
        with pytest.raises(SystemExit):
            main([name, "--help"])
        text = capsys.readouterr().out
        assert text.startswith(f"usage: pdserve {name}") and "``" not in text, text
