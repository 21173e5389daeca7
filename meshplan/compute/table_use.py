"""What a measured table (``step --gemm-table``, :class:`meshplan.compute.gemm.GemmTable`) did
to a step: how many of the plan's distinct GEMM shapes (and fused-attention calls) it timed,
and where the others came from.

A table is looked up by exact key, ``(M, N, K, dtype)`` for a GEMM
(:func:`meshplan.compute.gemm.gemm_time`), the attention key for fused attention
(:func:`meshplan.compute.attention.flash_ops`); it is never interpolated. The other shapes
take :func:`~meshplan.compute.gemm.gemm_time`'s next source: the catalog's measured points
for the GPU and dtype, interpolated (``catalog``), else the shape model (``model``). A
``bench gemm --grid`` file given as ``--kernels`` is the measured data that is interpolated.

The keys come from the step's own ops (:attr:`meshplan.compute.ops.Op.table_key`), so the
count is what the step looked up, async TP pieces and fused QKV included.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Iterable

from meshplan.compute.gemm import GemmTable, gemm_time
from meshplan.compute.ops import Op
from meshplan.compute.rate_check import table_rates
from meshplan.spec.cluster import GPUSpec
from meshplan.units import counted


@dataclass(frozen=True)
class TableUse:
    """``gemm_shapes``: the plan's distinct GEMM keys (M, N, K, dtype), sorted; ``matched``:
    how many the table holds; ``sources``: (source, count) of the others ("catalog" or
    "model"); ``attention_calls`` / ``attention_matched``: distinct fused-attention keys of the
    plan and how many the table holds; the table's ``path``, GEMM ``rows``, ``attention_rows``,
    ``dtypes``, ``devices`` (of its GEMM rows, with torch versions) and ``shapes`` (M, N, K);
    ``rate_warnings``: its rows' rates against the GPU's peak
    (:func:`meshplan.compute.rate_check.table_rates`)."""

    path: str
    rows: int
    attention_rows: int
    dtypes: tuple[str, ...]
    devices: tuple[str, ...]
    gemm_shapes: tuple[tuple, ...]
    matched: int
    sources: tuple[tuple[str, int], ...]
    attention_calls: int
    attention_matched: int
    shapes: tuple[tuple[int, int, int], ...] = ()
    rate_warnings: tuple[str, ...] = ()


def table_use(ops: Iterable[Op], table: GemmTable, gpu: GPUSpec) -> TableUse:
    """:class:`TableUse` of ``table`` for the step whose compute is ``ops`` on ``gpu``. Raises
    ConfigError naming a row faster than the GPU's GEMM ceiling
    (:func:`~meshplan.compute.rate_check.table_rates`).

    >>> from meshplan import catalog
    >>> from meshplan.compute.gemm import GemmTable, Measurement
    >>> row = Measurement(8192, 1024, 4096, "fp32", 0.7, "cpu (1 thread)", "2.13.0+cpu")
    >>> t = GemmTable({(8192, 1024, 4096, "fp32"): row}, "mini.csv")
    >>> ops = [Op("wq", "attn", "forward", "gemm", 1e-4, table_key=(8192, 1024, 4096, "bf16"))]
    >>> u = table_use(ops, t, catalog.gpu("h100-sxm5-80gb"))
    >>> u.matched, u.sources, u.dtypes
    (0, (('catalog', 1),), ('fp32',))
    """
    gemms = sorted({o.table_key for o in ops if o.kind == "gemm" and o.table_key})
    attention = {o.table_key for o in ops if o.kind == "attention" and o.table_key}
    hit = [g for g in gemms if table.lookup(*g) is not None]
    rest = Counter(gemm_time(gpu, m, n, k, dtype).source for m, n, k, dtype in gemms if (m, n, k, dtype) not in hit)
    rows = list(table.entries.values())
    rates = tuple(table_rates([table.lookup(*g) for g in hit], gpu, f"--gemm-table {table.path}"))
    return TableUse(table.path, len(rows), len(table.attention), tuple(sorted({r.dtype for r in rows})),
                    tuple(sorted({f"{r.device}, torch {r.torch}" for r in rows})), tuple(gemms), len(hit),
                    tuple(sorted(rest.items())), len(attention), len(attention & set(table.attention)),
                    tuple(sorted({(r.m, r.n, r.k) for r in rows})), rates)


def gemm_shapes(ops: Iterable[Op]) -> dict[str, int]:
    """The distinct GEMM keys (M, N, K, dtype) of ``ops`` counted per dtype: the shapes a step
    looks up in a table or interpolates from a kernels file's points.

    >>> gemm_shapes([Op("wq", "attn", "forward", "gemm", 1e-4, table_key=(8, 8, 8, "bf16"))] * 2)
    {'bf16': 1}
    """
    return dict(Counter(key[3] for key in {o.table_key for o in ops if o.kind == "gemm" and o.table_key}))


def _others(u: TableUse, gpu: GPUSpec) -> str:
    words = {"catalog": f"the catalog's {gpu.name} points, interpolated", "model": "the shape model"}
    return ", ".join(f"{n} from {words.get(s, s)}" for s, n in u.sources)


def use_line(u: TableUse, gpu: GPUSpec) -> str:
    """The ``gemm table:`` line: the table, what it holds, and how many of the plan's GEMM
    shapes (and attention calls) it timed, the others' source.

    >>> u = TableUse("mini.csv", 14, 0, ("bf16",), ("cpu (1 thread), torch 2.13.0+cpu",),
    ...              ((1, 1, 1, "bf16"),) * 16, 14, (("catalog", 2),), 1, 0)
    >>> from meshplan import catalog
    >>> print(use_line(u, catalog.gpu("h100-sxm5-80gb")))  # doctest: +NORMALIZE_WHITESPACE
    gemm table: mini.csv (14 GEMM rows, bf16, measured on cpu (1 thread), torch 2.13.0+cpu): 14 of the
    plan's 16 GEMM shapes (bf16) timed from it (exact shape and dtype; a table is not interpolated),
    2 from the catalog's h100-sxm5-80gb points, interpolated
    """
    held = f"{counted(u.rows, 'GEMM row')}" + (f", {'/'.join(u.dtypes)}" if u.dtypes else "")
    if u.attention_rows:
        held += f", {counted(u.attention_rows, 'attention row')}"
    on = f", measured on {'; '.join(u.devices)}" if u.devices else ""
    plan_dtypes = "/".join(sorted({g[3] for g in u.gemm_shapes}))
    line = (f"gemm table: {u.path} ({held}{on}): {u.matched} of the plan's {len(u.gemm_shapes)} GEMM shapes "
            f"({plan_dtypes}) timed from it (exact shape and dtype; a table is not interpolated)")
    if u.sources:
        line += f", {_others(u, gpu)}"
    if u.attention_rows:
        line += f"; attention: {u.attention_matched} of the plan's {counted(u.attention_calls, 'call')} from it"
    return line


def use_warnings(u: TableUse, gpu: GPUSpec) -> list[str]:
    """``warning:`` texts (without the prefix) for a table that times none of the plan's
    GEMMs (with why: another dtype, or other shapes), for one measured on a CPU, and for one
    whose device name does not carry the plan's GPU model (:func:`_model`), after its rows' rate
    warnings (``u.rate_warnings``)."""
    out = list(u.rate_warnings)
    if u.rows and not u.matched:
        plan_dtypes = sorted({g[3] for g in u.gemm_shapes})
        why = [f"it holds {'/'.join(u.dtypes)} rows and the plan's GEMMs run in {'/'.join(plan_dtypes)}"] * (
            not set(u.dtypes) & set(plan_dtypes))
        why += ["its shapes are not this mesh's"] * (not set(u.shapes) & {g[:3] for g in u.gemm_shapes})
        out.append(f"--gemm-table {u.path} times none of the plan's {len(u.gemm_shapes)} GEMM shapes "
                   f"({'; '.join(why) or 'no row has both a shape and the dtype of the plan'}), so the step is the "
                   f"catalog's; write it for this config on the plan's GPU ({gpu.name}) with `meshplan bench gemm "
                   f"CONFIG --dtype {plan_dtypes[0] if plan_dtypes else 'bf16'}`, or give a `bench gemm --grid` file "
                   f"as --kernels, whose points are interpolated to any shape")
    if u.attention_rows and not u.attention_matched:
        out.append(f"--gemm-table {u.path}: its {counted(u.attention_rows, 'attention row')} "
                   f"match{'es' if u.attention_rows == 1 else ''} none of the plan's "
                   f"{counted(u.attention_calls, 'attention call')} (batch, heads, sequence, head_dim and dtype must "
                   f"all match), so attention is the catalog's; write it with `meshplan bench attention CONFIG`")
    if u.matched and any(d.startswith("cpu") for d in u.devices):
        out.append(f"--gemm-table {u.path} was measured on the CPU, not on the plan's {gpu.name}: its {u.matched} "
                   f"GEMM shapes time that CPU's compute in this step; run `meshplan bench gemm CONFIG` on the GPU")
    elif u.matched and u.devices and not any(_model(gpu) in d.lower() for d in u.devices):
        out.append(f"--gemm-table {u.path} was measured on {'; '.join(u.devices)}, which is not named as the "
                   f"plan's {gpu.name} ({_model(gpu)}): its {u.matched} GEMM shapes time that device in this step; "
                   f"run `meshplan bench gemm CONFIG` on the plan's GPU")
    return out


def _model(gpu: GPUSpec) -> str:
    """The GPU model as a device name carries it: the catalog id's first word (``h100`` of
    ``h100-sxm5-80gb``; torch's ``NVIDIA H100 80GB HBM3``, ``AMD Instinct MI300X``)."""
    return gpu.name.split("-")[0].lower()


def as_json(u: TableUse, gpu: GPUSpec) -> dict:
    """``--json``'s ``kernels.gemm_table``: the counts of :class:`TableUse`, its line and warnings."""
    return {"path": u.path, "rows": u.rows, "attention_rows": u.attention_rows, "dtypes": list(u.dtypes),
            "devices": list(u.devices), "plan_gemm_shapes": len(u.gemm_shapes), "matched": u.matched,
            "others": {s: n for s, n in u.sources}, "attention_calls": u.attention_calls,
            "attention_matched": u.attention_matched, "line": use_line(u, gpu), "warnings": use_warnings(u, gpu)}
