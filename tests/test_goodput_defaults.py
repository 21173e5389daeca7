"""The search's goodput column uses default storage bandwidths and restart overhead where
``[search]`` gives none (newcomer trial 12, item 3): the line under the table names each
default's value, its source (the Llama 3 paper's 2 TB/s) or that it is an assumption (600 s),
and the field that sets it. ``meshplan reliability`` has no default: its options are required."""

import re

import pytest

from meshplan.cli import main
from meshplan.spec.search import ASSUMED_RESTART_OVERHEAD_S, LLAMA3_STORAGE_GB_PER_S, SearchOptions
from tests.configs import job_toml

#: One candidate: Llama-3-8B, dp_shard 4 x tp 2 on one DGX H100 (the mini example's mesh).
TINY = job_toml(training={"global_batch": 64, "seq_len": 8192, "micro_batch": 1, "recompute": "none"},
                search={"pp": [1], "dp_replicate": [1], "cp": [1], "tp": [2], "micro_batch": [1],
                        "sharding": ["zero3"], "recompute": ["none"], "reshard_after_forward": [True]})

DEFAULTS = ("goodput (Daly, printed, not ranked): checkpoint write/read 2000/2000 GB/s (default: the Llama 3 paper's "
            "sustained storage throughput, 2 TB/s (arXiv 2407.21783, 3.3.1); set [search] checkpoint_write_gb_per_s, "
            "checkpoint_read_gb_per_s), restart overhead 600 s (default: an assumption, no published figure; set "
            "[search] restart_overhead_s)")


def _search(tmp_path, capsys, extra: str = "") -> str:
    (tmp_path / "t.toml").write_text(TINY + extra)
    with pytest.raises(SystemExit) as done:
        main(["search", str(tmp_path / "t.toml")])
    assert (done.value.code or 0) == 0
    return " ".join(re.sub("[│┃]", " ", capsys.readouterr().out).split())  # rich wraps long lines and cells


def _goodput(out: str) -> str:
    """The goodput cell of the top row (the one before the GEMM efficiency)."""
    return re.search(r" 1 dp_shard 4 x tp 2 .* (\d+\.\d+%) \d+\.\d% ", out).group(1)


def test_the_defaults_are_the_sources_figures():
    """2 TB/s sustained (Llama 3, 3.3.1) = 2000 GB/s; the restart overhead 600 s, assumed."""
    assert LLAMA3_STORAGE_GB_PER_S == 2e12 / 1e9 and ASSUMED_RESTART_OVERHEAD_S == 600
    o = SearchOptions()
    assert (o.checkpoint_write_gb_per_s, o.checkpoint_read_gb_per_s, o.restart_overhead_s) == (2000, 2000, 600)


def test_search_names_each_default_its_source_and_field(tmp_path, capsys):
    out = _search(tmp_path, capsys)
    assert DEFAULTS in out
    default_goodput = _goodput(out)
    # the same values given: the same goodput, and the line names no default
    given = _search(tmp_path, capsys, "checkpoint_write_gb_per_s = 2000.0\ncheckpoint_read_gb_per_s = 2000.0\n"
                                      "restart_overhead_s = 600.0\n")
    assert ("goodput (Daly, printed, not ranked): checkpoint write/read 2000/2000 GB/s, restart overhead 600 s "
            "([search] fields) ") in given and "default" not in given.split("goodput (Daly")[1].split(" the top")[0]
    assert _goodput(given) == default_goodput
    # a slower store checkpoints less often and loses more: the column moves, the read default is named
    slow = _search(tmp_path, capsys, "checkpoint_write_gb_per_s = 0.5\n")
    assert ("checkpoint write/read 0.5/2000 GB/s (read default: the Llama 3 paper's sustained storage throughput, "
            "2 TB/s (arXiv 2407.21783, 3.3.1); set [search] checkpoint_read_gb_per_s), restart overhead 600 s "
            "(default: an assumption") in slow
    assert float(_goodput(slow)[:-1]) < float(default_goodput[:-1])
