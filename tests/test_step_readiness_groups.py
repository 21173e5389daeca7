"""`meshplan step`'s readiness list (the collectives' ready time, deadline and slack, printed and
in `--json`'s ``collectives``) names each per-step collective by the group it runs on, as the
plan's collective table does: the SP norms' weight-gradient all-reduce over tp (without FSDP,
at the optimizer's reads; Megatron-LM: one coalesced call), the tied embedding's all-reduce
between the first and last stage over pp, the routed experts' ZeRO-1 reduction over efsdp (printed edp); the
dense data axes' reductions and gathers on "dp". Newcomer trial: at tp 8 and dp 1 the norms'
all-reduce was listed as ``dp``, the event stream filing every per-step reduction under dp."""

from __future__ import annotations

import json

import pytest

from meshplan.cli import main
from meshplan.config import load_config
from meshplan.plan import build_plan
from meshplan.spec.wording import stream_words
from tests.conftest import ROOT

#: The table's dense data axes (meshplan.mesh.resolve.DERIVED's dp, fsdp and Megatron-LM's DDP
#: group "loss", or a mesh axis they stand for): their per-step rows share the "dp" stream.
DENSE_DATA = {"dp", "dp_shard", "dp_replicate", "fsdp", "loss"}

#: examples/mini_2x4_tp4-dp2.toml's workload (Llama 3 8B, seq 8192, SP) on one DGX H100.
MINI = {"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
        "training": {"global_batch": 8, "seq_len": 8192, "micro_batch": 1, "sharding": "zero3", "recompute": "none"},
        "mesh": {"names": ["dp_shard", "tp"], "shape": [2, 4], "sequence_parallel": True}}


def _config(tmp_path, name: str, training: dict, mesh: dict, base: dict = MINI, **top) -> str:
    """``base`` with ``training`` and ``mesh`` fields replaced, written as TOML."""
    d = {**base, **top, "training": {**base["training"], **training}, "mesh": {**base["mesh"], **mesh}}
    path = tmp_path / f"{name}.toml"
    path.write_text("\n".join(f"[{t}]\n" + "\n".join(f"{k} = {json.dumps(v)}" for k, v in d[t].items())
                              for t in ("model", "cluster", "training", "mesh")) + "\n")
    return str(path)


def _step(path: str, tmp_path, capsys) -> tuple[list[dict], str]:
    out = tmp_path / "step.json"
    out.unlink(missing_ok=True)
    with pytest.raises(SystemExit) as done:
        main(["step", path, "--json", str(out)])
    assert done.value.code == 0
    return json.loads(out.read_text())["collectives"], capsys.readouterr().out


def _rows(path: str) -> list:
    """The plan's collective table, stage 0."""
    return build_plan(load_config(path)).stage(0).collectives


def _per_step_rows(path: str) -> list:
    """The table's stage-0 rows issued per step, not per micro-batch (no micro-batch count)."""
    return [r for r in _rows(path) if not r.per_microbatch and r.per_step]


def _check(path: str, tmp_path, capsys) -> tuple[set, str]:
    """Each per-step row of the table is in the readiness list under its group and op (the
    dense data axes as "dp"), in --json and printed; "dp" only where the table has a data row."""
    rows = _rows(path)
    listed, out = _step(path, tmp_path, capsys)
    got = {(c["stream"], c["op"]) for c in listed}
    want = {("dp" if r.axis in DENSE_DATA else r.axis, r.op) for r in rows if not r.per_microbatch and r.per_step}
    assert want and want <= got
    # each listed in the table's phase (step; backward for torch DDP's buckets), also where its pieces go out
    # inside the last backward (it was "backward" for every such piece)
    phased = {("dp" if r.axis in DENSE_DATA else r.axis, r.phase, r.op) for r in rows
              if not r.per_microbatch and r.per_step}
    assert phased <= {(c["stream"], c["phase"], c["op"]) for c in listed}
    assert any(r.axis in DENSE_DATA for r in rows) or not any(s == "dp" for s, _ in got)
    printed = {tuple(x.split()[:3]) for x in out.split("collectives on stage 0", 1)[1].splitlines()[1:]
               if x.startswith("  ")}
    # printed under the stream's name in the text (spec.wording.stream_words: efsdp as edp under ZeRO-1/2, DDP)
    names = stream_words(load_config(path).training)
    assert {(names.get(c["stream"], c["stream"]), c["phase"], c["op"]) for c in listed} <= printed
    return want, out


def test_tp8_dp1_norm_gradients_are_tp(tmp_path, capsys):
    """tp 8, dp 1, SP, no FSDP to reduce them: the table's one per-step row is the norms'
    ``tp step all-reduce`` (65 norms = 32 layers x 2 + the final one, each all-reduced once by the
    default fused AdamW: 65 calls of h 4096 x 2 B; 195 = 65 x 3 reads with the foreach one), and the
    readiness list names tp, with the optimizer step as its deadline (it waits for no op)."""
    path = _config(tmp_path, "tp8", {}, {"shape": [1, 8]})
    rows = _per_step_rows(path)
    assert [(r.axis, r.phase, r.op, r.size_bytes, r.per_step) for r in rows] == \
        [("tp", "step", "all-reduce", 8192, 65)]
    want, out = _check(path, tmp_path, capsys)
    assert want == {("tp", "all-reduce")}
    line = next(x for x in out.splitlines() if x.startswith("  tp            step     all-reduce"))
    ready, deadline, dur, slack = map(float, line.split()[3:7])
    assert line.endswith("  (issued in the last backward)")  # phase "backward" before: the table says step
    assert slack == pytest.approx(deadline - ready - dur, abs=2e-3) and slack > 0
    assert not any(x.startswith("  dp ") for x in out.splitlines()) and "dp and tp overlap" not in out


def test_ddp_dp2_tp4_splits_the_reduction_by_group(tmp_path, capsys):
    """DDP (sharding none) over dp 2 with tp 4 + SP: the table's per-step rows are the DDP
    buckets' all-reduces over dp_shard and the norms' over tp; each is listed on its own group."""
    path = _config(tmp_path, "ddp", {"sharding": "none"}, {})
    want, out = _check(path, tmp_path, capsys)
    assert want == {("dp", "all-reduce"), ("tp", "all-reduce")}
    # torch DDP's buckets: the table's rows say backward (once per step, each bucket in the last backward)
    line = next(x for x in out.splitlines() if x.startswith("  dp            backward all-reduce"))
    assert line.endswith("  (issued in the last backward)")


def test_megatron_tied_embedding_is_pp_and_sp_norms_tp(capsys, tmp_path):
    """D4 (GPT-3 175B, tp 8 x pp 8, dp 1, Megatron-LM, SP, tied embeddings): stage 0's per-step
    rows are the coalesced SP all-reduce over tp and the tied embedding's over pp (stages 0 and 7);
    neither is dp."""
    path = str(ROOT / "benchmarks" / "fidelity" / "megatron-175b_64xa100_tp8-pp8-vpp3_sp-selective.toml")
    want, out = _check(path, tmp_path, capsys)
    assert want == {("tp", "all-reduce"), ("pp", "all-reduce")}
    assert "exposed dp" not in out


def test_zero1_moe_expert_reduction_is_edp(tmp_path, capsys):
    """Mixtral 8x7B at dp_shard 32 x ep 8 under ZeRO-1: the routed experts' per-step
    reduce-scatter and all-gather run over the expert data axis, the dense parameters' over
    dp_shard; each pair is listed on its own group. The text names the experts' group edp, not
    efsdp: ZeRO-1 shards only the optimizer state over it, no FSDP runs there (Megatron-Core's
    _EXPERT_DATA_PARALLEL_GROUP, spec.wording.expert_data_axis); the table's rows and --json keep
    the internal stream name efsdp."""
    base = {"model": {"catalog": "mixtral-8x7b"}, "cluster": {"system": "dgx-h100", "nodes": 4},
            "training": {"global_batch": 256, "seq_len": 4096, "micro_batch": 1, "sharding": "zero1",
                         "recompute": "full"},
            "mesh": {"names": ["dp_shard", "ep"], "shape": [32, 8]}}
    path = _config(tmp_path, "moe", {}, {}, base=base)
    want, out = _check(path, tmp_path, capsys)
    assert want == {(g, op) for g in ("dp", "efsdp") for op in ("reduce-scatter", "all-gather")}
    listed = out.split("collectives on stage 0", 1)[1].splitlines()[1:]
    assert {tuple(x.split()[:3]) for x in listed if x.startswith("  edp ")} == {
        ("edp", "step", op) for op in ("reduce-scatter", "all-gather")}
    assert not any(x.startswith("  efsdp ") for x in listed)


def test_tp_past_the_kv_heads_under_megatron_has_no_kv_replica_step_row(tmp_path, capsys):
    """tp 4 past 2 KV heads (handed case C6 at small size, tests/test_schedule_semantics.py) under
    framework megatron (torch refuses it: rule torch_kv_heads): Megatron-LM replicates no KV head
    (its QKV all-gather runs per layer on tp, spec/axes/tp_kv.py), so no per-step ``kv_replica``
    all-reduce is in the table or in the readiness list (before: the copies' all-reduce was)."""
    base = {"model": {"layers": 4, "hidden": 64, "ffn": 256, "gated_mlp": False, "q_heads": 4, "kv_heads": 2,
                      "vocab": 256},
            "cluster": {"system": "dgx-h100", "nodes": 1},
            "training": {"global_batch": 8, "seq_len": 64, "micro_batch": 1, "sharding": "none",
                         "param_dtype": "bf16", "recompute": "none", "framework": "megatron"},
            "mesh": {"names": ["dp", "tp"], "shape": [2, 4]}}
    path = _config(tmp_path, "kv", {}, {}, base=base)
    rows = _per_step_rows(path)
    listed, _ = _step(path, tmp_path, capsys)
    assert rows and not [r for r in rows if r.axis == "kv_replica"]
    assert not [c for c in listed if c["stream"] == "kv_replica"]


def test_megatron_example_lists_per_step_rows_as_step_and_names_the_sends(tmp_path, capsys):
    """The Megatron example (Llama 3 8B, pp 2 x dp 4 x tp 2, 1F1B, 32 micro-batches, DDP buffers with
    --overlap-grad-reduce): the coalesced SP all-reduce and the buckets' reduce-scatters are the
    table's ``step`` rows whose pieces go out inside the last backward; the list printed them as
    ``backward`` (newcomer trial) and now gives the table's phase and where they are issued. The pp
    sends are not in the list, and a note line says so and where they are counted: stage 0 sends
    its output activation once per micro-batch, 32 per schedule run (it receives the gradients)."""
    path = str(ROOT / "examples" / "megatron_llama3-8b_16xh100_tp2-pp2.args")
    out = tmp_path / "step.json"
    with pytest.raises(SystemExit) as done:
        main(["step", path, "--cluster", "dgx-h100", "--nodes", "2", "--json", str(out)])
    assert done.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    table = {(r.axis, r.phase, r.op) for r in build_plan(_megatron(path)).stage(0).collectives}
    assert {("tp", "step", "all-reduce"), ("dp", "step", "reduce-scatter")} <= table
    for stream, op in (("tp", "all-reduce"), ("dp", "reduce-scatter")):
        line = next(x for x in lines if x.startswith(f"  {stream:13s} step     {op}"))
        assert line.endswith("  (issued in the last backward)")
    assert not [x for x in lines if x.startswith("  dp            backward")]
    assert ("  not listed: pp send/recv between stages (stage 0 sends 32 per schedule run): counted in the parts "
            "line's exposed pp (their transfers; a blocking call's wait for its partner stage is bubble)") in lines
    doc = {(c["stream"], c["phase"], c["op"]): c for c in json.loads(out.read_text())["collectives"]}
    assert doc[("dp", "step", "reduce-scatter")]["issued"] == "in the last backward"
    assert "issued" not in doc[("dp", "step", "all-gather")]  # after the optimizer, at the step's end


def _megatron(path: str):
    from meshplan.interop.common import ImportOptions
    from meshplan.interop.foreign import load_any
    return load_any(path, opts=ImportOptions(cluster="dgx-h100", nodes=2))


def test_no_pp_note_without_a_pipeline(tmp_path, capsys):
    """pp 1 (MINI): no sends, no note."""
    _, out = _step(_config(tmp_path, "mini", {}, {}), tmp_path, capsys)
    assert "not listed: pp send/recv" not in out
