"""Regenerate the capacity planner's verdicts and outputs quoted in README.md and docs/*.md, in place.

    python scripts/update_capacity_docs.py [FILE.md ...] [--check]

Without files: README.md and docs/*.md. `--check` changes nothing and exits 1 where a file is out of date (what
test/test_docs_capacity.py asserts, with the same parser). Two conventions:

1. Recipe rows. A markdown table row with a code span holding a launch command (`python -m sglang.launch_server
   FLAGS`), a cell naming the GPUs (`8 × H200`; `8 x H200` too; H200, B200 or MI355X) and a verdict cell (starting
   with `fits` or `does not fit`): the verdict is the line `python -m sglang.check_capacity --gpu h200 FLAGS
   --summary` prints, and the GPU count must equal the command's --tp.
2. Output blocks. A ```bash block holding one `python -m sglang.check_capacity ...` command, followed at once (blank
   lines aside) by a ```text block: the text block is what the command prints (stdout), verbatim. A planner command
   in a ```bash block without a text block after it must still run: exit 0 (fits) or 1 (does not fit).

The planner runs in this process (sglang.check_capacity.main), once per distinct command.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import glob
import io
import os
import re
import shlex
import sys
from dataclasses import dataclass
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH = ("python", "-m", "sglang.launch_server")
PLANNER = ("python", "-m", "sglang.check_capacity")
GPU_CELL = re.compile(r"(\d+)\s*[×x]\s*(H200|B200|MI355X)")
VERDICT = re.compile(r"(fits|does not fit)\b")
CODE_SPAN = re.compile(r"`([^`]+)`")
FENCE = re.compile(r"^```\s*([\w-]*)\s*$")
REGENERATE = "python scripts/update_capacity_docs.py"


@dataclass(frozen=True)
class Cell:
    text: str  # stripped
    start: int  # its span in the row's line, between the pipes
    end: int


def split_cells(line: str) -> list:
    """The cells of a markdown table row (pipes inside code spans or escaped do not split)."""
    body = line.rstrip("\n")
    i = body.index("|") + 1 if body.lstrip().startswith("|") else 0
    cells, start, tick = [], i, False
    while i < len(body):
        if body[i] == "\\":
            i += 2
            continue
        if body[i] == "`":
            tick = not tick
        elif body[i] == "|" and not tick:
            cells.append(Cell(body[start:i].strip(), start, i))
            start = i + 1
        i += 1
    if body[start:].strip():
        cells.append(Cell(body[start:].strip(), start, len(body)))
    return cells


def planner_output(argv: tuple) -> tuple:
    """(exit status, stdout, stderr) of `python -m sglang.check_capacity ARGV`, run here; cached per command."""
    return _planner_output(tuple(argv))


@functools.lru_cache(maxsize=None)
def _planner_output(argv: tuple) -> tuple:
    from sglang.check_capacity import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as e:  # argparse: usage errors (2) and --help (0)
            code = e.code if isinstance(e.code, int) else 1
    return code, out.getvalue(), err.getvalue()


def command_argv(command: str, program: tuple) -> Optional[list]:
    """The flags after `python -m MODULE` when `command` runs `program` (python3 too), else None."""
    try:
        words = shlex.split(command)
    except ValueError:
        return None
    if len(words) >= 3 and words[0] in ("python", "python3") and tuple(words[1:3]) == program[1:]:
        return words[3:]
    return None


@dataclass(frozen=True)
class RecipeRow:
    path: str
    line: int  # 0-based index in the file
    launch: str  # the launch command (code span)
    gpus: int
    gpu: str  # "H200" | "B200" | "MI355X"
    verdict: Cell

    @property
    def planner_argv(self) -> tuple:
        return (*command_argv(self.launch, LAUNCH), "--gpu", self.gpu.lower(), "--summary")

    def where(self) -> str:
        return f"{os.path.relpath(self.path, ROOT)}:{self.line + 1}"


@dataclass(frozen=True)
class PlannerCommand:
    path: str
    line: int  # 0-based line of the command in the file
    argv: tuple
    output: Optional[tuple] = None  # (first, end) 0-based lines of the text block's content, when one follows

    def where(self) -> str:
        return f"{os.path.relpath(self.path, ROOT)}:{self.line + 1}"


class DocsFormatError(ValueError):
    """A markdown file breaks the conventions (e.g. a bash block with output holds several commands)."""


def recipe_rows(path: str, lines: list) -> list:
    """Every recipe row of a file's lines; a row with a launch command and a verdict but no GPU cell is an error."""
    rows = []
    for i, line in enumerate(lines):
        if not line.lstrip().startswith("|"):
            continue
        cells = split_cells(line)
        spans = [span.strip() for c in cells for span in CODE_SPAN.findall(c.text)]
        launch = next((span for span in spans if command_argv(span, LAUNCH) is not None), None)
        verdict = next((c for c in cells if VERDICT.match(c.text)), None)
        if launch is None or verdict is None:
            continue
        gpus = next((GPU_CELL.fullmatch(c.text) for c in cells if GPU_CELL.fullmatch(c.text)), None)
        if gpus is None:
            raise DocsFormatError(f"{os.path.relpath(path, ROOT)}:{i + 1}: a recipe row with a verdict needs a cell "
                                  f"naming its GPUs, as '8 × H200' (H200, B200 or MI355X)")
        rows.append(RecipeRow(path, i, launch, int(gpus[1]), gpus[2], verdict))
    return rows


def fenced_blocks(lines: list) -> list:
    """(language, first content line, end line (the closing fence)) of every fenced block."""
    blocks, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m is None or not lines[i].startswith("```"):
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].rstrip() == "```"), len(lines))
        blocks.append((m[1], i + 1, end))
        i = end + 1
    return blocks


def shell_commands(lines: list, first: int, end: int) -> list:
    """(0-based line, command) of each logical command in lines[first:end] (continuations joined, comments and
    blank lines skipped, a leading '$ ' prompt dropped)."""
    out, pending, at = [], "", None
    for j in range(first, end):
        text = lines[j].strip()
        if not pending and (not text or text.startswith("#")):
            continue
        at = j if not pending else at
        if text.endswith("\\"):
            pending += text[:-1] + " "
            continue
        out.append((at, (pending + text).removeprefix("$ ")))
        pending = ""
    if pending:
        out.append((at, pending.removeprefix("$ ")))
    return out


def planner_commands(path: str, lines: list) -> list:
    """Every planner command in a ```bash block, with the text block that shows its output when one follows."""
    found = []
    blocks = fenced_blocks(lines)
    for k, (lang, first, end) in enumerate(blocks):
        if lang != "bash":
            continue
        commands = shell_commands(lines, first, end)
        planner = [(at, command_argv(c, PLANNER)) for at, c in commands if command_argv(c, PLANNER) is not None]
        if not planner:
            continue
        nxt = blocks[k + 1] if k + 1 < len(blocks) else None
        shown = (nxt is not None and nxt[0] == "text"
                 and all(not ln.strip() for ln in lines[end + 1:nxt[1] - 1]))
        if shown and len(commands) != 1:
            raise DocsFormatError(f"{os.path.relpath(path, ROOT)}:{first}: a ```bash block followed by its output "
                                  f"(```text) must hold one check_capacity command, this one holds {len(commands)}")
        for at, argv in planner:
            found.append(PlannerCommand(path, at, tuple(argv), (nxt[1], nxt[2]) if shown else None))
    return found


def doc_files(root: str = ROOT) -> list:
    return [p for p in [os.path.join(root, "README.md")] + sorted(glob.glob(os.path.join(root, "docs", "*.md")))
            if os.path.exists(p)]


def read_lines(path: str) -> list:
    with open(path, encoding="utf-8") as f:
        return f.read().split("\n")


def check_row(row: RecipeRow) -> list:
    """Problems of one recipe row: its GPU count against the command's --tp, its verdict against the planner's."""
    from sglang.check_capacity import build_parser

    problems = []
    code, out, err = planner_output(row.planner_argv)
    if code not in (0, 1):
        return [f"{row.where()}: check_capacity refused the launch command `{row.launch}` on {row.gpu} (exit {code}):"
                f" {err.strip()}"]
    tp = build_parser().parse_args(list(row.planner_argv)).tp_size
    if row.gpus != tp:
        problems.append(f"{row.where()}: the row names {row.gpus} × {row.gpu} but the launch command runs --tp {tp}")
    if row.verdict.text != out.strip():
        problems.append(f"{row.where()}: verdict of `{row.launch}` on {row.gpus} × {row.gpu} should read\n    "
                        f"{out.strip()}\n  but reads\n    {row.verdict.text}\n  (regenerate: {REGENERATE})")
    return problems


def check_command(cmd: PlannerCommand, lines: list) -> list:
    code, out, err = planner_output(cmd.argv)
    shown = " ".join(PLANNER + cmd.argv)
    if code not in (0, 1):
        return [f"{cmd.where()}: `{shown}` exits {code} (0 fits, 1 does not fit expected): {err.strip()[-500:]}"]
    if cmd.output is not None:
        text = "\n".join(lines[cmd.output[0]:cmd.output[1]]) + "\n"
        if text != out:
            return [f"{cmd.where()}: the ```text block after `{shown}` is not its output; it prints\n{out}"
                    f"(regenerate: {REGENERATE})"]
    return []


def check_file(path: str) -> list:
    """Every problem of one markdown file (empty when its recipe rows and planner outputs are current)."""
    lines = read_lines(path)
    try:
        rows, commands = recipe_rows(path, lines), planner_commands(path, lines)
    except DocsFormatError as e:
        return [str(e)]
    return [p for r in rows for p in check_row(r)] + [p for c in commands for p in check_command(c, lines)]


def update_file(path: str) -> bool:
    """Rewrite the verdict cells and output blocks of one file from the planner; True when it changed. Rows and
    commands the planner refuses are left as they are (check_file names them)."""
    lines = read_lines(path)
    new = list(lines)
    for row in recipe_rows(path, lines):
        code, out, _ = planner_output(row.planner_argv)
        if code in (0, 1):
            line, cell = new[row.line], row.verdict
            new[row.line] = f"{line[:cell.start]} {out.strip()} {line[cell.end:]}"
    # bottom-up, so that replacing a block does not move the ones above it
    for cmd in sorted(planner_commands(path, lines), key=lambda c: -c.line):
        code, out, _ = planner_output(cmd.argv)
        if cmd.output is not None and code in (0, 1):
            new[cmd.output[0]:cmd.output[1]] = out.rstrip("\n").split("\n")
    if new == lines:
        return False
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(new))
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*", help="markdown files (default: README.md and docs/*.md)")
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 where a file is out of date")
    a = ap.parse_args(argv)
    files = a.files or doc_files()
    if a.check:
        problems = [p for f in files for p in check_file(f)]
        print("\n".join(problems) if problems else f"{len(files)} file(s) current")
        return 1 if problems else 0
    for f in files:
        if update_file(f):
            print(f"updated {os.path.relpath(f, ROOT)}")
    problems = [p for f in files for p in check_file(f)]  # what the planner refused, left as it was
    if problems:
        print("\n".join(problems))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
