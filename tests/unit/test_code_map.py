"""docs/architecture.md's package map names every module of megaframe/ and nothing that is gone
(issue 34: the old README's code map had missed 21 files)."""
from __future__ import annotations

import re

from tests.support.helpers import REPO

MAP_LINE = re.compile(r"^(megaframe/\S+\.py)\s")


def _mapped() -> list[str]:
    text = (REPO / "docs" / "architecture.md").read_text()
    blocks = re.findall(r"^```text\n(.*?)^```", text, flags=re.S | re.M)
    return [m.group(1) for block in blocks for line in block.splitlines() if (m := MAP_LINE.match(line))]


def test_the_package_map_lists_every_module_once():
    modules = sorted(str(p.relative_to(REPO)) for p in (REPO / "megaframe").rglob("*.py")
                     if "__pycache__" not in p.parts and "_conf" not in p.parts and "_recipes" not in p.parts)
    mapped = _mapped()
    assert len(mapped) == len(set(mapped)), sorted({m for m in mapped if mapped.count(m) > 1})
    missing, gone = sorted(set(modules) - set(mapped)), sorted(set(mapped) - set(modules))
    assert not missing, f"docs/architecture.md's map lacks {missing}"
    assert not gone, f"docs/architecture.md's map names files that do not exist: {gone}"
