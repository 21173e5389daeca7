"""Newcomer trial findings on ``meshplan search`` and the reports (:mod:`meshplan.report.search_lines`):
the ``your mesh`` line on the HTML page as the text prints it; the goodput column dropped (its
value said once, and why) where every row prints the same goodput, kept where rows differ; and
recompute ``selective`` worded as what is modelled under each framework (under torch:
Megatron-LM's core-attention recompute, which torchtitan has no option for)."""

from __future__ import annotations

import html
import json
import re
from dataclasses import replace
from math import exp, sqrt
from pathlib import Path

import pytest

from meshplan.config import load_config
from meshplan.memory.activations import layer_terms
from meshplan.memory.layer_dims import LayerDims
from meshplan.plan import build_plan
from meshplan.report.html_pages import search_page
from meshplan.report.search import top_table
from meshplan.report.search_lines import goodput_line, goodput_shared, recompute_lines
from meshplan.schedule.steptime import step_time
from meshplan.schedule.unit_sim import Overlap
from meshplan.search.driver import search
from meshplan.spec.recompute_words import recompute_words
from tests.cli_run import run_main

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
#: The mini example (llama3-8b on one DGX H100, [mesh] dp_shard 4 x tp 2) narrowed to tp 2, pp 1,
#: cp 1, micro-batch 1: recompute none/selective/full, reshard or not, zero3/hsdp rows.
NARROW = {"tp": [2], "pp": [1], "cp": [1], "micro_batch": [1]}


def _cfg(training: dict | None = None, **narrow):
    cfg = load_config(EXAMPLES / "mini_2x4_tp2-dp4.toml")
    return replace(cfg, training=cfg.training.model_copy(update=training or {}),
                   search=cfg.search.model_copy(update=NARROW | narrow))


@pytest.fixture(scope="module")
def mini():
    return search(_cfg(), workers=1)


def _text(out: str) -> str:
    """Printed text with rich's wrapping and cell borders undone."""
    return " ".join(re.sub("[│┃]", " ", out).split())


def test_html_holds_the_your_mesh_line_the_text_prints(tmp_path, capsys):
    """One line, the same words and numbers: the step is the plan and step commands' own."""
    cfg = _cfg()
    toml = tmp_path / "c.toml"
    toml.write_text((EXAMPLES / "mini_2x4_tp2-dp4.toml").read_text()
                    + "\n[search]\ntp = [2]\npp = [1]\ncp = [1]\nmicro_batch = [1]\n")
    assert run_main("search", toml, "--html", tmp_path / "s.html", "--json", tmp_path / "s.json") == 0
    text, page = _text(capsys.readouterr().out), (tmp_path / "s.html").read_text()
    mine = json.loads((tmp_path / "s.json").read_text())["configured"]
    st = step_time(build_plan(cfg), Overlap())
    assert mine["step_s"] == st.step_s
    head = f"your mesh (dp_shard 4 x tp 2): {st.step_s:.3f} s, {st.tokens_per_s:,.0f} tokens/s, rank #{mine['rank']}"
    line = re.search(r"your mesh \([^\n<]*", html.unescape(page)).group(0)
    assert line.startswith(head) and line in text  # the page's line is the text's, word for word
    assert page.count("your mesh (") == 1


def test_html_holds_the_your_mesh_line_when_no_candidate_fits():
    """zero1 under torch: rule 'framework' rejects every candidate; the page's verdict section
    has the line under the verdict, as the text prints it."""
    r = search(_cfg({"sharding": "zero1"}, recompute=["none"], sharding=["zero1"]), workers=1)
    assert not r.top and r.configured.status == "infeasible"
    page = html.unescape(search_page(r, "t"))
    verdict = page.index("No feasible mesh</h2>")
    assert page.index(r.configured.line()) > verdict
    assert r.configured.line().startswith("your mesh (dp_shard 4 x tp 2): infeasible: rule 'framework'")


def _daly_goodput(params: int, gpus: int) -> float:
    """Daly (2006) goodput by hand: checkpoint = fp32 parameters and Adam's two fp32 moments,
    12 bytes a parameter (FSDP2 keeps no other master copy) at 2 TB/s; MTBF = 1 / (419 / (54 d x
    16,384 GPUs) x gpus) (Llama 3, 3.3.4); restart R = 600 s + the read at 2 TB/s;
    tau = sqrt(2CM)(1 + sqrt(C/2M)/3 + C/18M) - C; goodput = tau / (M e^(R/M) (e^((tau+C)/M) - 1))."""
    c = 12 * params / 2e12
    m = 86400 / (419 / (54 * 16384) * gpus)
    tau = sqrt(2 * c * m) * (1 + sqrt(c / (2 * m)) / 3 + c / (18 * m)) - c
    return tau / (m * exp((600 + c) / m) * (exp((tau + c) / m) - 1))


def test_equal_goodput_is_said_once_and_the_column_dropped(mini, tmp_path):
    """Every row prints 99.99% (8 GPUs, 8.03 B parameters: C = 0.048 s, M = 264 days): no
    column, one value with why; --json keeps each row's goodput."""
    expected = f"{_daly_goodput(load_config(EXAMPLES / 'mini_2x4_tp2-dp4.toml').model.param_count(), 8):.2%}"
    assert expected == "99.99%" and len(mini.top) > 1
    assert {f"{e.goodput:.2%}" for e in mini.top} == {expected} and goodput_shared(mini) == expected
    columns, rows = top_table(mini)
    assert "goodput" not in columns and all(len(x) == len(columns) == 12 for x in rows)
    assert goodput_line(mini).startswith(
        "goodput (Daly, printed, not ranked): 99.99% for every candidate shown, so no column: the checkpoint's bytes "
        "(the persistent state, each shard written once) and the failure rate (of all 8 GPUs) do not depend on the "
        "mesh here; checkpoint write/read 2000/2000 GB/s (default")
    page = search_page(mini, "t")
    assert "<th>goodput</th>" not in page and "99.99% for every candidate shown" in page
    assert "<th>GEMM eff</th>" in page


def test_goodput_that_differs_keeps_the_column(mini):
    """Rows 99.91% and 99.90%: the column stays, each row its own cell, and the line its inputs only."""
    top = [replace(e, goodput=g) for e, g in zip(mini.top[:2], (0.99912, 0.99904))]
    r = replace(mini, top=top)
    assert goodput_shared(r) is None
    columns, rows = top_table(r)
    g = columns.index("goodput")
    assert [x[g] for x in rows] == ["99.91%", "99.90%"]
    assert goodput_line(r) == r.config.search.goodput_words()
    assert "<th>goodput</th><th>GEMM eff</th>" in search_page(r, "t")
    # one row: nothing to tell apart, the column as before (its goodput on its row)
    assert goodput_shared(replace(mini, top=mini.top[:1])) is None


def test_torch_selective_is_worded_as_what_is_modelled():
    """Under torch: the torchtitan names, and Megatron-LM's core-attention recompute as the model;
    under megatron its own flag; the plan, step and memory text read the one source."""
    t = _cfg().training.model_copy(update={"recompute": "selective"})
    torch = recompute_words(t, "torch")
    assert torch.startswith("attention-core recompute, modelled as Megatron-LM's selective recompute "
                            "(--recompute-activations): the attention core's forward (the flash kernel) replayed in "
                            "backward, its softmax statistics not kept, the other activations kept; torchtitan has no "
                            "such option: its selective AC (activation_checkpoint.mode = \"selective\") is recompute "
                            "\"op\" (selective_ac_option = \"op\")")
    assert "its softmax output (and dropout tensors) not kept" in recompute_words(
        t.model_copy(update={"flash_attention": False}), "torch")
    assert recompute_words(t, "megatron").startswith("Megatron-LM selective recompute (--recompute-activations: "
                                                    "attention core")
    st = step_time(build_plan(_cfg({"recompute": "selective"})), Overlap())
    assert any(x.startswith(f"recompute: {torch}: ") for x in st.lines())


def test_the_words_say_what_the_memory_model_keeps():
    """The words' "softmax statistics not kept, the other activations kept": selective's terms
    are none's less exactly the flash softmax statistics (GPT-3-like layer, flash)."""
    d = LayerDims.gpt(s=2048, b=1, h=4096, a=32, dropout=False)
    none = {x.name: x.size_bytes for x in layer_terms(d, tp=2, sp=True, recompute="none", flash=True)}
    sel = {x.name: x.size_bytes for x in layer_terms(d, tp=2, sp=True, recompute="selective", flash=True)}
    assert set(none) - set(sel) == {"flash softmax statistics (fp32)"} and set(sel) <= set(none)
    assert none["flash softmax statistics (fp32)"] == 4 * 32 // 2 * 2048  # 4 B x a/t heads x s tokens x b 1
    assert all(sel[k] == none[k] for k in sel)


def test_search_says_what_selective_models():
    """A selective row shown: one line in the runtime's words (torch here), in the text and on the page.
    Under torch selective is searched only where [search] recompute lists it (searchtie: torchtitan
    has no option for it); listed alone here, so every row has it."""
    sel = search(_cfg(recompute=["selective"]), workers=1)
    t = sel.config.training.model_copy(update={"recompute": "selective"})
    assert top_table(sel)[1] and all(x[3] == "selective" for x in top_table(sel)[1])
    assert recompute_lines(sel) == [f"recompute selective: {recompute_words(t, 'torch')}"]
    # listed, it is searched (plan accepts it under torch: searchknobs item 3), and a note says what that means
    assert [n for n in sel.notes if n.startswith("recompute 'selective'")] == [
        "recompute 'selective' is searched because [search] recompute lists it: Megatron-LM's core-attention "
        "recompute, which meshplan plan accepts under training.framework \"torch\" but torchtitan has no option for "
        "(--export --to torchtitan writes such a row as mode \"none\", \"full\" without flash attention); for "
        "torchtitan's own options list none, op, layer, full"]
    assert html.escape(recompute_lines(sel)[0], quote=True) in search_page(sel, "t")
    shown = replace(sel, top=[], best_rejected=None)
    assert recompute_lines(shown) == []


def test_torch_search_leaves_selective_out_by_default(mini):
    """searchtie item 2: under torch the default search varies none, full and op only (torchtitan
    has no core-attention recompute), and a note says so. The narrowed mini search is at tp 2, cp 1:
    until op was searched at tp > 1 (nc57 #7b: op_recompute_ok is cp = 1) it held none and full alone;
    now op too, one op row beside each none row (space.py's doctest: one per none row at cp 1), and still no
    selective (RECOMPUTE: none 0, selective 1, full 2, op 3; no per-layer 'layer' without ep > 1 or MLA)."""
    from meshplan.search.columns import RECOMPUTE
    c = mini.candidates
    rc = {RECOMPUTE[int(x)] for x in c.rc}
    assert rc == {"none", "full", "op"} and any("recompute 'selective' is not searched" in n for n in mini.notes)
    assert (c.rc == RECOMPUTE.index("op")).sum() == (c.rc == RECOMPUTE.index("none")).sum()
    assert recompute_lines(mini) == []


def test_plan_page_words_recompute_as_the_plan_text():
    """The report page's training row: the policy in its runtime's words, as the text's train line."""
    from meshplan.report.html_pages import plan_page
    cfg = _cfg({"recompute": "selective"})
    plan = build_plan(cfg)
    words = recompute_words(cfg.training, "torch")
    assert f"recompute selective ({html.escape(words, quote=True)}), params" in plan_page(plan, None, "t")
    meg = replace(cfg, training=cfg.training.model_copy(update={"framework": "megatron", "sharding": "zero1"}))
    assert "recompute selective (Megatron-LM selective recompute (--recompute-activations: attention core" in (
        html.unescape(plan_page(build_plan(meg), None, "t")))
