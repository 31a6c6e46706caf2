"""The code is lint-clean (ruff: pycodestyle, pyflakes, import order, bugbear) and the whole package type-checks
(mypy); both read their configuration from pyproject.toml.

Each tool runs as a subprocess of this interpreter (``python -m ruff``, ``python -m mypy``), so the versions are
the environment's; the test is skipped where a tool is not installed (both come with the ``dev`` extra). mypy keeps
its cache in ``.mypy_cache``: a warm run takes a few seconds, a cold one well under a minute.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LINTED = ["lit_mpstable", "tests", "bench", "experiments"]


def _run(tool: str, *args: str) -> subprocess.CompletedProcess[str]:
    if importlib.util.find_spec(tool) is None:
        pytest.skip(f"{tool} is not installed (pip install -e '.[dev]' brings it)")
    return subprocess.run([sys.executable, "-m", tool, *args], cwd=REPO, capture_output=True, text=True, timeout=300)


def test_ruff_finds_nothing() -> None:
    result = _run("ruff", "check", "--no-fix", "--output-format", "concise", *LINTED)
    assert result.returncode == 0, f"ruff check {' '.join(LINTED)}:\n{result.stdout}{result.stderr}"


def test_mypy_finds_nothing() -> None:
    # No paths given: the files, the Python version and the strictness come from [tool.mypy].
    result = _run("mypy")
    assert result.returncode == 0, f"mypy (files from [tool.mypy]):\n{result.stdout}{result.stderr}"
