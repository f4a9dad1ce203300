"""The code in the README and docs/ runs as written: every ```python block of
docs/API.md, in order, as one script; every ```python block of the README (each on its own).

Each runs in a scratch directory (the blocks write files there: `tiny_hf`, `runs/...`) on the 8
simulated CPU devices of the tests: docs/API.md in this process (sharing its imports), the
README's blocks in a fresh subprocess each. Nothing is substituted: the text a reader copies is
the text that runs.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

from jaxrl.infra.metrics import read_metrics

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 600


def python_blocks(relpath: str) -> list[str]:
    """The ```python blocks of a markdown file, in order."""
    text = open(os.path.join(REPO, relpath), encoding="utf-8").read()
    return re.findall(r"^```python\n(.*?)^```$", text, flags=re.M | re.S)


def run_script(code: str, cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, str(cwd)])}
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


def test_api_doc_runs_as_one_script(tmp_path, monkeypatch):
    """In this process (its imports and devices are the reader's), in a scratch directory."""
    blocks = python_blocks("docs/API.md")
    assert len(blocks) >= 7, "docs/API.md lost its code blocks"
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "api_doc"}
    exec(compile("\n\n".join(blocks), "docs/API.md", "exec"), namespace)
    assert int(namespace["state"].step) == 2  # the controller ran to total_steps=2
    assert [float(r) for r in namespace["rewards"]] == [0.0] * 16  # a random model
    assert namespace["logits_btv"].shape == (2, 5, 64)
    assert (tmp_path / "tiny_hf" / "config.json").exists()
    assert (tmp_path / "out_dir" / "model.safetensors").exists()
    steps = [r["step"] for r in read_metrics(tmp_path / "runs" / "mine" / "metrics.jsonl")]
    assert steps[-1] == 2


def test_every_readme_python_block_runs_on_its_own(tmp_path):
    """The README's blocks stand alone (the reward file of "Your model, your data" is also run
    by that recipe's test, which writes it out as my_rewards.py and trains with it)."""
    blocks = python_blocks("README.md")
    assert blocks, "the README lost its code blocks"
    for block in blocks:
        check = ""
        if "def score" in block:
            check = "\nprint(score(['p', 'p'], ['so 7', 'so 8'], ['7', '7']))\n"
        proc = run_script(block + check, tmp_path)
        assert proc.returncode == 0, (block, proc.stderr[-3000:])
        if check:
            assert proc.stdout.strip().splitlines()[-1] == "[1.0, 0.0]"
