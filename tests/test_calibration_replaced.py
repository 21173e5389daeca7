"""Newcomer 25, item 3: ``step --calibration`` moved the step but named only the measured
bandwidth. Plan, step, search and compare now print, per calibrated link class, the catalog
figure it replaced (:func:`meshplan.comm.calibration_replaced.replaced_lines`, one home)."""

from __future__ import annotations

from meshplan.catalog import system
from meshplan.comm.calibration import CalibratedLink
from meshplan.comm.calibration_replaced import replaced_lines
from nccl_published import DATA
from tests.cli_run import run_cli
from tests.test_cli_json import H100X2

#: 2 x 8 H100 at 360 GB/s all-reduce busbw: 45 GB/s per NIC; dgx-h100's catalog NIC curve (S19) is
#: 376.0 GB/s at 8 GiB against 8 x 50 GB/s, 376 x 50 / 400 = 47.00 per NIC. 45.00 is the calibrated
#: fit (newcomer trial 27 #D: not called "measured"); the log's own busbw at 8 GiB (8589934592 B,
#: all_reduce_perf_2x8h100.txt) is 359.76 GB/s over the node's 8 NICs: 44.97 per NIC.
NIC_LINE = ("  nic all-reduce busbw 45.00 GB/s per NIC calibrated fit (logged 44.97 at 8.00 GiB = busbw 359.76 / 8 "
            "NICs), catalog 47.00 (ib-ndr-400-8nic at 8.00 GiB; line rate 50)")


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
        "  nvlink all-reduce busbw 340.00 GB/s calibrated fit, catalog 368.00 (h100-nvlink4-ring at 8.00 GiB; line rate 450)",
        "  pcie busbw 50.00 GB/s calibrated fit, catalog 63 (line rate; no measured curve in the catalog)"]
    mine = cluster.model_copy(update={"node": cluster.node.model_copy(update={"name": "my-node"})})
    assert replaced_lines({"pcie": calib["pcie"]}, mine) == [
        "  pcie busbw 50.00 GB/s calibrated fit, no catalog figure: node my-node is not a catalog node"]


def test_the_fit_is_not_called_measured_and_the_logged_value_is_beside_it():
    """Newcomer trial 27 #D: 4 dgx-a100 nodes, nccl-tests all-reduce over 32 ranks. The file's fit is
    163.32 GB/s a node over its 8 NICs = 20.42 per NIC (the alpha-beta line, not a logged number);
    the log's busbw at 4 GiB, the catalog curve's largest size, is 174.96 / 8 = 21.87 per NIC. The
    catalog's HDR 8-NIC curve: 188.18 GB/s at 4 GiB x 25 / 200 = 23.52 per NIC."""
    from meshplan.comm.calibration import LoggedCurve
    run = LoggedCurve(op="all-reduce", ranks=32, nodes=4, sizes_bytes=[2 ** 31, 2 ** 32, 2 ** 33],
                      busbw_gb_per_s=[174.34, 174.96, 176.39], source="all_reduce_4nodes.log")
    nic = CalibratedLink(latency_us=41.05, bandwidth_gb_per_s=20.42, op="all-reduce", ranks=32, points=62,
                         source="all_reduce_4nodes.log", curve=[run])
    assert replaced_lines({"nic": nic}, system("dgx-a100", nodes=4)) == [
        "  nic all-reduce busbw 20.42 GB/s per NIC calibrated fit (logged 21.87 at 4.00 GiB = busbw 174.96 / 8 NICs), "
        "catalog 23.52 (ib-hdr-200-8nic at 4.00 GiB; line rate 25)"]


def test_an_all_to_all_is_logged_per_nic_as_its_fit_is():
    """Newcomer trial 28 #B: ``34.66 GB/s per NIC ... (logged 8.07 at 4.00 GiB)`` put two quantities side by
    side (8.07 = 64.59 / 8 ranks per node; the fit's 34.66 is busbw x (16 - 8) / (16 - 1)). The logged
    value is now the fit's quantity, busbw per NIC: its 4 GiB row's busbw 64.59 GB/s x 8 / 15 = 34.448,
    said with its formula once; an all-to-all fit replaced no ring figure (catalog NDR 8-NIC curve:
    376.0 x 50 / 400 = 47.00 per NIC), which the ring ops keep."""
    from meshplan.comm.calibration import LoggedCurve
    run = LoggedCurve(op="all-to-all", ranks=16, nodes=2, sizes_bytes=[2 ** 31, 2 ** 32],
                      busbw_gb_per_s=[64.66, 64.59], source="alltoall_2node_fixed.log")
    nic = CalibratedLink(latency_us=37.74, bandwidth_gb_per_s=34.66, op="all-to-all", ranks=16, points=32,
                         source="alltoall_2node_fixed.log", curve=[run])
    assert replaced_lines({"nic": nic}, system("dgx-h100", nodes=64)) == [
        "  nic all-to-all busbw 34.66 GB/s per NIC calibrated fit (logged 34.45 at 4.00 GiB = busbw 64.59 x (16 - 8) "
        "/ (16 - 1), the share of a rank's bytes that leaves its host, through its own NIC), the ring ops keep the "
        "catalog's 47.00 (ib-ndr-400-8nic at 8.00 GiB; line rate 50)"]
    assert round(64.59 * 8 / 15, 2) == 34.45
