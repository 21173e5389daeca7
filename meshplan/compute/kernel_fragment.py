"""A measured kernel table in ``meshplan/catalog/kernels.toml`` form, as ``meshplan bench gemm
--grid`` / ``bench attention --grid`` write it: one GPU's GEMM points per dtype and attention
rows, each with its source, to paste into kernels.toml or to lay over the catalog's data.

Schema (the catalog's own; ``<gpu>`` a catalog GPU id)::

    [gpu.<gpu>]
    source = "meshplan bench gemm on <device name>, torch <version>, <date>"
    [gpu.<gpu>.gemm]
    bf16 = [[M, N, K, TFLOP/s, "source key"], ...]
    [gpu.<gpu>.attention]
    prefer = ["SDPA"]
    rows = [{ kernel, pass, mask, head_dim, dtype, seq = [...], tflops = [...], source }, ...]
    [host]                              # optional: eager DTensor TP's host pace on your host
    dtensor_tp_block_forward_s = 4.65e-3    # seconds per transformer block, both keys
    dtensor_tp_block_backward_s = 5.37e-3   # (`meshplan bench rank --kernels-out` writes them)

A file may hold the ``[host]`` table alone (no ``[gpu.<id>]``): the host's pace is the host's, so
it applies to whatever GPU the plan uses (source :data:`HOST_ONLY_SOURCE`).

:func:`load_fragment` reads it (a malformed file is one :class:`ConfigError` line naming the
field); :func:`with_fragment` lays it over a GPU's :class:`~meshplan.compute.measured.KernelData`:
its GEMM dtypes replace the catalog's points of those dtypes, its attention rows go first (its
``prefer`` list before the catalog's), its ``[host]`` pace replaces the catalog's (kernels.toml
``[host] dtensor_tp_block_*``, M1), its source then ``your kernels file FILE``.

**For one run** (``--kernels FILE`` on plan, report, step, reliability, compare, search; a config's
``[kernels] files``): :func:`read_kernel_file` checks a file against the config's GPU and
:func:`with_kernel_files` puts it on the :class:`~meshplan.spec.cluster.GPUSpec`
(``kernels``); :func:`kernel_data` is the compute model's one way to a GPU's kernel data: the
catalog's (:func:`meshplan.compute.measured.kernel_data`) with the GPU's files laid over it in
order (a later file's dtypes and attention rows over an earlier one's). :func:`kernels_line`
says which data a run used: ``kernels: catalog`` or ``kernels: FILE (source line; per GEMM dtype
the points it has, against the plan's shapes and the catalog's points)``.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Optional

from meshplan.compute import measured
from meshplan.compute.measured import AttentionRow, KernelData, attention_row
from meshplan.errors import ConfigError
from meshplan.fileread import read_text_limited
from meshplan.limits import FILE_BYTES
from meshplan.spec.cluster import GPUSpec, KernelFile

#: The fix every --kernels error ends with.
KERNELS_FIX = "give a kernels TOML written by `meshplan bench gemm --grid` or `bench attention --grid`"


@dataclass(frozen=True)
class KernelFragment:
    """One GPU's measured GEMM points (dtype -> ((M, N, K, TFLOP/s, source key), ...)) and
    attention rows from a kernels.toml-form file."""

    gpu: Optional[str]  # None: a [host] table alone (any GPU)
    gemm: dict[str, tuple[tuple, ...]]
    attention: tuple[AttentionRow, ...]
    prefer: tuple[str, ...]
    source: str
    host_pace_s: Optional[tuple[float, float]] = None  # [host]: (forward, backward) s per block
    path: str = "kernels file"


#: The keys of a kernels file's ``[host]`` table: eager DTensor TP's (forward, backward) host
#: pace, seconds per transformer block (kernels.toml ``[host]``, whose other keys stay the catalog's).
HOST_KEYS = ("dtensor_tp_block_forward_s", "dtensor_tp_block_backward_s")

#: The source of a file holding a ``[host]`` table alone (no ``[gpu.<id>]``), as ``kernels:`` names it.
HOST_ONLY_SOURCE = "[host] pace alone, for any GPU"


def _host_pace(raw) -> Optional[tuple[float, float]]:
    """The ``[host]`` table's (forward, backward) seconds per block, None without one; both keys,
    each positive and finite, no other key."""
    if raw is None:
        return None
    fix = f"give [host] {' and '.join(HOST_KEYS)}, seconds per transformer block (e.g. 4.65e-3)"
    if not isinstance(raw, dict):
        raise ConfigError("host", f"must be a table; {fix}")
    for key in raw:
        if key not in HOST_KEYS:
            raise ConfigError(f"host.{key}", f"unknown key; {fix}")
    for key in HOST_KEYS:
        if key not in raw:
            raise ConfigError(f"host.{key}", f"missing; {fix}")
        if not _positive(raw[key], (int, float)):
            raise ConfigError(f"host.{key}", f"{raw[key]!r}; must be a positive, finite number of seconds per "
                                             f"transformer block (e.g. 4.65e-3)")
    return float(raw[HOST_KEYS[0]]), float(raw[HOST_KEYS[1]])


def _positive(x, kind) -> bool:
    """``x`` a finite number of ``kind`` above 0 (TOML has inf and nan; a bool is no number)."""
    return isinstance(x, kind) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def _attention(field: str, r) -> AttentionRow:
    """One attention row (:func:`~meshplan.compute.measured.attention_row`), checked: rates and
    lengths positive and finite, one rate per length, lengths increasing."""
    fix = "give kernel, pass (fwd, bwd or fwd+bwd), mask (none, causal or any), head_dim, seq, tflops, source (dtype " \
          "optional, bf16)"
    if not isinstance(r, dict):
        raise ConfigError(field, f"{r!r}; {fix}")
    try:
        row = attention_row(r)
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(field, f"{e}; {fix}") from None
    if row.pass_ not in ("fwd", "bwd", "fwd+bwd") or row.mask not in ("none", "causal", "any"):
        raise ConfigError(field, f"pass {row.pass_!r}, mask {row.mask!r}; {fix}")
    if not row.seq or len(row.seq) != len(row.tflops):
        raise ConfigError(field, "seq and tflops differ in length; one rate per length")
    if not (all(_positive(x, int) for x in (row.head_dim,) + row.seq) and all(_positive(x, float) for x in row.tflops)
            and list(row.seq) == sorted(set(row.seq))):
        raise ConfigError(field, "head_dim, seq and tflops must be positive and finite, seq increasing")
    return row


def _gemm_points(field: str, pts) -> tuple[tuple, ...]:
    out = []
    for i, p in enumerate(pts if isinstance(pts, list) else [None]):
        ok = (isinstance(p, list) and len(p) == 5 and all(_positive(x, int) for x in p[:3])
              and _positive(p[3], (int, float)) and isinstance(p[4], str))
        if not ok:
            raise ConfigError(f"{field}[{i}]", f"{p!r}; write [M, N, K, TFLOP/s, \"source key\"] with positive numbers")
        out.append((p[0], p[1], p[2], float(p[3]), p[4]))
    if not out:
        raise ConfigError(field, "no points; give at least one [M, N, K, TFLOP/s, \"source key\"]")
    return tuple(out)


def parse_fragment(doc: dict, where: str = "kernels file") -> KernelFragment:
    """A parsed kernels.toml-form document with exactly one ``[gpu.<id>]`` table (and an
    optional top-level ``[host]``: :data:`HOST_KEYS`), or a ``[host]`` table alone: a host-only
    fragment (``gpu`` None, :data:`HOST_ONLY_SOURCE`) that applies to whatever GPU the plan uses,
    the host's pace being the host's, not the GPU's."""
    gpus = doc.get("gpu")
    if gpus is None and doc.get("host") is not None:
        return KernelFragment(None, {}, (), (), HOST_ONLY_SOURCE, _host_pace(doc["host"]), where)
    if not isinstance(gpus, dict) or len(gpus) != 1:
        raise ConfigError(f"{where}: [gpu]", "expected exactly one [gpu.<id>] table (the kernels.toml schema), "
                                             "or a [host] table alone")
    (gpu, raw), = gpus.items()
    base = f"gpu.{gpu}"
    if not isinstance(raw, dict) or not isinstance(raw.get("source"), str):
        raise ConfigError(f"{base}.source", "missing; say where the numbers were measured")
    gemm_raw, att = raw.get("gemm", {}), raw.get("attention", {})
    for key, value, kind in (("gemm", gemm_raw, "dtype = [[M, N, K, TFLOP/s, \"key\"], ...]"),
                             ("attention", att, "rows = [...] and prefer = [...]")):
        if not isinstance(value, dict):
            raise ConfigError(f"{base}.{key}", f"must be a table [{base}.{key}] of {kind}")
    gemm = {dt: _gemm_points(f"{base}.gemm.{dt}", v) for dt, v in gemm_raw.items()}
    if not isinstance(att.get("rows", []), list):
        raise ConfigError(f"{base}.attention.rows", "must be a list of row tables")
    rows = [_attention(f"{base}.attention.rows[{i}]", r) for i, r in enumerate(att.get("rows", []))]
    host = _host_pace(doc.get("host"))
    if not gemm and not rows and host is None:
        raise ConfigError(base, "neither gemm points, attention rows nor a [host] table; nothing to read")
    prefer = att.get("prefer", sorted({r.kernel for r in rows}))
    if not isinstance(prefer, list) or not all(isinstance(k, str) for k in prefer):
        raise ConfigError(f"{base}.attention.prefer", "must be a list of kernel names, e.g. [\"SDPA\"]")
    prefer = tuple(prefer)
    return KernelFragment(gpu, gemm, tuple(rows), prefer, raw["source"], host, where)


def load_fragment(path: str | Path) -> KernelFragment:
    """Read a kernels.toml-form file (module docstring)."""
    return _parse_text(read_text_limited(path, str(path), FILE_BYTES["kernels"], KERNELS_FIX), str(path))


def _parse_text(text: str, where: str) -> KernelFragment:
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(where, f"not TOML ({e}); give a file written by `meshplan bench --grid`") from None
    return parse_fragment(doc, where)


def with_fragment(data: KernelData, frag: KernelFragment) -> KernelData:
    """``data`` with ``frag`` laid over it: the fragment's GEMM dtypes replace those dtypes'
    points; its attention rows come before the catalog's, its ``prefer`` first, before the
    framework's kernels too (``KernelData.first``: measured on the run's GPU); its ``[host]`` pace
    replaces the host pace, sourced ``your kernels file FILE``. Its own fp8 points drop the
    catalog's ``fp8_no_fast_accum`` factor (which is relative to the catalog's fast-accumulation rows)."""
    mine = frag.prefer if frag.attention else ()
    accum = 1.0 if "fp8" in frag.gemm else data.fp8_no_fast_accum
    out = replace(data, gemm={**data.gemm, **frag.gemm}, attention=frag.attention + data.attention,
                  fp8_no_fast_accum=accum,
                  prefer=tuple(dict.fromkeys(frag.prefer + data.prefer)),
                  first=tuple(dict.fromkeys(mine + data.first)),
                  source=f"{data.source}; overlaid by {frag.source}")
    if frag.host_pace_s is None:
        return out
    return replace(out, dtensor_tp_block_s=frag.host_pace_s, dtensor_tp_source=f"your kernels file {frag.path}")


def read_kernel_file(path: str | Path, gpu: GPUSpec, field: str = "--kernels") -> tuple[KernelFile, list[str]]:
    """``path`` read and checked for a run on ``gpu``: (the file, warning lines). Errors, one
    line naming ``field``: no such file, malformed, a fragment for another GPU (naming both),
    a GPU without catalog kernel data to lay it over (its GEMM rates against the GPU:
    :func:`meshplan.compute.rate_check.kernel_file_rates`). A fragment measured on the CPU (its
    ``source`` says "CPU", :func:`meshplan.runtime.bench.grid.source_line`) is a warning: its
    rates describe that CPU, not ``gpu``."""
    if not Path(path).exists():
        raise ConfigError(field, f"no file {str(path)!r}; {KERNELS_FIX}")
    text = read_text_limited(path, field, FILE_BYTES["kernels"], KERNELS_FIX)
    try:
        frag = _parse_text(text, str(path))
    except ConfigError as e:
        raise ConfigError(field, f"{e}") from None
    if frag.gpu is not None and frag.gpu != gpu.name:
        raise ConfigError(field, f"{path} describes GPU {frag.gpu}, but the config uses {gpu.name}; give a "
                                 f"file measured on {gpu.name} (meshplan bench gemm CONFIG --grid on one), or plan "
                                 f"{frag.gpu} ([cluster] gpu = \"{frag.gpu}\")")
    if measured.kernel_data(gpu.name) is None:
        raise ConfigError(field, f"{path}: {gpu.name} has no catalog kernel data (memory bandwidths, norm times) "
                                 f"to lay the file over; add a [gpu.{gpu.name}] entry to meshplan/catalog/kernels.toml")
    warn = [f"{field} {path} was measured on the CPU ({frag.source}): its rates describe that CPU, not the "
            f"config's GPU {gpu.name}, and the times below use them as given; measure on a {gpu.name} "
            f"(meshplan bench gemm CONFIG --grid there)"] if "CPU" in frag.source else []
    return KernelFile(path=str(path), source=frag.source, text=text), warn


def fragment_of(f: KernelFile) -> KernelFragment:
    """The parsed fragment of a file a GPU carries (read and checked by :func:`read_kernel_file`)."""
    return _parse_text(f.text, f.path)


def with_kernel_files(gpu: GPUSpec, paths, field: str = "--kernels") -> tuple[GPUSpec, list[str]]:
    """``gpu`` with the files of ``paths`` (:func:`read_kernel_file`) after the ones it carries;
    (the GPU, warning lines)."""
    files, warns = list(gpu.kernels), []
    for path in paths:
        f, w = read_kernel_file(path, gpu, field)
        files.append(f)
        warns += w
    return gpu.model_copy(update={"kernels": tuple(files)}), warns


def kernel_data(gpu: GPUSpec | str) -> Optional[KernelData]:
    """The kernel data a run times ``gpu`` with: the catalog's, with the GPU's ``kernels`` files
    laid over it in order (module docstring); a GPU name: the catalog's alone."""
    if isinstance(gpu, str) or not gpu.kernels:
        return measured.kernel_data(gpu if isinstance(gpu, str) else gpu.name)
    return overlaid(gpu.name, gpu.kernels)


@lru_cache(maxsize=64)
def overlaid(gpu_name: str, files: tuple[KernelFile, ...]) -> Optional[KernelData]:
    """The catalog's kernel data of ``gpu_name`` with ``files`` laid over it in order; a pure
    function of the texts (memoised: every kernel lookup of a run asks for it)."""
    data = measured.kernel_data(gpu_name)
    for f in files:
        if data is not None:
            data = with_fragment(data, _parse_text(f.text, f.path))
    return data


def kernels_line(gpu: GPUSpec, shapes: Optional[dict[str, int]] = None) -> str:
    """Which kernel data a run uses: ``kernels: catalog`` (meshplan/catalog/kernels.toml), or
    each laid-over file with its source line and, per GEMM dtype it replaces, how many points it
    has against the catalog's (:func:`_grid_words`; ``shapes``: the plan's distinct GEMM shapes
    per dtype, as step counts them), ``kernels: my.toml (meshplan bench gemm on ...; bf16: 1
    point for the plan's 12 bf16 GEMM shapes, in place of the catalog's 20)``."""
    if not gpu.kernels:
        return "kernels: catalog"
    return "kernels: " + "; ".join(f"{f.path} ({'; '.join([f.source] + _grid_words(f, gpu.name, shapes))})"
                                   for f in gpu.kernels)


def _grid_words(f: KernelFile, gpu_name: str, shapes: Optional[dict[str, int]]) -> list[str]:
    """Per GEMM dtype of ``f``: its points, the plan's shapes they time (interpolated,
    :func:`meshplan.compute.gemm_points.gemm_seconds`) where ``shapes`` has that dtype, and the
    catalog's points it replaces (newcomer trial 54 #14: one point timing 12 shapes unsaid)."""
    catalog = measured.kernel_data(gpu_name)
    out = []
    for dt, pts in fragment_of(f).gemm.items():
        words = f"{dt}: {len(pts)} point{'s' * (len(pts) != 1)}"
        if shapes and shapes.get(dt):
            words += f" for the plan's {shapes[dt]} {dt} GEMM shape{'s' * (shapes[dt] != 1)}"
        had = len(catalog.gemm.get(dt, ())) if catalog is not None else 0
        out.append(words + (f", in place of the catalog's {had}" if had else ", the catalog has none"))
    return out
