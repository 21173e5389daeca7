"""Names and free text in specs: what may reach a report, a file name or a generated script.

A *name* (model, GPU, node, NIC, link, network tier, mesh axis) is 1 to 128 characters of
``A-Z a-z 0-9 _ . : + @ / -`` and inner spaces, starting with a letter, digit or ``_`` (never
``-``: a name is never read as an option) and ending with no space: every name in
the catalog, NVIDIA's NIC (``mlx5_0``, ``mlx5_0:1``) and network interface (``enp1s0f0``,
``ib0``) names and Hugging Face model ids (``meta-llama/Meta-Llama-3-8B``) fit, and none of
these characters means anything to POSIX sh inside quotes or to a terminal (a value with a
space is single-quoted in a generated script). Anything
else is refused with the offending character named (:func:`check_name`); a name is never
silently changed. Free *text* (``source``) may hold any printable character but no control,
format or separator character (:func:`meshplan.errors.printable` leaves it unchanged).
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator

from meshplan.errors import printable

NAME_CHARS = "A-Z a-z 0-9 _ . : + @ / - and inner spaces"
NAME_MAX = 128
_NAME = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_.:+@/ -]*[A-Za-z0-9_.:+@/-])?")
_NOT_NAME = re.compile(r"[^A-Za-z0-9_.:+@/ -]")


def check_name(value: str) -> str:
    """``value`` if it is a safe name (see the module docstring); ValueError saying which
    character is not allowed and what is (pydantic reports it as the field's one-line error).

    >>> check_name("mlx5_0:1")
    'mlx5_0:1'
    >>> check_name("mlx5_0\\necho pwned")
    Traceback (most recent call last):
    ...
    ValueError: character '\\n' at position 6 is not allowed in a name; use 1-128 of A-Z a-z 0-9 _ . : + @ / - and inner spaces, starting with a letter, digit or _
    """
    rule = f"use 1-{NAME_MAX} of {NAME_CHARS}, starting with a letter, digit or _"
    if _NAME.fullmatch(value.rstrip(" ")) and value.endswith(" ") and _NOT_NAME.search(value) is None:
        raise ValueError(f"a name ending with a space; {rule}")
    if not value or len(value) > NAME_MAX:
        raise ValueError(f"a name of {len(value)} characters; {rule}")
    if not _NAME.fullmatch(value):
        bad = _NOT_NAME.search(value)
        i = bad.start() if bad else 0
        raise ValueError(f"character {value[i]!r} at position {i} is not allowed in a name; {rule}")
    return value


def safe_name(value: str, default: str) -> str:
    """A name made from text that is not the user's own choice (a file's folder, a Hugging
    Face ``_name_or_path``): each run of other characters becomes ``_``, cut to 128
    characters; ``default`` when nothing is left.

    >>> safe_name("/home/me/My Model (v2)", "hf-llama")
    'home/me/My_Model_v2_'
    """
    out = re.sub(r"[^A-Za-z0-9_.:+@/-]+", "_", value).lstrip("./:+@-")[:NAME_MAX]
    return out or default


def check_text(value: str) -> str:
    """``value`` if it holds no control, format or separator character; else ValueError."""
    if printable(value) != value:
        raise ValueError(f"{printable(value)[:80]!r} holds control characters; remove them")
    return value


Name = Annotated[str, AfterValidator(check_name)]
Text = Annotated[str, AfterValidator(check_text)]
