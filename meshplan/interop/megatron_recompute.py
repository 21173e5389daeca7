"""Megatron-LM's recompute flags read into ``training.recompute`` and
``training.recompute_modules`` (:func:`recompute`, :func:`modules`), one of the flag readers
:func:`meshplan.interop.megatron.read` assembles (the others: :mod:`~meshplan.interop.megatron_flags`).
Flag names and defaults from ``megatron/training/arguments.py`` at NVIDIA/Megatron-LM d98e8a6.
"""

from __future__ import annotations

from meshplan.errors import ConfigError
from meshplan.interop.megatron_deepspeed import recompute_granularity
from meshplan.interop.megatron_model import int_flag as _int
from meshplan.spec import recompute_modules as rm


def recompute(args: dict, layers_per_stage: int, notes: list[str], vpp: int = 1) -> dict:
    """``training.recompute`` (none, selective or full) of ``--recompute-granularity`` (or
    ``--recompute-activations``, ``--checkpoint-activations``), and under selective
    ``training.recompute_modules`` of ``--recompute-modules`` where it is not Megatron-LM's default
    (:func:`modules`). ``--recompute-method block --recompute-num-layers n`` checkpoints the first
    n layers of each model chunk (Megatron-Core's ``checkpointed_forward`` counts
    ``layer_idx < recompute_num_layers`` over the TransformerBlock's own layers, one block per
    virtual stage: :meth:`~meshplan.spec.training.TrainingSpec.layer_recomputed`): read into
    ``training.recompute_num_layers`` where n is below a chunk's ``ceil(layers_per_stage / vpp)``
    layers (newcomer trial 49: 2 of every 5 at vpp 4, 8 of a stage's 20), else every layer is
    recomputed, as ``full`` plans it. ``--recompute-method uniform --recompute-num-layers n``
    checkpoints every layer, n consecutive layers under one checkpoint (one input kept per n
    layers, n layers replayed together): planned as ``full`` of every layer, one input kept per
    layer (the n > 1 grouping not modelled).

    >>> notes = []
    >>> recompute({"--recompute-granularity": "full", "--recompute-method": "block", "--recompute-num-layers": "2"},
    ...           20, notes, 4), notes
    ({'recompute': 'full', 'recompute_num_layers': 2}, [])
    >>> recompute({"--recompute-granularity": "full", "--recompute-method": "uniform", "--recompute-num-layers": "4"},
    ...           20, notes), notes[0].split(";")[0]
    ({'recompute': 'full'}, '--recompute-method uniform --recompute-num-layers 4 checkpoints 4 consecutive layers together (one input kept per 4 layers, the 4 replayed at once in backward)')

    >>> recompute({"--recompute-granularity": "selective", "--recompute-modules": "core_attn mlp"}, 4, [])
    {'recompute': 'selective', 'recompute_modules': ['core_attn', 'mlp']}
    >>> recompute({"--recompute-activations": True}, 4, [])
    {'recompute': 'selective'}
    """
    gran = recompute_granularity(args)  # --checkpoint-activations too (megatron_deepspeed)
    if gran is None:
        return {"recompute": "none"}
    if args.get("--checkpoint-activations") and not args.get("--deepspeed") and "--recompute-granularity" not in args:
        notes.append("--checkpoint-activations: planned as full recompute of every layer, its meaning before 2022 "
                     "and in Megatron-DeepSpeed; Megatron-LM d98e8a6 refuses it (validate_args: \"no longer valid\"): "
                     "export writes --recompute-granularity full --recompute-method uniform --recompute-num-layers 1")
    if gran not in ("full", "selective"):
        raise ConfigError("--recompute-granularity", f"{gran!r}; use full or selective")
    if gran == "selective":
        mods = modules(args)
        return {"recompute": gran} | ({"recompute_modules": list(mods)} if mods != rm.DEFAULT else {})
    n = _int(args, "--recompute-num-layers")
    chunk = -(-max(layers_per_stage, 1) // max(vpp, 1))
    if args.get("--recompute-method") == "block" and n is not None and n < chunk:
        return {"recompute": gran, "recompute_num_layers": n}
    if args.get("--recompute-method") == "uniform" and n is not None and n > 1:
        notes.append(f"--recompute-method uniform --recompute-num-layers {n} checkpoints {n} consecutive layers "
                     f"together (one input kept per {n} layers, the {n} replayed at once in backward); planned as "
                     f"full recompute of each layer (one input per layer, one layer replayed at a time), which export "
                     f"writes as --recompute-method uniform --recompute-num-layers 1")
    return {"recompute": gran}


def modules(args: dict) -> tuple[str, ...]:
    """``--recompute-modules`` (one or more names; unset: Megatron-LM's default, core_attn alone,
    :data:`meshplan.spec.recompute_modules.DEFAULT`), each a module meshplan models
    (:func:`meshplan.spec.recompute_modules.check_names`): a one-line ConfigError naming the flag
    otherwise. Whether Megatron-LM accepts them for the model is the config's check
    (:func:`meshplan.spec.recompute_modules.config_notes`).

    >>> modules({"--recompute-modules": "mlp moe_act"}), modules({})
    (('mlp', 'moe_act'), ('core_attn',))
    """
    given = args.get("--recompute-modules")
    if given is None:
        return rm.DEFAULT
    names = tuple(str(given).split()) if given is not True else ()
    why = rm.check_names(names)
    if why is not None:
        raise ConfigError("--recompute-modules", f"{' '.join(names) or '(none)'}: {why}")
    return names
