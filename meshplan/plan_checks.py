"""The settings :func:`meshplan.plan.build_plan` refuses before it plans (a ConfigError naming the
field and the fix, never an infeasible plan): combinations of the mesh and ``[training]`` that
no runtime runs: DeepSpeed's ZeRO-3 beside pp, cp or (of 2021) other axes, gradient
accumulation modes under pp, and recompute policies the framework or engine does not have.
The restart search asks :func:`check_deepspeed_zero3` of its meshes too. And one setting it
plans as it acts (:func:`without_pipeline`): a pipeline schedule at pp 1.
"""

from __future__ import annotations

import dataclasses

from meshplan.comm import deepspeed_zero12
from meshplan.config import Config
from meshplan.errors import ConfigError
from meshplan.interop.keymaps import keymap_of
from meshplan.keymap import OWN, KeyMap
from meshplan.mesh import resolve
from meshplan.mesh.resolve import Mesh
from meshplan.spec.mesh import MeshSpec, Schedule


#: Axes DeepSpeed ZeRO-3 of 2021 (``training.zero3_engine = "deepspeed-2021"``) cannot run
#: beside it, and why (its parameters are partitioned over the data-parallel group only; tp is
#: Megatron-DeepSpeed's ``mpu``).
DEEPSPEED_2021_AXES = {
    "pp": "DeepSpeed's pipeline engine refuses ZeRO stages 2 and 3 (runtime/pipe/engine.py)",
    "dp_replicate": "ZeRO-3 of 2021 partitions over the whole data-parallel group (hierarchical "
                    "partitioning came with ZeRO++ in 2023)",
    "cp": "DeepSpeed of 2021 has no context parallelism",
    "ep": "experts with ZeRO-3 are not modelled for DeepSpeed of 2021",
}


def check_deepspeed_zero3(mesh, engine: str) -> None:
    """ConfigError on the first axis DeepSpeed's ZeRO-3 ``engine`` cannot run beside with degree
    > 1: :data:`DEEPSPEED_2021_AXES` for ``deepspeed-2021``; pp and cp for ``deepspeed`` (its
    pipeline engine refuses ZeRO-3; meshplan's cp is all-gather CP, which DeepSpeed does not run)."""
    axes = DEEPSPEED_2021_AXES if engine == "deepspeed-2021" else {
        "pp": DEEPSPEED_2021_AXES["pp"], "cp": "DeepSpeed has no all-gather context parallelism (its sequence "
                                               "parallelism is Ulysses' all-to-all)"}
    for axis, why in axes.items():
        if mesh.degree(axis) > 1:
            raise ConfigError("training.zero3_engine", f"{engine!r} with {axis} {mesh.degree(axis)}: {why}; "
                              f"use {axis} 1 or zero3_engine = \"fsdp2\"")


def check_zeropp(mesh, t, keys: KeyMap = OWN) -> None:
    """ConfigError where DeepSpeed ZeRO++'s groups do not fit ``mesh`` (:mod:`meshplan.comm.zeropp`):
    hpZ and qgZ build their groups from world ranks (deepspeedai/DeepSpeed edaa722 ``utils/groups.py``
    ``_create_zero_param_parallel_group``, 859-883, and ``_get_local_all_to_all_group``, 672-697), so
    the data axis must be the whole world (every other axis 1), and hpZ's g must divide it
    (``_ensure_divisibility``). The error names the key as the config's file has it (``keys``:
    :func:`meshplan.interop.keymaps.keymap_of`; ``zero_optimization.zero_hpz_partition_size`` in a
    DeepSpeed JSON, ``training.zero_hpz_partition_size`` in a meshplan TOML)."""
    g, world, dp = t.zero_hpz_partition_size, mesh.world, mesh.degree("fsdp")
    key = "zero_hpz_partition_size" if g > 1 else "zero_quantized_gradients" if t.zero_quantized_gradients else ""
    if key and dp != world:
        raise ConfigError(keys.field(f"training.{key}"), f"DeepSpeed builds ZeRO++'s groups from consecutive world "
                          f"ranks (utils/groups.py), so the data axis must span the world; here fsdp {dp} of {world} "
                          f"ranks: set every other axis to 1 or remove {keys.field(f'training.{key}')}")
    if g > 1 and world % g:
        raise ConfigError(keys.field("training.zero_hpz_partition_size"), f"{g} does not divide the world {world} "
                          f"(DeepSpeed's _ensure_divisibility): use a divisor, e.g. the GPUs of a node")


#: Why ``recompute = "op"`` has no runtime where :attr:`~meshplan.spec.training.TrainingSpec.has_op_recompute`
#: is false, and the fix: the same rule ``[search] recompute`` (:mod:`meshplan.config`) and
#: ``export --to megatron`` (:mod:`meshplan.interop.megatron`) apply.
_NO_OP_RECOMPUTE = {
    "framework": "'op' is torchtitan's op-level selective AC, which framework \"megatron\" does not have (Megatron-LM "
                 "has no flag for it); use 'selective' (--recompute-activations), 'full' or 'none', or framework "
                 "\"torch\"",
    "zero3_engine": "'op' is torchtitan's op-level selective AC, which zero3_engine \"{engine}\" does not have "
                    "(DeepSpeed's ZeRO-3); use 'selective', 'full' or 'none', or zero3_engine \"fsdp2\"",
    "zero0_engine": "'op' is torchtitan's op-level selective AC, which zero0_engine \"deepspeed\" (DeepSpeed without "
                    "ZeRO) does not have; use 'selective', 'full' or 'none', or remove zero0_engine (DDP)",
    "zero12_engine": "'op' is torchtitan's op-level selective AC, which zero12_engine \"deepspeed\" (DeepSpeed's "
                     "ZeRO-1/2) does not have; use 'selective', 'full' or 'none', or sharding \"zero3\" without "
                     "zero12_engine (FSDP2)",
}
#: Why ``recompute = "layer"`` has no Megatron-LM run: Megatron-Core's full recompute
#: (``--recompute-granularity full``) checkpoints, with ``--recompute-method uniform``, every layer
#: in chunks of ``--recompute-num-layers``, with ``block`` the first ``--recompute-num-layers`` layers
#: of each stage (``TransformerBlock._checkpointed_forward``,
#: megatron/core/transformer/transformer_block.py, NVIDIA/Megatron-LM at 0034bda); neither is
#: torchtitan's every ``ac_freq``-th layer, which ``export --to megatron`` refuses too.
_NO_LAYER_RECOMPUTE = ("'layer' is torchtitan's per-layer selective AC (every ac_freq-th layer in full), which "
                       "framework \"megatron\" does not have (--recompute-method uniform recomputes every layer, "
                       "block the first n layers of each stage); use 'full' (every layer: 'layer' with ac_freq 1), "
                       "'selective' or 'none', or framework \"torch\"")


def check_runnable(config: Config, spec: MeshSpec, mesh: Mesh | resolve.Infeasible) -> None:
    """ConfigError on the first setting of ``config`` that no runtime runs on ``mesh`` (``spec``
    resolved; an infeasible mesh skips the checks that read its degrees): gradient accumulation
    modes under pp, an explicit ``[memory] fsdp_reduce``, DeepSpeed's ZeRO-3
    (:func:`check_deepspeed_zero3`) and ZeRO-1/2 (:func:`meshplan.comm.deepspeed_zero12.check_mesh`)
    beside other axes, and the recompute policies a framework or engine does not have."""
    t = config.training
    if t.grad_accumulation != "sync" and not isinstance(mesh, resolve.Infeasible) and mesh.degree("pp") > 1:
        raise ConfigError("training.grad_accumulation", f"{t.grad_accumulation!r} is for pp 1; with pp "
                          f"{mesh.degree('pp')} torch.distributed.pipelining turns gradient sync and "
                          "reshard-after-backward off itself: remove the key")
    if not isinstance(mesh, resolve.Infeasible):  # an explicit [memory] fsdp_reduce must state the table's rule
        config.memory.fsdp_reduce_for(t, mesh.degree("pp"))
    if t.zero3_engine != "fsdp2" and not isinstance(mesh, resolve.Infeasible):
        check_deepspeed_zero3(mesh, t.zero3_engine)
        check_zeropp(mesh, t, keymap_of(config))
        if not t.reshard_after_forward:  # a search candidate's (TrainingSpec refuses it in a config)
            raise ConfigError("training.reshard_after_forward", f"false is FSDP2's; zero3_engine "
                              f"{t.zero3_engine!r} gathers every parameter again in backward: remove it")
    if not isinstance(mesh, resolve.Infeasible):
        deepspeed_zero12.check_mesh(t, mesh.degree, spec.pp_schedule)
    if t.recompute == "layer" and t.framework == "megatron":
        raise ConfigError("training.recompute", _NO_LAYER_RECOMPUTE)
    if t.recompute == "op" and not t.has_op_recompute:
        raise ConfigError("training.recompute", _NO_OP_RECOMPUTE[t.op_recompute_blocker].format(engine=t.zero3_engine))
    if t.recompute == "op" and not isinstance(mesh, resolve.Infeasible) and mesh.degree("cp") > 1:
        raise ConfigError("training.recompute", "'op' (torchtitan op-level selective AC) is planned with cp = 1 "
                          "only: which CP collectives its recompute replays is not modelled yet; use 'layer', "
                          "'selective' or 'full'")
    if t.recompute == "op" and not isinstance(mesh, resolve.Infeasible) and mesh.degree("tp") > 1 and \
            not mesh.sequence_parallel:
        raise ConfigError("training.recompute", "'op' (torchtitan op-level selective AC) with tp > 1 is planned with "
                          "sequence parallelism, as torchtitan applies TP: set mesh.sequence_parallel = true")


def without_pipeline(config: Config, spec: MeshSpec, mesh: Mesh) -> tuple[Config, MeshSpec, tuple[str, ...]]:
    """``(config, spec, notes)`` as planned: at pp 1 there is no pipeline schedule (torchtitan and
    Megatron-LM run each micro-batch's forward and backward in turn, gradient accumulation, which is
    1F1B's order on one stage; GPipe's order would hold every micro-batch's activations at once), so a
    one-chunk ``mesh.pp_schedule`` other than 1F1B is planned as 1F1B, with a note; unchanged at pp > 1
    or with virtual stages (their schedule's chunk map decides, :func:`meshplan.mesh.validity.check`)."""
    if mesh.degree("pp") > 1 or spec.pp_schedule == Schedule.ONE_F_ONE_B or spec.virtual_stages > 1 \
            or spec.layers_per_virtual_stage is not None:
        return config, spec, ()
    note = (f"mesh.pp_schedule {spec.pp_schedule} applies with pp > 1; with pp 1 each micro-batch is its own "
            "forward and backward (gradient accumulation), planned so")
    spec = spec.model_copy(update={"pp_schedule": Schedule.ONE_F_ONE_B})
    return dataclasses.replace(config, mesh=spec), spec, (note,)
