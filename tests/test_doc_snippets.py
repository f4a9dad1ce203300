"""The code in the README and docs/ runs as written (issue 35): every ```python block of
docs/API.md, in order, as one script; every ```python block of the README (each on its own).

Each document runs in a fresh subprocess in a scratch directory (the blocks write files there:
`tiny_hf`, `runs/...`), on the 8 simulated CPU devices of the tests. Nothing is substituted:
the text a reader copies is the text that runs.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

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


def test_api_doc_runs_as_one_script(tmp_path):
    blocks = python_blocks("docs/API.md")
    assert len(blocks) >= 7, "docs/API.md lost its code blocks"
    script = "\n\n".join(blocks) + (
        "\n\nimport json\n"
        "print(json.dumps({'rewards': [float(r) for r in rewards], 'step': int(state.step),"
        " 'loss': float(metrics['loss'])}))\n"
    )
    proc = run_script(script, tmp_path)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["step"] == 2  # the controller runs to total_steps=2 (step 1 was by hand)
    assert len(report["rewards"]) == 16
    assert (tmp_path / "tiny_hf" / "config.json").exists()
    assert (tmp_path / "out_dir" / "model.safetensors").exists()
    assert (tmp_path / "runs" / "mine" / "metrics.jsonl").exists()


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
