"""An unknown node or GPU name is guessed only as an entry holding the same GPU
(meshplan/catalog/unknown.py). ``dgx-h20`` is no typo of ``dgx-h200``: the NVIDIA H20 is another
GPU (Hopper, 96 GB HBM3, compute cut for export to China), so the error names the field, says
what the H20 is, names no node as its spelling, lists the nodes with their GPUs and how to
describe one inline in [cluster] (README, "Input"). A memory or form factor none holds
(``a100-24gb``: the catalog's A100s have 40 and 80 GB) is another GPU too; a memory spelled
``40g`` or ``40G`` is read as 40 GB, so ``dgx-a100-40g`` is guessed as the 40 GB node and
``dgx-a100-80g`` as the 80 GB one; a typo of the same GPU (``dgx-h10O``, an O for a 0) is still
guessed."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshplan import catalog
from meshplan.errors import ConfigError
from tests.cli_run import run_main

TT = Path(__file__).resolve().parents[1] / "examples" / "torchtitan_llama3-8b_8xh100.toml"
NODES = ", ".join(catalog.names("node"))
NODE_GPUS = ("dgx-a100 (a100-sxm-80gb), dgx-a100-40gb (a100-sxm-40gb), dgx-b200 (b200-sxm-180gb), dgx-h100 (h100-sxm5-80gb), dgx-h200 "
             "(h200-sxm-141gb), gb200-nvl72-tray (b200-gb200-186gb), grand-teton-h100 (h100-hbm2e-96gb-500w), "
             "hgx-h800 (h800-sxm-80gb), mi300x-azure-nd-v5 (mi300x-oam-192gb), seed-8x8-2nic (h100-sxm5-80gb)")
HOW = ("describe yours in the config: [cluster] gpu = {...} and node = {...}, or a catalog system with gpu = {...} "
       "and fabric = {...} (docs/input.md)")
H20 = "NVIDIA H20: Hopper, 96 GB HBM3, compute cut for export to China"


def _message(kind: str, name: str) -> str:
    with pytest.raises(ConfigError) as e:
        catalog.entry(kind, name)
    return e.value.message


def test_dgx_h20_is_not_guessed_as_dgx_h200(capsys):
    assert run_main("plan", TT, "--cluster", "dgx-h20", "--nodes", "1") == 2
    assert capsys.readouterr().err == (
        f"error: --cluster: unknown node 'dgx-h20'; no catalog node holds GPU 'h20' ({H20}; 'dgx-h200' is another "
        f"GPU, not a spelling of it); known: {NODE_GPUS}; {HOW}; or give a TOML file whose [cluster] writes the "
        "node inline (--cluster node.toml)\n")  # the inline route, since nc52fixC (newcomer trial 52 #16)


@pytest.mark.parametrize("typed,nearest", [("h20", "dgx-h200"), ("hgx-h20", "hgx-h800")])
def test_other_h20_names_are_not_guessed(typed, nearest):
    # the nearest name (difflib) is named as another GPU: hgx-h20 is one letter closer to hgx-h800
    assert _message("node", typed) == (f"unknown node '{typed}'; no catalog node holds GPU 'h20' ({H20}; "
                                       f"'{nearest}' is another GPU, not a spelling of it); known: {NODE_GPUS}; {HOW}")


def test_an_h20_gpu_is_not_guessed_as_h200():
    assert _message("gpu", "h20") == (
        f"unknown gpu 'h20'; no catalog GPU is an 'h20' ({H20}; 'h200-sxm-141gb' is another GPU, not a spelling of "
        f"it); known: {', '.join(catalog.names('gpu'))}; describe yours in the config: [cluster] gpu = {{...}} "
        "(docs/input.md)")


@pytest.mark.parametrize("typed,nearest", [("a100-24gb", "dgx-a100"), ("dgx-a100-24gb", "dgx-a100-40gb"),
                                           ("dgx-a100-24g", "dgx-a100-40gb")])
def test_an_a100_of_other_memory_is_not_guessed_as_an_a100_node(typed, nearest):
    # dgx-a100 holds a100-sxm-80gb, dgx-a100-40gb a100-sxm-40gb: 24 GB is neither (difflib alone guessed
    # dgx-a100-40gb for dgx-a100-24gb, one letter away); the nearest name (difflib) is named as another GPU
    assert _message("node", typed) == (f"unknown node '{typed}'; no catalog node holds GPU 'a100-24gb' ('{nearest}' "
                                       f"is another GPU, not a spelling of it); known: {NODE_GPUS}; {HOW}")


@pytest.mark.parametrize("typed,guess", [("dgx-a100-40g", "dgx-a100-40gb"), ("dgx-a100-40G", "dgx-a100-40gb"),
                                         ("dgx-a100-80g", "dgx-a100"), ("dgx-a100-80G", "dgx-a100"),
                                         ("a100-40gb", "dgx-a100-40gb")])
def test_a_memory_spelled_g_is_read_as_gb(typed, guess):
    # 40g is 40 GB: the 40 GB node, never the 80 GB one; 80g is the 80 GB node, not dgx-a100-40gb (difflib
    # alone guessed dgx-a100-40gb for dgx-a100-80g, the longer common prefix)
    assert _message("node", typed) == f"unknown node '{typed}'; did you mean '{guess}'? known: {NODES}"


def test_a100_gpus_by_memory():
    # the 40 GB and 80 GB A100 SXM are each guessed only for their own memory, however it is spelled
    for typed, guess in [("a100-sxm-40g", "a100-sxm-40gb"), ("a100-40G", "a100-sxm-40gb"),
                         ("a100-sxm-80g", "a100-sxm-80gb")]:
        assert f"did you mean '{guess}'?" in _message("gpu", typed), typed
    assert _message("gpu", "a100-sxm-24gb").startswith(
        "unknown gpu 'a100-sxm-24gb'; no catalog GPU is an 'a100-sxm-24gb' ('a100-sxm-40gb' is another GPU, not a "
        "spelling of it); known: ")


def test_pcie_and_other_memory_gpus_are_not_guessed():
    # h100-pcie-80gb is no SXM5 and no 96 GB part
    assert "did you mean" not in _message("gpu", "h100-pcie-80gb")
    assert _message("node", "h100-pcie") == f"unknown node 'h100-pcie'; known: {NODES}"  # close to none: no guess


@pytest.mark.parametrize("typed,guess", [("dgx-h10O", "dgx-h100"), ("dgx-h2OO", "dgx-h200"), ("dgx-h10", "dgx-h100"),
                                         ("dgx-h800", "hgx-h800")])
def test_a_typo_of_the_same_gpu_is_still_guessed(typed, guess):
    assert _message("node", typed) == f"unknown node '{typed}'; did you mean '{guess}'? known: {NODES}"


def test_dgx_a10_is_the_a10_not_a_short_dgx_a100():
    # the NVIDIA A10 (Ampere GA102, 24 GB GDDR6, PCIe: its datasheet) starts "a100" as H20 starts "h200"
    assert _message("node", "dgx-a10") == (
        "unknown node 'dgx-a10'; no catalog node holds GPU 'a10' (NVIDIA A10: Ampere GA102, 24 GB GDDR6, PCIe; "
        f"'dgx-a100' is another GPU, not a spelling of it); known: {NODE_GPUS}; {HOW}")
