"""The megaframe-* commands of README.md and docs/*.md, as tests/e2e/test_doc_commands.py checks them.

A guide marks how each fenced ```bash block is checked with an HTML comment on the line before the
fence (invisible where Markdown renders):

  <!-- doc-test: run -->           the block runs, line by line as bash, in one scratch directory per
                                   guide (later run blocks see the files earlier ones made); it must
                                   exit 0, so its commands must be cheap on a CPU
  <!-- doc-test: run, exit N -->   each command of the block runs on its own and must exit N (a refusal)

An unmarked block's megaframe-train commands are composed and validated as megaframe-train does
before launch (config, layout, the planner's fit, an elastic job's whole range), without running;
its megaframe-plan commands run; the arguments of its megaframe-eval, -convert, -preprocess and
-sample commands must parse (their files are the user's: run blocks run them).
"""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GUIDES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
_MARK = re.compile(r"<!--\s*doc-test:\s*run(?:,\s*exit\s+(\d+))?\s*-->")
_SEPARATORS = {"&&", "||", ";", "|", "&"}
_FENCE = re.compile(r"^```(bash|sh|shell|console)\s*$")


@dataclass
class Block:
    guide: Path
    line: int  # 1-based line of the opening fence
    run: bool
    exit_code: int = 0
    lines: list[str] = field(default_factory=list)  # the block's text, one logical line each
    shown: list[str] = field(default_factory=list)  # the ```text block right after it, if any (its output)

    @property
    def where(self) -> str:
        return f"{self.guide.relative_to(REPO)}:{self.line}"

    def megaframe_commands(self) -> list[list[str]]:
        """Every megaframe-* command of the block, as argv (commands chained with && or ; split)."""
        return [words for words, _ in self.commented_commands()]

    def commented_commands(self) -> list[tuple[list[str], str]]:
        """Every megaframe-* command of the block with the comment that ends its line ("" if none)."""
        found = []
        for line in self.lines:
            lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
            lexer.whitespace_split, lexer.commenters = True, "#"
            comment = line.partition(" # ")[2].strip()
            words: list[str] = []
            for token in [*lexer, ";"]:
                if token in _SEPARATORS:
                    if words and words[0].startswith("megaframe-"):
                        found.append((words, comment))
                    words = []
                else:
                    words.append(token)
        return found


def _logical_lines(raw: list[str]) -> list[str]:
    """Backslash continuations and multi-line quoted strings joined; blank lines and whole-line
    comments dropped."""
    lines, pending = [], ""
    for text in raw:
        stripped = text.rstrip()
        if not pending and (not stripped.strip() or stripped.lstrip().startswith("#")):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        try:
            shlex.split(pending + stripped, comments=True)
        except ValueError:  # a quoted string goes on to the next line (python -c "...")
            pending += stripped + "\n"
            continue
        lines.append(pending + stripped)
        pending = ""
    if pending:
        lines.append(pending)
    return lines


def blocks(guide: Path) -> list[Block]:
    """The ```bash blocks of one guide, with how each is checked."""
    text = guide.read_text().splitlines()
    found: list[Block] = []
    i = 0
    while i < len(text):
        if not _FENCE.match(text[i]):
            i += 1
            continue
        before = next((text[j] for j in range(i - 1, -1, -1) if text[j].strip()), "")
        mark = _MARK.search(before)
        end = next(j for j in range(i + 1, len(text)) if text[j].startswith("```"))
        body = [line[2:] if line.startswith("$ ") else line for line in text[i + 1:end]]  # a console's prompts
        after = next((j for j in range(end + 1, len(text)) if text[j].strip()), len(text))
        shown_end = next((j for j in range(after + 1, len(text)) if text[j].startswith("```")), after) \
            if after < len(text) and text[after].strip() == "```text" else after
        found.append(Block(guide, i + 1, run=mark is not None, exit_code=int(mark.group(1) or 0) if mark else 0,
                           lines=_logical_lines(body), shown=text[after + 1:shown_end]))
        i = end + 1
    return found


def all_blocks() -> list[Block]:
    return [block for guide in GUIDES for block in blocks(guide)]


def shown_plans() -> list[tuple[str, list[str], list[str]]]:
    """(where, argv, lines) of every ```text block that shows megaframe-plan's output (its first line,
    after a "…" that stands for lines left out, starts "megaframe-plan:" or "parallel=auto picks:"),
    with the last megaframe-plan command above it in its guide."""
    found = []
    for guide in GUIDES:
        text, commands = guide.read_text().splitlines(), []
        for block in blocks(guide):
            commands += [(block.line, words) for words in block.megaframe_commands() if words[0] == "megaframe-plan"]
        for i, line in enumerate(text):
            first = next((t for t in text[i + 1:i + 3] if t.strip() != "…"), "")
            if line.strip() != "```text" or not first.startswith(("megaframe-plan:", "parallel=auto picks:")):
                continue
            above = [words for at, words in commands if at < i + 1]
            if above:
                end = next(j for j in range(i + 1, len(text)) if text[j].startswith("```"))
                found.append((f"{guide.relative_to(REPO)}:{i + 1}", above[-1], text[i + 1:end]))
    return found


_REDIRECT = re.compile(r"(?<![0-9&<])>\s*([\w./-]+)")
_SAVED = re.compile(r"save_pretrained\('([^']+)'\)")
_NOT_PATHS = {"auto", "none", "null", "byte"}


@dataclass
class GuidePaths:
    """The relative paths a guide's run blocks write (run and sweep directories, datasets, exports,
    redirected files) and the run or data paths they read (train.resume, data.*, eval and convert)."""

    writes: set[str] = field(default_factory=set)
    reads: set[str] = field(default_factory=set)

    def owns(self, path: str) -> bool:
        """Whether the guide wrote path itself, or a directory or dataset prefix holding it."""
        return any(path == w or path.startswith(w.rstrip("/") + "/") or w.startswith(path + ".")  # PREFIX.bin
                   for w in self.writes)


def guide_paths(guide: Path) -> GuidePaths:
    """What guide's run blocks write and read, from their commands (tests/e2e/test_doc_commands.py
    checks that no two guides share a path and that no guide reads another's)."""
    found = GuidePaths()
    for block in blocks(guide):
        if not block.run:
            continue
        for line in block.lines:
            found.writes.update(_REDIRECT.findall(line.split("<<", 1)[0]))
            found.writes.update(_SAVED.findall(line))
            words = line.split()
            if words[:2] in (["mkdir", "-p"],) and len(words) > 2:
                found.writes.add(words[2])
            if words[:1] == ["cp"] and len(words) == 3:
                found.writes.add(words[2])
        for words in block.megaframe_commands():
            _megaframe_paths(words, found)
    found.writes -= _NOT_PATHS
    found.reads = {path for path in found.reads - _NOT_PATHS if not Path(path).is_absolute()}
    return found


def _megaframe_paths(words: list[str], found: GuidePaths) -> None:
    name, args = words[0], words[1:]
    for i, arg in enumerate(args):
        key, _, value = arg.partition("=")
        if key in ("hydra.run.dir", "hydra.sweep.dir"):
            found.writes.add(value)
        elif key in ("train.resume", "data.path", "data.valid_path"):
            found.reads.add(value)
        elif key in ("data.blend", "data.valid_blend"):
            found.reads.update(part for part in value.strip("[]").split(",") if "/" in part)
        elif arg in ("--output-prefix", "--valid-output-prefix") and i + 1 < len(args):
            found.writes.add(args[i + 1])
    positional = [a for a in args if "=" not in a and not a.startswith("-")]
    if name == "megaframe-convert" and len(positional) == 3:  # to-hf|from-hf SOURCE DESTINATION
        found.reads.add(positional[1])
        found.writes.add(positional[2])
    elif name == "megaframe-eval" and positional:
        found.reads.add(positional[0])
