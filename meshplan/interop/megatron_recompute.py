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
    n layers of each model chunk: Megatron-Core's ``TransformerBlock._checkpointed_forward`` counts
    ``l < recompute_num_layers`` over the block's own layers, and each of a rank's ``vpp`` virtual
    stages is its own block (megatron/core/transformer/transformer_block.py, NVIDIA/Megatron-LM
    d98e8a6); meshplan plans it as full recompute of every layer and its note counts per chunk
    (newcomer trial 49: "2 of 20 layers per stage" at vpp 4, where Megatron-LM recomputes 2 of
    every 5, 8 of 20).

    >>> notes = []
    >>> recompute({"--recompute-granularity": "full", "--recompute-method": "block", "--recompute-num-layers": "2"},
    ...           20, notes, 4)
    {'recompute': 'full'}
    >>> print(notes[0])
    --recompute-method block --recompute-num-layers 2 recomputes the first 2 layers of each model chunk (Megatron-Core's TransformerBlock counts its own layers): 2 of every 5 at 4 virtual stages, 8 of 20 per stage; planned as full recompute of every layer (20 of 20), which export writes as --recompute-method uniform --recompute-num-layers 1

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
    method = args.get("--recompute-method")
    chunk = max(layers_per_stage // max(vpp, 1), 1)
    if method == "block" and n is not None and n < chunk:
        each = (f"{n} of every {chunk} at {vpp} virtual stages, {n * vpp} of {layers_per_stage} per stage" if vpp > 1
                else f"{n} of {layers_per_stage} per stage")
        notes.append(f"--recompute-method block --recompute-num-layers {n} recomputes the first {n} layers of each "
                     f"model chunk (Megatron-Core's TransformerBlock counts its own layers): {each}; planned as full "
                     f"recompute of every layer ({layers_per_stage} of {layers_per_stage}), which export writes as "
                     f"--recompute-method uniform --recompute-num-layers 1")
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
