"""The stand-alone scripts of examples/ run against the installed package."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_torch_embedding_bag_learns(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    script = EXAMPLES / "torch_embedding_bag.py"
    argv = [sys.executable, "-P", str(script), "--epochs", "2", "--path", str(tmp_path / "run")]
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=240).stdout
    last = out.strip().splitlines()[-1]
    assert last.startswith("epoch 2: test accuracy ")
    assert float(last.split()[4].rstrip(",")) > 0.8
