"""The README stays a front door, and the docs it sends readers to stay true.

- README.md is short (the detail lives in docs/*.md);
- every relative link in README.md and docs/*.md reaches a file, and an ``#anchor`` a heading of that file
  (GitHub's slug rule);
- every ``stare ...`` line in a ```bash block parses through the real CLI (Click's ``make_context``: the
  subcommand exists, every option is one it defines, ints and ranges hold, required options are there), and names
  presets and algorithms that exist. Nothing is run: ``make_context`` only parses;
- the README keeps the two newcomer commands (CI runs the second, ``.ci/run``).
"""
import re
import shlex
import unicodedata
from pathlib import Path

import pytest
import typer

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
MAX_README_LINES = 220
INSTALL_LINE = ("python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && pip install -e . && "
                "stare run --preset tiny-cpu")

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})(.*)$")


def _blocks_and_prose(text: str):
    """(prose lines, [(language, [lines]) for each fenced block]), as CommonMark reads fences: at a line's start
    (up to 3 spaces in), and a backtick fence's info string has no backtick (```` ```python ```` opening a line
    is inline code)."""
    prose, blocks, current, lang, fence = [], [], None, "", ""
    for line in text.splitlines():
        m = FENCE.match(line)
        if m and m.group(1)[0] == "`" and "`" in m.group(2):
            m = None
        if current is None and m:
            fence, lang, current = m.group(1), (m.group(2).split() or [""])[0].lower(), []
        elif current is not None and line.strip().startswith(fence) and not line.strip().strip(fence[0]):
            blocks.append((lang, current))
            current = None
        elif current is not None:
            current.append(line)
        else:
            prose.append(line)
    assert current is None, "unclosed code fence"
    return prose, blocks


# ---- links ---------------------------------------------------------------------------------------------------------
def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text, lower-cased, with every character that is not a letter,
    digit, space, hyphen or underscore removed, and each space turned into a hyphen."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links and images: their text
    text = text.replace("`", "").strip().lower()
    out = []
    for ch in text:
        if ch in " -_" or unicodedata.category(ch)[0] in "LN":
            out.append("-" if ch == " " else ch)
    return "".join(out)


def anchors(path: Path) -> set[str]:
    prose, _ = _blocks_and_prose(path.read_text())
    seen: dict[str, int] = {}
    out = set()
    for line in prose:
        m = re.match(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = github_slug(m.group(1))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def relative_links(path: Path):
    prose, _ = _blocks_and_prose(path.read_text())
    text = "\n".join(prose)
    text = re.sub(r"(`+)(?:(?!\1).)+\1", "", text)  # inline code is not a link
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
            continue
        yield target


def test_there_are_docs_pages_and_links():
    names = {p.name for p in PAGES}
    assert {"README.md", "local-engine.md", "openrlhf-backend.md", "evaluation.md", "tool-use.md", "results.md",
            "benchmarks.md", "gpu-check.md", "algorithm.md", "local-settings.md", "settings.md", "architecture.md"} <= names
    linked = set(relative_links(README))
    for page in names - {"README.md"}:
        assert any(t.split("#")[0] == f"docs/{page}" for t in linked), f"the README does not link docs/{page}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(page):
    broken = []
    for target in relative_links(page):
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with anchor #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, broken


def test_the_slug_rule():
    assert github_slug("`stare run --preset tiny-cpu` (4 arms x 3 seeds, 4 min 14 s on a 2-core machine)") == \
        "stare-run---preset-tiny-cpu-4-arms-x-3-seeds-4-min-14-s-on-a-2-core-machine"
    assert github_slug("7. The entropy baselines (`algorithms/baselines.py`)") == \
        "7-the-entropy-baselines-algorithmsbaselinespy"
    assert github_slug("OpenRLHF's real training loop on CPU (tests)") == "openrlhfs-real-training-loop-on-cpu-tests"


# ---- stare command lines ------------------------------------------------------------------------------------------
def _logical_lines(lines):
    """Join continuation lines (a trailing backslash), as bash reads them."""
    out, current = [], ""
    for line in lines:
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
        else:
            out.append(current + line)
            current = ""
    if current:
        out.append(current)
    return out


def _words(line: str) -> list[str]:
    lex = shlex.shlex(line, posix=True, punctuation_chars=";&|()")
    lex.whitespace_split = True
    lex.commenters = "#"
    return list(lex)


def _without_redirections(words: list[str]) -> list[str]:
    """The words less output redirections (``> FILE``, ``>> FILE``, ``2> FILE``, ``>FILE``), as bash strips them."""
    out, skip = [], False
    for w in words:
        if skip:
            skip = False
        elif re.fullmatch(r"[12]?>>?", w):
            skip = True
        elif not re.match(r"^[12]?>>?.", w):
            out.append(w)
    return out


def stare_commands(path: Path):
    """Each `stare ...` invocation in the page's bash blocks, as its argument list (after `stare`). A line is cut
    at `&&`, `||`, `;`, `|`; leading VAR=value assignments are dropped; `docker run ... stare:TAG ARGS` (the
    image's entrypoint is `stare`) counts too, unless it sets another --entrypoint."""
    _, blocks = _blocks_and_prose(path.read_text())
    for lang, lines in blocks:
        if lang not in ("bash", "sh", "shell", "console"):
            continue
        for line in _logical_lines(lines):
            words = _words(line)
            segments, seg = [], []
            for w in words:
                if w and set(w) <= set(";&|()"):
                    segments.append(seg)
                    seg = []
                else:
                    seg.append(w)
            segments.append(seg)
            for seg in segments:
                seg = _without_redirections(seg)
                while seg and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", seg[0]):
                    seg = seg[1:]
                if seg and seg[0] == "stare":
                    yield line.strip(), seg[1:]
                elif seg[:2] == ["docker", "run"] and "--entrypoint" not in seg:
                    image = next((i for i, w in enumerate(seg) if re.match(r"^stare:[\w.-]+$", w)), None)
                    if image is not None:
                        yield line.strip(), seg[image + 1:]


def parse_stare(args: list[str]):
    """Parse ``stare ARGS`` with the real Click command, running nothing; return (subcommand name, its params).
    A usage error (unknown command or option, a bad int, a value out of range, a missing required option)
    propagates."""
    from stare.cli.main import app

    group = typer.main.get_command(app)
    ctx = group.make_context("stare", ["presets"])  # a context to look commands up in; parses nothing else
    help_names = set(ctx.help_option_names)
    if not args or args[0].startswith("-"):
        assert set(args) <= help_names, f"only --help is shown at the top level in the docs, got {args}"
        return None, {}
    name, rest = args[0], args[1:]
    command = group.get_command(ctx, name)
    assert command is not None, f"no command 'stare {name}'"
    if any(a in help_names for a in rest):
        assert rest in ([h] for h in help_names), f"stare {name} --help takes nothing else: {rest}"
        return name, {}
    sub = command.make_context(name, list(rest), parent=ctx)  # resilient_parsing off: errors are raised
    return name, sub.params


def _cases():
    out = []
    for page in PAGES:
        for line, args in stare_commands(page):
            out.append(pytest.param(line, args, id=f"{page.relative_to(ROOT).as_posix()}: {line[:70]}"))
    return out


CASES = _cases()


def test_the_pages_have_stare_commands():
    assert len(CASES) >= 30
    assert any(args[:3] == ["run", "--preset", "tiny-cpu"] for _, args in (c.values for c in CASES))


@pytest.mark.parametrize(("line", "args"), CASES)
def test_every_stare_command_in_a_bash_block_parses(line, args):
    name, params = parse_stare(args)
    if name in ("run", "train"):
        from stare.algorithms import ALGORITHMS
        from stare.cli.presets import preset_names

        from stare.cli.presets import is_preset_file

        if params.get("preset") is not None and not is_preset_file(params["preset"]):  # a file: the docs' own
            assert params["preset"] in preset_names(), f"{line}: unknown preset {params['preset']!r}"
        algos = [params["algo"]] if params.get("algo") else (params.get("algos") or "").split(",")
        unknown = [a for a in algos if a and a not in ALGORITHMS]
        assert not unknown, f"{line}: unknown algorithm(s) {unknown}"


def test_the_parse_check_catches_what_it_should():
    """The check above fails on a misspelt flag, a bad int, a missing required option and an unknown command."""
    try:  # typer >= 0.2x ships its own Click; before, it used click
        from typer._click.exceptions import UsageError
    except ImportError:
        from click.exceptions import UsageError

    assert parse_stare(["run", "--preset", "tiny-cpu", "--seeds", "3"])[1]["seeds"] == 3
    for bad in (["run", "--preset", "tiny-cpu", "--seed", "3"], ["run", "--seeds", "0"], ["eval", "--k", "4"],
                ["train", "--algo", "stare"], ["eval", "--bench", "aime25", "--k", "many"]):
        with pytest.raises(UsageError):
            parse_stare(bad)
    with pytest.raises(AssertionError):
        parse_stare(["trian", "--preset", "tiny-cpu"])
    assert list(stare_commands_of("```bash\nA=1 stare eval --bench aime25 && echo ok  # a comment\n```\n")) == \
        [["eval", "--bench", "aime25"]]
    assert list(stare_commands_of("```bash\ndocker run -v x:/y stare:0.1.0 \\\n  train --preset p\n```\n")) == \
        [["train", "--preset", "p"]]


def stare_commands_of(text: str):
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "page.md"
        path.write_text(text)
        return [args for _, args in stare_commands(path)]


# ---- the README as a front door -----------------------------------------------------------------------------------
def test_the_readme_is_a_front_door():
    text = README.read_text()
    assert len(text.splitlines()) <= MAX_README_LINES, f"README.md has {len(text.splitlines())} lines"
    assert "bash scripts/test.sh" in text
    assert INSTALL_LINE in text.splitlines()
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text()
