"""One verdict everywhere (issue 11, searchknobs item 1): ``meshplan compare`` of two configs of
one mesh that differ only in a setting (recompute, tp overlap) decides as the search orders
them, through the search's own tie key (:func:`meshplan.search.tie_key.tie_key`), and gives the
search's reason. Before, compare weighed the mesh keys alone within 1%, so two settings of one
mesh went to the shorter step (or the lower peak) where the search lists the fewer settings
first."""

from __future__ import annotations

import json

import pytest

from meshplan.compare.sides import plan_tie_key
from meshplan.config import config_from_dict
from meshplan.plan import build_plan
from meshplan.search.rank import PAIR_RULE, RULE_LINE, TOWARD
from meshplan.units import GiB
from tests.cli_run import run_main
from tests.configs import job_toml

#: Llama-3-8B on one dgx-h100 under Megatron-LM, ZeRO-1; the search narrowed to pp 1, cp 1,
#: micro-batch 1 (tp 2 and 4: two rows, so the search explains its top against the fastest).
SEARCH = """[model]
catalog = "llama3-8b"
[cluster]
system = "dgx-h100"
nodes = 1
[training]
global_batch = 64
seq_len = {seq}
framework = "megatron"
sharding = "zero1"
[search]
pp = [1]
cp = [1]
tp = [2, 4]
micro_batch = [1]
sharding = ["zero1"]
recompute = {recompute}
tp_comm_overlap = {overlap}
"""


def _search(tmp_path, capsys, seq: int, recompute: str, overlap: str) -> tuple[dict, str]:
    """Run the search on :data:`SEARCH`, export row 1 as a meshplan TOML: (--json, the TOML's text)."""
    cfg = tmp_path / "s.toml"
    cfg.write_text(SEARCH.format(seq=seq, recompute=recompute, overlap=overlap))
    assert run_main("search", cfg, "--json", tmp_path / "s.json", "--export", 1, "--to", "meshplan",
                    "-o", tmp_path / "top.toml") == 0
    capsys.readouterr()
    return json.loads((tmp_path / "s.json").read_text()), (tmp_path / "top.toml").read_text()


def _compare(tmp_path, capsys, a_text: str, b_text: str, run: str = "1") -> dict:
    """``meshplan compare a.toml top.toml --json`` in folder ``run`` of ``tmp_path``: the document."""
    here = tmp_path / run
    here.mkdir()
    (here / "a.toml").write_text(a_text)
    (here / "top.toml").write_text(b_text)
    assert run_main("compare", here / "a.toml", here / "top.toml", "--out", here / "cmp",
                    "--json", here / "c.json") == 0
    capsys.readouterr()
    return json.loads((here / "c.json").read_text())


def test_tp_overlap_within_1_percent_compare_lists_the_search_top(tmp_path, capsys):
    """seq 2048, tp overlap off and on: dp 4 x tp 2 with overlap is the fastest (1.5260 s), without
    it 1.5348 s (0.57% longer, peaks equal); the search lists it without overlap as row 1 and says
    why (0 settings off their default against 1). compare of the two exported plans now picks row 1
    with the same words; it picked the overlap plan before ("shorter step (1.5259 s vs 1.5346 s)").
    Both steps 0.1504 ms longer since the loss scale's multiply and its backward were counted (16
    micro-batches x 2 kernels x 4.7 us, compute/megatron.LOSS_KERNELS): 1.52589 -> 1.52605 s and
    1.53461 -> 1.53476 s."""
    doc, top = _search(tmp_path, capsys, 2048, '["none"]', "[false, true]")
    why = doc["top_vs_runner_up"]["tie_criterion"]
    assert why == "fewer settings off their default (0 vs 1: none vs none, tp overlap)"
    assert "tp_comm_overlap" not in top
    fast = top.replace('recompute = "none"', 'recompute = "none"\ntp_comm_overlap = true')
    c = _compare(tmp_path, capsys, fast, top)
    assert (c["winner"], c["rejected"], c["decided_by"]) == ("top", "a", why)
    assert (round(c["a"]["step_s"], 4), round(c["b"]["step_s"], 4)) == (1.526, 1.5348)
    assert c["reasons"][0] == ("step times within 1% (top 1.535 s, a 1.526 s): top is listed first by the search's "
                               f"tie rule: {why}")


def test_recompute_within_1_percent_compare_names_the_settings(tmp_path, capsys):
    """seq 512, recompute none and selective (no overlap): dp 4 x tp 2 none 0.6564 s, selective
    0.6588 s (0.37% longer: the attention core is small at 512 tokens), peaks 37.78 GiB within
    1 MB. The search lists none first; compare says so by the settings (0 against 1), where it said
    "shorter step, peaks within 1%" before. Either order of the files gives the same verdict.
    Both 0.1504 ms longer since the loss scale's multiply and its backward were counted (16
    micro-batches x 2 x 4.7 us): 0.65621 -> 0.65636 s, 0.65862 -> 0.65877 s."""
    doc, top = _search(tmp_path, capsys, 512, '["none", "selective"]', "[false]")
    mesh2 = [p for p in doc["placed"] if p["mesh"]["tp"] == 2]
    assert [(p["recompute"], p["listed"]) for p in mesh2] == [("none", True), ("selective", False)]
    selective = top.replace('recompute = "none"', 'recompute = "selective"')
    c = _compare(tmp_path, capsys, selective, top)
    assert (c["winner"], c["rejected"]) == ("top", "a")
    assert c["decided_by"] == "fewer settings off their default (0 vs 1: none vs selective)"
    assert (round(c["a"]["step_s"], 4), round(c["b"]["step_s"], 4)) == (0.6588, 0.6564)
    c = _compare(tmp_path, capsys, top, selective, "2")  # a: none now, "top" the selective one
    assert (c["winner"], c["decided_by"]) == ("a", "fewer settings off their default (0 vs 1: none vs selective)")


BASE = {"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
        "training": {"global_batch": 8, "seq_len": 1024}}


def _plan(training: dict, mesh: dict):
    return build_plan(config_from_dict({**BASE, "training": BASE["training"] | training, "mesh": mesh}))


def test_plan_tie_key_reads_the_settings_as_the_search_holds_them():
    """A plan's key is the search's candidate key: pp 4 x dp_shard 2 (2 axes, tp*pp*cp*ep 4, tp 1);
    recompute full (index 5 of none, selective, op, layer, block, full: block, Megatron-LM's first n
    layers of each chunk, added before full since blockrc), vpp 2, the Llama 3 short end
    stages [7, 9, 9, 7] (ends_short_split of 32 layers over 4), ZBV (PIPELINE index 1): 3
    settings off the default (ZB-V's vpp 2 comes with its name: tie_key.implied_vpp). The even split
    written out ([8, 8, 8, 8]) is no setting; GPipe,
    which the search does not try, counts as one (index 4, after DualPipeV 2 and ZB-H1 3, which the
    search tries since nc56 #3); ZB-H1 at vpp 1 is one setting (its index 3), no vpp of its own."""
    mesh = {"names": ["pp", "dp_shard"], "shape": [4, 2]}
    p = _plan({"recompute": "full"}, mesh | {"virtual_stages": 2, "pp_schedule": "zbv", "pp_layer_split": [7, 9, 9, 7]})
    assert plan_tie_key(p) == (2, 4, 1, 3, 5, 0, 2, 0, 1, 1)
    even = _plan({"recompute": "none"}, mesh | {"pp_layer_split": [8, 8, 8, 8]})
    assert plan_tie_key(even) == (2, 4, 1, 0, 0, 0, 1, 0, 0, 0)
    gpipe = _plan({"recompute": "none"}, mesh | {"pp_schedule": "gpipe"})
    assert plan_tie_key(gpipe) == (2, 4, 1, 1, 0, 0, 1, 0, 0, 4)
    zb = _plan({"recompute": "none"}, mesh | {"pp_schedule": "zb_h1"})
    assert plan_tie_key(zb) == (2, 4, 1, 1, 0, 0, 1, 0, 0, 3)


def test_the_pair_rule_is_the_search_rule():
    """compare states the search's words for the settings, not the mesh keys alone."""
    assert TOWARD in PAIR_RULE and TOWARD in RULE_LINE
    assert "fewer and cheaper settings off their default (no recompute before selective, op, layer, block, full" in PAIR_RULE


#: Llama-3-8B on one dgx-h100 at pp 4 x dp_shard 2, global batch 8 (m = 8 / (dp 2 x mb 1) = 4
#: micro-batches per pipeline), no recompute; the schedule line is added per side.
PIPE = job_toml(training={"global_batch": 8, "seq_len": 4096, "recompute": "none"},
                mesh={"names": ["pp", "dp_shard"], "shape": [4, 2]})


def test_a_schedule_the_search_does_not_try_counts_as_one_setting_the_user_sets(tmp_path, capsys):
    """GPipe against 1F1B on one mesh (searchnits item 2). Is GPipe "one setting off the default"
    though the search never tries it? The tie key counts what the user must set to get the run:
    mesh.pp_schedule defaults to 1f1b (torchtitan's parallelism.pipeline_parallel_schedule to
    "1F1B"; Megatron-LM has no GPipe), so GPipe is set by hand: one setting, as the search counts a
    V-shaped schedule it tries; whether the search enumerates it does not change what the user
    sets. So the count is kept, and the verdict follows by hand: for uniform stages GPipe and 1F1B
    run the same m forwards and m backwards per stage with the same (p - 1)(t_f + t_b) idle
    (Narayanan et al. SC21, 2.2.1: 1F1B has GPipe's bubble and holds fewer micro-batches), so the
    steps differ by less than 1% (here equal: 0.726 s each, both kept gathered, the default at pp 4
    since rafpp, 0.725 s before torchp2p's waited 1F1B/GPipe calls; 0.738 vs 0.740 s resharded before) and the tie key decides before the peak (GPipe
    holds all 4 micro-batches' activations: 48.1 against 41.3 GiB): 0 settings against 1, for
    1F1B, in either order of the files. At pp 1 the schedule runs nothing and counts nothing.
    (nicshare4: 0.726 -> 0.729 s each, 0.72566 -> 0.72919 s: under FSDP2's one reduce-scatter in
    flight (Overlap.fsdp_rs_queue, torch 2.13 _fsdp_param_group.py 639-658) stage 0's deferred
    reduction after its last backward runs each of its 8 layers' copy-ins (0.4406 ms, Llama-3-8B's 32
    layers on 4 stages) between the reduce-scatters, not all ahead of them: its tail 13.510 -> 17.035
    ms, 8 x 0.4406 = 3.525 ms of exposed fsdp at the step's end, both schedules alike, as
    test_compare_settings' pp 2 x dp_shard 4 sides' 16 copy-ins.) (kvheads: 0.729 -> 0.726 s each, 0.72919 ->
    0.72602 s: no repeat_kv copies without ``[memory] kv_expanded`` (the SDPA reads the 8 KV heads,
    enable_gqa), 2 x 83,886,080 B a layer at 2.97 TB/s = 56.49 us, on the critical path's (m + p - 1) = 7
    units of 8 layers: 3.163 ms, both schedules alike; kv_expanded true gives 0.72919 s again.)"""
    from meshplan.compare.sides import plan_tie_key

    gpipe = PIPE.replace('shape = [4, 2]', 'shape = [4, 2]\npp_schedule = "gpipe"')
    why = "fewer settings off their default (0 vs 1: none vs none, another schedule)"
    c = _compare(tmp_path, capsys, gpipe, PIPE)
    assert (c["winner"], c["rejected"], c["decided_by"]) == ("top", "a", why)
    steps = (c["a"]["step_s"], c["b"]["step_s"])
    assert max(steps) / min(steps) - 1 < 0.01 and (round(steps[0], 3), round(steps[1], 3)) == (0.726, 0.726)
    assert 0.725662 + 8 * 0.4406e-3 - 7 * 8 * 2 * 83_886_080 / 2.97e12 == pytest.approx(steps[0], abs=2e-6)
    assert c["a"]["peak_bytes"] > c["b"]["peak_bytes"]  # the peak would pick 1F1B too, but the key decides first
    c = _compare(tmp_path, capsys, PIPE, gpipe, "2")
    assert (c["winner"], c["decided_by"]) == ("a", why)
    flat = {"names": ["dp_shard"], "shape": [8]}
    assert plan_tie_key(_plan({"recompute": "none"}, flat | {"pp_schedule": "gpipe"})) == \
        plan_tie_key(_plan({"recompute": "none"}, flat)) == (1, 1, 1, 0, 0, 0, 1, 0, 0, 0)


def test_torch_pp2_reshard_true_is_the_setting_off_the_default(tmp_path, capsys):
    """searchraf: under framework torch with pp > 1 an unset reshard_after_forward plans false
    (TrainingSpec.reshard_default, torchtitan's default), so compare counts true as the setting off
    the default, as the search does. Llama-3-8B on one dgx-h100, pp 2 x dp_shard 4, global batch 8
    at seq 8192 (m = 8 / 4 = 2 micro-batches), recompute full: unset (kept gathered) 1.673 s, 40.9
    GiB; true 1.687 s (0.88% longer: its backward all-gathers), 36.7 GiB. Within 1%, so the tie key
    decides before the peak: 1 setting (full) against 2 (full, resharded), the unset plan first.
    Before, true counted as the default and kept gathered as the setting off it: the resharded plan
    won, "fewer settings off their default (1 vs 2: full vs full, kept gathered)". (nicshare: 1.673 ->
    1.680 s and 1.687 -> 1.695 s, 0.87% apart: after stage 0's last backward its 17 FSDP units' reduce-
    scatters (the root's, then 16 layers') ran back to back behind copy-ins issued together; under FSDP2's
    one reduce-scatter in flight (grad_reduce.rs_buffer_wait, torch 2.13 _fsdp_param_group.py 639-658)
    each layer's copy-in (0.4406 ms) waits for the reduce-scatter before: the tail 16 x 0.4406 = 7.05 ms
    longer in both, 1672.81 -> 1679.86 ms and 1687.49 -> 1694.54 ms.) (kvheads: 1679.86 -> 1671.73 ms and
    1694.54 -> 1686.40 ms: no repeat_kv copies (``[memory] kv_expanded`` false), 2 x 83,886,080 B forward,
    backward and full recompute's replay, 3 x 56.49 us a layer (s 8192: 2 x 8192 x 128 x 40 x 2 B each), on the
    critical path's (m + p - 1) = 3 units of 16 layers: 8.13 ms; kv_expanded true gives the steps before.)"""
    base = job_toml(training={"global_batch": 8, "seq_len": 8192, "recompute": "full"},
                    mesh={"names": ["pp", "dp_shard"], "shape": [2, 4]})
    resharded = base.replace('recompute = "full"', 'recompute = "full"\nreshard_after_forward = true')
    why = "fewer settings off their default (1 vs 2: full vs full, resharded)"
    c = _compare(tmp_path, capsys, resharded, base)
    assert (c["winner"], c["rejected"], c["decided_by"]) == ("top", "a", why)
    assert (round(c["a"]["step_s"], 3), round(c["b"]["step_s"], 3)) == (1.686, 1.672)
    assert round(3 * 16 * 3 * 2 * (2 * 8192 * 128 * 40) / 2.97e12 * 1e3, 2) == 8.13
    assert (round(c["a"]["peak_bytes"] / GiB, 1), round(c["b"]["peak_bytes"] / GiB, 1)) == (36.7, 40.9)
    assert c["reasons"][0] == ("step times within 1% (top 1.672 s, a 1.686 s): top is listed first by the search's "
                               f"tie rule: {why}")
    c = _compare(tmp_path, capsys, base, resharded, "2")  # either order of the files
    assert (c["winner"], c["decided_by"]) == ("a", why)
