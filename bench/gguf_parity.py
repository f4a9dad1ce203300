"""GGUF import parity on a real model: the library against `transformers`' own GGUF loader.

    python -m launch.fetch smollm2-135m-instruct      # once (or launch.import_gguf)
    python -m bench.gguf_parity --gguf=~/.cache/jaxrl/downloads/SmolLM2-135M-Instruct.Q4_1.gguf

Imports --gguf with `jaxrl.models.gguf` (into a temporary directory, or reads --hf_dir), loads it
with `jaxrl.models.hf`, and loads the same file with `transformers`
(`from_pretrained(dir, gguf_file=...)`, torch, float32). Measured, on the same token ids:

- logits: 8 prompts, the library's fp32 logits as one left-padded batch against transformers'
  per prompt (unpadded); max |diff| over every real position (bound 2e-4);
- greedy: 16 chat-templated questions, 32 new tokens, the library's continuous-batching engine
  (as `launch.generate --greedy`) against `transformers.generate(do_sample=False)` stopping at
  `<|im_end|>`; the number of token-identical completions (bound: all);
- tokenizer: 200 mixed strings (digits, unicode, chat markup, code, whitespace) encoded by the
  imported tokenizer and by transformers' GGUF tokenizer; the number identical (bound: all).

Writes bench/results/gguf_parity.{json,md}.

XLA:CPU runs here with `jaxrl.infra.xla_cpu.CPU_EXACT_DOT_FLAG` (f32 dots by XLA's own emitter,
not YNNPACK, whose GEMM rounds more: against a float64 forward the library's logits err by
4.8e-4 with YNNPACK dots, 1.3e-4 without, torch fp32 1.3e-4); --ynn_dots keeps the default.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time

from jaxrl.infra.xla_cpu import CPU_EXACT_DOT_FLAG, add_xla_flag

if "--ynn_dots" not in sys.argv:  # before JAX starts its backend
    add_xla_flag(CPU_EXACT_DOT_FLAG)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from bench.common import command, machine, write_results  # noqa: E402

LOGIT_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "What is 23 + 58? The answer is",
    "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a small village by the sea, there lived",
    "Les élèves ont étudié la photosynthèse — 光合作用 — pendant 3 heures.",
    "1, 1, 2, 3, 5, 8, 13, 21,",
    "Q: If a train travels 60 km in 45 minutes, what is its speed in km/h?\nA:",
]
CHAT_QUESTIONS = [
    "What is the capital of France?",
    "What is 23 + 58?",
    "What is 7 * 8?",
    "Name three primary colours.",
    "Write a haiku about the sea.",
    "What is the boiling point of water in Celsius?",
    "Translate 'good morning' into Spanish.",
    "Who wrote Romeo and Juliet?",
    "What is 144 divided by 12?",
    "Give me a synonym for 'happy'.",
    "How many legs does a spider have?",
    "What is the largest planet in the solar system?",
    "Explain what a prime number is in one sentence.",
    "What is 15% of 200?",
    "Write a Python function that returns the square of a number.",
    "What colour do you get by mixing blue and yellow?",
]


def mixed_strings(n: int, seed: int = 0) -> list[str]:
    """`n` strings mixing numbers, unicode, chat markup, code and whitespace (seeded)."""
    rng = random.Random(seed)
    pieces = [
        lambda: str(rng.randint(0, 10 ** rng.randint(1, 12))),
        lambda: f"{rng.uniform(-1000, 1000):.{rng.randint(0, 6)}f}",
        lambda: f"{rng.randint(1, 999)} + {rng.randint(1, 999)} = ?",
        lambda: rng.choice(["héllo", "naïve", "café", "Straße", "日本語", "你好", "🙂👍", "∑x²"]),
        lambda: rng.choice(["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_start|>user\n"]),
        lambda: rng.choice(["don't", "we'll", "IT'S", "they've", "I'm"]),
        lambda: rng.choice(["    ", "\n", "\n\n", "\t", " ", "  ", "\r\n"]),
        lambda: rng.choice(["def f(x):", "return x**2", "if a >= b:", "{'k': [1, 2]}", "x=-3;"]),
        lambda: rng.choice(["The", "quick", "brown", "fox", "jumps", "over", "lazy", "dog"]),
        lambda: rng.choice(["#### 42", "$3.50", "50%", "3/4", "1e-5", "2^10", "(12)", "#7"]),
    ]
    return ["".join(rng.choice(pieces)() for _ in range(rng.randint(1, 12))) for _ in range(n)]


def library_logits(model, ids_list: list[list[int]]) -> list[np.ndarray]:
    """fp32 logits of each prompt, computed as one left-padded batch."""
    from flax import nnx

    width = max(map(len, ids_list))
    tokens = np.zeros((len(ids_list), width), np.int32)
    mask = np.zeros_like(tokens, dtype=bool)
    for row, ids in enumerate(ids_list):
        tokens[row, width - len(ids) :], mask[row, width - len(ids) :] = ids, True
    with jax.default_matmul_precision("highest"):
        logits = np.asarray(nnx.jit(lambda m, t, k: m(t, k))(model, tokens, mask))
    return [logits[row, width - len(ids) :] for row, ids in enumerate(ids_list)]


def library_greedy(model, tokenizer, ids_list, new_tokens: int) -> list[list[int]]:
    """Greedy completions from the engine, as `launch.generate --greedy` makes them."""
    from flax import nnx

    from jaxrl.generation.engine_sampler import make_sampler
    from jaxrl.generation.sampling import SamplingConfig

    graphdef, params = nnx.split(model)
    sampler = make_sampler(
        "engine",
        graphdef,
        model.config,
        num_slots=len(ids_list),
        pad_id=tokenizer.pad_token_id,
        eos_ids=model.config.eos_token_ids,
    )
    with jax.default_matmul_precision("highest"):
        out = sampler.generate(
            params,
            ids_list,
            SamplingConfig(max_new_tokens=new_tokens, greedy=True),
            jax.random.key(0),
        )
    return [out.tokens_bn[i, : int(out.lengths_b[i])].tolist() for i in range(len(ids_list))]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", required=True, help="the .gguf file")
    p.add_argument("--hf_dir", default=None, help="its import (default: import it now)")
    p.add_argument("--new_tokens", type=int, default=32)
    p.add_argument("--num_strings", type=int, default=200)
    p.add_argument("--name", default="gguf_parity", help="results file name")
    p.add_argument("--ynn_dots", action="store_true", help="XLA:CPU's default YNNPACK f32 dots")
    args = p.parse_args(argv)
    import torch
    import transformers

    from jaxrl.models import gguf as gguf_import
    from jaxrl.models import hf

    gguf_path = os.path.expanduser(args.gguf)
    timings = {}
    tmp = tempfile.TemporaryDirectory()
    hf_dir = args.hf_dir
    if hf_dir is None:
        hf_dir = os.path.join(tmp.name, "imported")
        start = time.perf_counter()
        gguf_import.import_gguf(gguf_path, hf_dir)
        timings["import_s"] = time.perf_counter() - start
    start = time.perf_counter()
    model = hf.load_model(hf_dir)
    tokenizer = hf.load_tokenizer(hf_dir)
    timings["library_load_s"] = time.perf_counter() - start

    start = time.perf_counter()
    directory, name = os.path.split(os.path.abspath(gguf_path))
    ref_tokenizer = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=name, dtype=torch.float32
    ).eval()
    timings["transformers_load_s"] = time.perf_counter() - start
    print({k: round(v, 1) for k, v in timings.items()}, file=sys.stderr)

    # 1. Logits on the same ids.
    ids_list = [ref_tokenizer.encode(t) for t in LOGIT_PROMPTS]
    ours = library_logits(model, ids_list)
    logit_diff, logit_scale = 0.0, 0.0
    for ids, mine in zip(ids_list, ours, strict=True):
        with torch.no_grad():
            theirs = ref(torch.tensor([ids])).logits[0].float().numpy()
        logit_diff = max(logit_diff, float(np.abs(mine - theirs).max()))
        logit_scale = max(logit_scale, float(np.abs(theirs).max()))
    # How far fp32 itself is from exact: both against transformers in float64 on the same weights
    # (the imported directory, which equals transformers' own dequantisation bit for bit).
    exact = transformers.AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float64, attn_implementation="eager"
    ).eval()
    ours_vs_f64 = ref_vs_f64 = 0.0
    for ids, mine in zip(ids_list, ours, strict=True):
        with torch.no_grad():
            truth = exact(torch.tensor([ids])).logits[0].numpy()
            theirs = ref(torch.tensor([ids])).logits[0].double().numpy()
        ours_vs_f64 = max(ours_vs_f64, float(np.abs(mine - truth).max()))
        ref_vs_f64 = max(ref_vs_f64, float(np.abs(theirs - truth).max()))
    del exact
    print(
        f"logits: max |diff| {logit_diff:.3g} (|logits| up to {logit_scale:.3g}); against "
        f"float64: library {ours_vs_f64:.3g}, transformers fp32 {ref_vs_f64:.3g}",
        file=sys.stderr,
    )

    # 2. Greedy completions of chat-templated questions.
    chat_ids = [
        ref_tokenizer.encode(
            ref_tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
            ),
            add_special_tokens=False,
        )
        for q in CHAT_QUESTIONS
    ]
    start = time.perf_counter()
    mine = library_greedy(model, tokenizer, chat_ids, args.new_tokens)
    timings["library_greedy_s"] = time.perf_counter() - start
    eot = ref_tokenizer.convert_tokens_to_ids("<|im_end|>")
    start = time.perf_counter()
    identical, samples = 0, []
    for q, ids, got in zip(CHAT_QUESTIONS, chat_ids, mine, strict=True):
        with torch.no_grad():
            out = ref.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=args.new_tokens,
                do_sample=False,
                eos_token_id=eot,
                pad_token_id=eot,
            )
        want = out[0, len(ids) :].tolist()
        identical += got == want
        if got != want:
            pairs = zip(got, want, strict=False)
            first = next((i for i, (a, b) in enumerate(pairs) if a != b), None)
            print(f"differs at {first}: {q!r}\n  ours {got}\n  hf   {want}", file=sys.stderr)
        samples.append({"question": q, "answer": tokenizer.decode(got, skip_special_tokens=True)})
    timings["transformers_greedy_s"] = time.perf_counter() - start
    print(f"greedy: {identical}/{len(chat_ids)} identical", file=sys.stderr)

    # 3. The tokenizer on mixed strings.
    strings = mixed_strings(args.num_strings)
    same = sum(tokenizer.encode(s) == ref_tokenizer.encode(s) for s in strings)
    round_trip = sum(tokenizer.decode(tokenizer.encode(s)) == s for s in strings)
    print(f"tokenizer: {same}/{len(strings)} identical encodings", file=sys.stderr)

    rows = [
        {
            "check": "logits, 8 prompts (max abs diff)",
            "measured": f"{logit_diff:.3g} (logits up to {logit_scale:.3g})",
            "bound": "2e-4",
            "ok": logit_diff <= 2e-4,
        },
        {
            "check": "logits against float64 transformers (library / transformers fp32)",
            "measured": f"{ours_vs_f64:.3g} / {ref_vs_f64:.3g}",
            "bound": "(context)",
            "ok": "",
        },
        {
            "check": f"greedy {args.new_tokens} tokens, 16 chat prompts (identical)",
            "measured": f"{identical}/{len(chat_ids)}",
            "bound": "all",
            "ok": identical == len(chat_ids),
        },
        {
            "check": f"tokenizer, {len(strings)} mixed strings (identical ids)",
            "measured": f"{same}/{len(strings)} (decode round-trips {round_trip})",
            "bound": "all",
            "ok": same == len(strings),
        },
    ]
    xla_flags = os.environ.get("XLA_FLAGS", "")
    note = f"`{command()}` on {machine()}; XLA_FLAGS `{xla_flags}`; "
    note += f"{os.path.basename(gguf_path)}; " + ", ".join(
        f"{k} {v:.1f}" for k, v in timings.items()
    )
    table = write_results(
        args.name, rows, [("check", "check"), ("measured", "measured"), ("bound", "bound"),
                          ("ok", "ok")], note
    )  # fmt: skip
    print(table)
    for s in samples[:4]:
        print(f"  {s['question']!r} -> {s['answer']!r}")
    return 0 if all(r["ok"] is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
