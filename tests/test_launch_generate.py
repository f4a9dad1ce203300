"""`launch.generate` end to end on a tiny HF directory."""

from __future__ import annotations

import json

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
    prompts = tmp_path / name
    prompts.write_text(prompts_text)
    out = tmp_path / "out.jsonl"
    code = generate.main([f"--hf_dir={hf_dir}", f"--prompts={prompts}", f"--output={out}", *flags])
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
