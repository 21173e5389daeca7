"""What an export of a DeepSpeed config keeps of the user's own (``meshplan export ds.json --to
deepspeed``): every key meshplan does not plan (``steps_per_print``, ``optimizer``,
``scheduler``, ZeRO-3's persistence sizes ...) carried unchanged beside the written ones, as
torchtitan's and Megatron-LM's exports carry their files' other settings
(:func:`meshplan.interop.torchtitan_carry.carried`, :mod:`meshplan.interop.megatron_carry`).
"""

from __future__ import annotations

from meshplan.interop.common import flatten, merge_tables, strip_keys
from meshplan.interop.deepspeed_auto import CHECKPOINTING, runs_hf_trainer
from meshplan.interop.deepspeed_keys import DEEPSPEED_KEYS, USED
from meshplan.interop.deepspeed_zero import ZERO3_USED, ZERO12_USED


def read_keys(doc: dict) -> set[str]:
    """The keys :func:`meshplan.interop.deepspeed.read` reads in a DeepSpeed config of ``doc``'s
    ZeRO stage (an ``activation_checkpointing`` section is read by its presence: :func:`carried`; the
    offload devices at every ZeRO stage since ZeRO-Offload is read: :mod:`meshplan.interop.deepspeed_offload`).

    >>> sorted(read_keys({"zero_optimization": {"stage": 1}}) - read_keys({}))
    ['communication_data_type', 'data_types.grad_accum_dtype', 'zero_optimization.contiguous_gradients', 'zero_optimization.cpu_offload', 'zero_optimization.offload_optimizer.device', 'zero_optimization.offload_param.device', 'zero_optimization.overlap_comm', 'zero_optimization.reduce_bucket_size', 'zero_optimization.use_multi_rank_bucket_allreduce']
    """
    zero = doc.get("zero_optimization")
    stage = zero.get("stage", 0) if isinstance(zero, dict) else 0
    return set(USED) | (set(ZERO12_USED) if stage in (1, 2) else set()) | (
        {"data_types.grad_accum_dtype"} if stage == 1 else set()) | (
        {k for k in ZERO3_USED if k.startswith("zero_optimization.")} if stage == 3 else set())


def not_planned(user: dict) -> list[str]:
    """The dotted keys of the user's DeepSpeed config ``user`` that meshplan does not plan:
    every key the reader does not read at its stage (:func:`read_keys`; an
    ``activation_checkpointing`` section's own keys, though the section itself is read as
    recompute ``full``).

    >>> not_planned({"train_batch_size": 8, "steps_per_print": 10, "activation_checkpointing": {},
    ...              "zero_optimization": {"stage": 3, "overlap_comm": True, "stage3_module_granularity_threshold": 0}})
    ['steps_per_print', 'zero_optimization.stage3_module_granularity_threshold']
    """
    return list(flatten(strip_keys(user, read_keys(user) | {CHECKPOINTING})))


#: The ``zero_optimization`` keys only ZeRO-3 reads: the ``stage3_`` names and the fields they alias
#: (``DeepSpeedZeroConfig``, zero/config.py at edaa722); an export at stage 0-2 carries none of them.
ZERO3_ONLY = frozenset(k for k in DEEPSPEED_KEYS if k.startswith("zero_optimization.") and (
    k.startswith("zero_optimization.stage3_") or k.replace(".", ".stage3_", 1) in DEEPSPEED_KEYS))


def carried(user: dict, written: dict) -> tuple[dict, list[str]]:
    """(config, what was carried) of ``written`` (:func:`meshplan.interop.deepspeed_write.write`)
    with the keys of the user's DeepSpeed config ``user`` that meshplan does not plan
    (:func:`not_planned`: ``steps_per_print``, ``optimizer``, ``scheduler``, ZeRO-3's persistence
    sizes, ...) carried through unchanged, as a torchtitan export keeps the job's other sections;
    every key the reader reads at the user's stage or the written one is what ``written`` says.
    The keys of an ``activation_checkpointing`` section go with it only where ``written`` has
    one (the plan checkpoints: recompute ``full``, or a policy whose calls the section still
    configures, :func:`with_section`; a plan without checkpointing has none, as a section would
    read back as ``full``). What was carried: dotted keys, the user's order.

    >>> user = {"train_batch_size": 64, "steps_per_print": 10, "zero_optimization": {"stage": 2,
    ...         "overlap_comm": True, "round_robin_gradients": True}, "activation_checkpointing": {"partition_activations": True}}
    >>> doc, names = carried(user, {"train_batch_size": 32, "zero_optimization": {"stage": 1}})
    >>> doc
    {'train_batch_size': 32, 'zero_optimization': {'stage': 1, 'round_robin_gradients': True}, 'steps_per_print': 10}
    >>> names
    ['steps_per_print', 'zero_optimization.round_robin_gradients']
    >>> carried(user, {"activation_checkpointing": {}})[1]
    ['steps_per_print', 'zero_optimization.round_robin_gradients', 'activation_checkpointing.partition_activations']

    ZeRO-3's own keys (:data:`ZERO3_ONLY`) go only into a stage-3 config:

    >>> carried({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": "auto"}},
    ...         {"zero_optimization": {"stage": 2}})
    ({'zero_optimization': {'stage': 2}}, [])
    """
    zero = written.get("zero_optimization")
    drop = read_keys(user) | read_keys(written) | {CHECKPOINTING} | (
        set() if CHECKPOINTING in written else {k for k in flatten(user) if k.startswith(CHECKPOINTING + ".")}) | (
        set() if isinstance(zero, dict) and zero.get("stage") == 3 else ZERO3_ONLY)
    keep = strip_keys(strip_keys(user, drop), set(flatten(written)))
    return merge_tables(written, keep), list(flatten(keep))


#: The recompute policies the model code runs through ``deepspeed.checkpointing.checkpoint``
#: (:func:`meshplan.spec.recompute_words.recompute_words` under DeepSpeed: every layer, every k-th layer,
#: the attention core), which an ``activation_checkpointing`` section configures
#: (``partition_activations``, ``contiguous_memory_optimization``, ``cpu_checkpointing``, ...).
CHECKPOINT_CALLS = ("full", "layer", "selective")


def source_recompute(user: dict) -> str:
    """The recompute the user's DeepSpeed config ``user`` was read as: ``full`` with an
    ``activation_checkpointing`` section, ``none`` without (:func:`meshplan.interop.deepspeed.read`)."""
    return "full" if CHECKPOINTING in user else "none"


def with_section(user: dict, written: dict, recompute: str) -> dict:
    """``written`` with an ``activation_checkpointing`` section where the user's config ``user`` has
    one and the plan's ``recompute`` still calls ``deepspeed.checkpointing.checkpoint``
    (:data:`CHECKPOINT_CALLS`), so that :func:`carried` keeps the section's settings, which
    configure those calls; a plan without them (``none``, torch's op-level SAC) writes none.

    >>> user = {"activation_checkpointing": {"partition_activations": True}}
    >>> with_section(user, {}, "layer"), with_section(user, {}, "none"), with_section({}, {}, "layer")
    ({'activation_checkpointing': {}}, {}, {})
    """
    if CHECKPOINTING in user and recompute in CHECKPOINT_CALLS and CHECKPOINTING not in written:
        return written | {CHECKPOINTING: {}}
    return written


def recompute_change(user: dict, recompute: str) -> list[str]:
    """One header line when the plan's ``recompute`` is ``none`` and the user's config ``user``
    was read as ``full`` (:func:`source_recompute`: its ``activation_checkpointing`` section,
    not a file of the HF Trainer's, whose recompute its ``--gradient_checkpointing`` says,
    :func:`~meshplan.interop.deepspeed_auto.hf_recompute`): the JSON alone does not switch
    activation checkpointing off, the model code does (the import's own note), so the line says
    what to change there and what became of the section. ``full`` is said by
    :func:`checkpointing_line`; other policies are not expressed by the file: their header line
    says what to apply (:func:`meshplan.spec.recompute_words.deepspeed_recompute_fix`).

    >>> print(recompute_change({"activation_checkpointing": {"partition_activations": False}}, "none")[0])
    model code: recompute none here, full in the DeepSpeed config (its activation_checkpointing section); the JSON does not turn activation checkpointing off, the model code does: remove its deepspeed.checkpointing.checkpoint calls (Megatron-DeepSpeed: drop --checkpoint-activations); the section's settings are dropped: they configure only those calls, and a section reads back as recompute full
    >>> recompute_change({}, "none"), recompute_change({}, "layer"), recompute_change({"activation_checkpointing": {},
    ...     "train_batch_size": "auto"}, "none")
    ([], [], [])
    """
    if recompute != "none" or source_recompute(user) != "full" or runs_hf_trainer(user, None):
        return []
    return [f"model code: recompute none here, full in the DeepSpeed config (its {CHECKPOINTING} section); the JSON "
            f"does not turn activation checkpointing off, the model code does: remove its deepspeed.checkpointing."
            f"checkpoint calls (Megatron-DeepSpeed: drop --checkpoint-activations); the section's settings are "
            f"dropped: they configure only those calls, and a section reads back as recompute full"]


def checkpointing_line(recompute: str) -> list[str]:
    """The export header's line for ``recompute = "full"``, which no DeepSpeed key turns on
    (:mod:`meshplan.interop.deepspeed_write`): where it is set instead, the HF Trainer's
    ``--gradient_checkpointing`` (:func:`~meshplan.interop.deepspeed_auto.hf_recompute`) or
    other model code's ``deepspeed.checkpointing.checkpoint`` calls; none for other policies.

    >>> print(checkpointing_line("full")[0])
    activation checkpointing (recompute full) is not a DeepSpeed JSON key: the HF Trainer runs it with --gradient_checkpointing (import this file with --gradient-checkpointing); other model code calls deepspeed.checkpointing.checkpoint on every transformer layer (Megatron-DeepSpeed: --checkpoint-activations), which an activation_checkpointing section only configures
    """
    if recompute != "full":
        return []
    return ["activation checkpointing (recompute full) is not a DeepSpeed JSON key: the HF Trainer runs it with "
            "--gradient_checkpointing (import this file with --gradient-checkpointing); other model code calls "
            f"deepspeed.checkpointing.checkpoint on every transformer layer (Megatron-DeepSpeed: --checkpoint-activations), "
            f"which an {CHECKPOINTING} section only configures"]
