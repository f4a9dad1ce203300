"""Export a run's policy to a Hugging Face directory that `transformers` loads.

    python -m launch.export --workdir=runs/arith --out=exported/ [--step=N] [--dtype=bfloat16]

The architecture and tokenizer come from WORKDIR/model/, the weights from the newest finished
checkpoint (or --step); only the params are read, never the optimizer state. The output
directory is written atomically (a temporary directory renamed into place).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from jaxrl import workdir as run_dir
from jaxrl.models import hf


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Export a run's policy as a HF checkpoint.")
    parser.add_argument("--workdir", required=True, help="the run's workdir")
    parser.add_argument("--out", required=True, help="output directory (save_pretrained layout)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default newest)")
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default=None,
        help="cast the weights (default: keep the training dtype)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    args = parser.parse_args(argv)

    if os.path.exists(args.out) and not args.overwrite:
        print(f"error: {args.out} exists; pass --overwrite to replace it", file=sys.stderr)
        return 2
    start = time.perf_counter()
    step, model, tokenizer = run_dir.load_policy(args.workdir, step=args.step)
    hf.save_hf(model, args.out, tokenizer=tokenizer, dtype=args.dtype)
    print(
        f"exported step {step} of {args.workdir} ({model.config.num_params():,} params, "
        f"{model.config.model_type}) to {os.path.abspath(args.out)} in "
        f"{time.perf_counter() - start:.1f}s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
