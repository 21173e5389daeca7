"""Megatron-LM's checkpoint flags, which meshplan does not plan but checks on import: ``--ckpt-format``
against the sharding (Megatron FSDP asserts :data:`~meshplan.interop.megatron_flags.FSDP_CKPT`) and
``--async-save`` against the format and ``--use-persistent-ckpt-worker``; a mismatch is a note
naming the fix. An export carries both as the user gave them
(:data:`meshplan.interop.megatron_carry.KEPT_UNLESS_WRITTEN`). Flag names, defaults and line
numbers at NVIDIA/Megatron-LM d98e8a6.
"""

from __future__ import annotations

from meshplan.interop.megatron_flags import FSDP_CKPT, FSDP_FLAGS


def ckpt_format(args: dict, notes: list[str]) -> None:
    """``--ckpt-format`` (Megatron-LM's default when not given): it does not change the plan, but
    Megatron-LM refuses to start when it does not match the sharding (:data:`FSDP_CKPT`), so a
    mismatch is a note naming the fix; a format not given is said to be unset, not named (the
    default is Megatron-LM's to choose, and may change).

    >>> notes = []; ckpt_format({"--use-megatron-fsdp": True}, notes); notes[0][:103]
    "--ckpt-format unset (Megatron-LM's default applies) with --use-megatron-fsdp: Megatron-LM (d98e8a6) ass"
    >>> notes = []; ckpt_format({"--use-megatron-fsdp": True, "--ckpt-format": "torch"}, notes); notes[0][:46]
    '--ckpt-format torch with --use-megatron-fsdp: '
    """
    fmt = args.get("--ckpt-format")
    fsdp = next((f for f in FSDP_FLAGS if args.get(f)), None)
    if fsdp and fmt != FSDP_CKPT:
        given = f"--ckpt-format {fmt}" if fmt is not None else "--ckpt-format unset (Megatron-LM's default applies)"
        notes.append(f"{given} with {fsdp}: Megatron-LM (d98e8a6) asserts --ckpt-format {FSDP_CKPT} under Megatron "
                     f"FSDP (arguments.py); planned all the same, add --ckpt-format {FSDP_CKPT} to run it")
    elif not fsdp and fmt == FSDP_CKPT:
        notes.append(f"--ckpt-format {FSDP_CKPT} without --use-megatron-fsdp: Megatron-LM (d98e8a6) asserts Megatron FSDP "
                     f"for it (arguments.py); planned all the same, drop it or add --use-megatron-fsdp")


def async_save(args: dict, notes: list[str]) -> None:
    """``--async-save`` (not planned: carried by an export, with the user's ``--ckpt-format``), a note
    where NVIDIA/Megatron-LM d98e8a6 does not save asynchronously as asked: with ``--ckpt-format
    torch`` its first save raises NotImplementedError (megatron/training/checkpointing.py:764-768; it
    saves asynchronously in torch_dist, torch_dcp and fsdp_dtensor only, 769-775); in a distributed
    format (the default torch_dist) without ``--use-persistent-ckpt-worker``, validate_args warns and
    turns it off (arguments.py:1814-1820), so every save blocks training.

    >>> notes = []; async_save({"--async-save": True}, notes); notes[0][:73]
    '--async-save without --use-persistent-ckpt-worker: Megatron-LM (d98e8a6) '
    >>> notes = []; async_save({"--async-save": True, "--use-persistent-ckpt-worker": True}, notes); notes
    []
    """
    if not args.get("--async-save"):
        return
    if args.get("--ckpt-format") == "torch":
        notes.append("--async-save with --ckpt-format torch: Megatron-LM (d98e8a6) raises NotImplementedError at the "
                     "first save (checkpointing.py:764-768, no async save of legacy checkpoints): use --ckpt-format "
                     "torch_dist")
    elif not args.get("--use-persistent-ckpt-worker"):
        notes.append("--async-save without --use-persistent-ckpt-worker: Megatron-LM (d98e8a6) warns and turns async "
                     "save off (arguments.py:1814-1820), so each save blocks training: add --use-persistent-ckpt-worker")
