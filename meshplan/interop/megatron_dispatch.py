"""Megatron-LM's MoE token dispatcher flags <-> ``training.moe_dispatcher``.

At NVIDIA/Megatron-LM d98e8a6 the flags come from TransformerConfig (arguments.py builds them
with ``ArgumentGroupFactory(TransformerConfig)``): ``--moe-token-dispatcher-type`` (allgather,
alltoall, flex; default allgather), ``--moe-flex-dispatcher-backend`` (deepep, hybridep, ncclep;
default deepep; transformer_config.py:898) and the deprecated ``--moe-enable-deepep``, which
requires flex and sets the backend to deepep (transformer_config.py:1743-1752). meshplan plans
``alltoall`` (an all-to-all over ep, one copy per routed expert) and flex with the deepep backend
(``moe_dispatcher = "deepep"``, :mod:`meshplan.comm.deepep`); allgather, hybridep and ncclep are
refused where they communicate.

>>> dispatcher({"--moe-token-dispatcher-type": "flex"}, True, [])
{'moe_dispatcher': 'deepep'}
>>> dispatcher({"--moe-token-dispatcher-type": "flex", "--moe-enable-deepep": True}, True, [])
{'moe_dispatcher': 'deepep'}
>>> dispatcher({"--moe-token-dispatcher-type": "alltoall"}, True, [])
{}
>>> dispatcher_flags("deepep")
['--moe-token-dispatcher-type flex', '--moe-flex-dispatcher-backend deepep', '--moe-grouped-gemm']
"""

from __future__ import annotations

from meshplan.errors import ConfigError, printable

TYPE, BACKEND, ENABLE = "--moe-token-dispatcher-type", "--moe-flex-dispatcher-backend", "--moe-enable-deepep"
PAD = "--moe-pad-expert-input-to-capacity"
#: Megatron-LM's switch for the routed experts' grouped GEMM (TEGroupedMLP; off: SequentialMLP), a
#: switch in its parser at d98e8a6 (``megatron_flag_list.toml``), default off.
GROUPED = "--moe-grouped-gemm"
#: Megatron-LM's EP all-to-all overlap (the dispatch and combine of one micro-batch beside another's
#: compute), which meshplan does not model (:func:`overlap_note`).
OVERLAP = "--overlap-moe-expert-parallel-comm"
#: The flags this module reads (for the importer's list of used flags).
FLAGS = (TYPE, BACKEND, ENABLE, GROUPED, OVERLAP)
#: Megatron-LM's dispatcher types, its default first, with what each runs.
TYPES = {"allgather": "all-gathers every token over tp x ep and keeps its experts' copies",
         "alltoall": "the all-to-all dispatch over ep", "flex": "runs a fused dispatch backend"}
#: The flex backends (default deepep) with what each runs.
BACKENDS = {"deepep": "DeepEP's normal kernels", "hybridep": "HybridEP's kernels (a DeepEP branch, MNNVL)",
            "ncclep": "NCCL EP through Transformer Engine"}


def is_deepep(args: dict) -> bool:
    """Whether the flags run flex with the deepep backend (given, Megatron-LM's default, or the
    deprecated ``--moe-enable-deepep``)."""
    return args.get(TYPE) == "flex" and (args.get(BACKEND) in (None, "deepep") or bool(args.get(ENABLE)))


def dispatcher(args: dict, active: bool, notes: list[str]) -> dict:
    """``training`` keys of the dispatcher flags (module docstring): ``{"moe_dispatcher": "deepep"}``
    for flex with the deepep backend (given or Megatron-LM's default) or ``--moe-enable-deepep``,
    ``{}`` for alltoall; an unknown value is a ConfigError naming the flag, and so is :data:`PAD` with
    deepep (Megatron-LM refuses the padded buffer there). ``active`` (an MoE model
    with ep x etp > 1): another planned-nothing choice (allgather, hybridep, ncclep) is a
    ConfigError, an absent type a note (Megatron-LM's default allgather, planned as alltoall)."""
    kind, backend = args.get(TYPE), args.get(BACKEND)
    if kind is not None and kind not in TYPES:
        raise ConfigError(TYPE, f"{printable(str(kind))[:40]!r} is not allgather, alltoall or flex; give alltoall "
                          f"(the all-to-all dispatch) or flex with {BACKEND} deepep")
    if backend is not None and backend not in BACKENDS:
        raise ConfigError(BACKEND, f"{printable(str(backend))[:40]!r} is not deepep, hybridep or ncclep; give deepep")
    if args.get(ENABLE) and kind != "flex":
        raise ConfigError(ENABLE, f"needs {TYPE} flex (Megatron-LM: \"DeepEP backend is only supported with flex "
                          f"token dispatcher\"): add {TYPE} flex")
    deepep = is_deepep(args)
    if deepep and args.get(PAD):  # TransformerConfig.__post_init__, transformer_config.py:1754-1761 at d98e8a6
        raise ConfigError(PAD, "Megatron-LM refuses it with the flex dispatcher's deepep backend (\"Flex token "
                          "dispatcher with deepep backend does not support moe_pad_expert_input_to_capacity\"): "
                          f"remove it (the capacity's dropped copies are planned unpadded), or use {TYPE} alltoall")
    if kind == "flex" and not deepep and active:
        raise ConfigError(BACKEND, f"{backend} runs {BACKENDS[str(backend)]}, which meshplan does not model; use "
                          f"{BACKEND} deepep, or {TYPE} alltoall")
    if active and kind == "allgather":
        raise ConfigError(TYPE, f"allgather {TYPES['allgather']}, which meshplan does not model (it plans the "
                          f"all-to-all dispatch over ep, or flex with DeepEP); use {TYPE} alltoall")
    if active and kind is None:
        notes.append(f"{TYPE} not given: Megatron-LM's default allgather ({TYPES['allgather']}); planned as "
                     f"alltoall: add {TYPE} alltoall")
    return {"moe_dispatcher": "deepep"} if deepep else {}


def dispatcher_flags(moe_dispatcher: str) -> list[str]:
    """The flags that run ``training.moe_dispatcher`` (the inverse of :func:`dispatcher`), with
    :data:`GROUPED`: the plan times each rank's routed experts as one grouped GEMM (newcomer trial
    nc58 #5: the export ran SequentialMLP, a loop of one GEMM per local expert)."""
    if moe_dispatcher == "deepep":
        return [f"{TYPE} flex", f"{BACKEND} deepep", GROUPED]
    return [f"{TYPE} alltoall", GROUPED]


def overlap_note(args: dict, active: bool, notes: list[str]) -> None:
    """A note where :data:`OVERLAP` is given and ep communicates (``active``: ep x etp > 1): meshplan
    does not model Megatron-LM's overlap of one micro-batch's EP all-to-alls with another's compute, so
    the plan's and step's ep all-to-alls are as exposed as without the flag, an upper bound (newcomer
    trial nc58 #4: the flag was only in the unused list, beside an ep hint built on that exposed time).

    >>> n = []; overlap_note({OVERLAP: True}, True, n); n[0].split(":")[0]
    '--overlap-moe-expert-parallel-comm not modelled'
    """
    if active and args.get(OVERLAP):
        notes.append(f"{OVERLAP} not modelled: the ep all-to-alls are planned as exposed as without it, so step's "
                     f"exposed ep (and an ep hint built on it) is an upper bound")


def grouped_note(args: dict, local_experts: int, notes: list[str]) -> None:
    """A note where an MoE job without :data:`GROUPED` holds more than one routed expert a layer on a
    rank (``local_experts``): Megatron-LM then builds SequentialMLP (``megatron/core/transformer/moe/
    experts.py``: one GEMM per local expert in turn), and meshplan times the experts as one grouped GEMM.

    >>> n = []; grouped_note({}, 16, n); n
    ['--moe-grouped-gemm not given: Megatron-LM runs SequentialMLP, the 16 local experts of a layer one GEMM after another; planned as one grouped GEMM (TEGroupedMLP): add --moe-grouped-gemm']
    >>> n = []; grouped_note({}, 1, n); grouped_note({GROUPED: True}, 16, n); n
    []
    """
    if local_experts > 1 and not args.get(GROUPED):
        notes.append(f"{GROUPED} not given: Megatron-LM runs SequentialMLP, the {local_experts} local experts of a "
                     f"layer one GEMM after another; planned as one grouped GEMM (TEGroupedMLP): add {GROUPED}")
