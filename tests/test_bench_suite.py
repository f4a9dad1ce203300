"""`python -m bench suite`: pytest's summary line is read right (counts and seconds), and the
smoke run (one small test file, in a worktree of this commit) reports consistent figures."""

import math

import pytest

from bench import suite


@pytest.mark.parametrize(
    "output, expected",
    [
        ("....\n930 passed in 978.60s (0:16:18)\n", (930, 0, 978.6)),
        ("2 failed, 928 passed, 3 warnings in 1112.99s (0:18:32)", (928, 2, 1112.99)),
        ("=== 1 error, 5 passed in 3.20s ===", (5, 1, 3.2)),
    ],
)
def test_the_summary_line_is_parsed(output, expected):
    got = suite.parse_summary(output)
    assert (got["passed"], got["failed"], got["pytest_s"]) == expected


def test_no_summary_is_an_error_naming_the_output():
    with pytest.raises(ValueError, match="no pytest summary line.*ImportError"):
        suite.parse_summary("ImportError: no module named x\n")


def test_bench_suite_smoke():
    rows = suite.main(["--smoke"])
    run, mean = rows
    assert run["tree"] == mean["tree"] == "this" and mean["round"] == "mean"
    assert run["passed"] >= 5 and run["failed"] == 0
    # The process's wall time holds pytest's own time, which holds the tests' (one worker).
    assert run["wall_s"] >= run["pytest_s"] > 0 and 0 < run["test_s"] <= run["pytest_s"] + 1
    assert math.isclose(mean["wall_s"], run["wall_s"])


def test_a_run_gets_the_makefiles_flags_and_not_the_bench_command(monkeypatch):
    """The benchmarks' smoke tests check the command their rows record: the suite's own
    `python -m bench suite` command must not reach them."""
    monkeypatch.setenv("JAXRL_BENCH_COMMAND", "python -m bench suite")
    monkeypatch.setenv("JAXRL_BENCH_RESULTS_DIR", "/elsewhere")
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    env = suite.suite_env("/tree")
    assert "JAXRL_BENCH_COMMAND" not in env and "JAXRL_BENCH_RESULTS_DIR" not in env
    assert env["XLA_FLAGS"] == suite.MAKE_ENV["XLA_FLAGS"] and env["PYTHONPATH"] == "/tree"
