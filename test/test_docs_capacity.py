"""The capacity planner's verdicts and outputs quoted in README.md and docs/*.md are its own: every recipe row's verdict
is `check_capacity --summary` for that launch command on those GPUs, every ```text block after a planner command is
its output, every other planner command runs. scripts/update_capacity_docs.py regenerates them; its parser is the one
checked here, on the files and on a sample (test/data/capacity_docs_sample.md) whose rows and blocks it knows."""

from __future__ import annotations

import os
import shutil
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import update_capacity_docs as docs  # noqa: E402

README = os.path.join(ROOT, "README.md")
SAMPLE = os.path.join(ROOT, "test", "data", "capacity_docs_sample.md")
# The README's "Serve DeepSeek-V4" table: Flash and Pro on 4 x H200, 8 x H200, 8 x B200 and 8 x MI355X.
README_MIN_RECIPE_ROWS = 6


@pytest.mark.parametrize("path", docs.doc_files(), ids=lambda p: os.path.relpath(p, ROOT))
def test_docs_quote_the_planner(path):
    problems = docs.check_file(path)
    assert not problems, "\n".join(problems)


def test_readme_has_the_recipe_table():
    rows = docs.recipe_rows(README, docs.read_lines(README))
    assert len(rows) >= README_MIN_RECIPE_ROWS, (
        f"README.md has {len(rows)} recipe rows (a table row with a `python -m sglang.launch_server ...` code span, a "
        f"GPU cell like '8 × H200' and a verdict cell: run {docs.REGENERATE} to fill the verdicts); the 'Serve "
        f"DeepSeek-V4' table needs at least {README_MIN_RECIPE_ROWS}")


def test_sample_rows_and_blocks_are_found():
    lines = docs.read_lines(SAMPLE)
    rows = docs.recipe_rows(SAMPLE, lines)
    assert [(r.gpus, r.gpu, r.verdict.text.split(":")[0]) for r in rows] == [
        (4, "H200", "fits"), (8, "MI355X", "fits"), (1, "H200", "does not fit")]  # the row without a verdict is not one
    assert rows[0].planner_argv[:4] == ("--model-path", "deepseek-ai/DeepSeek-V4-Flash", "--tp", "4")
    assert rows[0].planner_argv[-3:] == ("--gpu", "h200", "--summary") and "--speculative-eagle-topk" in rows[0].launch
    commands = docs.planner_commands(SAMPLE, lines)
    assert [c.argv for c in commands] == [("flash", "--tp", "4", "--gpu", "b200", "--kv-cache-dtype", "fp8_e4m3"),
                                          ("pro", "--tp", "8", "--kv-cache-dtype", "fp8_e4m3", "--summary")]
    first, end = commands[0].output
    assert lines[first].startswith("flash on 4 x B200 GPUs") and lines[end] == "```"
    assert commands[1].output is None  # shown without its output: it must run, nothing to compare


def test_sample_is_current():
    assert docs.check_file(SAMPLE) == []


def test_stale_docs_are_named_and_regenerated(tmp_path):
    """A wrong verdict, a GPU count that is not the layout's and a stale output block are each named (where, what the
    planner says, how to regenerate); the script rewrites the verdicts and outputs in place (the GPU count is the
    writer's to fix)."""
    path = str(tmp_path / "stale.md")
    shutil.copy(SAMPLE, path)
    text = docs.read_lines(SAMPLE)
    rows = docs.recipe_rows(SAMPLE, text)
    stale = list(text)
    stale[rows[0].line] = stale[rows[0].line].replace(rows[0].verdict.text, "fits: 1.0 GB weights/GPU")
    stale[rows[1].line] = stale[rows[1].line].replace("8 x MI355X", "4 x MI355X")
    out = docs.planner_commands(SAMPLE, text)[0].output
    stale[out[0] + 3] = "weights per GPU 1.0 GB"
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(stale))
    problems = docs.check_file(path)
    assert len(problems) == 3, problems
    assert f"stale.md:{rows[0].line + 1}: verdict of" in problems[0] and rows[0].verdict.text in problems[0]
    assert docs.REGENERATE in problems[0] and "reads\n    fits: 1.0 GB weights/GPU" in problems[0]
    assert "names 4 × MI355X but the launch command runs --tp 8" in problems[1]
    assert "the ```text block after `python -m sglang.check_capacity flash --tp 4" in problems[2]
    assert docs.update_file(path)
    assert docs.check_file(path) == [problems[1]]
    assert docs.read_lines(path) == [ln.replace("8 x MI355X", "4 x MI355X") for ln in text]
    assert not docs.update_file(path)  # current: nothing rewritten


def test_refused_commands_and_broken_conventions_are_named(tmp_path):
    path = str(tmp_path / "bad.md")
    with open(path, "w", encoding="utf-8") as f:
        f.write("| GPUs | Launch | Verdict |\n|---|---|---|\n"
                "| 3 × H200 | `python -m sglang.launch_server --model-path flash --tp 3` | fits |\n\n"
                "```bash\npython -m sglang.check_capacity flash --tp 3\n```\n")
    problems = docs.check_file(path)
    assert "bad.md:3: check_capacity refused the launch command" in problems[0]
    assert "attention heads do not split over 3 ranks" in problems[0]
    assert "bad.md:6: `python -m sglang.check_capacity flash --tp 3` exits 2" in problems[1]
    with open(path, "w", encoding="utf-8") as f:
        f.write("```bash\npython -m sglang.check_capacity flash --tp 4\npython -m sglang.check_capacity pro --tp 8\n"
                "```\n\n```text\n```\n| Launch | Verdict |\n|---|---|\n"
                "| `python -m sglang.launch_server --model-path flash --tp 4` | fits |\n")
    problems = docs.check_file(path)
    assert len(problems) == 1 and "a recipe row with a verdict needs a cell naming its GPUs" in problems[0]


def test_cells_split_outside_code_spans():
    cells = docs.split_cells("| a | `x | y` | b \\| c |")
    assert [c.text for c in cells] == ["a", "`x | y`", "b \\| c"]
