"""`launch.generate` end to end on a tiny HF directory."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from flax import nnx

from jaxrl.models import hf
from jaxrl.models.config import ModelConfig
from jaxrl.models.transformer import Transformer
from jaxrl.tasks.tokenizer import build_arithmetic_tokenizer
from launch import generate


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    tokenizer = build_arithmetic_tokenizer()
    config = ModelConfig(
        "llama",
        56,
        32,
        64,
        2,
        4,
        2,
        8,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        max_position_embeddings=128,
    )
    path = str(tmp_path_factory.mktemp("hf"))
    hf.save_hf(Transformer(config, rngs=nnx.Rngs(0), init_std=0.3), path, tokenizer=tokenizer)
    return path


def _run(hf_dir, tmp_path, prompts_text, *flags, name="prompts.txt"):
    """`launch.generate` on the HF directory `hf_dir` (or a source flag, `--workdir=...`)."""
    prompts = tmp_path / name
    prompts.write_text(prompts_text)
    out = tmp_path / "out.jsonl"
    source = hf_dir if hf_dir.startswith("--") else f"--hf_dir={hf_dir}"
    code = generate.main([source, f"--prompts={prompts}", f"--output={out}", *flags])
    assert code == 0
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_generate_writes_one_record_per_prompt(hf_dir, tmp_path):
    records = _run(
        hf_dir,
        tmp_path,
        "12+7=\n3+45=\n60+21=\n",
        "--max_new_tokens=6",
        "--seed=1",
        "--batch_size=2",
        "--top_k=8",
    )
    assert [r["prompt"] for r in records] == ["12+7=", "3+45=", "60+21="]
    for r in records:
        assert 1 <= len(r["completion_ids"]) == len(r["logprobs"]) <= 6
        assert all(lp <= 0 for lp in r["logprobs"])
        assert isinstance(r["completion"], str) and isinstance(r["stopped"], bool)


def test_greedy_is_deterministic_and_tp2_agrees(hf_dir, tmp_path):
    text = '{"prompt": "1+1="}\n{"prompt": "99+1="}\n'
    a = _run(hf_dir, tmp_path, text, "--greedy", "--max_new_tokens=5", name="p.jsonl")
    b = _run(hf_dir, tmp_path, text, "--greedy", "--max_new_tokens=5", "--tp=2", name="p.jsonl")
    assert [r["completion_ids"] for r in a] == [r["completion_ids"] for r in b]


def test_bad_prompt_files_name_the_line(hf_dir, tmp_path):
    with pytest.raises(ValueError, match=r"prompts.txt: no prompts"):
        _run(hf_dir, tmp_path, "")
    with pytest.raises(ValueError, match=r"prompts.txt:2: empty prompt"):
        _run(hf_dir, tmp_path, "1+1=\n\n2+2=\n")
    with pytest.raises(ValueError, match=r"p.jsonl:1: expected a JSON object"):
        _run(hf_dir, tmp_path, "{not json\n", name="p.jsonl")


def test_generate_and_eval_read_a_lora_run(tmp_path, capsys, monkeypatch):
    """Regression: `launch.generate` / `launch.eval --workdir` on a LoRA run looked for
    base weights in its checkpoints (which hold adapters only) and crashed. They load the base
    the run recorded with the adapters merged: greedy completions are the merged export's
    (under `transformers`)."""
    import torch
    import transformers
    from test_launch_export import fake_lora_run

    from launch import eval as eval_launch
    from launch import export

    run, merged = tmp_path / "run", str(tmp_path / "merged")
    fake_lora_run(run)
    assert export.main([f"--workdir={run}", f"--out={merged}", "--merge_lora"]) == 0
    records = _run(f"--workdir={run}", tmp_path, "12+7=\n3+45=\n", "--greedy", "--max_new_tokens=5")
    reference = transformers.AutoModelForCausalLM.from_pretrained(merged).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(merged)
    for record in records:
        prompt = torch.tensor([tokenizer.encode(record["prompt"])])
        with torch.no_grad():
            ids = reference.generate(prompt, max_new_tokens=5, do_sample=False)
        n = len(record["completion_ids"])
        assert record["completion_ids"] == ids[0, prompt.shape[1] :][:n].tolist()
    # launch.eval scores the same merged weights (the engine's evaluation is tested elsewhere).
    seen = _capture_evaluate(monkeypatch)
    assert eval_launch.main([f"--workdir={run}"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["step"] == 7
    flat = lambda tree: {
        jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(tree)
    }
    want = flat(nnx.to_pure_dict(nnx.state(hf.load_model(merged), nnx.Param)))
    got = flat(nnx.to_pure_dict(seen["params"]))
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=1e-6, atol=1e-6)


def _capture_evaluate(monkeypatch) -> dict:
    """Replaces launch.eval's evaluation with one that records its arguments."""
    from launch import eval as eval_launch

    seen = {}

    def evaluate(sampler, params, tokenizer, reward, items, ids, **settings):
        seen.update(params=params, reward=reward, items=items, **settings)
        return {"eval/accuracy": 0.0}

    monkeypatch.setattr(eval_launch, "evaluate", evaluate)
    return seen


def test_eval_takes_every_registered_task(hf_dir, capsys, monkeypatch):
    """Regression: `launch.eval --task` offered arithmetic and math_jsonl only, so an exported
    chain-sum model could not be evaluated. Any registered task is taken; chain sums get their
    long completions by default (the task's longest, not the arithmetic 6 tokens)."""
    from jaxrl.tasks.chain import ChainTask
    from launch import eval as eval_launch

    seen = _capture_evaluate(monkeypatch)
    argv = [f"--hf_dir={hf_dir}", "--task=chain_sum", "--max_operands=3", "--eval_size=4"]
    assert eval_launch.main(argv) == 0
    assert seen["reward"] == "chain_sum_exact" and len(seen["items"]) == 4
    assert all(item.text.count("+") in (1, 2) for item in seen["items"]), seen["items"]
    assert seen["max_new_tokens"] == ChainTask(max_operands=3).max_completion_tokens()
    with pytest.raises(SystemExit, match="unknown task 'nope'"):
        eval_launch.main([f"--hf_dir={hf_dir}", "--task=nope"])
