"""Megatron-LM's pipeline-split flags <-> ``mesh.pp_layer_split`` and ``mesh.virtual_stages``
(one home for both directions; :mod:`meshplan.interop.megatron` reads the rest of the
arguments, :mod:`~meshplan.interop.megatron_write` writes them): ``--decoder-first/last-
pipeline-num-layers``, ``--num-layers-per-virtual-pipeline-stage``,
``--num-virtual-stages-per-pipeline-rank`` and ``--account-for-embedding/loss-in-pipeline-
split``, as Megatron-Core's ``TransformerConfig`` and ``get_num_layers_to_build``
(megatron/core/transformer/transformer_block.py) take them at NVIDIA/Megatron-LM d98e8a6.
"""

from __future__ import annotations

from typing import Any

from meshplan.config import Config
from meshplan.errors import ConfigError
from meshplan.interop.deepspeed_partition import EMBEDDING_METHOD, pipe_split
from meshplan.interop.megatron_model import int_flag as _int
from meshplan.interop.tomlout import mesh_spec, virtual_split
from meshplan.mesh.layers import first_last_sets


def read_pipeline(args: dict, pp: int, layers: int) -> dict:
    """[mesh] keys ``pp_layer_split``, ``virtual_stages`` and ``pp_schedule`` of Megatron-LM's
    pipeline flags (module docstring) at pp and ``layers``; ConfigError naming the flag for a
    split Megatron-LM refuses. An even split without virtual stages gives no key.

    >>> read_pipeline({"--decoder-first-pipeline-num-layers": "6"}, 4, 30)
    {'pp_layer_split': [6, 8, 8, 8]}
    """
    if pp == 1:
        return {}
    per_chunk, vstages = _int(args, "--num-layers-per-virtual-pipeline-stage"), \
        _int(args, "--num-virtual-stages-per-pipeline-rank")
    first, last = _int(args, "--decoder-first-pipeline-num-layers"), _int(args, "--decoder-last-pipeline-num-layers")
    out: dict[str, Any] = {}
    split = None
    if first is not None or last is not None:
        middle = pp - (first is not None) - (last is not None)
        rest = layers - (first or 0) - (last or 0)
        if middle < 0 or (middle and rest % middle) or (not middle and rest):
            raise ConfigError("--decoder-first-pipeline-num-layers", f"{layers} layers less first {first} and last "
                              f"{last} do not divide evenly over the other {middle} stages")
        even = rest // middle if middle else 0
        split = [first if first is not None else even] + [even] * (pp - 2) + [last if last is not None else even]
        out["pp_layer_split"] = split
    vpp = vstages or 1
    if per_chunk:  # arguments.py 960-964: each --account-for-* flag adds one layer before the checks
        counted = sum(bool(args.get(f)) for f in ACCOUNT)
        stage = (layers + counted) // pp
        if split is not None or (layers + counted) % pp or stage % per_chunk:
            raise chunk_error(per_chunk, layers, pp, split, counted)
        vpp = stage // per_chunk
    if split is not None and vpp > 1 and any(n % vpp for n in split):
        # Megatron-Core's TransformerConfig: each stage's layers a multiple of the virtual stages
        raise ConfigError("--decoder-first-pipeline-num-layers", f"layers per stage {split} with {vpp} virtual "
                          f"stages per rank: Megatron-LM needs each a multiple of {vpp}")
    accounted = [f for f in ACCOUNT if args.get(f)]
    if accounted:
        if len(accounted) == 1 or split is not None:
            raise ConfigError(accounted[0], "meshplan reads --account-for-embedding-in-pipeline-split and "
                              "--account-for-loss-in-pipeline-split together, without --decoder-first/last-pipeline-"
                              "num-layers")
        virtual = accounted_split(layers, pp, vpp)
        if isinstance(virtual, str):
            raise ConfigError(accounted[0], virtual)
        out["pp_layer_split"] = virtual
    if vpp > 1:
        out |= {"virtual_stages": vpp, "pp_schedule": "interleaved_1f1b"}
    return out


def chunk_error(per_chunk: int, layers: int, pp: int, split, counted: int = 0) -> ConfigError:
    """The one-line error of a ``--num-layers-per-virtual-pipeline-stage`` Megatron-LM refuses, with
    its fix: ``arguments.py`` ``validate_args`` (d98e8a6, lines 953-975) adds one layer for each of
    ``--account-for-embedding-in-pipeline-split`` and ``--account-for-loss-in-pipeline-split``
    (``counted`` of them given, lines 960-964), asserts that those layers
    divide over pp and the flag divides the layers per stage, and wants
    ``--num-virtual-stages-per-pipeline-rank`` with ``--decoder-first/last-pipeline-num-layers``
    (``split``, the layers per stage those give). The fix lists the values that divide a stage,
    each giving stage / value virtual stages per rank; the whole stage is one: no interleaving.
    Llama 3 8B (32 layers) at pp 2:

    >>> print(chunk_error(5, 32, 2, None))
    --num-layers-per-virtual-pipeline-stage: 5 does not divide the 32 layers / pp 2 = 16 per stage (Megatron-LM \
asserts it does); fix: --num-layers-per-virtual-pipeline-stage 1, 2, 4 or 8 (16, 8, 4 or 2 virtual stages per \
rank), or drop it for no interleaving (16, the whole stage)
    """
    flag = "--num-layers-per-virtual-pipeline-stage"
    what = f"{layers} layers" if not counted else \
        f"{layers} layers + {' + '.join(('embedding', 'loss')[:counted])} = {layers + counted}"
    layers += counted
    if split is not None:
        return ConfigError(flag, f"is not read with --decoder-first/last-pipeline-num-layers (Megatron-LM asserts "
                           f"--num-virtual-stages-per-pipeline-rank there); fix: give --num-virtual-stages-per-"
                           f"pipeline-rank N instead, N dividing each stage's layers {split}")
    if layers % pp:
        return ConfigError(flag, f"{per_chunk}: the {what} do not divide over pp {pp} (Megatron-LM asserts "
                           f"they do with this flag); fix: a pp that divides {layers}, or --num-virtual-stages-per-"
                           f"pipeline-rank with --decoder-first/last-pipeline-num-layers")
    stage = layers // pp
    ok = [d for d in range(1, stage) if stage % d == 0]
    fix = (f"{flag} {_either(ok)} ({_either([stage // d for d in ok])} virtual stages per rank), or drop it"
           if ok else "drop it") + f" for no interleaving ({stage}, the whole stage)"
    return ConfigError(flag, f"{per_chunk} does not divide the {what} / pp {pp} = {stage} per stage "
                       f"(Megatron-LM asserts it does); fix: {fix}")


def _either(values: list[int]) -> str:
    """``1, 2, 4 or 8``: the values in a line."""
    words = [str(v) for v in values]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


#: Megatron-LM's switches that count the embedding and the loss as a layer each in the split.
ACCOUNT = ("--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split")


def accounted_split(layers: int, pp: int, vpp: int):
    """Layers per virtual stage (``chunk * pp + stage``) under both of Megatron-LM's
    ``--account-for-embedding-in-pipeline-split`` and ``--account-for-loss-in-pipeline-split``:
    (layers + 2) / (pp x vpp) slots each, the embedding taking one of the first virtual stage's
    and the loss one of the last's (Megatron-Core TransformerConfig: layers + 2 a multiple of
    pp, and of vpp per rank); a one-line reason otherwise. At one slot the first virtual stage
    builds no transformer layer (the embedding alone) and the last none (the loss alone):
    ``get_num_layers_to_build``, megatron/core/transformer/transformer_block.py:188-202@d98e8a6.
    Llama 3 405B at pp 16, vpp 2 and vpp 8:

    >>> s = accounted_split(126, 16, 2); s[:2], s[-2:], len(s)
    ([3, 4], [4, 3], 32)
    >>> s = accounted_split(126, 16, 8); s[:2], s[-2:], len(s)
    ([0, 1], [1, 0], 128)
    >>> accounted_split(32, 4, 2)
    '32 layers + embedding + loss = 34 are not a multiple of pp 4 x vpp 2'
    """
    slots, left = divmod(layers + 2, pp * vpp)
    if left or slots < 1:
        return f"{layers} layers + embedding + loss = {layers + 2} are not a multiple of pp {pp} x vpp {vpp}"
    if slots == 1 and vpp == 1:  # the first stage would hold the embedding alone
        return (f"{layers} layers + embedding + loss = {layers + 2} over pp {pp} is 1 per stage: the first and "
                f"last stage would hold no layer, which meshplan does not model (a virtual stage may)")
    return [slots - 1] + [slots] * (pp * vpp - 2) + [slots - 1]


def write_pipeline(cfg: Config, mesh) -> list[str]:
    split = virtual_split(cfg, mesh)
    if split is None:
        return []
    pp, vpp = mesh.degree("pp"), mesh_spec(cfg).virtual_stages
    if str(mesh_spec(cfg).pp_schedule) not in ("1f1b", "interleaved_1f1b"):
        raise ConfigError("--to", f"Megatron-LM runs 1F1B (interleaved with virtual stages); schedule "
                          f"{mesh_spec(cfg).pp_schedule} has no flag")
    if cfg.training.pp_engine == "deepspeed":  # Megatron-DeepSpeed: DeepSpeed's partition, not these flags
        return pipe_partition_flags(split, cfg.model.layers, pp)
    if vpp > 1:
        if len(set(split)) == 1:
            return [f"--num-layers-per-virtual-pipeline-stage {split[0]}"]
        if split == accounted_split(cfg.model.layers, pp, vpp):  # Llama 3's: the ends counted as layers
            return [f"--num-virtual-stages-per-pipeline-rank {vpp}", *ACCOUNT]
        stages = [[split[c * pp + k] for c in range(vpp)] for k in range(pp)]
        if any(len(set(ch)) > 1 for ch in stages):
            raise ConfigError("--to", f"virtual stages {split} differ within a stage: Megatron-LM's "
                              f"--decoder-first/last-pipeline-num-layers need each stage's layers a multiple of "
                              f"vpp {vpp} (Megatron-Core TransformerConfig), and its --account-for-embedding/loss-"
                              f"in-pipeline-split needs (layers + 2) / (pp x vpp) per virtual stage; meshplan does "
                              f"not write --pipeline-model-parallel-layout")
        split = [sum(ch) for ch in stages]
        return [f"--num-virtual-stages-per-pipeline-rank {vpp}"] + first_last_flags(split)
    return first_last_flags(split)


def pipe_partition_flags(split: list[int], layers: int, pp: int) -> list[str]:
    """Megatron-DeepSpeed's flags of layers per stage ``split`` under DeepSpeed's PipelineEngine
    (``training.pp_engine = "deepspeed"``; its parser has no ``--decoder-first/last-pipeline-num-layers``):
    none where DeepSpeed's default ``type:transformer`` partition gives it, BigScience's
    ``--pp-partition-method 'type:transformer|embedding'`` where that one does
    (:func:`meshplan.interop.deepspeed_partition.pipe_split`), else ConfigError.

    >>> pipe_partition_flags([5] + [6] * 10 + [5], 70, 12), pipe_partition_flags([6] * 11 + [4], 70, 12)
    (["--pp-partition-method 'type:transformer|embedding'"], [])
    """
    if split == pipe_split(layers, pp):
        return []
    if split == pipe_split(layers, pp, EMBEDDING_METHOD):
        return [f"--pp-partition-method '{EMBEDDING_METHOD}'"]
    raise ConfigError("--to", f"layer split {split}: DeepSpeed's PipelineModule partitions GPTModelPipe by "
                      f"partition_method (type:transformer gives {pipe_split(layers, pp)}, "
                      f"{EMBEDDING_METHOD} {pipe_split(layers, pp, EMBEDDING_METHOD)}); use one of those")


def first_last_flags(split: list[int]) -> list[str]:
    """``--decoder-first/last-pipeline-num-layers`` of layers per stage ``split`` (the flags of the
    stages that differ from the even middle), or ConfigError where the middle stages differ
    (:func:`~meshplan.mesh.layers.first_last_sets`).

    >>> first_last_flags([3] + [4] * 14 + [2])
    ['--decoder-first-pipeline-num-layers 3', '--decoder-last-pipeline-num-layers 2']
    """
    middle = split[1:-1]
    if not first_last_sets(split):
        raise ConfigError("--to", f"layer split {split}: Megatron-LM sets the first and last stage and spreads the "
                          f"rest evenly; the middle stages differ")
    even = middle[0] if middle else None
    return ([f"--decoder-first-pipeline-num-layers {split[0]}"] if split[0] != even else []) + \
        ([f"--decoder-last-pipeline-num-layers {split[-1]}"] if split[-1] != even else [])
