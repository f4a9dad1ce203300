"""The speed-up model (`bench.scale`) on LlamaRL's 8B / 70B / 405B settings, next to the paper's
table (Wu et al. 2025, "LlamaRL", arXiv 2505.24034: RL step 8B 22.4 s -> 8.90 s, 70B 82.3 s ->
20.67 s, 405B 635.8 s -> 59.5 s; 2.52x / 3.98x / 10.7x against a DeepSpeed-Chat-like
synchronous baseline).

A hand count (no compile: a 405B compile would not fit this machine's memory budget), the same
model as `bench.scale`: each phase at its roofline on the H100's published peaks, one kernel per
layer-collective at a fixed latency.

Per rollout batch of B rows, prompt P and completion C tokens, model of N parameters, L layers,
attention width A = heads x head_dim, KV bytes per token per row `kv` (2 L kv_heads head_dim x
2 bytes):

    train   Tt = (6 N + 6 L A S) B (P + C) / (G_t peak)        S: mean attended length (P + C) / 2
    prefill      2 N B P / (G_g peak)
    decode       C steps of  max(2 N r / (tp peak), (N w / tp + r kv (P + C/2) / tp) / bw)
                 + 2 L t_allreduce (tp > 1),  r = B / (G_g / tp) rows per replica, in waves if
                 the KV cache of r rows does not fit beside the weights
    sync   (colocated, all G GPUs)         Tg(G) + Tt(G) + reshard (weights gathered into the
                                           generation layout: N w_train / tp / link)
    async  (LlamaRL, G_g + G_t = G)        max(Tg(G_g), Tt(G_t) + Ts),  Ts = N w / (G_t link);
                                           the split G_g (whole 8-GPU nodes) is the one that
                                           minimises the async step (what a planner would pick)

Everything the paper's abstract does not give is a named guess (`SETTINGS`, `H100`);
docs/benchmarks.md ("Speed-up model") lists them. Run: `python -m bench.scale_llamarl`.
"""

from __future__ import annotations

import dataclasses
import math
import sys

# NVIDIA H100 SXM5 datasheet: dense BF16 989 TFLOP/s, FP8 1979 TFLOP/s, HBM3 3.35 TB/s, 80 GB;
# NVLink 900 GB/s total (450 GB/s a direction); one 400 Gb/s InfiniBand NIC per GPU (50 GB/s).
H100 = dict(
    peak_bf16=989e12, peak_fp8=1979e12, hbm_bw=3.35e12, hbm=80e9, nvlink=450e9, ib=50e9,
    allreduce_intra_s=10e-6, allreduce_inter_s=30e-6,  # guesses: small-message latencies
)  # fmt: skip
PAPER = {"8B": (22.4, 8.90), "70B": (82.3, 20.67), "405B": (635.8, 59.5)}


@dataclasses.dataclass(frozen=True)
class Setting:
    """One model size's run (named guesses where the abstract is silent).

    gpus: G in all; prompts x samples = B rows of prompt_len + completion_len tokens;
    tp_sync / tp_async: the generator's tensor parallelism colocated / on its own GPUs;
    gen_bytes_async: bytes per weight the async generator decodes with (2 bf16, 1 fp8)."""

    name: str
    preset: str
    gpus: int
    tp_sync: int
    tp_async: int
    gen_bytes_async: int = 2
    prompts: int = 512
    samples: int = 4
    prompt_len: int = 1024
    completion_len: int = 2048


SETTINGS = [
    Setting("8B", "llama3_8b", gpus=64, tp_sync=1, tp_async=1),
    Setting("70B", "llama3_70b", gpus=256, tp_sync=4, tp_async=4),
    # bf16 405B weights are 811 GB: 101 GB a GPU at tp 8, over the H100's 80 GB, so colocated
    # generation spans two nodes (tp 16, its all-reduces over InfiniBand); LlamaRL's generator
    # quantizes to fp8 (the paper lists quantization among its techniques), 51 GB a GPU at tp 8.
    Setting("405B", "llama3_405b", gpus=1024, tp_sync=16, tp_async=8, gen_bytes_async=1),
]


def shapes(preset_name: str) -> dict:
    from jaxrl.models.presets import preset

    c = preset(preset_name)
    return dict(
        params=c.num_params(),
        layers=c.num_layers,
        attn=c.num_heads * c.head_dim,
        kv_per_token=2 * c.num_layers * c.num_kv_heads * c.head_dim * 2,  # bf16 K and V
    )


def train_seconds(s: Setting, m: dict, gpus: int, hw=H100) -> float:
    rows, seq = s.prompts * s.samples, s.prompt_len + s.completion_len
    flops = (6 * m["params"] + 6 * m["layers"] * m["attn"] * seq / 2) * rows * seq
    return flops / (gpus * hw["peak_bf16"])


def generate_seconds(s: Setting, m: dict, gpus: int, tp: int, w: int, hw=H100) -> dict:
    rows = s.prompts * s.samples
    peak = hw["peak_fp8"] if w == 1 else hw["peak_bf16"]
    replicas = gpus // tp
    r = math.ceil(rows / replicas)
    free = hw["hbm"] * 0.9 - m["params"] * w / tp  # per GPU, 10% kept for activations
    if free <= 0:
        raise ValueError(f"{s.name}: weights do not fit at tp={tp}")
    kv_row = m["kv_per_token"] * (s.prompt_len + s.completion_len) / tp
    per_wave = max(1, min(r, int(free // kv_row)))
    waves = math.ceil(r / per_wave)
    prefill = 2 * m["params"] * rows * s.prompt_len / (gpus * peak)
    ctx = s.prompt_len + s.completion_len / 2
    step_compute = 2 * m["params"] * per_wave / (tp * peak)
    step_bytes = (m["params"] * w + per_wave * m["kv_per_token"] * ctx) / tp
    latency = hw["allreduce_inter_s"] if tp > 8 else hw["allreduce_intra_s"]
    step = max(step_compute, step_bytes / hw["hbm_bw"]) + (
        2 * m["layers"] * latency if tp > 1 else 0
    )
    decode = waves * s.completion_len * step
    bound = "compute" if step_compute * hw["hbm_bw"] > step_bytes else "HBM"
    return dict(prefill=prefill, decode=decode, total=prefill + decode, rows=per_wave,
                waves=waves, step_ms=step * 1e3, bound=bound)  # fmt: skip


def predict(s: Setting, hw=H100) -> dict:
    m = shapes(s.preset)
    gen_sync = generate_seconds(s, m, s.gpus, s.tp_sync, 2, hw)
    link = hw["nvlink"] if s.tp_sync <= 8 else hw["ib"]
    reshard = m["params"] * 2 / s.tp_sync / link  # FSDP shards gathered into the TP layout
    tt_sync = train_seconds(s, m, s.gpus, hw)
    best = None
    for gen_gpus in range(8, s.gpus, 8):  # whole 8-GPU nodes each side
        if gen_gpus % s.tp_async:
            continue
        train_gpus = s.gpus - gen_gpus
        gen = generate_seconds(s, m, gen_gpus, s.tp_async, s.gen_bytes_async, hw)
        tt = train_seconds(s, m, train_gpus, hw)
        ts = m["params"] * s.gen_bytes_async / (train_gpus * hw["ib"])  # DDMA: all trainers send
        step = max(gen["total"], tt + ts)
        if best is None or step < best[0]:
            best = (step, gen_gpus, gen, tt, ts)
    asyn, gen_gpus, gen_async, tt_async, ts = best
    sync = gen_sync["total"] + tt_sync + reshard
    return dict(
        name=s.name, params=m["params"], gpus=s.gpus, gen_gpus=gen_gpus,
        sync_generate=gen_sync["total"], sync_train=tt_sync, sync_reshard=reshard, sync=sync,
        async_generate=gen_async["total"], async_train=tt_async, async_push=ts, asynch=asyn,
        speedup=sync / asyn, sync_decode=gen_sync, async_decode=gen_async,
        paper_sync=PAPER[s.name][0], paper_async=PAPER[s.name][1],
        paper_speedup=PAPER[s.name][0] / PAPER[s.name][1],
    )  # fmt: skip


def main(argv=None) -> list[dict]:
    rows = [predict(s) for s in SETTINGS]
    print(
        "| model | H100s (async: generator) | sync: generate + train + reshard = step s "
        "| paper sync s | "
        "async: max(generate, train + push) = step s | paper async s | speed-up | paper |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['name']} | {r['gpus']} ({r['gen_gpus']} generate) | "
            f"{r['sync_generate']:.2f} + {r['sync_train']:.2f} + "
            f"{r['sync_reshard']:.2f} = {r['sync']:.2f} | {r['paper_sync']} | "
            f"max({r['async_generate']:.2f}, {r['async_train']:.2f} + {r['async_push']:.2f}) = "
            f"{r['asynch']:.2f} | {r['paper_async']} | {r['speedup']:.2f}x | "
            f"{r['paper_speedup']:.2f}x |"
        )
    for r in rows:
        for kind in ("sync", "async"):
            d = r[f"{kind}_decode"]
            print(
                f"{r['name']} {kind} decode: {d['rows']} rows x {d['waves']} wave(s) per replica, "
                f"{d['step_ms']:.2f} ms a step ({d['bound']}-bound), prefill {d['prefill']:.2f} s"
            )
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
