"""Smoke version of the generation benchmark: both sides run and a ratio is reported.

(The RL learning experiment is not smoke-tested here: its code path is `launch.rl`, which
tests/test_rl_loop.py runs end to end.)
"""

from __future__ import annotations

import json

from bench import gen


def test_bench_gen_smoke(capsys):
    gen.main(["--smoke"])
    row = json.loads(capsys.readouterr().out.splitlines()[0])
    assert row["jax_tok_s"] > 0 and row["torch_tok_s"] > 0 and row["speedup"] > 0
