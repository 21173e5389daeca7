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

:func:`load_fragment` reads it (a malformed file is one :class:`ConfigError` line naming the
field); :func:`with_fragment` lays it over a GPU's :class:`~meshplan.compute.measured.KernelData`:
its GEMM dtypes replace the catalog's points of those dtypes, its attention rows go first (its
``prefer`` list before the catalog's).
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, replace
from pathlib import Path

from meshplan.compute.measured import AttentionRow, KernelData, attention_row
from meshplan.errors import ConfigError


@dataclass(frozen=True)
class KernelFragment:
    """One GPU's measured GEMM points (dtype -> ((M, N, K, TFLOP/s, source key), ...)) and
    attention rows from a kernels.toml-form file."""

    gpu: str
    gemm: dict[str, tuple[tuple, ...]]
    attention: tuple[AttentionRow, ...]
    prefer: tuple[str, ...]
    source: str


def _gemm_points(field: str, pts) -> tuple[tuple, ...]:
    out = []
    for i, p in enumerate(pts if isinstance(pts, list) else [None]):
        ok = (isinstance(p, list) and len(p) == 5 and all(isinstance(x, int) and x > 0 for x in p[:3])
              and isinstance(p[3], (int, float)) and p[3] > 0 and isinstance(p[4], str))
        if not ok:
            raise ConfigError(f"{field}[{i}]", f"{p!r}; write [M, N, K, TFLOP/s, \"source key\"] with positive numbers")
        out.append((p[0], p[1], p[2], float(p[3]), p[4]))
    if not out:
        raise ConfigError(field, "no points; give at least one [M, N, K, TFLOP/s, \"source key\"]")
    return tuple(out)


def parse_fragment(doc: dict, where: str = "kernels file") -> KernelFragment:
    """A parsed kernels.toml-form document with exactly one ``[gpu.<id>]`` table."""
    gpus = doc.get("gpu")
    if not isinstance(gpus, dict) or len(gpus) != 1:
        raise ConfigError(f"{where}: [gpu]", "expected exactly one [gpu.<id>] table (the kernels.toml schema)")
    (gpu, raw), = gpus.items()
    base = f"gpu.{gpu}"
    if not isinstance(raw, dict) or not isinstance(raw.get("source"), str):
        raise ConfigError(f"{base}.source", "missing; say where the numbers were measured")
    gemm_raw = raw.get("gemm", {})
    gemm = {dt: _gemm_points(f"{base}.gemm.{dt}", v) for dt, v in gemm_raw.items()}
    att = raw.get("attention", {})
    rows = []
    for i, r in enumerate(att.get("rows", [])):
        try:
            row = attention_row(r)
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"{base}.attention.rows[{i}]", f"{e}; give kernel, pass, mask, head_dim, seq, tflops, "
                                                            "source (dtype optional, bf16)") from None
        if len(row.seq) != len(row.tflops) or not row.seq:
            raise ConfigError(f"{base}.attention.rows[{i}]", "seq and tflops differ in length; one rate per length")
        rows.append(row)
    if not gemm and not rows:
        raise ConfigError(base, "neither gemm points nor attention rows; nothing to read")
    prefer = tuple(att.get("prefer", sorted({r.kernel for r in rows})))
    return KernelFragment(gpu, gemm, tuple(rows), prefer, raw["source"])


def load_fragment(path: str | Path) -> KernelFragment:
    """Read a kernels.toml-form file (module docstring)."""
    try:
        doc = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError(str(path), f"cannot read ({e.strerror}); give a kernels TOML file") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(str(path), f"not TOML ({e}); give a file written by `meshplan bench --grid`") from None
    return parse_fragment(doc, str(path))


def with_fragment(data: KernelData, frag: KernelFragment) -> KernelData:
    """``data`` with ``frag`` laid over it: the fragment's GEMM dtypes replace those dtypes'
    points; its attention rows come before the catalog's, its ``prefer`` first."""
    return replace(data, gemm={**data.gemm, **frag.gemm}, attention=frag.attention + data.attention,
                   prefer=tuple(dict.fromkeys(frag.prefer + data.prefer)),
                   source=f"{data.source}; overlaid by {frag.source}")
