"""bench.multiturn's scripted workload (`--turn_tokens`): what docs/multiturn.md says it is."""

from __future__ import annotations

import argparse
import re

from bench.multiturn import scripted_workload


def test_scripted_workload_has_its_turns_replies_and_stop_share():
    args = argparse.Namespace(turn_tokens=32, turns=3, observation_tokens=8, prompts=2)
    work = scripted_workload("arith_tiny", args)
    vocab = work.model.config.vocab_size
    assert vocab == 512 and work.stop_ids == tuple(range(512 - 16, 512))  # P(stop) ~ 1 / 32
    assert work.budget.max_turns == 3 and work.budget.max_turn_tokens == 96
    assert all(0 < t < work.stop_ids[0] for p in work.prompts for t in p)
    env = work.make_env(1)
    assert tuple(env.reset(work.items[1])) == work.prompts[1] != work.prompts[0]
    steps = [env.step([5, work.stop_ids[0]]) for _ in range(3)]
    assert [s.done for s in steps] == [False, False, True]
    assert len(steps[0].observation) == 8 and steps[0].observation == steps[1].observation


def test_chat_workload_is_the_learning_configs_task_on_the_models_template(tmp_path):
    """`--hf_dir`: the chat calculator's episodes as configs/rl/calc_smollm2_learn.gin sets
    them (digits, worked exchange, budgets), on the model's own tokenizer and template."""
    import os

    import gin
    from chat_fixtures import chatml_tokenizer
    from flax import nnx

    from bench.multiturn import chat_workload
    from jaxrl.infra.config import parse_gin, resolve_bindings
    from jaxrl.models import hf
    from jaxrl.models.config import ModelConfig
    from jaxrl.models.transformer import Transformer
    from launch.rl import rl_main

    tokenizer = chatml_tokenizer()
    config = ModelConfig("llama", len(tokenizer), 32, 64, 2, 4, 2, 8, pad_token_id=2,
                         bos_token_id=1, eos_token_id=2, max_position_embeddings=1024)  # fmt: skip
    hf.save_hf(Transformer(config, rngs=nnx.Rngs(0)), str(tmp_path), tokenizer=tokenizer)
    work = chat_workload("smollm2", argparse.Namespace(hf_dir=str(tmp_path), prompts=3))

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        parse_gin([os.path.join(repo, "configs", "rl", "calc_smollm2_learn.gin")],
                  [f"PolicySpec.init_from = '{tmp_path}'"])  # fmt: skip
        kwargs = resolve_bindings(rl_main)
    finally:
        gin.clear_config()
    task, budget = kwargs["task"], kwargs["episodes"]
    assert work.budget == budget and work.temperature == kwargs["rl"].temperature
    a, b = re.findall(r"What is (\d+)\*(\d+)\?", work.items[0].text)[-1]  # the question
    assert len(a) == task.max_digits == 3 and len(b) == task.max_digits_b == 2
    assert work.items[0].reference == str(int(a) * int(b))
    ((ea, eb),) = task.few_shot
    assert f"What is {ea}*{eb}?" in work.items[0].text and str(ea * eb) in work.items[0].text
    assert work.stop_ids == (tokenizer.convert_tokens_to_ids("<|im_end|>"),)
    env = work.make_env(0)
    assert tuple(env.reset(work.items[0])) == work.prompts[0]
