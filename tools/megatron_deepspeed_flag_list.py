"""Megatron-DeepSpeed's full flag list, for meshplan/interop/megatron_deepspeed_flag_list.toml.

Usage (a microsoft/Megatron-DeepSpeed source tree at the commit)::

    git -C Megatron-DeepSpeed show f4157bea:megatron/arguments.py > /tmp/mds_arguments.py
    python tools/megatron_deepspeed_flag_list.py /tmp/mds_arguments.py f4157be > meshplan/interop/megatron_deepspeed_flag_list.toml

Megatron-DeepSpeed's ``megatron/arguments.py`` writes every option out as a literal
``group.add_argument('--flag', ...)`` call (no config dataclass builds flags, unlike Megatron-LM's
``ArgumentGroupFactory``), so the option strings of those calls are the parser's flags; switches are
the calls with ``action='store_true'`` or ``'store_false'``. ``parse_args`` then adds DeepSpeed's
``add_config_arguments`` (arguments.py:55): ``--deepspeed``, ``--deepspeed_config``, ``--deepscale``,
``--deepscale_config`` (deepspeedai/DeepSpeed edaa722 ``deepspeed/__init__.py:285-300``), the two
``--deep*`` switches among them.
"""

from __future__ import annotations

import re
import sys

#: DeepSpeed's add_config_arguments: flag -> whether it is a switch.
DEEPSPEED = {"--deepspeed": True, "--deepspeed_config": False, "--deepscale": True, "--deepscale_config": False}


def calls(text: str) -> list[str]:
    """The text of each ``add_argument(...)`` call of ``text``, up to its closing parenthesis."""
    out = []
    for m in re.finditer(r"add_argument\(", text):
        depth, i = 1, m.end()
        while depth and i < len(text):
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            i += 1
        out.append(text[m.end():i - 1])
    return out


def flags(text: str) -> tuple[set[str], set[str]]:
    """(every ``--flag``, the switches) of the ``add_argument`` calls of ``text`` and :data:`DEEPSPEED`."""
    every, switches = set(DEEPSPEED), {f for f, s in DEEPSPEED.items() if s}
    for call in calls(text):
        names = re.findall(r"""^\s*(?:['"](--?[\w-]+)['"]\s*,\s*)+""", call)
        opts = re.findall(r"""['"](--[\w-]+)['"]""", call.split("=", 1)[0])
        if not names:
            continue
        every |= set(opts)
        if re.search(r"""action\s*=\s*['"]store_(true|false)['"]""", call):
            switches |= set(opts)
    return every, switches


def main() -> None:
    path, commit = sys.argv[1], sys.argv[2]
    every, switches = flags(open(path, encoding="utf-8").read())
    print(f"# Every option of Megatron-DeepSpeed's parser: {len(every)} flags, {len(switches)} of them switches.")
    print("# Written by tools/megatron_deepspeed_flag_list.py; do not edit by hand.")
    print(f'source = "microsoft/Megatron-DeepSpeed {commit}, megatron/arguments.py parse_args with DeepSpeed\'s '
          f'add_config_arguments (argparse, parse_args strict)"')
    for name, items in (("flags", every), ("switches", switches)):
        print(f"{name} = [")
        print("\n".join(f'  "{f}",' for f in sorted(items)))
        print("]")


if __name__ == "__main__":
    main()
