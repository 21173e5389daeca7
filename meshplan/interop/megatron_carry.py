"""What an export of Megatron-LM arguments keeps of the user's own (``meshplan export ARGS
--to megatron``): every flag meshplan does not read (``--lr``, ``--train-iters``,
``--tokenizer-type``, ``--data-path`` ...) carried unchanged after the written ones, as
torchtitan's and DeepSpeed's exports carry their files' other settings
(:func:`meshplan.interop.torchtitan_carry.carried`, :func:`meshplan.interop.deepspeed_carry.carried`);
a flag meshplan reads is the plan's, and one the export writes otherwise or drops
(``--overlap-grad-reduce`` under zero1, planned without overlap) is listed by
:func:`meshplan.interop.common.rewritten`.
"""

from __future__ import annotations

import shlex

from meshplan.interop.common import rewritten
from meshplan.interop.megatron import USED
from meshplan.interop.megatron_attention import FLAG as ATTENTION, written_attention
from meshplan.interop.megatron_flags import FSDP_CKPT
from meshplan.interop.megatron_precision import FLAGS as PRECISION_FLAGS, FP8PG

#: Megatron-LM switches that only set another flag -> that flag and its value
#: (megatron/training/arguments.py ``validate_args``: ``if args.recompute_activations:
#: args.recompute_granularity = 'selective'``, then ``del args.recompute_activations``).
ALIASES = {"--recompute-activations": ("--recompute-granularity", "selective")}
#: Flags meshplan reads (to check them against the plan) whose value the plan does not hold: carried as
#: the user gave them where the export writes none of its own. ``--ckpt-format``: an export that dropped
#: it kept the user's ``--async-save``, which at NVIDIA/Megatron-LM d98e8a6 works with torch_dist,
#: torch_dcp and fsdp_dtensor only (megatron/training/checkpointing.py:764-775 raises
#: NotImplementedError at the first save otherwise; training_config.py:517 "works only with
#: `torch_dist`"), so the run's format must stay the user's, not whatever default Megatron-LM has.
#: Its value fsdp_dtensor is not carried where the export writes no Megatron FSDP (arguments.py:1675-1676
#: asserts Megatron FSDP for it): dropped, and listed as dropped.
#: The flags of :mod:`~meshplan.interop.megatron_precision` (precision-aware optimizer dtypes,
#: ``--transformer-impl``, those it notes as not modelled) are read into the plan or its notes but
#: not written by the export: carried as given, so the exported run keeps them.
KEPT_UNLESS_WRITTEN = ("--ckpt-format", *sorted(PRECISION_FLAGS))


def planned_off(training) -> frozenset[str]:
    """The :data:`KEPT_UNLESS_WRITTEN` flags the plan reads and keeps off, which an export must not
    carry from the user's file (:func:`carried`) nor ``launch`` let its program give
    (:func:`meshplan.interop.launch_args.unplanned_flags`): ``--fp8-param-gather`` where the import
    plans it (Transformer Engine's fp8 linears under framework megatron with the distributed
    optimizer, sharding zero1: :func:`meshplan.interop.megatron_precision.fp8_param_gather_keys`)
    and ``training.fp8_param_gather`` is false. Elsewhere (an FSDP, no ``--fp8-format``) the
    plan does not read the switch and the user's is carried as given.

    >>> from types import SimpleNamespace as S
    >>> t = S(framework="megatron", linear_dtype="fp8", sharding="zero1", fp8_param_gather=False)
    >>> planned_off(t), planned_off(S(**{**vars(t), "fp8_param_gather": True})), planned_off(S(**{**vars(t), "sharding": "zero3"}))
    (frozenset({'--fp8-param-gather'}), frozenset(), frozenset())
    """
    reads = training.framework == "megatron" and training.linear_dtype == "fp8" and training.sharding == "zero1"
    return frozenset({FP8PG}) if reads and not training.fp8_param_gather else frozenset()


def not_planned(user: dict) -> list[str]:
    """The flags of the user's parsed arguments (:func:`meshplan.interop.megatron.parse_args`)
    that meshplan does not read, in the file's order.

    >>> not_planned({"--num-layers": "32", "--lr": "3e-4", "--use-mcore-models": True})
    ['--lr', '--use-mcore-models']
    """
    return [f for f in user if f not in USED]


def carried(user: dict, written: list[str], off: frozenset[str] = frozenset()) -> tuple[list[str], list[str]]:
    """(``written`` with :func:`not_planned`'s flags appended as the user gave them, those
    flags): a switch bare, a value quoted for the shell where it needs it; the user's
    ``--attention-backend`` too where it agrees with the plan, in place of the writer's flag for
    it (:func:`~meshplan.interop.megatron_attention.written_attention`).

    >>> carried({"--num-layers": "32", "--lr": "3e-4", "--data-path": "a b"}, ["--num-layers 4"])
    (['--num-layers 4', '--lr 3e-4', "--data-path 'a b'"], ['--lr', '--data-path'])

    and the user's :data:`KEPT_UNLESS_WRITTEN` flags where ``written`` has none of its own and the
    plan does not keep them off (``off``, :func:`planned_off`):

    >>> carried({"--ckpt-format": "torch_dist", "--async-save": True}, ["--num-layers 4"])[0]
    ['--num-layers 4', '--ckpt-format torch_dist', '--async-save']
    >>> carried({"--ckpt-format": "torch_dist"}, ["--ckpt-format fsdp_dtensor"])[1]
    []
    >>> carried({"--fp8-param-gather": True}, ["--num-layers 4"], frozenset({"--fp8-param-gather"}))[1]
    []
    """
    written, backend = written_attention(user, written)  # the user's --attention-backend says it once
    own = {w.split()[0] for w in written}
    kept = [f for f in user if f not in USED or (backend and f == ATTENTION) or (
        f in KEPT_UNLESS_WRITTEN and f not in own and f not in off and user[f] != FSDP_CKPT)]
    return written + [f if user[f] is True else f"{f} {shlex.quote(str(user[f]))}" for f in kept], kept


def show(value) -> str:
    """A flag's value as :func:`~meshplan.interop.common.rewritten` lists it: ``(switch)`` for
    a switch, else as given."""
    return "(switch)" if value is True else str(value)


def rewritten_args(user: dict, written: dict) -> list[str]:
    """:func:`~meshplan.interop.common.rewritten` of the user's parsed arguments against the
    written ones (values by :func:`show`), a switch of :data:`ALIASES` whose flag the export
    writes with its value said to be expressed so, not dropped.

    >>> rewritten_args({"--recompute-activations": True, "--lr": "1"}, {"--recompute-granularity": "selective"})
    ['--recompute-activations (switch) -> expressed as --recompute-granularity selective', '--lr 1 -> dropped']
    """
    out = []
    for flag, value in user.items():
        alias = ALIASES.get(flag)
        if alias and value is True and flag not in written and str(written.get(alias[0])) == alias[1]:
            out.append(f"{flag} {show(value)} -> expressed as {' '.join(alias)}")
        else:
            out += rewritten({flag: value}, written, show)
    return out
