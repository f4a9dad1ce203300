"""Ahead-of-time compilation for NVIDIA GPU systems on the CPU (`jaxrl.infra.gpu`, `launch.plan`).

Needs the CUDA plugin, its PJRT and the nvcc wheel (ptxas), all in the test extra: the plugin
describes an H100 / H200 node from `jaxrl.infra.gpu.SYSTEMS`, XLA:GPU compiles for it; no GPU
is attached and nothing is allocated.
"""

import re

import pytest

pytest.importorskip("jax_plugins.xla_cuda12", reason="AOT GPU tests need jax-cuda12-plugin")

from jaxrl.infra import gpu  # noqa: E402
from jaxrl.infra.chips import TopologyError  # noqa: E402
from jaxrl.infra.mesh import MeshConfig, make_mesh  # noqa: E402
from jaxrl.models.presets import rlbench_tiny  # noqa: E402
from jaxrl.plan.programs import plan_trainer  # noqa: E402
from jaxrl.train.trainer import LossConfig, OptimizerConfig  # noqa: E402

GiB = 1024**3


def test_gpu_systems_topologies_and_refusals():
    devices = gpu.topology_devices("h200:1x1")
    assert [d.platform for d in devices] == ["gpu"]
    spec = gpu.device_spec(devices)
    assert (spec.name, spec.hbm_bytes) == ("h200", 143771 * 1024**2)
    h100 = gpu.topology_devices("h100:2x8")
    assert len(h100) == 16 and gpu.device_spec(h100).hbm_bytes == 81559 * 1024**2
    assert len({d.process_index for d in h100}) == 2  # one process a node
    with pytest.raises(TopologyError, match=r"whole nodes \('h100:2x8'\)"):
        gpu.parse_topology("h100:2x4")
    with pytest.raises(TopologyError, match="<system>:<nodes>x<gpus per node>"):
        gpu.parse_topology("a100:1x8")
    assert gpu.ptxas_path().endswith("ptxas")


def test_train_step_hand_count_and_flops_on_h100():
    """The RL train step compiled for 8 H100s (FSDP 4 x TP 2): per-device parameter + Adam
    bytes counted from the shapes equal XLA:GPU's argument bytes (less the batch) within 1%, and
    the FLOPs of its optimized HLO (XLA's cost analysis run on the CPU client: the GPU
    executable's own is None) are within 10% of 6 x params x tokens, params less the input
    embedding (a gather: no FLOPs). No remat and one unrolled layer: nothing sits in a loop that
    XLA counts once; attention is a few % of the count at 64 tokens."""
    E, F, V, L, H, K, D = 512, 1024, 1024, 1, 4, 2, 64
    config = rlbench_tiny(
        vocab_size=V, hidden_size=E, intermediate_size=F, num_layers=L, num_heads=H,
        num_kv_heads=K, head_dim=D, dtype="bfloat16", scan_layers=False, remat_policy="none",
    )  # fmt: skip
    mesh = make_mesh(MeshConfig(("fsdp", "tp"), (4, 2)), gpu.topology_devices("h100:1x8"))
    rows, prompt, completion = 16, 32, 32
    report, compiled = plan_trainer(
        config, mesh, rows=rows, prompt_len=prompt, completion_len=completion,
        optimizer=OptimizerConfig(learning_rate=1e-6), loss=LossConfig(name="grpo"),
    )  # fmt: skip
    assert compiled.cost_analysis() is None  # deviceless XLA:GPU: no cost analysis of its own
    # float32 weights; every matrix split 8 ways (fsdp x tp), the [E] norms replicated.
    matrices = 2 * V * E + L * (E * H * D + 2 * E * K * D + H * D * E + 3 * E * F)
    norms = (2 * L + 1) * E
    params = 4 * (matrices // 8 + norms)
    hand = 3 * params + 3 * 4  # Adam's mu and nu; int32 counts: Adam's, the schedule's, the step
    compiler = report.argument_bytes - report.parts["batch"]
    assert abs(compiler - hand) <= 0.01 * hand, (compiler, hand)
    assert report.parts["params"] == params
    # FLOPs: the whole step on 8 devices, per device.
    n = config.num_params()
    assert n == matrices + norms
    expected = 6 * (n - V * E) * rows * (prompt + completion) / mesh.size
    assert abs(report.flops / expected - 1) < 0.10, report.flops / expected
    assert report.bytes_accessed > 0


def _plan(capsys, *params: str) -> tuple[int, str]:
    import gin

    from launch.plan import main

    flags = [f"--gin_param={p}" for p in params]
    try:
        status = main(flags)
    finally:
        gin.clear_config()  # parsing locked gin; later tests register configurables
    captured = capsys.readouterr()
    return status, captured.out + captured.err


def test_launcher_refuses_a_generator_over_h100_memory_and_its_fix_fits(capsys):
    """The tiny model's generator on one H100 with 131072 decode slots of 512 tokens:
    XLA:GPU compiles it (no compile-time out-of-memory on GPU), the planner finds the prefill
    (the KV cache and the prompts' fresh cache; the decode step, in place, holds no second copy)
    over 80 GB, exits 1 with the numbers and a slot count; planned with that count, the same GPU
    fits (exit 0)."""
    common = [
        'PlanConfig.model="rlbench_tiny"',
        'PlanConfig.generator_topology="h100:1x1"',
        "PlanConfig.generator_axis_sizes=(1, 1)",
        "PlanConfig.roles=('generator',)",
        "PlanConfig.samples=8",
        "PlanConfig.prompt_len=256",
        "PlanConfig.completion_len=256",
    ]
    status, out = _plan(capsys, *common, "PlanConfig.prompts=16384", "PlanConfig.num_slots=131072")
    assert status == 1, out
    refusal = re.search(
        r"DOES NOT FIT: generator: prefill needs ([\d.]+) GiB per device, h100 has 80 GiB; "
        r"fix: lower num_slots to (\d+) ",
        out,
    )
    assert refusal, out
    assert float(refusal.group(1)) > 80
    slots = int(refusal.group(2))
    status, out = _plan(
        capsys, *common, f"PlanConfig.prompts={slots // 8}", f"PlanConfig.num_slots={slots}"
    )
    assert status == 0 and out.rstrip().endswith("verdict: fits"), out
    decode = next(line for line in out.splitlines() if line.startswith("| decode_step"))
    cells = [c.strip() for c in decode.strip("|").split("|")]
    assert cells[8] == "yes" and float(cells[6]) <= 80  # fits; total GiB within the HBM
    # Each program's whole-step cost beside its hand count (`launch.plan.hand_count_lines`).
    for name in ("prefill", "decode_step"):
        ratio = re.search(rf"  {name}: bytes ([\d.]+)x, FLOPs ([\d.]+)x the hand count", out)
        assert ratio and all(float(x) > 0.5 for x in ratio.groups()), out


def test_launcher_refuses_cudnn_attention_on_gpu(capsys):
    import gin

    from launch.plan import main

    try:
        assert (
            main(
                [
                    '--gin_param=PlanConfig.trainer_topology="h100:1x8"',
                    '--gin_param=PlanConfig.attention_impl="cudnn"',
                ]
            )
            == 2
        )
    finally:
        gin.clear_config()
    assert "plan with None" in capsys.readouterr().err
    try:  # the default TPU topologies
        assert main(['--gin_param=PlanConfig.attention_impl="cudnn"']) == 2
    finally:
        gin.clear_config()
    assert "cuDNN runs on NVIDIA GPUs only" in capsys.readouterr().err


def test_gpu_check_arguments_on_a_machine_without_a_gpu(tmp_path, capsys):
    """bench/gpu_check.py checks its arguments, then says it needs a GPU (exit 2) here."""
    from bench import gpu_check

    with pytest.raises(SystemExit) as exit_:
        gpu_check.main(["--aot_dir", str(tmp_path)])
    assert exit_.value.code == 2 and "holds no .aot files" in capsys.readouterr().err
    (tmp_path / "optimizer.aot").write_bytes(b"")
    with pytest.raises(SystemExit):
        gpu_check.main(["--aot_dir", str(tmp_path)])
    assert "not programs of launch.plan" in capsys.readouterr().err
    (tmp_path / "optimizer.aot").unlink()
    (tmp_path / "decode_step.aot").write_bytes(b"")
    with pytest.raises(SystemExit):
        gpu_check.main(["--aot_dir", str(tmp_path), "--steps", "0"])
    assert "--steps=0 must be >= 1" in capsys.readouterr().err
    assert gpu_check.main(["--aot_dir", str(tmp_path)]) == 2
    assert "bench.gpu_check needs a GPU; this machine runs JAX on cpu" in capsys.readouterr().err


# What the CUDA plugin and libtpu print on a machine without their devices (never a user's
# concern there), and the error the GPU plan gave when JAX_PLATFORMS was unset.
PLUGIN_NOISE = (
    "Could not find cuda drivers",
    "absl::InitializeLog()",
    "Jax plugin configuration error",
    "Unable to load CUDA",
    "TPU_WORKER_HOSTNAMES",
    "TPU_ACCELERATOR_TYPE",
    "topology not implemented",
)


def test_gpu_check_parity_runs_in_interpret_mode():
    """`bench.gpu_check`'s kernel-vs-XLA parity at tiny shapes in interpret mode: every case of
    the fused attention (padded, packed, shared prompt) and the decode kernel (plain and stacked
    cache) within its limit, so the GPU run's parity stage is exercised where no GPU is."""
    from bench.gpu_check import parity

    rows = parity(cpu=True)
    cases = {(r["kernel"], r["case"]) for r in rows}
    assert len(cases) == 5
    assert {r["kernel"] for r in rows} == {"flash_attention", "decode_attention"}
    assert all(r["ok"] and r["error"] < 1e-5 for r in rows), rows


def test_readme_gpu_plan_runs_as_typed_without_jax_platforms(tmp_path):
    """Regression: with JAX_PLATFORMS unset (the README's command as typed, on this CPU machine
    with the CUDA plugin installed) JAX validated the plugin, found no CUDA runtime and left it
    unregistered: `launch.plan` for H100 exited 2 ("topology not implemented for cuda") after a
    plugin traceback and TPU errors. The README's config, shrunk to the tiny model."""
    import os
    import subprocess
    import sys

    from jaxrl.infra.platforms import accelerator_attached

    if accelerator_attached():
        pytest.skip("checks a machine without a GPU or TPU")
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    command = [
        sys.executable, "-m", "launch.plan", "--gin_file=configs/plan/llama3_8b_grpo_h100.gin",
        '--gin_param=PlanConfig.model="rlbench_tiny"', "--gin_param=PlanConfig.prompts=2",
        "--gin_param=PlanConfig.samples=2", "--gin_param=PlanConfig.prompt_len=64",
        "--gin_param=PlanConfig.completion_len=64", "--gin_param=PlanConfig.grad_accum_steps=1",
        "--gin_param=PlanConfig.roles=('generator',)",
    ]  # fmt: skip
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.rstrip().endswith("verdict: fits"), result.stdout
    assert "h100:1x8 (h100, 8 devices)" in result.stdout
    for line in PLUGIN_NOISE:
        assert line not in result.stderr + result.stdout, result.stderr


# XLA:GPU's lines while compiling configs/plan/llama3_70b_grpo_h100x4.gin's train step (h100:4x8,
# fsdp 32), and the buffer assignment it reported: 8.22 GiB of weights, 16.44 of Adam state
# (both donated, so the outputs overwrite them) and 48.49 of temporaries, 73.14 GiB in all.
REMAT_LINE = (
    "W1206 10:33:48.005840 6548 hlo_rematerialization.cc:3231] Can't reduce memory use below "
    "61.76GiB (66319246119 bytes) by rematerialization; only reduced to 105.34GiB (113108468884 "
    "bytes), down from 105.43GiB (113207723168 bytes) originally\n"
)
IO_LINE = (
    "E1206 10:33:22.446788 5914 gpu_hlo_schedule.cc:968] The byte size of input/output "
    "arguments (105845327100) exceeds the base limit (68416647987). This indicates an error in "
    "the calculation!\n"
)


def _report_70b(notes):
    from jaxrl.plan.programs import ProgramReport

    state = int(24.65 * GiB)
    return ProgramReport(
        name="train_step", compile_seconds=0.0, argument_bytes=state, output_bytes=state,
        alias_bytes=state, temp_bytes=int(48.49 * GiB), code_bytes=0, flops=0.0,
        bytes_accessed=0.0, parts={"params": int(8.22 * GiB), "optimizer": int(16.43 * GiB)},
        xla_notes=notes,
    )  # fmt: skip


def test_xla_memory_lines_are_read_and_explained_beside_the_verdict(capsys):
    """Regression: the 70B plan on h100:4x8 printed `verdict: fits` (73.14 of 80 GiB) followed
    by XLA's "Can't reduce memory use below 61.76GiB ... only reduced to 105.34GiB", unexplained.
    The verdict reads the buffer assignment (what the program allocates); the pass's 105.34 GiB
    adds the 24.65 GiB of outputs, which overwrite donated inputs, to its own schedule's peak
    (XLA's log at vmodule hlo_rematerialization=1: main's peak 80.78 GiB + the output). The
    plan now says so in the trainer's section, and keeps the raw lines out of the table."""
    from jaxrl.infra import gpu
    from jaxrl.plan.programs import xla_memory_notes
    from launch.plan_notes import xla_notes

    notes, rest = xla_memory_notes(["an XLA line of its own\n", REMAT_LINE, IO_LINE])
    assert rest == ["an XLA line of its own\n"]
    assert (notes.remat_bytes, notes.remat_limit_bytes) == (113108468884, 66319246119)
    assert (notes.io_bytes, notes.io_limit_bytes) == (105845327100, 68416647987)
    assert xla_memory_notes(["nothing about memory\n"]) == (None, ["nothing about memory\n"])
    xla_notes(_report_70b(notes), gpu.SYSTEMS["h100"].chip)
    out = capsys.readouterr().out
    assert "estimated 105.34 GiB for train_step (over its limit of 61.76 GiB)" in out, out
    assert "the buffers the compiled program allocates total 73.14 GiB" in out, out
    assert "outputs (24.65 GiB, 24.65 GiB of them written over donated inputs)" in out, out
    assert "the buffer assignment fits all the same" in out, out


def test_a_trainer_refusal_gives_the_config_lines_and_the_ready_config():
    """Regression: the refusal's fix said "use at least 32 devices with fsdp=32" without the
    settings to write or the config that holds them."""
    from jaxrl.plan.programs import TrainerFix
    from launch.plan import PlanConfig, _config_lines, ready_config

    config = PlanConfig(
        model="llama3_70b", trainer_topology="h100:1x8", trainer_axis_sizes=(8, 1),
        grad_accum_steps=8,
    )  # fmt: skip
    fix = TrainerFix("...", devices=32, fsdp=32, tp=1, grad_accum_steps=8)
    lines = _config_lines(config, fix)
    assert lines == [
        'PlanConfig.trainer_topology = "h100:4x8"',
        "PlanConfig.trainer_axis_sizes = (32, 1)",
    ]
    assert ready_config("llama3_70b", lines) == "configs/plan/llama3_70b_grpo_h100x4.gin"
    assert ready_config("llama3_8b", lines) is None  # that file plans 70B
    # On a TPU slice: the slice of that many chips, and the micro-batches when they change.
    tpu_config = PlanConfig(trainer_topology="v5p:2x2x2", trainer_axis_sizes=(8, 1))
    fix = TrainerFix("...", devices=32, fsdp=32, tp=1, grad_accum_steps=16)
    assert _config_lines(tpu_config, fix) == [
        'PlanConfig.trainer_topology = "v5p:2x4x4"',
        "PlanConfig.trainer_axis_sizes = (32, 1)",
        "PlanConfig.grad_accum_steps = 16",
    ]
