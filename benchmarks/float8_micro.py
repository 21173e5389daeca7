"""meshplan's float8 kernel model against torchao's float8 microbenchmark on H100: NOT the development
set, and not an end-to-end run (nothing here is fitted to torchtitan's rows or to
../shared/reference/published-runs-dev.md). A diagnostic of the float8 components alone.

Source (``benchmarks/float8_micro/torchao_readme_h100.toml``, every cell with its revision):
torchao's README "Performance" tables, the forward + backward GPU kernel time of a compiled
``LayerNorm -> Linear -> Sigmoid`` module (``benchmarks/float8/float8_roofline.py``,
``LNLinearSigmoid``), bf16 against float8, "speedup vs bfloat16" by the forward Linear's M, K, N:
the whole rowwise table (pytorch/ao fdddb2c, PyTorch 2.8.0a0+git48807d5, 216 cells, M, K, N 1024 to
32768) and two tensorwise cells the README's text quotes (e2dad4a, Sep 2024). The GPU is Meta's
96 GB HBM2e 500 W H100 (the toml says why), catalog ``h100-hbm2e-96gb-500w``; ``--gpu`` plans
another. One caveat on the module: since ao #1789 (March 2025) the script times a bare
``Linear`` unless ``--enable_fusion_modeling`` is passed, which the README's rowwise reproduction
line does not pass, while the figure's title says LayerNorm -> Linear -> Sigmoid; both are
planned (columns ``ln`` and ``bare``).

What is planned, per shape, with meshplan's own kernel model (GPU kernel time, as the profiler
sums it: no host issue floor):

- the three GEMMs (forward M x N over K, data gradient M x K over N, weight gradient N x K over M)
  at :func:`meshplan.compute.gemm.gemm_time` (the catalog's points, bf16 or fp8);
- LayerNorm (no affine) forward, read and write M x K (4 B an element), and backward, read the
  gradient and the input and write the input's gradient (6 B), as the catalog's fused norm
  (:func:`meshplan.compute.measured.memory_seconds` kind "norm": fitted fixed time + bytes);
- sigmoid forward (read and write M x N, 4 B) and backward (read the gradient and the saved
  output, write, 6 B) at the streaming bandwidth; the same on both sides (compile fuses nothing
  else: each is one kernel, no GEMM epilogue fusion by default);
- float8 only: the casts of :mod:`meshplan.compute.float8` for the recipe, compiled
  (:func:`~meshplan.compute.float8.activation_kernels` of the input M x K and of the output
  gradient M x N, :func:`~meshplan.compute.float8.weight_kernels` of the K x N weight, not
  gathered in float8, and rowwise's :func:`~meshplan.compute.float8.rescale_kernels`); the bare
  Linear's rowwise data-gradient rescale is a kernel of its own (M x K, read and write 2 B: the
  compiled backward's output, no consumer to fuse into).

Rows: published and predicted speedups, error = predicted / published - 1; then the mean error by
N and by recipe. ``--shape M K N [--recipe R]`` lists one shape's kernels on both sides.
"""

from __future__ import annotations

import argparse
import statistics
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from meshplan import catalog
from meshplan.compute import float8
from meshplan.compute.gemm import gemm_time
from meshplan.compute.kernel_fragment import kernel_data
from meshplan.compute.kernel_time import no_fast_accum_factor
from meshplan.compute.measured import memory_seconds
from meshplan.compute.ops import PHASES, Workload

TABLE = Path(__file__).resolve().parent / "float8_micro" / "torchao_readme_h100.toml"
GPU = "h100-hbm2e-96gb-500w"
B = 2  # bf16 bytes an element
#: A torch float8 Linear's workload, for :func:`no_fast_accum_factor` (torchao's GEMM settings).
W = Workload(seq_len=1, micro_batch=1, linear_dtype="fp8", float8_gemms=frozenset({"w"}))
#: ``--derive``: the cells whose GEMMs dominate the planned float8 time (M, K, N all at least this).
LARGE = 8192


@dataclass(frozen=True)
class Cell:
    """One published cell: forward M, K, N, recipe, bf16 time / float8 time."""

    m: int
    k: int
    n: int
    recipe: str
    speedup: float


def cells(path: Path = TABLE) -> list[Cell]:
    """The published cells of ``path``: the rowwise table's rows x its N, then the tensorwise cells."""
    t = tomllib.loads(path.read_text())
    out = [Cell(r[0], r[1], n, "rowwise", v) for r in t["rowwise"]["rows"] for n, v in zip(t["rowwise"]["n"], r[2:])]
    return out + [Cell(m, k, n, "tensorwise", v) for m, k, n, v in t["tensorwise"]["cells"]]


def gemm_kernels(gpu, m: int, k: int, n: int, dtype: str, slow: Optional[float] = None) -> list[tuple[str, float]]:
    """(name, seconds) of a Linear's three GEMMs, (M, N, K) as :func:`gemm_time` takes them; the
    two backward ones x :func:`~meshplan.compute.kernel_time.no_fast_accum_factor` (torchao runs
    them without fast accumulation), or x ``slow`` when given (``--derive`` plans them at 1)."""
    shapes = {"forward": (m, n, k), "data gradient": (m, k, n), "weight gradient": (n, k, m)}
    out = []
    for (name, (a, b, c)), phase in zip(shapes.items(), PHASES):
        e = gemm_time(gpu, a, b, c, dtype)
        f = slow if slow is not None and phase != "forward" and dtype == "fp8" else \
            no_fast_accum_factor(gpu, dtype, phase, W, e.source)
        out.append((f"{name} {dtype} GEMM {a}x{b}x{c}" + (f" x{f:g}" if f != 1.0 else ""), e.seconds * f))
    return out


def module_kernels(data, m: int, k: int, n: int, ln: bool) -> list[tuple[str, float]]:
    """(name, seconds) of the LayerNorm and the sigmoid, forward and backward (none for a bare Linear)."""
    if not ln:
        return []
    return [("layernorm forward", memory_seconds(data, 2 * B * m * k, "norm")),
            ("layernorm backward", memory_seconds(data, 3 * B * m * k, "norm")),
            ("sigmoid forward", memory_seconds(data, 2 * B * m * n)),
            ("sigmoid backward", memory_seconds(data, 3 * B * m * n))]


def float8_kernels(data, m: int, k: int, n: int, recipe: str, ln: bool) -> list[tuple[str, float]]:
    """(name, seconds) of the casts torchao adds for ``recipe``, compiled (module docstring)."""
    rowwise = recipe == "rowwise"
    out = []
    for what, elements in (("input", m * k), ("output grad", m * n)):
        out += [(f"{what} {name}", memory_seconds(data, nb * elements))
                for name, nb in float8.activation_kernels(rowwise, False, B, False)]
    out += [(f"weight {name}", memory_seconds(data, nb * k * n))
            for name, _, nb in float8.weight_kernels(rowwise, False, B, False)]
    out += [(f"{which} rescale", memory_seconds(data, nb * rows * k))
            for which, _, nb, rows in float8.rescale_kernels(rowwise, False, B, m, n)]
    if rowwise and not ln:
        out.append(("dgrad rescale (bare Linear: a graph output)", memory_seconds(data, 2 * B * m * k)))
    return out


def sides(gpu_name: str, c: Cell, ln: bool, slow: Optional[float] = None) -> tuple[list, list]:
    """(bf16 kernels, float8 kernels) of cell ``c``'s module on ``gpu_name``, (name, seconds) each."""
    gpu = catalog.gpu(gpu_name)
    data = kernel_data(gpu)
    common = module_kernels(data, c.m, c.k, c.n, ln)
    bf16 = common + gemm_kernels(gpu, c.m, c.k, c.n, "bf16")
    fp8 = common + gemm_kernels(gpu, c.m, c.k, c.n, "fp8", slow) + float8_kernels(data, c.m, c.k, c.n, c.recipe, ln)
    return bf16, fp8


def predicted(gpu_name: str, c: Cell, ln: bool = True) -> float:
    """Predicted speedup of cell ``c``: bf16 kernel seconds / float8 kernel seconds."""
    bf16, fp8 = sides(gpu_name, c, ln)
    return sum(t for _, t in bf16) / sum(t for _, t in fp8)


def implied_factor(gpu_name: str, c: Cell, ln: bool = True) -> tuple[float, float]:
    """(factor, GEMM share): the factor on the two backward fp8 GEMMs (planned at 1) that makes
    the planned float8 time the published one (planned bf16 time / published speedup), all else
    as planned; and the GEMMs' share of the planned float8 time."""
    bf16, fp8 = sides(gpu_name, c, ln, slow=1.0)
    backward = sum(t for name, t in fp8 if "gradient fp8 GEMM" in name)
    gemms = sum(t for name, t in fp8 if "GEMM" in name)
    total = sum(t for _, t in fp8)
    return 1.0 + (sum(t for _, t in bf16) / c.speedup - total) / backward, gemms / total


def derive(gpu_name: str, table: list[Cell]) -> list[str]:
    """The derivation of kernels.toml ``fp8_no_fast_accum_slowdown``: :func:`implied_factor` over
    the rowwise cells with M, K, N all at least :data:`LARGE`, their median; the tensorwise cells beside."""
    out, large = [], []
    for c in table:
        f, share = implied_factor(gpu_name, c)
        if c.recipe == "rowwise" and min(c.m, c.k, c.n) >= LARGE:
            large.append((f, share))
        if c.recipe == "tensorwise" or min(c.m, c.k, c.n) >= LARGE:
            out.append(f"{c.recipe} {c.m}x{c.k}x{c.n}: published {c.speedup:.2f}, backward factor {f:.3f}, "
                       f"GEMMs {share:.0%} of the planned float8 time")
    fs = [f for f, _ in large]
    out.append(f"rowwise, M, K, N >= {LARGE} ({len(fs)} cells): median {statistics.median(fs):.3f} "
               f"({min(fs):.3f}-{max(fs):.3f}), GEMMs {min(s for _, s in large):.0%}-{max(s for _, s in large):.0%}")
    return out


def rows(gpu_name: str, table: list[Cell]) -> list[str]:
    """The per-cell markdown table."""
    out = ["| recipe | M | K | N | published | predicted (ln) | error | predicted (bare) | error |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for c in table:
        p, q = predicted(gpu_name, c, True), predicted(gpu_name, c, False)
        out.append(f"| {c.recipe} | {c.m} | {c.k} | {c.n} | {c.speedup:.2f} | {p:.2f} | {p / c.speedup - 1:+.1%} "
                   f"| {q:.2f} | {q / c.speedup - 1:+.1%} |")
    return out


def summary(gpu_name: str, table: list[Cell]) -> list[str]:
    """Mean error (signed and absolute) by recipe and, for rowwise, by N: the column the error follows."""
    out = []
    groups = [(f"rowwise N {n}", [c for c in table if c.recipe == "rowwise" and c.n == n])
              for n in sorted({c.n for c in table if c.recipe == "rowwise"})]
    groups += [(r, [c for c in table if c.recipe == r]) for r in ("rowwise", "tensorwise")]
    for name, group in groups:
        for ln in (True, False):
            e = [predicted(gpu_name, c, ln) / c.speedup - 1 for c in group]
            out.append(f"{name} ({'ln' if ln else 'bare'}, {len(e)} cells): mean error {statistics.mean(e):+.1%}, "
                       f"mean |error| {statistics.mean(abs(x) for x in e):.1%}")
    return out


def breakdown(gpu_name: str, c: Cell, ln: bool) -> list[str]:
    """One shape's kernels, bf16 side then float8 side, in microseconds."""
    out = []
    for side, ks in zip(("bf16", "float8"), sides(gpu_name, c, ln)):
        out += [f"{side}: {name}: {t * 1e6:.1f} us" for name, t in ks]
        out.append(f"{side}: total {sum(t for _, t in ks) * 1e6:.1f} us")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu", default=GPU, help=f"catalog GPU to plan on (default {GPU})")
    ap.add_argument("--shape", nargs=3, type=int, metavar=("M", "K", "N"), help="list one shape's kernels")
    ap.add_argument("--recipe", default="rowwise", choices=("rowwise", "tensorwise"))
    ap.add_argument("--bare", action="store_true", help="with --shape: a bare Linear, no LayerNorm or sigmoid")
    ap.add_argument("--derive", action="store_true", help="derive kernels.toml fp8_no_fast_accum_slowdown")
    a = ap.parse_args()
    if a.derive:
        print("\n".join(derive(a.gpu, cells())))
        return
    if a.shape:
        print("\n".join(breakdown(a.gpu, Cell(*a.shape, a.recipe, 0.0), not a.bare)))
        return
    table = cells()
    print(f"torchao float8 microbenchmark (H100, compiled LayerNorm -> Linear -> Sigmoid) planned on {a.gpu}")
    print("\n".join(rows(a.gpu, table) + summary(a.gpu, table)))


if __name__ == "__main__":
    main()
