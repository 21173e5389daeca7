"""CPU sets as Linux and NCCL write them, and physical cores behind them.

- CPU lists (``/sys/.../cpulist``, ``nvidia-smi topo -m`` "CPU Affinity"): ``0-55,112-167``.
- cpumasks (``/sys/.../cpumap``, NCCL's topology XML ``affinity``): comma-separated 32-bit
  hex words, most significant first: ``ffffffff,ffff0000``.
- Linux numbers the second hardware thread of core c as c + H (H = physical cores of the
  machine), so a socket with SMT shows two equal runs: ``0-55,112-167`` = 56 cores.
"""

from __future__ import annotations

import re
from typing import Optional, Sequence

from meshplan.errors import ConfigError
from meshplan.limits import MAX_CPU_ID, over


def parse_cpu_list(text: str, where: str = "cpu list") -> tuple[int, ...]:
    """Linux CPU list ``0-55,112-167`` -> sorted CPU ids; ``N/A`` or empty -> (). Ids are
    bounded (:data:`meshplan.limits.MAX_CPU_ID`) before any range is expanded, so
    ``0-999999999`` is an error, not a billion-element set.

    >>> len(parse_cpu_list("0-55,112-167")), parse_cpu_list("0,2,4-5")
    (112, (0, 2, 4, 5))
    """
    text = text.strip()
    if text in ("", "N/A"):
        return ()
    cpus: set[int] = set()
    parts = text.split(",")
    if len(parts) > MAX_CPU_ID:
        raise ConfigError(where, f"{len(parts)} CPU ranges; CPU ids are bounded: {over('cpu id', len(parts))}")
    for part in parts:
        m = re.fullmatch(r"([0-9]{1,12})(?:-([0-9]{1,12}))?", part.strip())
        if not m:
            raise ConfigError(where, f"bad CPU list '{text[:80]}'; expected ranges like 0-55,112-167")
        lo, hi = int(m[1]), int(m[2] or m[1])
        if hi >= MAX_CPU_ID:
            raise ConfigError(where, f"CPU id {over('cpu id', hi)}")
        if lo > hi:
            raise ConfigError(where, f"CPU range {lo}-{hi} runs backwards; write it low-high")
        cpus.update(range(lo, hi + 1))
    return tuple(sorted(cpus))


def parse_cpu_mask(text: str, where: str = "affinity") -> tuple[int, ...]:
    """Hex cpumask as NCCL writes it (32-bit words, most significant first) -> CPU ids.

    >>> parse_cpu_mask("00000000,0000ff00")
    (8, 9, 10, 11, 12, 13, 14, 15)
    """
    words = text.strip().split(",")
    if not all(re.fullmatch(r"[0-9a-fA-F]{1,8}", w) for w in words):
        raise ConfigError(where, f"bad cpumask '{text[:80]}'; expected hex words like ffffffff,ffff0000")
    value = 0
    for w in words:
        value = (value << 32) | int(w, 16)
    if value.bit_length() > MAX_CPU_ID:
        raise ConfigError(where, f"cpumask of {value.bit_length()} bits; CPU id {over('cpu id', value.bit_length() - 1)}")
    return tuple(i for i in range(value.bit_length()) if value >> i & 1)


def cpu_affinity(text: str, where: str) -> tuple[int, ...]:
    """An XML ``affinity``: a cpumask (NCCL's dumps) or a CPU list (hand-written files)."""
    words = text.strip().split(",")
    if all(re.fullmatch(r"[0-9a-fA-F]{8}", w) for w in words) or re.search(r"[a-fA-F]", text):
        return parse_cpu_mask(text, where)
    return parse_cpu_list(text, where)


def _smt_offset(cpus: Sequence[int]) -> Optional[int]:
    """Sibling offset H when ``cpus`` is two equal runs ``a..b, a+H..b+H`` (Linux numbers
    the second hardware thread of core c as c + H), else None."""
    runs: list[list[int]] = []
    for c in sorted(cpus):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    if len(runs) == 2 and runs[0][1] - runs[0][0] == runs[1][1] - runs[1][0]:
        return runs[1][0] - runs[0][0]
    return None


def physical_cores(cpu_sets: list[tuple[int, ...]], threads_per_core: Optional[int]) -> list[int]:
    """Physical cores per socket: logical CPUs / threads per core. Without
    ``threads_per_core``, 2 when every socket's list is two equal runs with one common
    sibling offset (``0-55,112-167`` and ``56-111,168-223``), else 1.

    >>> physical_cores([parse_cpu_list("0-55,112-167"), parse_cpu_list("56-111,168-223")], None)
    [56, 56]
    >>> physical_cores([parse_cpu_list("0-37"), parse_cpu_list("38-75")], None)
    [38, 38]
    """
    if threads_per_core is None:
        offsets = {_smt_offset(s) for s in cpu_sets if s}
        threads_per_core = 2 if len(offsets) == 1 and None not in offsets else 1
    return [len(s) // threads_per_core for s in cpu_sets]
