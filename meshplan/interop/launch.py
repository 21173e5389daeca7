"""Shell launch scripts and arguments files as flags: the words bash hands the commands
(:func:`meshplan.interop.shell_run.run`: lines joined at ``\\``, comments dropped, a quoted
string spanning lines read whole, as ``GPT_ARGS="`` of Megatron-LM's ``examples/pretrain_gpt.sh``,
``NAME=value`` variables and ``NAME=(...)`` arrays expanded where they are used, ``$(...)`` kept
whole), then ``--flag [value]`` pairs, split into the training script's and those of
its launcher (the options between ``torchrun``, ``python -m torch.distributed.run`` or
``.launch`` and the script).
"""

from __future__ import annotations

import re
from typing import Any, Collection, Optional

from meshplan.interop.shell_run import run

#: Launchers whose options precede the training script (torch.distributed.run's torchrun).
LAUNCHERS = ("torchrun", "torch.distributed.run", "torch.distributed.launch")
#: torchrun's options that take no value (torch/distributed/run.py, action=check_env).
SWITCHES = ("--standalone", "--no-python", "--no_python", "--run-path", "--run_path", "-m", "--module",
            "--virtual-local-rank", "--virtual_local_rank")

#: Flags that take one or more values (argparse ``nargs="+"``), kept as one space-joined string:
#: Megatron-LM's ``--recompute-modules`` (TransformerConfig.recompute_modules, a ``List[str]``, which
#: megatron/training/argument_utils.py ``_extract_type`` turns into ``nargs="+"`` at d98e8a6).
LISTS = ("--recompute-modules",)


def parse_launch(text: str, switches: Collection[str] = (), repeated: Optional[dict[str, list[Any]]] = None,
                 exported: Optional[dict[str, str]] = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the script's flags, the launcher's options) of an arguments file or launch script
    (module docstring); ``switches``: the flags that take no value; ``repeated`` (when
    given) receives each script flag given more than once with its values in order
    (:func:`pairs`); ``exported`` (when given) receives the environment the script exports
    (``export NAME=value ...``, values substituted), which the training processes inherit.

    >>> seen = {}
    >>> parse_launch('export CUDA_DEVICE_MAX_CONNECTIONS=1 N=2\\nA="--nnodes $N"\\n'
    ...              'torchrun $A --nproc_per_node 8 pretrain_gpt.py --num-layers 4', exported=seen), seen
    (({'--num-layers': '4'}, {'--nnodes': '2', '--nproc_per_node': '8'}), {'CUDA_DEVICE_MAX_CONNECTIONS': '1', 'N': '2'})
    """
    seen: dict[str, str] = {}
    tokens = run(text, seen)  # bash's words: arrays expanded where used, $(...) kept whole (shell_run)
    if exported is not None:
        exported.update(seen)
    launcher: list[str] = []
    for i, tok in enumerate(tokens):
        if tok.rsplit("/", 1)[-1] in LAUNCHERS:
            end = next((j for j in range(i + 1, len(tokens)) if tokens[j].endswith(".py")), len(tokens))
            launcher, tokens = tokens[i + 1:end], tokens[:i] + tokens[end:]
            break
    return pairs(tokens, switches, repeated), pairs(launcher, SWITCHES)


_NEGATIVE = re.compile(r"-[0-9.][0-9.eE+-]*")


def _is_option(token: str) -> bool:
    """Whether a shell word is an option, not a value: ``--x``, ``-x``; a negative number
    (``--clip-grad -1``) is a value, as argparse reads it."""
    return token.startswith("-") and len(token) > 1 and not _NEGATIVE.fullmatch(token)


def _bare(token: str) -> str:
    """``token`` without the parentheses of an array written around it, ``$(...)`` kept whole."""
    return token if "$(" in token or "`" in token else token.strip("()")


def pairs(tokens: list[str], switches: Collection[str],
          repeated: Optional[dict[str, list[Any]]] = None) -> dict[str, Any]:
    """``--flag [value]`` pairs of shell words (a switch, or a flag before another flag, is
    True); a flag given twice keeps its last value, as argparse does, and ``repeated`` (when
    given) receives it with all its values in order.

    >>> seen = {}
    >>> pairs(["--seq-length", "2048", "--bf16", "--seq-length=4096"], ["--bf16"], seen), seen
    ({'--seq-length': '4096', '--bf16': True}, {'--seq-length': ['2048', '4096']})
    >>> pairs(["--recompute-modules", "core_attn", "mlp", "--bf16"], ["--bf16"])
    {'--recompute-modules': 'core_attn mlp', '--bf16': True}
    """
    out: dict[str, Any] = {}
    every: dict[str, list[Any]] = {}
    i = 0
    while i < len(tokens):
        tok = _bare(tokens[i])
        i += 1
        if not tok.startswith("--"):
            continue
        if "=" in tok:
            key, val = tok.split("=", 1)
            out[key] = val
        elif tok in switches or i >= len(tokens) or _is_option(tokens[i]) or tokens[i] in ("(", ")"):
            out[tok] = True
        else:
            j = i + 1
            while tok in LISTS and j < len(tokens) and not _is_option(tokens[j]) and tokens[j] not in ("(", ")"):
                j += 1
            out[tok] = " ".join(_bare(t) for t in tokens[i:j])
            i = j
        key = tok.split("=", 1)[0]
        every.setdefault(key, []).append(out[key])
    if repeated is not None:
        repeated.update({k: v for k, v in every.items() if len(v) > 1})
    return out
