"""What an nccl-tests log says about its run beside its rows: where and on which GPU each rank
ran (:func:`hosts_of`, :func:`gpus_of`), and whether a text log was cut off before its end
(:func:`trailer_warning`). The rows are read by :mod:`meshplan.comm.nccl_tests`.

The ``#  Rank`` lines are printed by nccl-tests src/util.cu (NVIDIA/nccl-tests a0b82b2,
2.19.6, the ``# Using devices`` block) as ``"#  Rank %2d Group %2d Pid %6d on %10s device %2d
[%04x:%02x:%02x] %s"`` with the host name and ``cudaDeviceProp.name`` (the GPU model, e.g.
``NVIDIA H100 80GB HBM3``, ``NVIDIA A100-SXM4-80GB``, ``NVIDIA H200``); ``-J`` JSON carries the
same line parsed per process as ``config.devices[] = {"rank", "group", "pid", "hostname",
"device", "device_hex", "device_info"}`` (``parseRankInfo``, ``jsonRankInfo``): :func:`hosts_of`
and :func:`gpus_of` read them.
"""

from __future__ import annotations

import json
import re
from typing import Optional

from meshplan.comm.nccl_tests import BenchRow
from meshplan.units import human_bytes

#: The lines nccl-tests prints after its last result row, one of which every version has
#: (src/util.cu at a0b82b2, the end of ``run()``: ``"# %-20s : %g"`` "Avg bus bandwidth", then
#: "# Collective test concluded: <program>", printed since dafb704 with the starting banner).
_TRAILER = re.compile(r"^#[ \t]*(Avg bus bandwidth[ \t]*:|Collective test concluded:)", flags=re.M)


def trailer_warning(text: str, rows: list[BenchRow], source: str) -> Optional[str]:
    """A ``warning:`` line when text output ``text`` (not ``-J`` JSON, which does not parse
    when cut) has neither of nccl-tests' trailer lines (:data:`_TRAILER`): the log was cut off
    at a row boundary after its largest size in ``rows``, so its sizes stop short of the run's
    ``-e``; None when it has one.

    >>> rows = [BenchRow("all-reduce", 16, 16384, 30.09e-6, 0.54e9, 1.02e9)]
    >>> print(trailer_warning("#  Rank  0 ...\\n   16384 ...\\n", rows, "cut.txt"))
    warning: cut.txt: no '# Avg bus bandwidth' or '# Collective test concluded' line, which nccl-tests prints after its last row, so the log was cut off after its 16.00 KiB row; pass the whole output of the run
    >>> trailer_warning("# Avg bus bandwidth    : 165.643\\n", rows, "a.txt") is None
    True
    """
    if text.lstrip().startswith("{") or _TRAILER.search(text) or not rows:
        return None
    top = max(r.size_bytes for r in rows)
    asked = re.search(r"^#.*\bmaxBytes[ \t]+([0-9]{1,16})\b", text, flags=re.M)  # the header's -e
    of = f" of the {human_bytes(int(asked[1]))} its header's maxBytes names" if asked else ""
    return (f"warning: {source}: no '# Avg bus bandwidth' or '# Collective test concluded' line, which nccl-tests "
            f"prints after its last row, so the log was cut off after its {human_bytes(top)} row{of}; pass the "
            "whole output of the run")


#: A ``#  Rank`` line (module docstring): rank, host, and what follows the PCI address (the GPU model).
_RANK_LINE = re.compile(r"^#[ \t]+Rank[ \t]+([0-9]{1,9})[ \t]+Group[ \t]+[0-9]+[ \t]+Pid[ \t]+[0-9]+[ \t]+on[ \t]+(\S+)"
                        r"(?:[ \t]+device[ \t]+[0-9]+[ \t]+\[[^\]\n]*\][ \t]*([^\n]*))?", flags=re.M)


def _devices(text: str) -> Optional[list]:
    """``config.devices`` of ``-J`` JSON; None for text output, [] when absent or malformed."""
    if not text.lstrip().startswith("{"):
        return None
    try:
        devices = json.loads(text).get("config", {}).get("devices", [])
    except (ValueError, AttributeError, RecursionError):
        return []
    return [d for d in devices if isinstance(d, dict)] if isinstance(devices, list) else []


def hosts_of(text: str) -> list[str]:
    """Host of each rank, in rank order: the ``on <host>`` field of nccl-tests' ``#  Rank``
    lines, or ``hostname`` of each ``config.devices`` entry of ``-J`` JSON, once per rank of
    that process (``nthreads x ngpus``: ``-g 8`` runs 8 ranks per process); [] when absent.

    >>> hosts_of("#  Rank  0 Group  0 Pid   7 on     node01 device  0 [0000:18:00] NVIDIA A100\\n"
    ...          "#  Rank  1 Group  0 Pid   8 on     node01 device  1 [0000:1a:00] NVIDIA A100\\n")
    ['node01', 'node01']
    >>> hosts_of('{"config": {"ngpus": 2, "devices": [{"hostname": "a"}, {"hostname": "b"}]}}')  # -g 2
    ['a', 'a', 'b', 'b']
    """
    devices = _devices(text)
    if devices is not None:
        per = _ranks_per_entry(text)
        return [str(d.get("hostname", ""))[:256] for d in devices for _ in range(per)]
    return [m[2] for m in sorted(_RANK_LINE.finditer(text), key=lambda m: int(m[1]))]


def _ranks_per_entry(text: str) -> int:
    """Ranks per ``config.devices`` entry of ``-J`` JSON: ``nthreads x ngpus`` (one entry per
    process, as :func:`meshplan.comm.nccl_tests.parse_nccl_tests_json` counts the ranks), 1 when either is not a whole
    number 1..1024."""
    try:
        cfg = json.loads(text).get("config", {})
        per = cfg.get("nthreads", 1) * cfg.get("ngpus", 1)
    except (ValueError, AttributeError, TypeError, RecursionError):
        return 1
    return per if isinstance(per, int) and not isinstance(per, bool) and 1 <= per <= 1024 else 1


def gpus_of(text: str) -> list[str]:
    """GPU model of each rank that names one, in rank order: what nccl-tests prints after the
    PCI address of a ``#  Rank`` line (``cudaDeviceProp.name``), or ``device_info`` of each
    ``config.devices`` entry of ``-J`` JSON; a trailing ``(global rank N)`` (``meshplan bench
    comm``'s text) is dropped; [] when no line names one.

    >>> gpus_of("#  Rank  0 Group  0 Pid  6899 on ztan-mig-235z device  0 [0000:04:00] NVIDIA H100 80GB HBM3\\n"
    ...         "#  Rank  1 Group  0 Pid  6900 on ztan-mig-235z device  1 [0000:05:00] NVIDIA H100 80GB HBM3\\n")
    ['NVIDIA H100 80GB HBM3', 'NVIDIA H100 80GB HBM3']
    """
    devices = _devices(text)
    if devices is not None:
        names = [str(d.get("device_info", "")) for d in devices]
    else:
        names = [m[3] or "" for m in sorted(_RANK_LINE.finditer(text), key=lambda m: int(m[1]))]
    names = [re.sub(r"\s*\(global rank [0-9]+\)\s*$", "", n).strip()[:128] for n in names]
    return [n for n in names if n]
