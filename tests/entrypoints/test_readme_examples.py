"""The Python examples of the README and docs/python.md run as written (on a tiny checkpoint in place of
/path/to/checkpoint)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "docs" / "python.md"]
BLOCKS = [b for page in PAGES for b in re.findall(r"```python\n(.*?)```", page.read_text(), re.S)
          if "/path/to/checkpoint" in b]


@pytest.mark.parametrize("block", BLOCKS, ids=[f"example{i}" for i in range(len(BLOCKS))])
def test_readme_example_runs(block: str, tiny_qwen2: str) -> None:
    code = block.replace("/path/to/checkpoint", tiny_qwen2)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip(), "the example printed nothing"


def test_examples_were_found() -> None:
    assert len(BLOCKS) >= 3  # the README's Omni example, docs/python.md's Omni and AsyncOmni ones
