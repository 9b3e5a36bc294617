"""The README's and the docs' links each lead to a file and a heading."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")


def _anchors(text):
    """The anchors GitHub gives a page's headings."""
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
            for heading in re.findall(r"^#+ (.*)$", text, re.M)}


def test_every_link_in_the_readme_and_the_docs_leads_to_a_file_and_a_heading():
    docs = os.path.join(ROOT, "docs")
    pages = [README] + [os.path.join(docs, p) for p in sorted(os.listdir(docs))
                        if p.endswith(".md")]
    broken = []
    for page in pages:
        with open(page, encoding="utf-8") as f:
            text = f.read()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if "://" in target:
                continue
            file, _, anchor = target.partition("#")
            path = os.path.normpath(os.path.join(os.path.dirname(page), file)) if file else page
            if not os.path.exists(path):
                broken.append(f"{os.path.relpath(page, ROOT)}: {target} (no such file)")
            elif anchor and path.endswith(".md"):
                with open(path, encoding="utf-8") as f:
                    if anchor not in _anchors(f.read()):
                        broken.append(f"{os.path.relpath(page, ROOT)}: {target} (no such heading)")
    assert not broken, broken
