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
docs/benchmarks.md ("Speed-up model") lists them. Run: `python -m bench.scale_llamarl`; writes
bench/results/scale_llamarl.{json,md} (the table) and prints each decode's rows, step and bound.

`--compiled` (GPU rows, docs/scale.md "Planning for NVIDIA GPUs"): the same settings and the
same composition, with each program's FLOPs and bytes per device read from programs XLA:GPU
compiled for H100s on this CPU (`launch.plan`'s functions, `jaxrl.infra.gpu`) instead of the
formulas above; `compiled_costs` names what is compiled and how it is scaled.
"""

from __future__ import annotations

import dataclasses
import math
import sys

# NVIDIA H100 SXM5 datasheet: dense BF16 989 TFLOP/s, FP8 1979 TFLOP/s, HBM3 3.35 TB/s, 80 GB;
# NVLink 900 GB/s total (450 GB/s a direction); one 400 Gb/s InfiniBand NIC per GPU (50 GB/s).
H100 = dict(
    name="h100", peak_bf16=989e12, peak_fp8=1979e12, hbm_bw=3.35e12, hbm=80e9, nvlink=450e9,
    ib=50e9, allreduce_intra_s=10e-6, allreduce_inter_s=30e-6,  # guesses: small-message latencies
    node=8,
)  # fmt: skip
# Google Cloud TPU v5p: dense BF16 459 TFLOP/s (no FP8: the 405B row's fp8 generator is not
# planned here), HBM2e 2.765 TB/s, 95 GB; ICI 4,800 Gb/s a chip (600 GB/s; `nvlink` here: the
# reshard inside a slice, at half of it, one direction); the push between the trainer's and the
# generator's slices over the data-centre network at 200 Gb/s a chip (`ib`, a guess); hosts of 4
# chips (`node`: the async split is in whole hosts).
V5P = dict(
    name="v5p", peak_bf16=459e12, peak_fp8=459e12, hbm_bw=2.765e12, hbm=95e9, nvlink=300e9,
    ib=25e9, allreduce_intra_s=10e-6, allreduce_inter_s=30e-6, node=4,
)  # fmt: skip
HARDWARE = {"h100": H100, "v5p": V5P}
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


def fastest_split(gpus: int, tp: int, parts, node: int = 8) -> tuple:
    """The async split of `gpus` into generator and trainer GPUs, whole nodes of `node` devices
    each side (the generator's a multiple of `tp`), with the shortest step max(generate, train +
    push); `parts(gen_gpus, train_gpus) -> (generate dict, train s, push s)`. Returns
    (step s, generator GPUs, generate dict, train s, push s)."""
    best = None
    for gen_gpus in range(node, gpus, node):
        if gen_gpus % tp:
            continue
        gen, tt, ts = parts(gen_gpus, gpus - gen_gpus)
        step = max(gen["total"], tt + ts)
        if best is None or step < best[0]:
            best = (step, gen_gpus, gen, tt, ts)
    return best


def predict(s: Setting, hw=H100) -> dict:
    m = shapes(s.preset)
    gen_sync = generate_seconds(s, m, s.gpus, s.tp_sync, 2, hw)
    link = hw["nvlink"] if s.tp_sync <= 8 else hw["ib"]
    reshard = m["params"] * 2 / s.tp_sync / link  # FSDP shards gathered into the TP layout
    tt_sync = train_seconds(s, m, s.gpus, hw)
    asyn, gen_gpus, gen_async, tt_async, ts = fastest_split(
        s.gpus,
        s.tp_async,
        lambda gen_gpus, train_gpus: (
            generate_seconds(s, m, gen_gpus, s.tp_async, s.gen_bytes_async, hw),
            train_seconds(s, m, train_gpus, hw),
            m["params"] * s.gen_bytes_async / (train_gpus * hw["ib"]),  # DDMA: all trainers send
        ),
        hw["node"],
    )
    sync = gen_sync["total"] + tt_sync + reshard
    return dict(
        name=s.name, params=m["params"], gpus=s.gpus, gen_gpus=gen_gpus,
        sync_generate=gen_sync["total"], sync_train=tt_sync, sync_reshard=reshard, sync=sync,
        async_generate=gen_async["total"], async_train=tt_async, async_push=ts, asynch=asyn,
        speedup=sync / asyn, sync_decode=gen_sync, async_decode=gen_async,
        paper_sync=PAPER[s.name][0], paper_async=PAPER[s.name][1],
        paper_speedup=PAPER[s.name][0] / PAPER[s.name][1],
    )  # fmt: skip


# --- the same settings from programs compiled for H100s (XLA:GPU, deviceless) --------------------

TRAIN_ROWS_PER_DEVICE = 1  # the probe's micro-batch: one rollout a GPU (FSDP over the node)
DECODE_ROWS = (16, 32)  # two slot counts: a decode step's cost is linear in its rows


def _meshes(s: Setting, hw: dict):
    """The trainer's mesh (one node / 8 chips, FSDP 8) and the generator's TP group, on devices
    of `hw`'s platform described without the hardware."""
    from jaxrl.infra.mesh import MeshConfig, make_mesh

    if hw["name"] == "h100":
        from jaxrl.infra.gpu import topology_devices

        trainer, generator = topology_devices("h100:1x8"), topology_devices(f"h100:1x{s.tp_async}")
    else:
        from jaxrl.infra.tpu import slice_with, topology_devices

        trainer = topology_devices("v5p:2x2x2")
        generator = topology_devices(slice_with("v5p", max(s.tp_async, 4)))
    return (
        make_mesh(MeshConfig(("fsdp", "tp"), (8, 1)), trainer),
        make_mesh(MeshConfig(("dp", "tp"), (1, s.tp_async), num_devices=s.tp_async), generator),
    )


def compiled_costs(
    s: Setting,
    remat_policy: str = "full",
    hw: dict = H100,
    weights: str = "native",
    train_row: tuple[float, float] | None = None,
) -> dict:
    """Per-device FLOPs and bytes of the train step, prefill and decode step of setting `s`,
    from programs compiled for `hw`'s devices (H100 with XLA:GPU, TPU v5p with the TPU
    compiler; deviceless), scaled to the setting; the generator's programs on the engine's
    copy of the weights in format `weights` (`GeneratorConfig.weights`: "fp8", "int8" ...);
    `train_row`: the train step's cost from an earlier call (not compiled again).

    Each program is compiled with 1 and 2 unrolled layers and extrapolated to the model's L
    (`jaxrl.plan.programs.probe_per_step`); a program's cost is its whole run as compiled
    (`ProgramReport.whole_step_cost`: every kernel as it runs, the attention kernels by their
    models, gathers and in-place cache writes by what they touch):

    - train: `Trainer.rl_step` (GRPO, fp32 master weights and Adam, bf16 compute, the platform's
      attention kernels, remat `remat_policy`) on 8 devices, FSDP 8, one rollout of P + C tokens
      a device: the cost of one rollout on one device. A step on G devices is ceil(B / G) such
      micro-steps (FSDP: each device computes its rows; the weights' all-gathers are not in the
      roofline).
    - prefill: the engine's prefill of 8 prompts of P tokens on the generator's TP group, cost
      per prompt (linear in prompts).
    - decode: the engine's decode step on the TP group with DECODE_ROWS slots, over a cache of
      the mean context P + C / 2 (the in-place kernels read each row's keys up to its length);
      linear in the rows through the two slot counts.
    """
    from jaxrl.models.presets import preset
    from jaxrl.plan.programs import plan_generator, plan_trainer, probe_per_step
    from jaxrl.train.trainer import LossConfig, OptimizerConfig

    trainer_mesh, gen_mesh = _meshes(s, hw)
    model = preset(s.preset, param_dtype="float32", dtype="bfloat16", remat_policy=remat_policy)
    gen_model = preset(s.preset, param_dtype="bfloat16", dtype="bfloat16")

    def train(c):
        r, _ = plan_trainer(
            c, trainer_mesh, rows=8 * TRAIN_ROWS_PER_DEVICE, prompt_len=s.prompt_len,
            completion_len=s.completion_len, optimizer=OptimizerConfig(learning_rate=1e-6),
            loss=LossConfig(name="grpo"),
        )  # fmt: skip
        return r.whole_step_cost()

    decode_probes: dict[int, dict[int, tuple[float, float]]] = {}

    def generate(rows):
        def probe(c):
            p, d = plan_generator(
                c, gen_mesh, num_slots=rows, samples=rows // 8, prompt_len=s.prompt_len,
                completion_len=s.completion_len // 2, weights=weights,
            )  # fmt: skip
            decode_probes.setdefault(rows, {})[c.num_layers] = d.whole_step_cost()
            return p.whole_step_cost()

        return probe_per_step(probe, gen_model)

    prefill = generate(DECODE_ROWS[0])
    generate(DECODE_ROWS[1])
    layers = gen_model.num_layers
    decode = {
        rows: tuple(a + (layers - 1) * (b - a) for a, b in zip(p[1], p[2], strict=True))
        for rows, p in decode_probes.items()
    }
    (r1, r2), (c1, c2) = DECODE_ROWS, (decode[DECODE_ROWS[0]], decode[DECODE_ROWS[1]])
    per_row = tuple((b - a) / (r2 - r1) for a, b in zip(c1, c2, strict=True))
    fixed = tuple(a - r1 * d for a, d in zip(c1, per_row, strict=True))
    return dict(
        # one rollout on one device
        train_row=train_row if train_row is not None else probe_per_step(train, model),
        prefill_prompt=tuple(x / 8 for x in prefill),  # per prompt, per TP-group device
        decode_fixed=fixed,  # per decode step, per device: weights etc.
        decode_row=per_row,  # per slot
        remat=remat_policy,
        weights=weights,
    )


def _roofline(cost: tuple[float, float], hw) -> float:
    return max(cost[0] / hw["peak_bf16"], cost[1] / hw["hbm_bw"])


def predict_compiled(s: Setting, costs: dict, hw=H100) -> dict:
    """`predict`'s composition with program times from `compiled_costs` at `hw`'s peaks; the
    weight push and reshard over the links and the all-reduce latencies stay hand counts. Each
    row also carries the hand-count prediction of the same settings (`predict`) and the ratio."""
    m = shapes(s.preset)
    rows = s.prompts * s.samples

    def train(gpus):
        return math.ceil(rows / gpus) * _roofline(costs["train_row"], hw)

    def generate(gpus, tp):
        replicas = gpus // tp
        r = math.ceil(rows / replicas)
        prompts_per_replica = math.ceil(s.prompts / replicas)
        prefill = prompts_per_replica * _roofline(costs["prefill_prompt"], hw)
        fixed, per_row = costs["decode_fixed"], costs["decode_row"]
        cost = tuple(f + r * d for f, d in zip(fixed, per_row, strict=True))
        latency = 2 * m["layers"] * hw["allreduce_intra_s"] if tp > 1 else 0.0
        step = _roofline(cost, hw) + latency
        bound = "compute" if cost[0] / hw["peak_bf16"] > cost[1] / hw["hbm_bw"] else "HBM"
        return dict(total=prefill + s.completion_len * step, prefill=prefill, rows=r,
                    step_ms=step * 1e3, bound=bound)  # fmt: skip

    tp = s.tp_async
    gen_sync = generate(s.gpus, tp)
    reshard = m["params"] * 2 / tp / hw["nvlink"]
    tt_sync = train(s.gpus)
    asyn, gen_gpus, gen_async, tt_async, ts = fastest_split(
        s.gpus,
        tp,
        lambda gen_gpus, train_gpus: (
            generate(gen_gpus, tp),
            train(train_gpus),
            m["params"] * 2 / (train_gpus * hw["ib"]),
        ),
        hw["node"],
    )
    sync = gen_sync["total"] + tt_sync + reshard
    hand = predict(dataclasses.replace(s, tp_sync=tp, gen_bytes_async=2), hw)
    return dict(
        name=s.name, gpus=s.gpus, gen_gpus=gen_gpus, tp=tp, remat=costs["remat"],
        weights=costs.get("weights", "native"),
        sync_generate=gen_sync["total"], sync_train=tt_sync, sync_reshard=reshard, sync=sync,
        async_generate=gen_async["total"], async_train=tt_async, async_push=ts, asynch=asyn,
        speedup=sync / asyn, paper_sync=PAPER[s.name][0], paper_async=PAPER[s.name][1],
        paper_speedup=PAPER[s.name][0] / PAPER[s.name][1],
        sync_ratio=sync / PAPER[s.name][0], async_ratio=asyn / PAPER[s.name][1],
        sync_decode_ms=gen_sync["step_ms"], async_decode_ms=gen_async["step_ms"],
        sync_decode_rows=gen_sync["rows"], async_decode_rows=gen_async["rows"],
        decode_bound=gen_async["bound"],
        train_row_tflop=costs["train_row"][0] / 1e12,
        hand_sync=hand["sync"], hand_async=hand["asynch"],
        hand_ratio_sync=sync / hand["sync"], hand_ratio_async=asyn / hand["asynch"],
        hand_decode_ms=hand["async_decode"]["step_ms"],
    )  # fmt: skip


def main_compiled(names=("8B", "70B"), platform: str = "h100") -> list[dict]:
    from jaxrl.infra.platforms import compile_only

    compile_only()  # deviceless compiles only: JAX on the CPU unless JAX_PLATFORMS says
    from bench.common import write_results

    hw = HARDWARE[platform]
    rows = []
    for s in SETTINGS:
        if s.name in names:
            rows.append(predict_compiled(s, compiled_costs(s, hw=hw), hw))
            print(rows[-1], flush=True)
    device = "H100s" if platform == "h100" else "v5p chips"
    for r in rows:
        r["sync_s"] = (
            f"{r['sync_generate']:.2f} + {r['sync_train']:.2f} + {r['sync_reshard']:.2f} = "
            f"{r['sync']:.2f}"
        )
        r["async_s"] = (
            f"max({r['async_generate']:.2f}, {r['async_train']:.2f} + {r['async_push']:.2f}) = "
            f"{r['asynch']:.2f}"
        )
        r["devices"] = f"{r['gpus']} ({r['gen_gpus']} generate, TP {r['tp']})"
        r["hand"] = f"{r['hand_sync']:.2f} / {r['hand_async']:.2f}"
        r["hand_ratios"] = f"{r['hand_ratio_sync']:.2f} / {r['hand_ratio_async']:.2f}"
        r["ratios"] = f"{r['sync_ratio']:.2f} / {r['async_ratio']:.2f}"
        r["speedups"] = f"{r['speedup']:.2f}x / {r['paper_speedup']:.2f}x"
        r["decode_ms"] = f"{r['async_decode_ms']:.1f} / {r['hand_decode_ms']:.1f}"
    columns = [
        ("name", "model"), ("devices", f"{device} (async: generator)"),
        ("sync_s", "sync: generate + train + reshard = step s"), ("paper_sync", "paper sync s"),
        ("async_s", "async: max(generate, train + push) = step s"),
        ("paper_async", "paper async s"), ("hand", "hand count sync / async s"),
        ("hand_ratios", "compiled / hand count, sync / async"),
        ("ratios", "predicted / paper, sync / async"),
        ("speedups", "speed-up predicted / paper"),
        ("decode_ms", "decode step ms (async): compiled / hand count"),
    ]  # fmt: skip
    compiler = (
        "XLA:GPU compiles for H100 (jax-cuda12-plugin 0.10.2"
        if platform == "h100"
        else "TPU compiles for v5p (libtpu 0.0.42.1"
    )
    note = (
        "`python -m bench.scale_llamarl --compiled"
        + ("" if platform == "h100" else " --platform=v5p")
        + f"`: program FLOPs / bytes from {compiler}, deviceless, on the CPU), train remat "
        f"{rows[0]['remat']}, {platform} peaks"
    )
    print(write_results(f"scale_llamarl_{platform}", rows, columns, note))
    return rows


def main(argv=None) -> list[dict]:
    if argv and "--compiled" in argv:
        platform = next((a.split("=", 1)[1] for a in argv if a.startswith("--platform=")), "h100")
        if platform not in HARDWARE:
            raise SystemExit(f"--platform={platform}: use one of {sorted(HARDWARE)}")
        return main_compiled(platform=platform)
    from bench.common import command, write_results

    rows = [predict(s) for s in SETTINGS]
    cells = [
        {
            "model": r["name"],
            "gpus": f"{r['gpus']} ({r['gen_gpus']})",
            "sync": f"{r['sync_generate']:.2f} + {r['sync_train']:.2f} + "
            f"{r['sync_reshard']:.2f} = {r['sync']:.2f} s",
            "paper_sync": f"{r['paper_sync']} s",
            "async": f"max({r['async_generate']:.2f}, {r['async_train']:.2f} + "
            f"{r['async_push']:.2f}) = {r['asynch']:.2f} s",
            "paper_async": f"{r['paper_async']} s",
            "speedup": f"{r['speedup']:.2f}x",
            "paper_speedup": f"{r['paper_speedup']:.2f}x",
        }
        for r in rows
    ]
    columns = [
        ("model", "model"), ("gpus", "H100s (async: generator)"),
        ("sync", "predicted sync: generate + train + reshard"), ("paper_sync", "paper sync"),
        ("async", "predicted async: max(generate, train + push)"),
        ("paper_async", "paper async"), ("speedup", "predicted speed-up"),
        ("paper_speedup", "paper"),
    ]  # fmt: skip
    note = f"`{command()}` (a hand count: no compile), H100 peaks"
    print(write_results("scale_llamarl", cells, columns, note))
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
