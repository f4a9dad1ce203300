"""The generate phase's host work: what the generator spends around its compiled programs, and
its constants measured on a tiny model in the predicted run's own process.

A generate call (`GeneratorExecutor.generate`: the engine's scheduling loop or the static
sampler's padding, around the device calls) costs its programs plus host work: building the
sampling key (eager `fold_in`s), per device call the dispatch of a jitted call under the mesh
context, the placement of the slots' state arrays (7 `[S]` arrays) and the fetch of the new state
and outputs (10 small device-to-host copies), per live row and call the Python bookkeeping of its
tokens (list `extend`s), per row the result arrays. So, per generate call,

    t_host = c_step + c_call * n_calls + c_row * n_rowcalls

n_calls: the device calls (prefill, decode, slot moves; the static sampler: its one program);
n_rowcalls: the rows each call runs over, summed over the calls (a decode call's `active` slot
bucket; the static sampler: its padded batch). Both come from the generator's schedule, which
depends on the batch (prompts, samples, lengths, where rows stop), not on timing.

Constants (`HostCalibration`): the same generator (same class, slots, steps per call, mesh and
rules) over a tiny model (`TINY`: 1 layer, hidden 16, vocab 512), whose programs cost a few
milliseconds, on `BATCHES`: four batches that vary n_calls and n_rowcalls independently. Per
call the host time is measured directly: the call's (wall, CPU) seconds minus those of its
device calls, each timed blocked around the program alone. A least-squares fit of the medians
gives (c_step, c_call, c_row) for each clock. This run is never the predicted one (another
model, other batches besides the workload's shape), as the machine constants never come from
the workload either.

Why not more terms: on the rlbench-tiny workload (cProfile, and `bench.scale_validate`'s phase
minus programs) host work is 4-16 ms of a ~0.2 s generate call on one device; the reward
(`RewardExecutor.score`, ~1 ms a step) and the prompts (~0.4 ms) are not part of the generate
phase and too small to model.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import numpy as np

# (prompts, samples, max_new_tokens): n_calls 5 / 2 / 5 / 2 on the engine (steps_per_call 8),
# n_rowcalls 4 x 32 / 1 x 32 / 4 x 8 / 1 x 128: the two counts vary independently.
BATCHES = ((8, 4, 32), (8, 4, 8), (2, 4, 32), (32, 4, 8))
TINY = dict(hidden_size=16, intermediate_size=16, num_layers=1, num_heads=2, num_kv_heads=2,
            head_dim=8)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class HostCost:
    """Seconds of host work: per generate call, per device call, per row of a device call."""

    step_s: float
    call_s: float
    row_s: float

    def seconds(self, calls: float, rowcalls: float) -> float:
        """t_host of the module docstring for one generate call."""
        return self.step_s + self.call_s * calls + self.row_s * rowcalls


def rows_of(name: str, args, kwargs) -> int:
    """The rows one device call runs over: a decode call's active slots, the static sampler's
    padded batch; 0 for a prefill or a slot move (their host work is per call)."""
    if name == "decode":
        return int(kwargs["active"])
    if name == "sample":
        return int(args[1].shape[0])
    return 0


def fit(samples: list[tuple[float, float, float]]) -> HostCost:
    """Least squares of t_host = c_step + c_call n_calls + c_row n_rowcalls over
    (n_calls, n_rowcalls, t_host) samples."""
    a = np.array([[1.0, c, r] for c, r, _ in samples])
    b = np.array([t for *_, t in samples])
    coef = np.linalg.lstsq(a, b, rcond=None)[0]
    return HostCost(*(float(c) for c in coef))


class _Timed:
    """A jitted program called blocked, its (wall, CPU) seconds and rows kept per call."""

    def __init__(self, name, fn, sink):
        self.name, self.fn, self.sink = name, fn, sink

    def __call__(self, *args, **kwargs):
        import jax

        wall, cpu = time.perf_counter(), time.process_time()
        out = jax.block_until_ready(self.fn(*args, **kwargs))
        self.sink.append((time.perf_counter() - wall, time.process_time() - cpu,
                          rows_of(self.name, args, kwargs)))  # fmt: skip
        return out


class HostCalibration:
    """The generator of the predicted row over the tiny model, timed per call (see the module
    docstring). `generator`: "engine" or "static"; `mesh_sizes`: the trainer's ("fsdp", "tp")
    mesh, where a colocated engine runs; `generator_mesh`: the ("dp", "tp") mesh of an engine on
    its own devices; both as `bench.rl`'s `Mode.trainer` / `Mode.generator`."""

    def __init__(self, generator: str = "engine", mesh_sizes=((1, 1), 0), generator_mesh=None):
        import jax

        import bench.rl as rl
        from jaxrl.generation.executor import GeneratorExecutor
        from jaxrl.generation.placement import (
            colocated_sampler,
            generator_param_shardings,
            mesh_sampler,
        )
        from jaxrl.generation.sampler import Sampler
        from jaxrl.generation.sampling import SamplingConfig
        from jaxrl.infra.mesh import MeshConfig, make_mesh
        from jaxrl.infra.sharding import GENERATOR_RULES, TRAINER_RULES
        from jaxrl.models.presets import rlbench_tiny
        from jaxrl.train.trainer import OptimizerConfig, Trainer

        def mesh(axes, sizes_first):
            sizes, first = sizes_first
            return make_mesh(MeshConfig(axes, sizes, first, sizes[0] * sizes[1]))

        trainer = Trainer(rlbench_tiny(**TINY), mesh(("fsdp", "tp"), mesh_sizes), TRAINER_RULES,
                          OptimizerConfig(learning_rate=1e-5).make(1))  # fmt: skip
        self.params = trainer.init_params(0)
        self.tokenizer, self.rl = rl.IdTokenizer(), rl
        config = trainer.model_config
        if generator == "engine":
            if generator_mesh is None:  # colocated, on the trainer's mesh
                sampler = colocated_sampler(trainer, self.tokenizer)
            else:  # on its own devices, as `bench.rl.run_mode` places it
                gen_mesh = mesh(("dp", "tp"), generator_mesh)
                sampler = mesh_sampler(trainer, self.tokenizer, gen_mesh, GENERATOR_RULES)
                shardings = generator_param_shardings(trainer, gen_mesh, GENERATOR_RULES)
                self.params = jax.device_put(self.params, shardings)
            programs = sampler.engine
            names = (("_prefill", "prefill"), ("_decode", "decode"), ("_move", "move"))
        else:  # as `bench.rl.proxy_generator` builds it
            sampler = Sampler(trainer.graphdef, config, pad_id=0, eos_ids=config.eos_token_ids)
            programs, names = sampler, (("_generate", "sample"),)
        self.device: list[tuple[float, float, int]] = []
        for attr, name in names:
            setattr(programs, attr, _Timed(name, getattr(programs, attr), self.device))
        self._generate = GeneratorExecutor.generate  # unpatched: not a phase of the row
        self.generators = {
            b: GeneratorExecutor(sampler, SamplingConfig(b[2]), b[1], seed=0) for b in BATCHES
        }
        self.source = rl.RandomPrompts(config.vocab_size)
        self.samples: dict[tuple, list[tuple[int, int, float, float]]] = {b: [] for b in BATCHES}
        self.round()  # compiles; not kept
        for v in self.samples.values():
            v.clear()

    def round(self) -> None:
        """One generate call of each batch: (n_calls, n_rowcalls, host wall s, host CPU s)."""
        from jaxrl.tasks.source import encode_prompts

        for i, (batch, generator) in enumerate(self.generators.items()):
            items = [self.source.item(10_000 + i * 100 + j) for j in range(batch[0])]
            prompt_ids = encode_prompts(self.tokenizer, items, chat_formatted=False)
            self.device.clear()
            wall, cpu = time.perf_counter(), time.process_time()
            self._generate(generator, self.params, items, prompt_ids, 0, len(self.samples[batch]))
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            self.samples[batch].append((
                len(self.device), sum(r for *_, r in self.device),
                wall - sum(w for w, _, _ in self.device), cpu - sum(c for _, c, _ in self.device),
            ))  # fmt: skip

    def cost(self, clock: str = "wall") -> HostCost:
        """The fit over each batch's medians; clock "wall" or "cpu"."""
        i = {"wall": 2, "cpu": 3}[clock]
        return fit([
            (statistics.median(s[0] for s in v), statistics.median(s[1] for s in v),
             statistics.median(s[i] for s in v))
            for v in self.samples.values() if v
        ])  # fmt: skip

    def measured(self) -> dict:
        """Per batch: counts and median host seconds (for the results' record)."""
        return {
            "x".join(map(str, b)): dict(
                calls=statistics.median(s[0] for s in v),
                rowcalls=statistics.median(s[1] for s in v),
                host_wall_s=statistics.median(s[2] for s in v),
                host_cpu_s=statistics.median(s[3] for s in v),
            )
            for b, v in self.samples.items()
            if v
        }
