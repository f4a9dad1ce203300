"""Export a run's policy to a Hugging Face directory that `transformers` loads.

    python -m launch.export --workdir=runs/arith --out=exported/ [--step=N] [--dtype=bfloat16]

The architecture and tokenizer come from WORKDIR/model/, the weights from the newest finished
checkpoint (or --step); only the params are read, never the optimizer state. The output
directory is written atomically (a temporary directory renamed into place).

A LoRA run (WORKDIR/lora.json) checkpoints adapters only:

    python -m launch.export --workdir=runs/arith_lora --out=exported/ --merge_lora
    python -m launch.export --workdir=runs/arith_lora --peft_out=adapters/

`--merge_lora` folds `W + (alpha / r) A @ B` into a plain HF directory (the base read from where
the run recorded it); `--peft_out` writes the adapters in PEFT's layout (`adapter_config.json` +
`adapter_model.safetensors`). PEFT loads a base by the name or path its adapter config records,
and a jaxrl workdir is not one transformers reads: a base that is a run (the SFT stage) is
exported as an HF directory beside them, `PEFT_OUT/base/` (with the tokenizer), and recorded by
its absolute path; an HF-directory base is recorded where it is. Either way
`peft.AutoPeftModelForCausalLM.from_pretrained(PEFT_OUT)` loads base + adapters (after moving
PEFT_OUT: `PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(PEFT_OUT/base),
PEFT_OUT)`).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from jaxrl.infra.paths import user_path
from jaxrl.job import workdir as run_dir
from jaxrl.models import hf
from jaxrl.train import lora as lora_lib

# Where --peft_out puts the base when the run's base is a jaxrl workdir (transformers reads none).
PEFT_BASE_DIR = "base"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Export a run's policy as a HF checkpoint.")
    parser.add_argument("--workdir", required=True, type=user_path, help="the run's workdir")
    parser.add_argument(
        "--out", default=None, type=user_path, help="output directory (save_pretrained layout)"
    )
    parser.add_argument(
        "--merge_lora", action="store_true", help="LoRA run: export base + adapters merged"
    )
    parser.add_argument(
        "--peft_out", default=None, type=user_path, help="LoRA run: adapters-only PEFT directory"
    )
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default newest)")
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default=None,
        help="cast the weights (default: keep the training dtype)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    args = parser.parse_args(argv)

    is_lora = run_dir.load_run_lora(args.workdir) is not None
    if is_lora and args.out and not args.merge_lora:
        print(
            f"error: {args.workdir} is a LoRA run (its checkpoints hold adapters only): pass "
            "--merge_lora with --out, or --peft_out for the adapters alone",
            file=sys.stderr,
        )
        return 2
    if (args.merge_lora or args.peft_out) and not is_lora:
        print(f"error: {args.workdir} is not a LoRA run (no lora.json)", file=sys.stderr)
        return 2
    if not args.out and not args.peft_out:
        print("error: pass --out (and/or --peft_out for a LoRA run)", file=sys.stderr)
        return 2
    for out in (args.out, args.peft_out):
        if out and os.path.exists(out) and not args.overwrite:
            print(f"error: {out} exists; pass --overwrite to replace it", file=sys.stderr)
            return 2
    start = time.perf_counter()
    if is_lora:
        step, model, adapters, lora, base, tokenizer = run_dir.load_lora_policy(
            args.workdir, step=args.step
        )
        if args.peft_out:
            peft_base = base
            if os.path.isdir(run_dir.checkpoint_dir(base)):  # a jaxrl run: export it as HF
                peft_base = os.path.abspath(os.path.join(args.peft_out, PEFT_BASE_DIR))
            lora_lib.save_peft(adapters, lora, args.peft_out, base_model=peft_base)
            if tokenizer is not None:  # AutoTokenizer.from_pretrained(PEFT_OUT) as well
                tokenizer.save_pretrained(args.peft_out)
            if peft_base != base:
                _, base_model, base_tokenizer = run_dir.load_policy(base)
                hf.save_hf(base_model, peft_base, tokenizer=base_tokenizer, dtype=args.dtype)
            print(
                f"wrote the adapters of step {step} to {os.path.abspath(args.peft_out)} (base: "
                f"{peft_base}{', exported from ' + base if peft_base != base else ''})"
            )
        if not args.out:
            return 0
    else:
        step, model, tokenizer = run_dir.load_policy(args.workdir, step=args.step)
    hf.save_hf(model, args.out, tokenizer=tokenizer, dtype=args.dtype)
    print(
        f"exported step {step} of {args.workdir} ({model.config.num_params():,} params, "
        f"{model.config.model_type}) to {os.path.abspath(args.out)} in "
        f"{time.perf_counter() - start:.1f}s"
    )
    return 0


if __name__ == "__main__":
    from jaxrl.infra.launcher import run_cli

    run_cli(main)
