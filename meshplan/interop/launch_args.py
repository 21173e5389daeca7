"""The Megatron-LM arguments ``meshplan launch`` appends to a Megatron-LM plan's program
(newcomer trial 49: ``launch job.toml -- python pretrain_gpt.py`` wrote a torchrun line without the
plan's flags, so the run would start with Megatron-LM's defaults, tp 1 and pp 1).

They are what ``export --to megatron`` writes for the plan (:func:`meshplan.interop.export.export`):
the plan's flags, and the flags of its ``[source]`` launch script meshplan does not plan (``--lr``,
``--data-path``, ...) carried unchanged, without the export's ``#`` header. argparse keeps the last
of a repeated option, so the plan's flags, after the program's own, are the ones Megatron-LM runs
where the plan writes them. A flag the plan reads that it leaves out (a switch it keeps off,
``--sequence-parallel`` without SP; an option at Megatron-LM's default, ``--num-layers-per-virtual-
pipeline-stage`` at vpp 1) cannot be undone by a later word: given in the program, it would run
against the plan, so launch refuses it (:func:`refuse_unplanned`).
"""

from __future__ import annotations

from pathlib import Path

from meshplan.config import Config
from meshplan.errors import ConfigError
from meshplan.interop.export import export
from meshplan.interop.megatron import USED
from meshplan.interop.megatron_deepspeed import deepspeed_flags
from meshplan.interop.megatron_carry import ALIASES, KEPT_UNLESS_WRITTEN, planned_off
from meshplan.interop.shell_words import flag_value
from meshplan.interop.source_file import carried_source


def flag_lines(text: str) -> str:
    r"""An ``export --to megatron`` file's text without its ``#`` header and blank lines: what ``-o -``
    writes to stdout (the header goes to stderr), one flag a line, for ``$(...)`` on a command line.

    >>> flag_lines("# meshplan export of job.toml\n\n--num-layers 80\n--bf16\n")
    '--num-layers 80\n--bf16\n'
    """
    return "".join(f"{line}\n" for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#"))


def exported_words(text: str) -> list[str]:
    """The argument words of an ``export --to megatron`` file's text: its ``#`` header lines and
    blank lines dropped, each flag line split at blanks (Megatron-LM's values hold none).

    >>> exported_words("# meshplan export of job.toml\\n\\n--num-layers 80\\n--bf16\\n")
    ['--num-layers', '80', '--bf16']
    """
    return flag_lines(text).split()


def megatron_program_args(cfg: Config, config: Path) -> tuple[tuple[str, ...], str]:
    """(the words to append to a Megatron-LM plan's program, the note ``launch`` prints about
    them). An export Megatron-LM refuses appends nothing, and the note says why and how to pass
    the flags by hand."""
    user, _ = carried_source(config, None, cfg)
    try:
        text, _ = export(cfg, "megatron", str(config), user)
    except ConfigError as e:
        return (), (f"note: the plan's Megatron flags are not appended to the program: export --to megatron "
                    f"refuses it ({e.message}); pass the flags yourself")
    words = tuple(exported_words(text))
    parser = "Megatron-DeepSpeed" if deepspeed_flags(cfg.training) else "Megatron-LM"  # whose spellings (--deepspeed)
    return words, (f"note: the plan's {sum(w.startswith('--') for w in words)} {parser} flags (export --to "
                   f"megatron, with its [source]'s flags meshplan does not plan) appended to the program that "
                   f"torchrun.sh runs; argparse keeps the last of a repeated flag, so they win over the program's "
                   f"own (a planned flag they leave out is refused in the program); meshplan export {config.name} "
                   f"--to megatron -o - prints them alone")


def unplanned_flags(program: tuple[str, ...], appended: tuple[str, ...], off: frozenset[str] = frozenset()) -> list[str]:
    """The flags of ``program`` (in its order, once each) that meshplan reads as the plan's
    (:data:`meshplan.interop.megatron.USED`) but that the appended plan words ``appended`` do not
    set, so that Megatron-LM would run the program's: argparse keeps the last occurrence, and an
    absent flag overrides nothing. Not counted: the flags an export carries as the user gave
    them (:data:`~meshplan.interop.megatron_carry.KEPT_UNLESS_WRITTEN`: ``--ckpt-format``, the
    precision-aware optimizer's dtypes), unless the plan keeps one off (``off``,
    :func:`~meshplan.interop.megatron_carry.planned_off`: ``--fp8-param-gather`` at
    ``training.fp8_param_gather = false`` where the plan reads it); an alias (``--recompute-activations``, which
    Megatron-LM's validate_args turns into ``--recompute-granularity selective`` after parsing,
    over any value given) counts as set only where the plan writes that value.

    >>> plan = ("--tensor-model-parallel-size", "8", "--recompute-granularity", "full", "--bf16")
    >>> unplanned_flags(("python", "pretrain_gpt.py", "--bf16", "--sequence-parallel", "--lr", "1e-4",
    ...                  "--recompute-activations", "--ckpt-format", "torch"), plan)
    ['--sequence-parallel', '--recompute-activations']
    >>> unplanned_flags(("python", "p.py", "--fp8-param-gather"), plan), unplanned_flags(
    ...     ("python", "p.py", "--fp8-param-gather"), plan, frozenset({"--fp8-param-gather"}))
    ([], ['--fp8-param-gather'])
    >>> unplanned_flags(("python", "p.py", "--recompute-activations", "--tensor-model-parallel-size=2"),
    ...                 ("--recompute-granularity", "selective", "--tensor-model-parallel-size", "8"))
    []
    """
    written = {w.split("=", 1)[0] for w in appended if w.startswith("--")}
    out: list[str] = []
    for w in program:
        flag = w.split("=", 1)[0]
        if not flag.startswith("--") or flag not in USED or (flag in KEPT_UNLESS_WRITTEN and flag not in off) \
                or flag in out:
            continue
        if flag in ALIASES and flag_value(appended, ALIASES[flag][0]) == ALIASES[flag][1]:
            continue
        if flag not in ALIASES and flag in written:
            continue
        out.append(flag)
    return out


def refuse_unplanned(program: tuple[str, ...], appended: tuple[str, ...], config: Path, training=None) -> None:
    """A one-line ConfigError naming PROGRAM for the program's flags the plan leaves out
    (:func:`unplanned_flags`); nothing where none, or where nothing is appended (an export
    Megatron-LM refuses: the program's flags are then the user's own); ``training`` (the plan's
    TrainingSpec) gives the carried switches it keeps off (:func:`~meshplan.interop.megatron_carry.planned_off`).

    >>> refuse_unplanned(("python", "p.py", "--sequence-parallel"), ("--bf16",), Path("job.toml"))
    Traceback (most recent call last):
    ...
    meshplan.errors.ConfigError: PROGRAM: --sequence-parallel is a Megatron-LM flag meshplan plans, which the plan's appended flags leave out (a switch it keeps off, or an option at Megatron-LM's default): no later word undoes it, so the run would not be the plan; remove it from the program, or plan it in job.toml
    """
    off = planned_off(training) if training is not None else frozenset()
    flags = unplanned_flags(program, appended, off) if appended else []
    if not flags:
        return
    one = len(flags) == 1
    raise ConfigError("PROGRAM", f"{' '.join(flags)} {'is a Megatron-LM flag' if one else 'are Megatron-LM flags'} "
                                 f"meshplan plans, which the plan's appended flags leave out (a switch it keeps off, "
                                 f"or an option at Megatron-LM's default): no later word undoes "
                                 f"{'it' if one else 'them'}, so the run would not be the plan; remove "
                                 f"{'it' if one else 'them'} from the program, or plan {'it' if one else 'them'} in "
                                 f"{config.name}")
