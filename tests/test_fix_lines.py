"""Fix and error lines of a newcomer trial (findings 1-4): each names what the user typed
(the option, the foreign format's key) and the real limit (memory, or the global batch's cap
on the data axis), with values derived by hand or from the plans themselves."""

from __future__ import annotations

from pathlib import Path

from meshplan import catalog
from tests.cli_run import run_main

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
TT = EXAMPLES / "torchtitan_llama3-8b_8xh100.toml"
NODES = ", ".join(catalog.names("node"))


def test_unknown_cluster_names_the_option_and_the_closest_node(capsys):
    """Finding 4: ``--cluster dgx-h10`` is one edit from dgx-h100 (difflib ratio 14/15); the
    error names ``--cluster``, not the catalog's ``node``. dgx-h999 is close to none (ratio
    10/16 < 0.75): no guess. ``--gpu`` likewise."""
    assert run_main("plan", TT, "--cluster", "dgx-h10", "--nodes", "1") == 2
    assert capsys.readouterr().err == (f"error: --cluster: unknown node 'dgx-h10'; did you mean 'dgx-h100'? "
                                       f"known: {NODES}\n")
    assert run_main("plan", TT, "--cluster", "dgx-h999", "--nodes", "1") == 2
    assert capsys.readouterr().err == f"error: --cluster: unknown node 'dgx-h999'; known: {NODES}\n"
    assert run_main("plan", TT, "--cluster", "dgx-h100", "--nodes", "1", "--gpu", "h100-sxm5-80g") == 2
    assert capsys.readouterr().err.startswith("error: --gpu: unknown gpu 'h100-sxm5-80g'; did you mean "
                                              "'h100-sxm5-80gb'? known: a100-sxm-80gb, ")
