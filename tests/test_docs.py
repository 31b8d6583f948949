"""Documents the code cites are in the repository."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_cited_doc_is_in_the_repository():
    cited = {}
    for folder in ("algorithms", "eval", "stare_cli"):
        for path in (ROOT / folder).rglob("*.py"):
            for name in re.findall(r"\bdocs/[\w.-]+\.md\b", path.read_text()):
                cited.setdefault(name, []).append(path.relative_to(ROOT))
    assert "docs/algorithm.md" in cited  # the algorithms' docstrings point there
    missing = {name: paths for name, paths in cited.items() if not (ROOT / name).is_file()}
    assert not missing, missing
