"""Megatron-LM's parallel-size flags -> meshplan's ``[mesh]`` table (:mod:`meshplan.interop.megatron`
reads the rest of the arguments; :mod:`~meshplan.interop.megatron_pipeline` the pipeline split):
the degrees of ``--tensor-model-parallel-size``, ``--pipeline-model-parallel-size``,
``--context-parallel-size``, ``--expert-model-parallel-size`` and ``--expert-tensor-parallel-size``
(:data:`~meshplan.interop.megatron_flags.PARALLEL`), dp inferred as Megatron-LM infers it,
``world / (tp x cp x pp)`` (``megatron/training/arguments.py`` at NVIDIA/Megatron-LM d98e8a6), and
the axes' order outermost first, as meshplan writes a Megatron mesh (pp, dp, cp, tp, ep, etp), or
under ``--use-tp-pp-dp-mapping`` (:data:`TP_PP_DP`) dp outside pp (dp, pp, cp, tp);
``--num-distributed-optimizer-instances`` N as dp_replicate N outside dp_shard dp / N
(:func:`with_instances`).
"""

from __future__ import annotations

from typing import Any

from meshplan.errors import ConfigError
from meshplan.interop.common import model_is_moe, model_layers
from meshplan.interop.megatron_flags import FSDP_FLAGS, PARALLEL
from meshplan.interop.megatron_model import num_flag as _num
from meshplan.interop.world_words import megatron_world_error
from meshplan.spec.mesh_words import data_axis

#: Megatron-LM's switch of its rank order (megatron/training/arguments.py at d98e8a6: "If set, distributed
#: ranks initialize order is changed from tp-cp-ep-dp-pp to tp-cp-ep-pp-dp"; initialize.py passes
#: ``order="tp-cp-ep-pp-dp"`` to ``initialize_model_parallel``): pp inside dp, so a pipeline of tp x pp
#: <= 8 GPUs keeps its stage-to-stage sends inside a node and dp spans the nodes.
TP_PP_DP = "--use-tp-pp-dp-mapping"
#: The dense axes outermost first in each of Megatron-LM's two rank orders (:data:`TP_PP_DP` or not).
ORDERS = {False: ("pp", "dp", "cp", "tp"), True: ("dp", "pp", "cp", "tp")}


def degrees(args: dict, model: dict, world: int, nodes: int) -> tuple[dict[str, int], int]:
    """(each parallel axis's degree from its flag, default 1; the data-parallel degree
    ``world / (tp x cp x pp)``). Without ``--expert-tensor-parallel-size`` etp is tp at any ep
    (Megatron-LM's default: ``arguments.py:587-588`` at d98e8a6), 1 for a dense model (no experts
    to split). A world that tp x cp x pp does not divide is the error Megatron-LM's would be
    (:func:`~meshplan.interop.world_words.megatron_world_error`, naming ``nodes``).

    >>> degrees({"--tensor-model-parallel-size": "4", "--pipeline-model-parallel-size": "2"}, {}, 64, 8)
    ({'tp': 4, 'pp': 2, 'cp': 1, 'ep': 1, 'etp': 1}, 8)
    """
    deg = {axis: _num(args, flag, 1) for flag, axis in PARALLEL.items()}
    if "--expert-tensor-parallel-size" not in args:  # Megatron-LM: expert tp defaults to tp at any ep
        # (arguments.py:587-588 at d98e8a6); a dense model has no experts to split
        deg["etp"] = deg["tp"] if deg["ep"] > 1 or model_is_moe(model) else 1
    dense = deg["tp"] * deg["cp"] * deg["pp"]
    if world % dense:
        raise megatron_world_error(deg, world, nodes, model_layers(model))
    return deg, world // dense


def mesh_table(args: dict, deg: dict[str, int], dp: int, sharding: str) -> dict[str, Any]:
    """The ``[mesh]`` names, shape and ``sequence_parallel`` (``--sequence-parallel``), without the
    pipeline split: the axes of degree > 1 and dp, named ``dp_shard`` where the ``sharding``
    shards the parameters (:func:`~meshplan.spec.mesh_words.data_axis`, as DeepSpeed's ZeRO-3
    import). etp 1 beside tp > 1 and ep > 1 is named: a ``[mesh]`` without etp gets etp = tp under
    megatron (``config_mesh.megatron_etp``, Megatron-LM's default), so the flag's 1 would come back as tp.

    Under :data:`TP_PP_DP` dp is outside pp (Megatron-LM's order tp-cp-ep-pp-dp); with expert
    parallelism that is a ConfigError (meshplan places its expert grid inside each pipeline stage of
    the pp-outermost order only).

    >>> mesh_table({"--sequence-parallel": True}, {"tp": 4, "pp": 1, "cp": 1, "ep": 2, "etp": 1}, 8, "zero1")
    {'names': ['dp', 'tp', 'ep', 'etp'], 'shape': [8, 4, 2, 1], 'sequence_parallel': True}
    >>> mesh_table({TP_PP_DP: True}, {"tp": 2, "pp": 2, "cp": 1, "ep": 1, "etp": 1}, 4, "zero1")["names"]
    ['dp', 'pp', 'tp']
    """
    mapped = bool(args.get(TP_PP_DP))
    if mapped and deg["ep"] > 1:
        raise ConfigError(TP_PP_DP, f"with --expert-model-parallel-size {deg['ep']} is not planned by meshplan "
                          "(its expert grid sits inside each pipeline stage of the tp-cp-ep-dp-pp order); "
                          "drop the flag to plan Megatron-LM's default order")
    names = [a for a in ORDERS[mapped] + ("ep", "etp") if a == "dp" or (deg[a] > 1)
             or (a == "etp" and deg["ep"] > 1 and deg["tp"] > 1)]
    data = data_axis(sharding)
    return {"names": [data if a == "dp" else a for a in names],
            "shape": [dp if a == "dp" else deg[a] for a in names],
            "sequence_parallel": bool(args.get("--sequence-parallel"))}


#: Megatron-LM's partial distributed optimizer (arguments.py at d98e8a6, line 3216: "Number of Distributed
#: Optimizer copies across Data Parallel domain").
INSTANCES = "--num-distributed-optimizer-instances"


def with_instances(args: dict, mesh: dict[str, Any], sharding: str, notes: list[str]) -> dict[str, Any]:
    """``mesh`` with its dp axis split as :data:`INSTANCES` N > 1 splits it under
    ``--use-distributed-optimizer`` (sharding zero1, not Megatron FSDP, whose N > 1 is its HSDP):
    dp_replicate N outside dp_shard dp / N, and a note; unchanged otherwise (the flag stays among the
    notes' unmodelled flags, :func:`~meshplan.interop.megatron_precision.not_modelled_note`).

    Megatron-LM (megatron/core/parallel_state.py at d98e8a6, lines 921-1010): the optimizer's
    intra-instance group is a contiguous slice of (dp x cp) / N ranks of the dp-cp group (cp
    fastest, then dp: tp-cp-ep-dp-pp), so with N dividing dp an instance is dp / N consecutive dp
    indices with all their cp ranks, meshplan's dp_shard (fsdp = dp_shard x cp, inside); the
    inter-instance group takes every (dp x cp / N)-th rank, dp_replicate. Each step
    (param_and_grad_buffer.py, start_grad_sync: "With multiple DistOpt instances, we need to
    all-reduce across instances") the gradients are reduce-scattered within an instance and the
    reduced shard all-reduced across instances, which meshplan's zero1 with dp_replicate > 1 times
    (:func:`meshplan.comm.dp_rows._replica_rows`). N not dividing dp (only dp x cp) puts one cp group
    in two instances, which no meshplan mesh holds: left unmapped.

    >>> notes = []
    >>> mesh = {"names": ["pp", "dp", "tp"], "shape": [2, 16, 4], "sequence_parallel": False}
    >>> with_instances({INSTANCES: "2", "--use-distributed-optimizer": True}, mesh, "zero1", notes)["names"]
    ['pp', 'dp_replicate', 'dp_shard', 'tp']
    >>> with_instances({INSTANCES: "2", "--use-distributed-optimizer": True}, mesh, "zero1", [])["shape"]
    [2, 2, 8, 4]
    >>> with_instances({INSTANCES: "3", "--use-distributed-optimizer": True}, mesh, "zero1", []) == mesh
    True
    """
    n = _num(args, INSTANCES, 1)
    names = list(mesh["names"])
    data = next((a for a in ("dp", "dp_shard") if a in names), None)
    if n <= 1 or sharding != "zero1" or data is None or args.get("--use-torch-fsdp2") or any(
            args.get(f) for f in FSDP_FLAGS):
        return mesh
    i = names.index(data)
    dp = mesh["shape"][i]
    if dp % n:
        return mesh
    notes.append(f"{INSTANCES} {n}: dp {dp} = dp_replicate {n} x dp_shard {dp // n}, the distributed optimizer "
                 f"sharded over dp_shard within each of {n} instances and each step's reduced gradient shard "
                 f"all-reduced across them (Megatron-LM's partial distributed optimizer, parallel_state.py)")
    return mesh | {"names": [*names[:i], "dp_replicate", "dp_shard", *names[i + 1:]],
                   "shape": [*mesh["shape"][:i], n, dp // n, *mesh["shape"][i + 1:]]}
