"""The README stays a front page, and every file it names exists.

The README points a newcomer at files ("where to look first", the process
table, the layers); a move or a rename must carry it along. A name in
backticks that looks like a path (``router/api/openai.py``, ``llmgw_cli/``)
must exist from the repository's root; a bare file name (``spawn.py``) must
exist beside a path named on the same line, if the line names one. Relative
links must land on a file too (the docs site checks its own links, not the
README's). Hidden paths (``.llmgw/``: made at run time) are not checked.
"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 250

_CODE = re.compile(r"`([^`\s]+)`")
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_PATHLIKE = re.compile(r"^[\w.-]+(/[\w.-]+)*/?$")


def _named_paths(line: str) -> list[str]:
    return [
        name
        for name in _CODE.findall(line)
        if _PATHLIKE.match(name)
        and not name.startswith(".")
        and (name.endswith(("/", ".py", ".md", ".yml", ".toml")) or "/" in name)
    ]


def missing_paths(root: Path, text: str) -> list[str]:
    """Paths and relative links in ``text`` that do not exist under ``root``."""
    missing = []
    for line in text.splitlines():
        named = _named_paths(line)
        dirs = {Path(n).parent for n in named if "/" in n.rstrip("/")}
        for name in named:
            places = [root / name] if "/" in name else [root / d / name for d in dirs]
            if places and not any(p.exists() for p in places):
                missing.append(name)
        for link in _LINK.findall(line):
            if "://" in link or link.startswith(("#", "mailto:")):
                continue
            if not (root / link.split("#")[0]).exists():
                missing.append(link)
    return missing


def test_the_readme_is_a_front_page() -> None:
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= MAX_LINES, (
        f"README.md has {lines} lines; at most {MAX_LINES}: move detail to docs/"
    )


def test_every_file_the_readme_names_exists() -> None:
    missing = missing_paths(ROOT, (ROOT / "README.md").read_text())
    assert not missing, f"README.md names files that do not exist: {missing}"


def test_the_check_itself(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "here.py").write_text("")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text("")
    text = "\n".join(
        [
            "| a | `pkg/here.py` (and `gone.py`), `pkg/` |",
            "| b | `pkg/moved.py`, `LLMGW_X`, `make run`, `/v1`, `.llmgw/made-at-run` |",
            "| c | `elsewhere.py`, named without a directory on its line |",
            "[page](docs/page.md#part), [site](https://example.com/x), [old](docs/old.md)",
        ]
    )
    assert missing_paths(tmp_path, text) == ["gone.py", "pkg/moved.py", "docs/old.md"]
