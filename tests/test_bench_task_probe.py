"""`python -m bench task-probe --smoke`: the candidate reasoning-gym tasks probed greedily on a tiny
random Llama whose tokenizer spells ASCII and carries SmolLM2-135M-Instruct's chat template
(default system turn included), built here: nothing is downloaded. The rows' columns and
ranges, the result file, and the prompts and rewards being the RL config's own."""

from __future__ import annotations

import json
import os

import pytest
from chat_fixtures import chatml_tokenizer
from flax import nnx

from jaxrl.models import hf
from jaxrl.models.config import ModelConfig
from jaxrl.models.transformer import Transformer

pytest.importorskip("reasoning_gym")


@pytest.fixture(scope="module")
def tiny_chat_dir(tmp_path_factory):
    """A random 2-layer Llama (context 512: the characters of a templated question fit) and a
    character tokenizer with ChatML's special tokens; EOS and pad `<|im_end|>`, as SmolLM2's."""
    tokenizer = chatml_tokenizer()
    config = ModelConfig(
        "llama", len(tokenizer), 32, 64, 2, 4, 2, 8,
        pad_token_id=2, bos_token_id=1, eos_token_id=2, max_position_embeddings=512,
    )  # fmt: skip
    path = str(tmp_path_factory.mktemp("tiny_chat"))
    hf.save_hf(Transformer(config, rngs=nnx.Rngs(0), init_std=0.3), path, tokenizer=tokenizer)
    return path


def test_task_probe_smoke_rows_and_result_file(tiny_chat_dir):
    from bench import common, task_probe

    rows = task_probe.main(["--smoke", "--hf_dir", tiny_chat_dir])
    assert [(r["dataset"], r["config"]) for r in rows] == [
        (c.dataset, c.label) for c in task_probe.CANDIDATES
    ]
    for row in rows:
        assert row["draws"] == 4
        assert 0 <= row["greedy_pct"] <= 100 and 0 <= row["ended_pct"] <= 100
        assert 1 <= row["reply_tokens"] <= 8  # --smoke: 8 new tokens at most
        assert row["seconds"] >= 0
    with open(os.path.join(common.RESULTS_DIR, f"{task_probe.SMOKE_RESULT}.json")) as f:
        result = json.load(f)
    assert result["schema"] == common.SCHEMA
    assert [key for key, _ in result["columns"]] == [key for key, _ in task_probe.COLUMNS]
    assert result["rows"] == rows and "TaskSpec.seed=777" in result["note"]


def test_task_probe_builds_the_rl_configs_task(tiny_chat_dir):
    """The first candidate is the config's own task; its prompts carry the template's default
    system turn and the config's instruction, and the reward scores the true answer 1."""
    from bench import task_probe
    from jaxrl.job.specs import build_source
    from jaxrl.tasks.reasoning_gym import score_reply

    task, max_new_tokens = task_probe.config_task()
    assert max_new_tokens == 48 and task.instruction == "Give only the final answer."
    assert task.answer_format == "last_number" and task.system_prompt is None
    first = task_probe.CANDIDATES[0]
    assert (task.dataset, dict(task.dataset_config)) == (first.dataset, first.config)
    source = build_source(task, hf.load_tokenizer(tiny_chat_dir))
    entry = source.entry((777, 0))
    text = source.prompt(entry["question"])
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith(f"{entry['question']}\nGive only the final answer.<|im_end|>\n"
                         "<|im_start|>assistant\n")  # fmt: skip
    reference = source.reference((777, 0))
    assert score_reply(f"The answer is {entry['answer']}.", reference) == 1.0
    assert json.loads(reference)["seed"] == 777
