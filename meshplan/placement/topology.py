"""Read a node's real PCIe/NUMA topology: a :class:`TopoMatrix` of connection levels.

Two inputs, both from the machine itself:

- ``nvidia-smi topo -m`` text: a matrix over GPU0..GPUn and the NICs (``NIC0``.. with a
  "NIC Legend" naming them, or ``mlx5_*`` columns in older drivers) whose cells are ``X``,
  ``NV#`` (# bonded NVLinks), ``PIX`` (at most one PCIe bridge), ``PXB`` (several bridges,
  no host bridge), ``PHB`` (through a PCIe host bridge), ``NODE`` (between host bridges of
  one NUMA node), ``SYS`` (across the CPU interconnect; ``SOC`` in old drivers), then the
  GPU rows' "CPU Affinity" (``0-55,112-167``) and "NUMA Affinity" columns.
- NCCL's topology dump (``NCCL_TOPO_DUMP_FILE``): ``<system><cpu numaid= affinity=>`` with
  nested ``<pci busid=>`` bridges holding ``<gpu dev=>`` and ``<nic><net name= speed=>``;
  ``affinity`` is a hex cpumask (``ffffffff,ffff0000``, 32-bit words, most significant
  first); ``speed`` is in Mb/s. The level between a GPU and a NIC follows NCCL's path
  types: the same parent bridge is ``PIX``, a common bridge higher up ``PXB``, the same CPU
  only ``PHB``, another CPU ``SYS``.

The node these levels give (its sockets and NICs) is :mod:`meshplan.placement.topology_node`'s.

>>> text = '''\\tGPU0\\tGPU1\\tNIC0\\tCPU Affinity\\tNUMA Affinity
... GPU0\\t X \\tNV4\\tSYS\\t0-7\\t0
... GPU1\\tNV4\\t X \\tPIX\\t8-15\\t1
... NIC0\\tSYS\\tPIX\\t X
...
... NIC Legend:
...
...   NIC0: mlx5_0
... '''
>>> topo = parse_nvidia_smi_topo(text)
>>> topo.nics, topo.gpu_nic
(('mlx5_0',), (('SYS',), ('PIX',)))
"""

from __future__ import annotations

import math
import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from meshplan.placement.cpus import cpu_affinity, parse_cpu_list
from meshplan.errors import ConfigError
from meshplan.fileread import read_text_limited
from meshplan.limits import FILE_BYTES, MAX_GPUS_PER_NODE, MAX_LINE_CHARS, MAX_XML_DEPTH, over

#: nvidia-smi connection levels, nearest first (NV# is handled apart).
LEVELS = ("X", "PIX", "PXB", "PHB", "NODE", "SYS")
SAME_SWITCH = ("PIX", "PXB")
_LEVEL_ALIASES = {"SOC": "SYS"}


@dataclass(frozen=True)
class TopoMatrix:
    """One node's topology: levels ``gpu_nic[i][j]`` (GPU i, NIC j), ``gpu_gpu`` (``NV18``,
    ``PIX``...) and ``nic_nic``; ``gpu_cpus[i]``: logical CPUs of GPU i's affinity (empty if
    unknown); ``gpu_numa`` / ``nic_numa``: NUMA node or None when the input does not say;
    ``nic_speed_gbit_per_s``: line rate (XML only); ``numa_cpus``: (NUMA node, CPUs) pairs
    (XML only); ``gpu_sm``: each GPU's compute capability x 10 (XML ``sm``; empty for
    ``nvidia-smi topo -m``, which does not name the GPU)."""

    gpus: tuple[int, ...]
    nics: tuple[str, ...]
    gpu_gpu: tuple[tuple[str, ...], ...]
    gpu_nic: tuple[tuple[str, ...], ...]
    nic_nic: tuple[tuple[str, ...], ...]
    gpu_cpus: tuple[tuple[int, ...], ...]
    gpu_numa: tuple[Optional[int], ...]
    nic_numa: tuple[Optional[int], ...]
    nic_speed_gbit_per_s: tuple[Optional[float], ...]
    numa_cpus: tuple[tuple[int, tuple[int, ...]], ...] = ()
    source: str = ""
    gpu_sm: tuple[Optional[int], ...] = ()

    def level(self, gpu: int, nic: str) -> str:
        """Level between GPU ``gpu`` and NIC ``nic`` (by name)."""
        return self.gpu_nic[self.gpus.index(gpu)][self.nics.index(nic)]


# --------------------------------------------------------------------------- nvidia-smi


def _is_level(cell: str) -> bool:
    return _LEVEL_ALIASES.get(cell, cell) in LEVELS or re.fullmatch(r"NV\d+", cell) is not None


def _level(cell: str, where: str) -> str:
    if _is_level(cell):
        return _LEVEL_ALIASES.get(cell, cell)
    raise ConfigError(where, f"unknown connection '{cell}'; expected X, NV#, PIX, PXB, PHB, NODE or SYS "
                             "(pass the unmodified output of `nvidia-smi topo -m`)")


def _smi_header(lines: list[str], source: str) -> tuple[int, list[str]]:
    """(line index, device column names) of the matrix header."""
    for i, line in enumerate(lines):
        tokens = line.split()  # the header starts with GPU0; a row's second cell is a level
        if tokens[:1] == ["GPU0"] and (len(tokens) == 1 or not _is_level(tokens[1])):
            end = tokens.index("CPU") if "CPU" in tokens else len(tokens)
            return i, tokens[:end]
    raise ConfigError(source, "no header line with GPU0 found; pass the output of `nvidia-smi topo -m`")


def parse_nvidia_smi_topo(text: str, source: str = "nvidia-smi topo -m") -> TopoMatrix:
    """Parse ``nvidia-smi topo -m`` output (tab- or space-separated). NIC columns named in a
    "NIC Legend" (``NIC0: mlx5_0``) take the legend's name. Raises ConfigError naming
    ``source:line`` for a short row or an unknown cell."""
    lines = text.splitlines()
    long = next((i for i, line in enumerate(lines) if len(line) > MAX_LINE_CHARS), None)
    if long is not None:
        raise ConfigError(f"{source}:{long + 1}", f"a line of {len(lines[long])} characters; "
                                                  f"{over('line', len(lines[long]))}")
    head, devices = _smi_header(lines, source)
    n = len(devices)
    if n > 2 * MAX_GPUS_PER_NODE:
        raise ConfigError(f"{source}:{head + 1}", f"{n} devices; {over('topology devices', n)}")
    odd = next((i for i, line in enumerate(lines) if not line.replace("\t", " ").isprintable()), None)
    if odd is not None:
        raise ConfigError(f"{source}:{odd + 1}", "a control character; pass the unmodified output of "
                                                 "`nvidia-smi topo -m`")
    rows: dict[str, tuple[list[str], list[str]]] = {}
    for i in range(head + 1, len(lines)):
        tokens = lines[i].split()
        if not tokens or tokens[0] not in devices:
            if rows:
                break
            continue
        where = f"{source}:{i + 1}"
        if len(tokens) < n + 1:
            raise ConfigError(where, f"row {tokens[0]} has {len(tokens) - 1} cells for {n} devices; "
                                     "pass the full, unwrapped output of `nvidia-smi topo -m`")
        rows[tokens[0]] = ([_level(c, where) for c in tokens[1:n + 1]], tokens[n + 1:])
    legend = dict(re.findall(r"^[ \t]*(NIC[0-9]+)[ \t]*:[ \t]*(\S+)[ \t]*$", text, flags=re.M))
    gpu_cols = [d for d in devices if re.fullmatch(r"GPU\d+", d)]
    nic_cols = [d for d in devices if d not in gpu_cols]
    missing = [d for d in devices if d not in rows]
    if missing:
        raise ConfigError(source, f"no row for {', '.join(missing)}; pass the full output of `nvidia-smi topo -m`")
    col = {d: k for k, d in enumerate(devices)}
    gpus, cpus, numa = [], [], []
    for d in gpu_cols:
        extra = rows[d][1]
        where = f"{source}: {d} affinity"
        cpus.append(parse_cpu_list(extra[0], where) if extra else ())
        numa.append(int(extra[1]) if len(extra) > 1 and re.fullmatch(r"[0-9]{1,9}", extra[1]) else None)
        gpus.append(int(d[3:]))
    return TopoMatrix(
        gpus=tuple(gpus), nics=tuple(legend.get(d, d) for d in nic_cols),
        gpu_gpu=tuple(tuple(rows[g][0][col[h]] for h in gpu_cols) for g in gpu_cols),
        gpu_nic=tuple(tuple(rows[g][0][col[c]] for c in nic_cols) for g in gpu_cols),
        nic_nic=tuple(tuple(rows[c][0][col[e]] for e in nic_cols) for c in nic_cols),
        gpu_cpus=tuple(cpus), gpu_numa=tuple(numa), nic_numa=(None,) * len(nic_cols),
        nic_speed_gbit_per_s=(None,) * len(nic_cols), source=source)


# --------------------------------------------------------------------------- NCCL XML


def _walk(elem: ET.Element, path: tuple[str, ...], found: list):
    """Collect (kind, element, pci path) for every gpu and net under ``elem`` (iteratively;
    the depth is bounded by :func:`_check_depth` first)."""
    stack = [(elem, path)]
    while stack:
        node, at = stack.pop()
        for child in reversed(node):
            if child.tag == "pci":
                stack.append((child, at + (child.get("busid", "?"),)))
            elif child.tag == "gpu":
                found.append(("gpu", child, at))
            elif child.tag == "nic":
                found.extend(("net", net, at) for net in child.iter("net"))
            else:
                stack.append((child, at))
    found.reverse()


def _check_depth(root: ET.Element, source: str) -> None:
    """Nesting and element count within the stated bounds (:mod:`meshplan.limits`)."""
    stack, count = [(root, 1)], 0
    while stack:
        node, depth = stack.pop()
        count += 1
        if depth > MAX_XML_DEPTH:
            raise ConfigError(source, f"elements nested {depth} deep; {over('xml depth', depth)}")
        if count > 64 * MAX_GPUS_PER_NODE:
            raise ConfigError(source, f"over {count - 1} elements; a node's dump has a few hundred "
                                      f"({over('topology devices', 'the device count')})")
        stack.extend((c, depth + 1) for c in node)


def _xml_level(a: tuple[str, ...], b: tuple[str, ...], same_cpu: bool) -> str:
    """NCCL path type between two devices from their PCI paths (root bridge first, own
    endpoint last): shared parent bridge PIX, a shared bridge higher up PXB, else PHB on
    the same CPU, SYS across CPUs."""
    if not same_cpu:
        return "SYS"
    common = 0
    for x, y in zip(a[:-1], b[:-1]):
        if x != y:
            break
        common += 1
    if common == 0:
        return "PHB"
    return "PIX" if common == len(a) - 1 == len(b) - 1 else "PXB"


def _int_attr(elem: ET.Element, name: str, where: str) -> int:
    value = elem.get(name)
    if value is None or not re.fullmatch(r"-?[0-9]{1,18}", value.strip()):
        raise ConfigError(where, f"<{elem.tag}> needs an integer '{name}' (got {value!r:.40}); "
                                 "pass the file NCCL_TOPO_DUMP_FILE wrote")
    return int(value)


def _nvlinks(gpu: ET.Element, where: str) -> tuple[dict[str, int], int]:
    """(NVLink count per target bus id, NVLinks to NVSwitches (tclass 0x068000)) of one GPU."""
    direct: dict[str, int] = {}
    switch = 0
    for link in gpu.findall("nvlink"):
        n = _int_attr(link, "count", where) if link.get("count") is not None else 1
        if not 0 <= n <= 1024:
            raise ConfigError(where, f"<nvlink count={n}> outside 0..1024; pass the file NCCL_TOPO_DUMP_FILE wrote")
        if link.get("tclass") == "0x068000":
            switch += n
        target = link.get("target")
        if target is not None:
            direct[target] = direct.get(target, 0) + n
    return direct, switch


def _gpu_gpu_level(la, lb, pa, pb, same_cpu) -> str:
    """NV<links> when GPU a (its :func:`_nvlinks` ``la``) has NVLinks to b's bus id or to an
    NVSwitch that b also reaches; else the PCI level."""
    direct = la[0].get(pb[-1], 0) if pb else 0
    if direct:
        return f"NV{direct}"
    if la[1] and lb[1]:
        return f"NV{la[1]}"
    return _xml_level(pa, pb, same_cpu)


def _speed(net: ET.Element, where: str) -> Optional[float]:
    """A NIC's ``speed`` (Mb/s) in Gb/s; None when absent."""
    raw = net.get("speed")
    if raw is None or raw == "":
        return None
    try:
        value = float(raw) / 1000.0
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 < value <= 8e6):
        raise ConfigError(where, f"<net speed={raw[:40]!r}> must be a positive rate in Mb/s "
                                 "(NCCL writes e.g. 400000); pass the file NCCL_TOPO_DUMP_FILE wrote")
    return value


def _sm(gpu: ET.Element) -> Optional[int]:
    """A ``<gpu>``'s ``sm`` (compute capability x 10, ``90``); None when absent or not 1-4 digits."""
    raw = (gpu.get("sm") or "").strip()
    return int(raw) if re.fullmatch(r"[0-9]{1,4}", raw) else None


def parse_nccl_topo_xml(text: str, source: str = "NCCL topology XML") -> TopoMatrix:
    """Parse NCCL's topology dump (``NCCL_TOPO_DUMP_FILE``). GPUs are ordered by ``dev``;
    NICs keep file order (their ``dev``), named by ``name`` (with ``:port`` added when a
    name repeats). Raises ConfigError for XML errors, a missing ``dev`` or no GPU."""
    try:
        root = ET.fromstring(text)
    except ET.ParseError as err:
        raise ConfigError(source, f"not valid XML ({err}); pass the file NCCL_TOPO_DUMP_FILE wrote") from None
    if root.tag != "system":
        raise ConfigError(source, f"root element is <{root.tag[:40]}>, expected <system>; pass an NCCL topology dump")
    _check_depth(root, source)
    gpus: list = []
    nets: list = []
    numa_cpus: list = []
    for cpu in root.iter("cpu"):
        where = f"{source}: <cpu numaid={str(cpu.get('numaid'))[:20]}>"
        numa = _int_attr(cpu, "numaid", where)
        cpus = cpu_affinity(cpu.get("affinity", ""), where) if cpu.get("affinity") else ()
        numa_cpus.append((numa, cpus))
        found: list = []
        _walk(cpu, (), found)
        for kind, elem, path in found:
            (gpus if kind == "gpu" else nets).append((elem, path, numa, cpus))
    if not gpus:
        raise ConfigError(source, "no <gpu> element; pass the file NCCL_TOPO_DUMP_FILE wrote")
    for kind, found in (("<gpu>", gpus), ("<net>", nets)):
        if len(found) > MAX_GPUS_PER_NODE:
            raise ConfigError(source, f"{len(found)} {kind} elements; {over('topology devices', len(found))}")
    gpus.sort(key=lambda g: _int_attr(g[0], "dev", f"{source}: <gpu>"))
    names = [n[0].get("name") or f"net{k}" for k, n in enumerate(nets)]
    odd = next((nm for nm in names if not nm.isprintable() or len(nm) > 256), None)
    if odd is not None:
        raise ConfigError(source, f"<net name={odd[:40]!r}> is not a printable name of at most 256 characters; "
                                  "pass the file NCCL_TOPO_DUMP_FILE wrote")
    counts = {nm: names.count(nm) for nm in set(names)}
    names = [f"{nm}:{n[0].get('port', '1')}" if counts[nm] > 1 else nm for nm, n in zip(names, nets)]
    speed = [_speed(n[0], f"{source}: <net name={str(n[0].get('name'))[:40]}>") for n in nets]
    links = [_nvlinks(g[0], f"{source}: <gpu dev={str(g[0].get('dev'))[:20]}>") for g in gpus]
    return TopoMatrix(
        gpus=tuple(_int_attr(g[0], "dev", f"{source}: <gpu>") for g in gpus), nics=tuple(names),
        gpu_gpu=tuple(tuple("X" if a is b else _gpu_gpu_level(la, lb, a[1], b[1], a[2] == b[2])
                            for b, lb in zip(gpus, links)) for a, la in zip(gpus, links)),
        gpu_nic=tuple(tuple(_xml_level(g[1], n[1], g[2] == n[2]) for n in nets) for g in gpus),
        nic_nic=tuple(tuple("X" if a is b else _xml_level(a[1], b[1], a[2] == b[2]) for b in nets) for a in nets),
        gpu_cpus=tuple(g[3] for g in gpus), gpu_numa=tuple(g[2] for g in gpus),
        nic_numa=tuple(n[2] for n in nets), nic_speed_gbit_per_s=tuple(speed),
        numa_cpus=tuple(numa_cpus), source=source,
        gpu_sm=tuple(_sm(g[0]) for g in gpus))


def load_topology(path) -> TopoMatrix:
    """Read ``path``: NCCL XML when it starts with ``<``, else ``nvidia-smi topo -m`` text."""
    p = Path(path)
    text = read_text_limited(p, "--topology", FILE_BYTES["topology"],
                             "give the output of `nvidia-smi topo -m` or NCCL_TOPO_DUMP_FILE")
    if text.lstrip().startswith("<"):
        return parse_nccl_topo_xml(text, source=p.name)
    return parse_nvidia_smi_topo(text, source=p.name)
