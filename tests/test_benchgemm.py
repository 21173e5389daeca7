"""meshplan bench gemm writes a table the compute model reads back (issue 5 item 6)."""

import pytest

pytest.importorskip("torch")

from meshplan.errors import ConfigError  # noqa: E402
from meshplan.compute.gemm import gemm_time, load_gemm_table  # noqa: E402
from meshplan.runtime.bench.gemm import bench, write_table  # noqa: E402
from meshplan.compute.shapes import Gemm  # noqa: E402


def test_table_round_trip_and_override(tmp_path):
    from meshplan import catalog
    rows = bench([Gemm("wq", 64, 32, 48)], dtype="fp32", warmup=1, repeats=3)
    # forward plus its two backward shapes
    assert sorted((r.gemm.m, r.gemm.n, r.gemm.k) for r in rows) == [(32, 48, 64), (64, 32, 48), (64, 48, 32)]
    assert all(r.seconds > 0 for r in rows)
    path = write_table(rows, tmp_path / "gemm.csv")
    table = load_gemm_table(path)
    assert len(table) == 3
    est = gemm_time(catalog.gpu("h100-sxm5-80gb"), 64, 32, 48, "fp32", table=table)
    assert est.source == "measured"
    assert est.seconds == pytest.approx(next(r.seconds for r in rows if (r.gemm.m, r.gemm.n) == (64, 32)), rel=1e-6)
    with pytest.raises(ConfigError, match="exists"):
        write_table(rows, path)


def test_scaled_down_shape_scales_time_back():
    rows = bench([Gemm("big", 4096, 64, 64)], max_elements=64 * 256, backward=False, warmup=1, repeats=3)
    assert rows[0].scaled_m == 256 and rows[0].gemm.m == 4096
