"""Import a llama-architecture GGUF (llama.cpp) file as a Hugging Face directory, without torch.

    python -m launch.import_gguf --gguf=SmolLM2-135M-Instruct.Q4_1.gguf --out=smollm2/
    python -m launch.generate --hf_dir=smollm2/ --chat_template --greedy --prompts=- --output=-

The weights are dequantised to float32 (or --dtype=bfloat16), Q / K un-permuted to the
rotate-half layout, and written with the tokenizer (chat template, special tokens) rebuilt from
the GGUF metadata; `jaxrl.models.gguf` says what is supported. The directory is written
atomically: a failed import leaves nothing at --out.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from jaxrl.infra.paths import user_path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Import a llama GGUF file as an HF directory.")
    parser.add_argument("--gguf", required=True, type=user_path, help="the .gguf file")
    parser.add_argument(
        "--out", required=True, type=user_path, help="output directory (save_pretrained layout)"
    )
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="dtype the dequantised weights are stored in",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    args = parser.parse_args(argv)

    from jaxrl.models.gguf import GGUFError, import_gguf
    from jaxrl.models.gguf_tokenizer import GGUFTokenizerError

    start = time.perf_counter()
    try:
        config = import_gguf(
            args.gguf,
            args.out,
            dtype=args.dtype,
            overwrite=args.overwrite,
            progress=lambda line: print(line, file=sys.stderr, flush=True),
        )
    except (GGUFError, GGUFTokenizerError, FileNotFoundError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"imported {args.gguf} ({config.num_params():,} params, {config.model_type}, "
        f"{args.dtype}) to {os.path.abspath(args.out)} in {time.perf_counter() - start:.1f}s"
    )
    return 0


if __name__ == "__main__":
    from jaxrl.infra.launcher import run_cli
    from jaxrl.infra.user_code import keep_torch_out

    keep_torch_out()
    run_cli(main)
