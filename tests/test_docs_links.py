"""Every relative link in README.md and docs/*.md leads somewhere: the file exists, and a
``#fragment`` into a Markdown file names one of its headings (GitHub's anchors)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "examples" / "README.md"]

#: [text](target) and ![alt](target), outside code blocks and inline code
_LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
_CODE = re.compile(r"`[^`\n]*`")


def links(page: Path) -> list[str]:
    text = _CODE.sub("", _FENCE.sub("", page.read_text()))
    return [m[1] for m in _LINK.finditer(text)]


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation other than ``-`` and ``_`` dropped,
    spaces to ``-``."""
    text = re.sub(r"[`*]", "", heading.strip()).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = _FENCE.sub("", page.read_text())
    found: set[str] = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", text, re.M):
        name, n = anchor(heading), 1
        while name in found:  # a repeated heading gets -1, -2, ...
            name = f"{anchor(heading)}-{n}"
            n += 1
        found.add(name)
    return found


def test_the_pages_are_there_and_link_to_each_other():
    assert (ROOT / "docs" / "index.md") in PAGES
    assert any(link.startswith("docs/index.md") for link in links(ROOT / "README.md"))


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = []
    for link in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", link):  # https:, mailto: ...: not checked here
            continue
        path, _, fragment = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(f"{link}: no file {target}")
        elif fragment and target.suffix == ".md" and fragment not in anchors(target):
            broken.append(f"{link}: {target.name} has no heading with the anchor #{fragment}")
    assert not broken, f"{page.relative_to(ROOT)} links to what is not there:\n" + "\n".join(broken)


def test_anchor_follows_githubs_rules():
    assert anchor("Use corekv's tiers from vLLM") == "use-corekvs-tiers-from-vllm"
    assert anchor("Backend `hash_blocks`") == "backend-hash_blocks"
    assert anchor("Many machines: Redis Cluster and S3") == "many-machines-redis-cluster-and-s3"
