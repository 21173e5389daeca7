"""The Megatron-LM arguments ``meshplan launch`` appends to a Megatron-LM plan's program
(newcomer trial 49: ``launch job.toml -- python pretrain_gpt.py`` wrote a torchrun line without the
plan's flags, so the run would start with Megatron-LM's defaults, tp 1 and pp 1).

They are what ``export --to megatron`` writes for the plan (:func:`meshplan.interop.foreign.export`):
the plan's flags, and the flags of its ``[source]`` launch script meshplan does not plan (``--lr``,
``--data-path``, ...) carried unchanged, without the export's ``#`` header. argparse keeps the last
of a repeated option, so the plan's flags, after the program's own, are the ones Megatron-LM runs.
"""

from __future__ import annotations

from pathlib import Path

from meshplan.config import Config
from meshplan.errors import ConfigError
from meshplan.interop.foreign import export
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
        return (), (f"note: the plan's Megatron-LM flags are not appended to the program: export --to megatron "
                    f"refuses it ({e.message}); pass the flags yourself")
    words = tuple(exported_words(text))
    return words, (f"note: the plan's {sum(w.startswith('--') for w in words)} Megatron-LM flags (export --to "
                   f"megatron, with its [source]'s flags meshplan does not plan) appended to the program that "
                   f"torchrun.sh runs; argparse keeps the last of a repeated flag, so they win over the program's "
                   f"own; meshplan export {config.name} --to megatron -o - prints them alone")
