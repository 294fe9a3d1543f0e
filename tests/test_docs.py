"""README.md and docs/: every documented `isoloco ...` command line parses against the CLI (its
subcommand and flags, and a train or sweep command's key=value items against the config), and
every relative link and `#anchor` resolves."""

from __future__ import annotations

import argparse
import re
import shlex
import unicodedata
from pathlib import Path
from urllib.parse import unquote

import pytest
from markdown_it import MarkdownIt
from markdown_it.token import Token

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^\s*(```|~~~)\s*(\S*)")


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT))


def blocks(text: str) -> list[tuple[str | None, int, str]]:
    """Each line of a markdown page as (the language of the fenced block it is in, None outside
    one; its line number; the line). Fence lines themselves are left out."""
    out: list[tuple[str | None, int, str]] = []
    language: str | None = None
    for number, line in enumerate(text.splitlines(), 1):
        fence = FENCE.match(line)
        if fence:
            language = fence[2] if language is None else None
            continue
        out.append((language, number, line))
    return out


# ---------------------------------------------------------------------------------------
# Anchors and links


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: its links and code marks reduced to their text,
    lowercased, every character but letters, digits, spaces, hyphens and underscores dropped,
    spaces made hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = text.strip().lower()
    kept = "".join(ch for ch in text if ch in " -_" or unicodedata.category(ch)[0] in "LNM")
    return kept.replace(" ", "-")


#: The parser that reads the pages as GitHub renders them: CommonMark with GitHub's tables. A link's
#: text may span lines, and fenced or inline code holds no links and no headings.
MARKDOWN = MarkdownIt("commonmark").enable(["table", "strikethrough"])


def _tokens(page: Path) -> list[Token]:
    return MARKDOWN.parse(page.read_text())


def _text(inline: Token) -> str:
    """The text of an inline token (a heading's): its words and code, without the marks around them."""
    return "".join(child.content for child in inline.children or [] if child.type in ("text", "code_inline"))


def anchors(page: Path) -> set[str]:
    """Every heading anchor of a page (ATX and setext headings, not `#` lines in code); a repeated
    one gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    tokens = _tokens(page)
    for opening, inline in zip(tokens, tokens[1:]):
        if opening.type != "heading_open":
            continue
        base = slug(_text(inline))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(page: Path) -> list[tuple[int, str]]:
    """Every link and image target of a page, as a Markdown parser reads them (a link whose text
    spans lines included; none in code), each with the line its link starts on. Targets are
    unquoted (the parser percent-encodes `#worker_speeds-and-σ`)."""
    found = []
    for block in _tokens(page):
        if block.type != "inline" or block.map is None:
            continue
        number = block.map[0] + 1
        for child in block.children or []:
            if child.type in ("softbreak", "hardbreak"):
                number += 1
            elif child.type in ("link_open", "image"):
                found.append((number, unquote(str(child.attrs["href" if child.type == "link_open" else "src"]))))
    return found


def broken_link(page: Path, target: str) -> str | None:
    """What is wrong with a relative link `target` of `page`; None when it resolves."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
        return None
    path, _, anchor = target.partition("#")
    file = (page.parent / path).resolve() if path else page
    if not file.exists():
        return f"{path} does not exist"
    if path and ROOT in page.resolve().parents and ROOT not in [file, *file.parents]:
        return f"{path} is outside the repository"
    if anchor and file.suffix != ".md":
        return f"#{anchor} points into {path}, which is not a markdown page"
    if anchor and anchor not in anchors(file):
        return f"{path or 'the page'} has no heading #{anchor}"
    return None


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_every_relative_link_and_anchor_resolves(page):
    broken = [f"{_name(page)}:{number}: ({target}) {problem}" for number, target in links(page)
              if (problem := broken_link(page, target))]
    assert not broken, "\n".join(broken)


def test_slugs_follow_github():
    assert slug("Claims 1–3: the gap to data-parallel training against R") == \
        "claims-13-the-gap-to-data-parallel-training-against-r"
    assert slug("The regime: why 480 steps and H = 30") == "the-regime-why-480-steps-and-h--30"
    assert slug("Compression at 100×: low rank and top-k") == "compression-at-100-low-rank-and-top-k"
    assert slug("Factors: `merge.factors=auto` against exact") == "factors-mergefactorsauto-against-exact"
    assert slug("Stragglers: unequal speeds, token weights, late workers") == \
        "stragglers-unequal-speeds-token-weights-late-workers"
    assert slug("worker_speeds and σ") == "worker_speeds-and-σ"


def test_a_repeated_heading_gets_a_numbered_anchor(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# A\n\n## Tests\n\n```sh\n# Tests\n```\n\n## Tests\n\n### Tests\n")
    assert anchors(page) == {"a", "tests", "tests-1", "tests-2"}
    assert broken_link(page, "#tests-2") is None
    assert "does not exist" in broken_link(page, "missing.md")


def test_a_link_whose_text_spans_two_lines_is_read_and_its_anchor_checked(tmp_path):
    """A link is read as a Markdown parser reads it, whatever lines its text spans: a same-page
    anchor that lives on another page, and a cross-page anchor the other page lacks, are caught;
    one in code is no link."""
    (tmp_path / "other.md").write_text("# Other\n\nSetext heading\n--------------\n")
    page = tmp_path / "page.md"
    page.write_text("# Page\n\nIntro: [the other\npage's heading](#other), then [its setext\n"
                    "heading](other.md#setext-heading) and [a missing\none](other.md#missing).\n\n"
                    "`[code](#nowhere)`\n\n```md\n[fenced](#nowhere)\n```\n\n| a |\n|---|\n| [cell](#page) |\n")
    assert links(page) == [(3, "#other"), (4, "other.md#setext-heading"), (5, "other.md#missing"), (16, "#page")]
    broken = [(number, broken_link(page, target)) for number, target in links(page) if broken_link(page, target)]
    assert broken == [(3, "the page has no heading #other"), (5, "other.md has no heading #missing")]


# ---------------------------------------------------------------------------------------
# Commands


#: A word a page writes where the reader puts their own value: DIR, PRESET, SETTING, method=M.
PLACEHOLDER = re.compile(r"(?:[\w.]+=)?[A-Z][A-Z0-9_]*|key=value|\.\.\.|…")
INLINE = re.compile(r"`((?:[A-Z_]+=\S+ )*isoloco (?:train|sweep|report|launch|data|export)\b[^`]*)`")
SUBCOMMANDS = ("train", "sweep", "report", "launch", "data", "export")


def _has_arguments(command: str) -> bool:
    """Whether inline code is a command line rather than a command's name (`isoloco report`) or
    a flag's (`isoloco train --resume`): a word follows the subcommand that is not an option."""
    words = command.split()
    words = words[words.index("isoloco") + 1:]
    return any(not word.startswith("-") for word in words[2 if words[:1] == ["data"] else 1:])


def documented_commands(page: Path) -> list[tuple[int, str]]:
    """The `isoloco ...` command lines of a page: the lines of its ```sh blocks that start with
    `isoloco ` or `$ isoloco ` (with their continuation lines), the `-m isoloco ...` of a
    torchrun line, and inline code that starts with `isoloco train` (or another subcommand) and
    gives it an argument."""
    found: list[tuple[int, str]] = []
    lines = blocks(page.read_text())
    i = 0
    while i < len(lines):
        language, number, line = lines[i]
        i += 1
        if language is None:
            found += [(number, match[1]) for match in INLINE.finditer(line) if _has_arguments(match[1])]
            continue
        if language != "sh":
            continue
        command = line.strip().removeprefix("$ ")
        while command.endswith("\\") and i < len(lines) and lines[i][0] == "sh":
            command = command[:-1] + " " + lines[i][2].strip()
            i += 1
        torchrun = re.search(r"\s-m (isoloco\s.*)$", command)
        if command.startswith("isoloco ") or (command.startswith("torchrun ") and torchrun):
            found.append((number, command if command.startswith("isoloco ") else torchrun[1]))
    return found


def _argv(command: str) -> tuple[list[str], bool]:
    """A command line's arguments after `isoloco` (environment assignments and shell variables
    replaced by a number), and whether it holds a placeholder."""
    words = shlex.split(re.sub(r"\$\{?\w+\}?", "1", command), comments=True)
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        words.pop(0)
    assert words[0] == "isoloco", command
    placeholder = "$" in command or any(PLACEHOLDER.fullmatch(word) or "[" in word for word in words[1:])
    return words[1:], placeholder


def _check_items(items: list[str], placeholder: bool) -> None:
    """A train or sweep command's preset and key=value items resolve to a valid config (skipped
    where the page writes a placeholder, or names a YAML file of the reader's)."""
    from isoloco.config import parse_overrides, resolve, split_items

    if placeholder:
        return
    preset, overrides = split_items(items)
    if preset and preset.endswith((".yaml", ".yml")) and not (ROOT / preset).is_file():
        preset = None  # the reader's own file: check the items on the default preset
    from isoloco.config import DEFAULT_PRESET

    resolve(preset or DEFAULT_PRESET, parse_overrides(overrides))


def check_command(argv: list[str], placeholder: bool) -> None:
    """Parse `isoloco ARGV` as the CLI does, without running it; raise on anything it refuses
    (argparse's refusals are its SystemExit)."""
    from isoloco import cli, sweep
    from isoloco.cliargs import parse_late
    from isoloco.launch import launched_command

    if argv == ["--version"]:
        return
    args = cli.build_parser().parse_args(argv)
    if argv[0] == "train":
        args = cli._parse_train(args)
        if not args.resume:
            _check_items(args.items, placeholder)
    elif argv[0] == "sweep":
        _check_items(parse_late(args, sweep._add_options, prog="isoloco sweep").items, placeholder)
    elif argv[0] == "launch":
        check_command(launched_command(args), placeholder)


COMMANDS = [(page, number, command) for page in PAGES for number, command in documented_commands(page)]


def test_the_pages_document_commands():
    """The extraction finds the commands (a guard against a pattern that silently finds none)."""
    assert len(COMMANDS) >= 60
    assert {command.split()[1] for _, _, command in COMMANDS if command.startswith("isoloco ")} >= set(SUBCOMMANDS)


@pytest.mark.parametrize("page,number,command", COMMANDS,
                         ids=[f"{_name(page)}:{number}" for page, number, _ in COMMANDS])
def test_every_documented_command_parses(page, number, command):
    try:
        check_command(*_argv(command))
    except SystemExit as refused:  # argparse's usage error, already printed to stderr
        pytest.fail(f"{_name(page)}:{number}: {command}: argparse refused it (exit {refused.code})")


@pytest.mark.parametrize("command", [
    "isoloco train quick worker=8",  # a misspelt key
    "isoloco train quick method=diloco outer.lr=-1",  # a value out of range
    "isoloco train quick --qiet",  # an unknown flag
    "isoloco sweep repro-cpu --worker-count 2",
    "isoloco launch --nproc 2 -- train quick merge.quantize=int3",
    "isoloco trian quick",
])
def test_a_wrong_command_is_refused(command):
    """The check would catch a command the CLI refuses: a guard against a check that passes everything."""
    with pytest.raises((SystemExit, Exception)):
        check_command(*_argv(command))
