"""One source of the words the text output uses for what a runtime does: how the training state
is sharded, in the words of the runtime the plan models (torchtitan / torch, Megatron-LM,
DeepSpeed), and which runtime that is. The plan, memory and step text all read them here.

The runtime (:func:`runtime`): DeepSpeed when the config was read from a DeepSpeed JSON
(``origin``, :attr:`meshplan.config.Config.origin`) or one of DeepSpeed's engines runs the data
parallelism (``training.zero12_engine = "deepspeed"``, ``training.zero3_engine =
"deepspeed"`` or ``"deepspeed-2021"``); else ``training.framework``. Under ``framework = "megatron"`` with a DeepSpeed
engine (Megatron-DeepSpeed) the recompute keeps Megatron-LM's words (its flags choose it) and the
state DeepSpeed's (:func:`zero_runtime`).

How the output names a mesh, its axes and its schedule: :mod:`meshplan.spec.mesh_words`; the
recompute policy in each runtime's words (activation checkpointing under DeepSpeed):
:mod:`meshplan.spec.recompute_words`.

DeepSpeed's words (deepspeed.ai/docs/config-json, "ZeRO Optimizations"): ZeRO stage 1
*partitions* the optimizer states, stage 2 also the gradients, stage 3 also the parameters,
across the *data-parallel* processes.
"""

from __future__ import annotations

DEEPSPEED = "deepspeed"
#: Shardings whose data axis replicates the parameters (DDP, ZeRO-1/2): the axis is ``dp``,
#: Megatron-LM's and DeepSpeed's data-parallel group; under zero3 and hsdp it shards them
#: (torchtitan's ``dp_shard``). :func:`meshplan.spec.mesh_words.data_axis` names it by them.
REPLICATED = ("none", "zero1", "zero2")
#: ``training.sharding`` -> DeepSpeed's ZeRO stage (hsdp has no DeepSpeed stage: DeepSpeed's
#: config cannot express it, ``export --to deepspeed`` refuses it).
ZERO_STAGE = {"none": 0, "zero1": 1, "zero2": 2, "zero3": 3}
#: What each ZeRO stage partitions (DeepSpeed's configuration reference).
ZERO_PARTS = {0: "nothing", 1: "the optimizer states", 2: "the optimizer states and gradients",
              3: "the optimizer states, gradients and parameters"}


def zero_runtime(training, origin: str = "") -> str:
    """The runtime whose words name the state's sharding: ``deepspeed`` for a DeepSpeed JSON
    (``origin``) or a DeepSpeed engine, else ``training.framework``.

    >>> from meshplan.spec.training import TrainingSpec
    >>> t = TrainingSpec(global_batch=8, seq_len=16, sharding="zero2", zero12_engine="deepspeed", framework="megatron")
    >>> zero_runtime(t), runtime(t)
    ('deepspeed', 'megatron')
    """
    deepspeed = training.zero12_engine == DEEPSPEED or training.zero3_engine != "fsdp2"
    return DEEPSPEED if origin == DEEPSPEED or deepspeed else training.framework


def runtime(training, origin: str = "") -> str:
    """The runtime whose words name the recompute policy: :func:`zero_runtime`, except that
    Megatron-LM's own flags choose it under ``framework = "megatron"`` (Megatron-DeepSpeed)."""
    if training.framework == "megatron" and origin != DEEPSPEED:
        return "megatron"
    return zero_runtime(training, origin)


def sharding_words(training, origin: str = "", replicated: bool = False) -> str:
    """``training.sharding`` as the plan header names it: DeepSpeed's ZeRO stage under DeepSpeed
    (:func:`zero_runtime`), Megatron FSDP's strategy under ``training.megatron_fsdp`` (none, zero1),
    hsdp on a mesh whose FSDP axes are all 1 (``replicated``:
    :func:`meshplan.spec.mesh_words.replicates`) as what it runs, DDP, else meshplan's name alone.

    >>> from meshplan.spec.training import TrainingSpec
    >>> sharding_words(TrainingSpec(global_batch=8, seq_len=16, sharding="zero3"), "deepspeed")
    'zero3 (DeepSpeed ZeRO stage 3: partitions the optimizer states, gradients and parameters over the data-parallel group)'
    >>> sharding_words(TrainingSpec(global_batch=8, seq_len=16, sharding="hsdp"), replicated=True)
    'hsdp (dp_shard x cp 1: shards nothing, so ddp: replicated over dp_replicate, gradients all-reduced)'
    """
    if training.sharding == "hsdp" and replicated:
        return "hsdp (dp_shard x cp 1: shards nothing, so ddp: replicated over dp_replicate, gradients all-reduced)"
    stage = ZERO_STAGE.get(training.sharding)
    if training.megatron_fsdp and megatron_ddp(training, origin):
        strategy = {"none": "no_shard", "zero1": "optim"}[training.sharding]
        return f"{training.sharding} (Megatron FSDP, --data-parallel-sharding-strategy {strategy})"
    if zero_runtime(training, origin) != DEEPSPEED or stage is None:
        return training.sharding
    if training.bf16_optimizer:  # ZeRO stage 0 with bf16 (TrainingSpec.bf16_optimizer)
        return (f"{training.sharding} (DeepSpeed BF16_Optimizer, ZeRO stage 0 with bf16: partitions the fp32 master "
                f"weights and optimizer states over the data-parallel group; fp32 gradients all-reduced)")
    if stage == 0:
        return f"{training.sharding} (DeepSpeed ZeRO stage 0: nothing partitioned, gradients all-reduced)"
    return (f"{training.sharding} (DeepSpeed ZeRO stage {stage}: partitions {ZERO_PARTS[stage]} over the "
            f"data-parallel group)")


#: Axes a ZeRO stage partitions over under DeepSpeed: its one data-parallel group.
DATA_AXES = ("dp", "dp_shard", "dp_replicate", "fsdp", "efsdp")


def state_title(training, origin: str = "") -> str:
    """What the persistent-state table's "sharded over" column names.

    >>> from meshplan.spec.training import TrainingSpec
    >>> state_title(TrainingSpec(global_batch=8, seq_len=16, sharding="zero2"), "deepspeed")
    'ZeRO stage 2 partitions over the data-parallel group'
    """
    stage = ZERO_STAGE.get(training.sharding)
    if zero_runtime(training, origin) == DEEPSPEED and training.bf16_optimizer:
        return "DeepSpeed BF16_Optimizer partitions over the data-parallel group"
    if zero_runtime(training, origin) == DEEPSPEED and stage is not None:
        return f"ZeRO stage {stage} partitions over the data-parallel group"
    return "sharded over the axis named"


def expert_data_axis(sharding: str) -> str:
    """The name of the routed experts' data-parallel group (meshplan's derived ``efsdp`` = dp_shard x
    cp x tp / (ep x etp), :mod:`meshplan.spec.axes.ep`) as output prints it, by the rule of
    :func:`meshplan.spec.mesh_words.data_axis`: ``efsdp`` where FSDP shards the experts over it (zero3,
    hsdp: torchtitan's ``ParallelDims`` name), ``edp`` where it replicates them (DDP, ZeRO-1/2):
    Megatron-Core's expert data-parallel group (``_EXPERT_DATA_PARALLEL_GROUP``,
    megatron/core/parallel_state.py:71 at NVIDIA/Megatron-LM d98e8a6), over which its distributed
    optimizer shards the experts' state. The one home of the name: the derivation line, the groups
    and collective tables (:func:`meshplan.spec.mesh_words.axis_labels`) and the state tables
    (:func:`shard_words`) read it.

    >>> expert_data_axis("zero1"), expert_data_axis("none"), expert_data_axis("zero3"), expert_data_axis("hsdp")
    ('edp', 'edp', 'efsdp', 'efsdp')
    """
    return "edp" if sharding in REPLICATED else "efsdp"


def shard_words(axis: str, names: tuple[str, ...] | list[str], sharding: str = "") -> str:
    """The axis a state item is sharded over (``axis``, meshplan's derived ``fsdp`` = the data
    axis x cp), as the user's mesh ``names`` it: over a mesh whose data axis is ``dp``
    (Megatron-LM's, and every import of its arguments), ``dp``, or ``dp x cp`` with a cp axis
    (Megatron-LM's data-parallel group with context parallelism, over which its distributed
    optimizer shards); ``axis`` itself otherwise (torchtitan's ``fsdp`` over dp_shard x cp).
    Newcomer trial 23 #5: a Megatron-LM plan said ``fsdp (8)`` for its ``dp`` axis.

    >>> shard_words("fsdp", ("pp", "dp", "tp")), shard_words("fsdp", ("dp", "cp", "tp"))
    ('dp', 'dp x cp')
    >>> shard_words("fsdp", ("dp_shard", "tp")), shard_words("efsdp", ("dp", "ep"))
    ('fsdp', 'efsdp')

    The experts' group by ``sharding`` (:func:`expert_data_axis`; "" keeps ``efsdp``):

    >>> shard_words("efsdp", ("dp", "ep"), "zero1"), shard_words("efsdp", ("dp_shard", "ep"), "zero3")
    ('edp', 'efsdp')
    """
    if axis == "efsdp" and sharding:
        return expert_data_axis(sharding)
    if axis != "fsdp" or "dp" not in names:
        return axis
    return " x ".join(a for a in names if a in ("dp", "cp"))


def state_cell(training, axis: str, divisor: int, origin: str = "") -> str:
    """One "sharded over" cell: ``fsdp (16)``, or under DeepSpeed ``data-parallel group (16)``
    (its ranks); ``not sharded`` (DeepSpeed: ``not partitioned``) without an axis.

    >>> from meshplan.spec.training import TrainingSpec
    >>> t = TrainingSpec(global_batch=8, seq_len=16, sharding="zero2")
    >>> state_cell(t, "fsdp", 16), state_cell(t, "fsdp", 16, "deepspeed"), state_cell(t, "", 1, "deepspeed")
    ('fsdp (16)', 'data-parallel group (16)', 'not partitioned')
    """
    deepspeed = zero_runtime(training, origin) == DEEPSPEED and training.sharding in ZERO_STAGE
    if not axis:
        return "not partitioned" if deepspeed else "not sharded"
    if deepspeed and axis in DATA_AXES:
        return f"data-parallel group ({divisor})"
    return f"{axis} ({divisor})"


def state_how(training, axis: str, divisor: int, origin: str = "") -> str:
    """:func:`state_cell` as a phrase (the memory timeline's event notes): ``sharded over fsdp
    (16)``, under DeepSpeed ``partitioned over the data-parallel group (16)``.

    >>> from meshplan.spec.training import TrainingSpec
    >>> t = TrainingSpec(global_batch=8, seq_len=16, sharding="zero3")
    >>> state_how(t, "fsdp", 16), state_how(t, "fsdp", 16, "deepspeed"), state_how(t, "", 1)
    ('sharded over fsdp (16)', 'partitioned over the data-parallel group (16)', 'not sharded')
    """
    cell = state_cell(training, axis, divisor, origin)
    if not axis:
        return cell
    return f"partitioned over the {cell}" if cell.startswith("data-parallel") else f"sharded over {cell}"


#: The stream of the data-parallel collectives as DeepSpeed names what runs them: ZeRO over the
#: data-parallel group (its ``dp_process_group``), not FSDP.
ZERO_STREAM = "ZeRO data-parallel"


def stream_words(training, origin: str = "") -> dict[str, str]:
    """The step output's names of the collective streams that differ from their keys: under
    DeepSpeed (:func:`zero_runtime`) with a ZeRO stage, the ``fsdp`` stream (ZeRO-3's gathers and
    reduce-scatters over dp_shard) and the ``dp`` stream (ZeRO-1/2's gradient buckets over the data
    axis, named ``dp`` where the parameters are replicated) are both :data:`ZERO_STREAM`, the one
    data-parallel stream DeepSpeed has (one data axis, its ``dp_process_group``); the routed experts'
    ``efsdp`` stream by :func:`expert_data_axis` (``edp`` where nothing is FSDP-sharded over it).

    >>> from meshplan.spec.training import TrainingSpec
    >>> stream_words(TrainingSpec(global_batch=8, seq_len=16, zero3_engine="deepspeed"))
    {'fsdp': 'ZeRO data-parallel', 'dp': 'ZeRO data-parallel'}
    >>> stream_words(TrainingSpec(global_batch=8, seq_len=16)), stream_words(TrainingSpec(global_batch=8, seq_len=16, sharding="zero1"))
    ({}, {'efsdp': 'edp'})
    """
    experts = {} if expert_data_axis(training.sharding) == "efsdp" else {"efsdp": expert_data_axis(training.sharding)}
    if zero_runtime(training, origin) != DEEPSPEED or not ZERO_STAGE.get(training.sharding):
        return experts
    return {"fsdp": ZERO_STREAM, "dp": ZERO_STREAM} | experts


def fold_streams(parts: dict[str, float], names) -> dict[str, float]:
    """``parts`` (``compute``, ``bubble``, ``exposed <stream>`` ..., seconds) with the streams that
    ``names`` (stream -> its name in the text, :func:`stream_words`) names alike summed into one
    part under the first such stream's key: DeepSpeed's ``dp`` (ZeRO-1/2 buckets) and ``fsdp``
    (ZeRO-3) are its one ZeRO data-parallel stream, so a zero2 and a zero3 plan differ in one part.

    >>> fold_streams({"compute": 2.0, "exposed dp": 0.1}, {"fsdp": ZERO_STREAM, "dp": ZERO_STREAM})
    {'compute': 2.0, 'exposed fsdp': 0.1}
    """
    names = dict(names)
    first = {name: key for key, name in reversed(names.items())}
    out: dict[str, float] = {}
    for k, v in parts.items():
        stream = k[len("exposed "):] if k.startswith("exposed ") else ""
        k = f"exposed {first.get(names.get(stream, stream), stream)}" if stream else k
        out[k] = out.get(k, 0.0) + v
    return out


def group_words(training, origin: str = "") -> dict[str, str]:
    """The derived groups the groups table names in the runtime's words, as {group: printed}:
    under Megatron-LM (:func:`runtime` and :func:`zero_runtime` both ``megatron``) the derived
    ``fsdp`` group (dp x cp, :data:`meshplan.mesh.resolve.DERIVED`) is its data-parallel group
    with context parallel (``parallel_state.get_data_parallel_group(with_context_parallel=True)``,
    the ``dp_cp_group`` / ``intra_dp_cp_group`` of megatron/core/distributed/
    distributed_data_parallel.py:148-149 and megatron/core/optimizer/__init__.py:934-935 at
    NVIDIA/Megatron-LM d98e8a6), over which its DDP reduces the gradients, the distributed optimizer
    (zero1) shards, and Megatron FSDP shards (mcore_fsdp_adapter.py:352-367); {} elsewhere
    (torchtitan's fsdp = dp_shard x cp keeps its name).

    >>> from meshplan.spec.training import TrainingSpec
    >>> t = TrainingSpec(global_batch=8, seq_len=16, sharding="zero1", framework="megatron")
    >>> group_words(t), group_words(t.model_copy(update={"framework": "torch"}))
    ({'fsdp': 'dp x cp (distributed optimizer)'}, {})
    """
    if runtime(training, origin) != "megatron" or zero_runtime(training, origin) != "megatron":
        return {}
    fsdp = training.megatron_fsdp or training.sharding not in ("none", "zero1")
    what = ("Megatron FSDP" if fsdp else "distributed optimizer" if training.sharding == "zero1"
            else "DDP gradient all-reduce")
    return {"fsdp": f"dp x cp ({what})"}


def kind_words(training, origin: str = "", dp: int = 0) -> dict[str, str]:
    """The memory kinds' "what" (``meshplan memory``'s kinds table, the HTML report) that
    name the runtime, in DeepSpeed's words under DeepSpeed (:func:`zero_runtime`), by ZeRO
    stage: ZeRO-3's parameter all-gather and partitioned parameters, ZeRO-1/2's optimizer-state
    and gradient partitions, the ZeRO-1/2 engine's gradient buckets (``reduce_bucket_size``,
    :mod:`meshplan.comm.deepspeed_zero12`); ``dp``: the data-parallel group's ranks (0: "N");
    under :func:`megatron_ddp` the gradients as Megatron DDP's buffer. Empty elsewhere: the generic notes stand (:data:`meshplan.report.memory.KIND_NOTES`).

    >>> from meshplan.spec.training import TrainingSpec
    >>> t = TrainingSpec(global_batch=8, seq_len=16, sharding="zero2", zero12_engine="deepspeed")
    >>> kind_words(t, dp=16)["grads"].split(" (")
    ['ZeRO-2 gradient partition', "1/16 on each rank of the data-parallel group, each bucket's reduced gradients copied in)"]
    >>> kind_words(t.model_copy(update={"zero12_engine": "megatron"}))
    {}
    """
    stage = ZERO_STAGE.get(training.sharding)
    if megatron_ddp(training, origin):
        steps = "Megatron FSDP's optim sharding" if training.megatron_fsdp else "the distributed optimizer"
        return {"grads": f"{megatron_engine(training)} gradient buffer (main_grad), whole on every rank" + (
            f"; {steps} steps on its own 1/{dp if dp else 'N'}" if stage == 1 else "")}
    if zero_runtime(training, origin) != DEEPSPEED or stage is None:
        return {}
    part = f"1/{dp if dp else 'N'} on each rank of the data-parallel group"
    whole = f"whole on every rank (ZeRO stage {stage} does not partition them)"
    g = training.zero_hpz_partition_size if stage == 3 and training.zero3_engine == DEEPSPEED else 1
    sec = f" and hpZ's secondary partition of them (1/{g} on each rank of its group of {g})" if g > 1 else ""
    out = {"params": f"ZeRO-3 partitioned parameters ({part}){sec}" if stage == 3 else f"parameters, {whole}",
           "master": "fp32 master weights" + (f", ZeRO-{stage} partition ({part})" if stage else f", {whole}"),
           "optimizer": "optimizer states" + (f", ZeRO-{stage} partition ({part})" if stage else f", {whole}"),
           "grads": {0: f"gradients kept for the step, {whole}",
                     1: f"gradients kept for the step, {whole}; each rank steps on its own 1/N",
                     2: f"ZeRO-2 gradient partition ({part}, each bucket's reduced gradients copied in)",
                     3: f"ZeRO-3 gradient partition ({part}, from each reduce-scatter)"}[stage],
           "gathered_params": "ZeRO-3 parameter all-gather: the layers' full parameters (current + prefetched)",
           "grad_buffers": ("a layer's full gradients and the gradient bucket (reduce_bucket_size: the ipg buffers "
                            "under contiguous_gradients, else the flattened bucket being all-reduced)"
                            if training.zero3_engine == "deepspeed-2021" else
                            "a layer's full gradients, the ZeRO-3 reduce-scatter's input" + (
                                " and the ipg buffer (reduce_bucket_size, contiguous_gradients)"
                                if training.zero3_engine == "deepspeed" and training.contiguous_grads else ""))
           if stage == 3 else
           ("gradient buckets (reduce_bucket_size) and the bucket being all-reduced" if training.contiguous_grads
            else "the bucket being all-reduced, flattened (contiguous_gradients false: no ipg buffer)")}
    if stage in (1, 2) and training.zero12_engine != DEEPSPEED:  # Megatron-LM's buffer under ZeRO-3's 2021 engine
        del out["grad_buffers"]
    return out


def megatron_ddp(training, origin: str = "") -> bool:
    """Whether Megatron-LM's DDP runs the data-parallel gradients (``framework = "megatron"``,
    sharding none, or zero1 as its distributed optimizer, not under DeepSpeed): its contiguous
    gradient buffer whole on every rank, reduced bucket by bucket once per step, in the last
    micro-batch's backward (:class:`meshplan.spec.training.TrainingSpec`, ``overlap_grad_reduce``;
    NVIDIA/Megatron-LM 0e9fcc1 ``megatron/core/distributed/param_and_grad_buffer.py``: the
    distributed optimizer reduce-scatters into this rank's shard of the full buffer).

    >>> from meshplan.spec.training import TrainingSpec
    >>> t = TrainingSpec(global_batch=8, seq_len=16, sharding="zero1", framework="megatron")
    >>> megatron_ddp(t), megatron_ddp(t, "deepspeed"), megatron_ddp(t.model_copy(update={"sharding": "zero3"}))
    (True, False, False)
    """
    return (runtime(training, origin) == "megatron" and zero_runtime(training, origin) == "megatron"
            and training.sharding in ("none", "zero1"))


def megatron_engine(training) -> str:
    """Which Megatron-LM engine runs the data parallelism of sharding none or zero1: ``Megatron
    FSDP`` under ``training.megatron_fsdp`` (``--use-megatron-fsdp`` with no_shard or optim),
    else ``Megatron DDP`` (its DDP buffers, with the distributed optimizer for zero1).

    >>> from meshplan.spec.training import TrainingSpec
    >>> t = TrainingSpec(global_batch=8, seq_len=16, sharding="zero1", framework="megatron")
    >>> megatron_engine(t), megatron_engine(t.model_copy(update={"megatron_fsdp": True}))
    ('Megatron DDP', 'Megatron FSDP')
    """
    return "Megatron FSDP" if training.megatron_fsdp else "Megatron DDP"


def reduce_words(training, origin: str, rule: str) -> str:
    """When the gradients are reduced, as the memory caption names it: ``FSDP reduce RULE``
    (Megatron DDP's bucket reduction under :func:`megatron_ddp`; ``rule``: :meth:`meshplan.spec.memory.MemoryOptions.fsdp_reduce_for`, the ``[memory]
    fsdp_reduce`` knob); under DeepSpeed (:func:`zero_runtime`) ZeRO-3's reduce-scatter at that
    rule, and for ZeRO-1/2 DeepSpeed's engine, which the knob does not set
    (:mod:`meshplan.comm.deepspeed_zero12`: stage 2 reduces in every micro-batch's backward,
    stage 1 once per step).

    >>> from meshplan.spec.training import TrainingSpec
    >>> t = TrainingSpec(global_batch=8, seq_len=16, sharding="zero1", zero12_engine="deepspeed")
    >>> reduce_words(t, "", "per_microbatch"), reduce_words(t.model_copy(update={"sharding": "zero3",
    ...     "zero12_engine": "megatron"}), "deepspeed", "per_microbatch")
    ('ZeRO-1 gradient all-reduces once per step', 'ZeRO-3 gradient reduce-scatter per_microbatch')
    """
    stage = ZERO_STAGE.get(training.sharding)
    if megatron_ddp(training, origin):
        op = "all-reduce" if stage != 1 else "reduce-scatter (" + (
            "optim" if training.megatron_fsdp else "distributed optimizer") + ")"
        return f"{megatron_engine(training)} gradient {op} " + ("per bucket in the last micro-batch's backward (overlap_grad_reduce)"
                                                 if training.overlap_grad_reduce else "after the last micro-batch's backward")
    if zero_runtime(training, origin) != DEEPSPEED or not stage:
        return f"FSDP reduce {rule}"
    if stage == 3:
        return f"ZeRO-3 gradient reduce-scatter {rule}"
    if training.zero12_engine != DEEPSPEED:
        return f"FSDP reduce {rule}"
    return f"ZeRO-{stage} gradient all-reduces " + ("once per step" if stage == 1 else "every micro-batch")


def gathered_words(training, origin: str = "") -> str:
    """What the layers gathered for compute are called in the first memory estimate:
    ``gathered FSDP layers``, under DeepSpeed (:func:`zero_runtime`) ZeRO-3's. ZeRO-1/2 gather
    nothing: the estimate leaves the term out (:meth:`meshplan.memory.constraints.Estimate.line`).

    >>> from meshplan.spec.training import TrainingSpec
    >>> gathered_words(TrainingSpec(global_batch=8, seq_len=16), "deepspeed")
    'layers gathered by the ZeRO-3 parameter all-gather'
    """
    if zero_runtime(training, origin) != DEEPSPEED:
        return "gathered FSDP layers"
    return "layers gathered by the ZeRO-3 parameter all-gather"


def nic_words(node, notes: tuple[str, ...] = ()) -> str:
    """A node's NICs as plan's ``cluster`` line and report's cluster row say them: their count,
    ``RoCEv2`` when they speak it, and where ``[cluster] nic`` set their keys (its mark in
    ``node.source``, :func:`meshplan.config_tables._with_nics`) their line rate and that it is the
    config's (newcomer trial 54 #8: the report's row named neither); ``notes`` go in the same
    parentheses.

    >>> from meshplan import catalog
    >>> node = catalog.node("dgx-h100")
    >>> nic_words(node)
    '8 NIC(s)/node'
    >>> roce = [n.model_copy(update={"transport": "roce", "rate_gbit_per_s": 50.0}) for n in node.nics]
    >>> over = node.model_copy(update={"nics": roce, "source": "x; config's [cluster] nic (transport roce) on every NIC"})
    >>> nic_words(over, ("step notes how they are timed",))
    '8 NIC(s)/node RoCEv2 at 50 Gb/s ([cluster] nic; step notes how they are timed)'
    """
    words = f"{len(node.nics)} NIC(s)/node" + (" RoCEv2" if any(n.transport == "roce" for n in node.nics) else "")
    marks = list(notes)
    if "config's [cluster] nic (" in node.source and node.nics:
        words += f" at {'/'.join(f'{r:g}' for r in sorted({n.rate_gbit_per_s for n in node.nics}))} Gb/s"
        marks.insert(0, "[cluster] nic")
    return words + (f" ({'; '.join(marks)})" if marks else "")
