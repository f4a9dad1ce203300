"""Peak host memory of loading a HF checkpoint straight into a (fsdp=4, tp=2) sharding.

Writes a random Llama checkpoint of about `--megabytes` MB, then loads it in a fresh subprocess on
8 simulated CPU devices and reports, as one JSON line:

- `params_bytes`: bytes of the loaded (sharded) parameters;
- `largest_tensor_bytes`: the largest single tensor;
- `peak_rss_increase_bytes`: peak resident memory during the load minus the resident memory just
  before it (Linux VmHWM, reset through /proc/self/clear_refs). On CPU the "devices" live in host
  memory too, so this includes the params themselves;
- `host_overhead_bytes` = peak increase - params: what the loader held beyond the params;
- `tracemalloc_peak_bytes`: peak of Python/NumPy allocations during the load (device buffers
  excluded): the loader's temporaries;
- `ok`: host_overhead <= 2 x largest tensor.

    python -m bench.load_memory --megabytes 200
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

_CHILD = r"""
import json, os, sys, tracemalloc
from jaxrl.infra.xla_cpu import cpu_xla_flags
os.environ["XLA_FLAGS"] = cpu_xla_flags("", devices=8)
os.environ["JAX_PLATFORMS"] = "cpu"
import jax
from flax import nnx
from jaxrl.infra.mesh import MeshConfig, make_mesh
from jaxrl.infra.sharding import TRAINER_RULES
from jaxrl.models import hf
from jaxrl.models.safetensors_io import SafetensorsReader

def rss(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)

path = sys.argv[1]
reader = SafetensorsReader(path)
largest = max(
    int(__import__("numpy").prod(reader.shape(n))) * 4 for n in reader
)
mesh = make_mesh(MeshConfig(("fsdp", "tp"), (4, 2)))
hf.load_config(path)
jax.block_until_ready(jax.numpy.zeros(8))  # backend up before the baseline
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset VmHWM to the current RSS
before = rss("VmRSS")
tracemalloc.start()
model = hf.load_model(path, mesh=mesh, rules=TRAINER_RULES)
jax.block_until_ready(nnx.state(model))
_, traced_peak = tracemalloc.get_traced_memory()
peak = rss("VmHWM")
params = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
print(json.dumps({
    "params_bytes": params,
    "largest_tensor_bytes": largest,
    "peak_rss_increase_bytes": peak - before,
    "host_overhead_bytes": peak - before - params,
    "tracemalloc_peak_bytes": traced_peak,
    "ok": peak - before - params <= 2 * largest,
}))
"""


def write_checkpoint(path: str, megabytes: float) -> None:
    """A random fp32 Llama of about `megabytes` MB (the embeddings dominate, as in real LMs)."""
    from flax import nnx

    from jaxrl.models import hf
    from jaxrl.models.config import ModelConfig
    from jaxrl.models.transformer import Transformer

    hidden, layers = (512, 4) if megabytes >= 100 else (256, 2)
    per_layer = 4 * hidden * hidden + 3 * hidden * 3 * hidden + 2 * hidden
    vocab = max(256, int((megabytes * 1e6 / 4 - layers * per_layer) / (2 * hidden)))
    vocab -= vocab % 8
    config = ModelConfig("llama", vocab, hidden, 3 * hidden, layers, 8, 4, 64)
    hf.save_hf(Transformer(config, rngs=nnx.Rngs(0)), path)


def measure(megabytes: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ckpt")
        write_checkpoint(path, megabytes)
        disk = sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))
        out = subprocess.run(
            [sys.executable, "-c", _CHILD, path], capture_output=True, text=True, check=False
        )
        if out.returncode:
            raise RuntimeError(f"load subprocess failed:\n{out.stderr[-4000:]}")
        result = json.loads(out.stdout.strip().splitlines()[-1])
    result["checkpoint_bytes"] = disk
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="peak host memory of a sharded HF load")
    parser.add_argument("--megabytes", type=float, default=200.0)
    args = parser.parse_args(argv)
    result = measure(args.megabytes)
    result["command"] = (  # JAXRL_BENCH_COMMAND: set by `python -m bench`
        os.environ.get("JAXRL_BENCH_COMMAND")
        or f"python -m bench.load_memory --megabytes {args.megabytes:g}"
    )
    print(json.dumps(result))
    mb = lambda b: f"{b / 1e6:.1f} MB"
    print(
        f"checkpoint {mb(result['checkpoint_bytes'])}, params {mb(result['params_bytes'])}, "
        f"largest tensor {mb(result['largest_tensor_bytes'])}: peak RSS +"
        f"{mb(result['peak_rss_increase_bytes'])}, beyond the params "
        f"{mb(result['host_overhead_bytes'])} (bound 2 x largest = "
        f"{mb(2 * result['largest_tensor_bytes'])}), tracemalloc peak "
        f"{mb(result['tracemalloc_peak_bytes'])}"
    )


if __name__ == "__main__":
    main()
