"""Checks shared by the tests of the model cards the package writes: no path of this machine in a card, and the card's
Python snippet run as a reader would run it."""

import json
import re
import subprocess
import sys
from pathlib import Path


REPO_ROOT = Path(__file__).resolve().parents[1]


def assert_no_local_path(card: str, tmp_path_factory) -> None:
    assert str(tmp_path_factory.getbasetemp()) not in card and str(REPO_ROOT) not in card


def run_card_snippet(card: str, replacements: dict[str, Path], cwd: Path) -> str:
    """The card's Python code block, run in a fresh interpreter with each repo id replaced by a local folder (the only
    change); returns what it printed."""
    (code,) = re.findall(r"```python\n(.*?)```", card, flags=re.DOTALL)
    for repo_id, folder in replacements.items():
        assert f'"{repo_id}"' in code, repo_id
        code = code.replace(f'"{repo_id}"', json.dumps(str(folder)))
    done = subprocess.run(  # with the installed package, as a reader of the card would run it
        [sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout
