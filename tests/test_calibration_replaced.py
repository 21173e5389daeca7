"""Newcomer 25, item 3: ``step --calibration`` moved the step but named only the measured
bandwidth. Plan, step, search and compare now print, per calibrated link class, the catalog
figure it replaced (:func:`meshplan.comm.calibration_notes.replaced_lines`, one home)."""

from __future__ import annotations

from meshplan.catalog import system
from meshplan.comm.calibration import CalibratedLink
from meshplan.comm.calibration_notes import replaced_lines
from nccl_published import DATA
from tests.cli_run import run_cli
from tests.test_cli_json import H100X2

#: 2 x 8 H100 at 360 GB/s all-reduce busbw: 45 GB/s per NIC; dgx-h100's catalog NIC curve (S19) is
#: 376.0 GB/s at 8 GiB against 8 x 50 GB/s, 376 x 50 / 400 = 47.00 per NIC
NIC_LINE = "  nic all-reduce busbw 45.00 GB/s per NIC measured, catalog 47.00 (ib-ndr-400-8nic at 8.00 GiB; line rate 50)"


def test_step_names_the_catalog_figure_the_fit_replaced(tmp_path, capsys):
    cal, cfg = tmp_path / "c.toml", tmp_path / "h100x2.toml"
    cfg.write_text(H100X2)
    rc, _, err = run_cli(["calibrate", DATA / "all_reduce_perf_2x8h100.txt", "--link", "nic", "--out", cal], capsys)
    assert rc == 0, err
    for command in (["step", cfg], ["plan", cfg]):
        rc, text, err = run_cli([*command, "--calibration", cal], capsys)
        assert rc == 0, err
        assert text.splitlines()[0].endswith("nic 45 GB/s") and NIC_LINE in text.splitlines()


def test_each_class_against_its_own_catalog_figure():
    """NVLink against the catalog ring curve's 368.0 GB/s at 8 GiB (h100-nvlink4-ring, line 450);
    PCIe, with no catalog curve, against its 63 GB/s line rate; a node not in the catalog says so."""
    calib = {"nvlink": CalibratedLink(latency_us=10, bandwidth_gb_per_s=340.0, op="all-reduce", ranks=8, source="a"),
             "pcie": CalibratedLink(latency_us=10, bandwidth_gb_per_s=50.0, source="b")}
    cluster = system("dgx-h100", nodes=1)
    assert replaced_lines(calib, cluster) == [
        "  nvlink all-reduce busbw 340.00 GB/s measured, catalog 368.00 (h100-nvlink4-ring at 8.00 GiB; line rate 450)",
        "  pcie busbw 50.00 GB/s measured, catalog 63 (line rate; no measured curve in the catalog)"]
    mine = cluster.model_copy(update={"node": cluster.node.model_copy(update={"name": "my-node"})})
    assert replaced_lines({"pcie": calib["pcie"]}, mine) == [
        "  pcie busbw 50.00 GB/s measured, no catalog figure: node my-node is not a catalog node"]
