"""Pipeline parallelism combined with context parallelism, tied embeddings and experts
(meshplan.runtime.execution.pipelined, meshplan.runtime.execution.pipelined_stage), on the real engine.

Each multi-process test (``slow``, gloo, 4-8 ranks, tiny fp32 model; the runs share one torchrun
launch per world, tests/conftest.py ``world4_runs``/``world8_runs``) runs ``meshplan validate`` and checks that every rank's recorded collectives equal the
plan's table exactly (count, group, bytes, dtype, phase) and that the last stage's losses
equal a single-process reference on the same micro-batches: the first step's (the weights
as initialised) and the second step's (after one AdamW step on the gradient of the mean
loss over every data-parallel rank, cp chunk and micro-batch), which checks the gradients
that crossed the pipeline, the cp gathers and the data-parallel reduction.

The runs leave out the in-run collective probe and message curves (``probe=False``): nothing
here reads ``probe.json``, ``curves.json`` or a calibrated row, and together they took 4.5 s
of a 4-rank and 8-12 s of an 8-rank launch (measured on 2 shared cores). The probe runs for
real on the same axes (tp, dp_shard, cp, ep, efsdp) in tests/test_validate.py,
tests/test_validate_cp.py and tests/test_validate_moe.py.
"""

import json
import math
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from meshplan.runtime.validation.validate import Options  # noqa: E402
from meshplan.config import load_config  # noqa: E402
from tests.reference import per_token_losses  # noqa: E402

DATA = Path(__file__).parent / "data"


def test_what_pipelines_still_refuse_is_named():
    from meshplan.mesh.resolve import resolve_mesh
    from meshplan.runtime.execution.pipelined import unsupported
    from meshplan.spec.mesh import MeshSpec
    from meshplan.spec.model import ModelSpec
    from meshplan.spec.training import TrainingSpec

    training = TrainingSpec(global_batch=8, seq_len=16)
    tied = ModelSpec(layers=4, hidden=64, ffn=128, q_heads=4, vocab=256, tied_embeddings=True)
    moe = ModelSpec(layers=4, hidden=64, ffn=128, q_heads=4, vocab=256, experts=4, top_k=2, expert_ffn=32)
    pp2 = resolve_mesh(MeshSpec(names=["pp", "dp_shard", "cp"], shape=[2, 2, 2]), world=8)
    pp4 = resolve_mesh(MeshSpec(names=["pp", "dp_shard"], shape=[4, 2]), world=8)
    pp2_tp = resolve_mesh(MeshSpec(names=["pp", "dp_shard", "tp"], shape=[2, 2, 2]), world=8)
    # cp 2 beside pp: torch's ring attention (cp_attention unset under framework torch) is refused,
    # the all-gather CP the runtime builds is not
    assert unsupported(pp2, training, "1f1b", tied).startswith("cp > 1 with training.cp_attention 'ring'")
    assert unsupported(pp2, TrainingSpec(global_batch=8, seq_len=16, cp_attention="allgather"), "1f1b", tied) is None
    assert unsupported(pp4, training, "1f1b", tied).startswith("tied embeddings with pp > 2")
    assert unsupported(pp4, training, "1f1b", moe) is None
    assert unsupported(pp2_tp, training, "1f1b", moe) is None
    # fsdp 1, efsdp = tp 4 / ep 2: expert FSDP2 units with no FSDP root on the stage
    pp2_tp4 = resolve_mesh(MeshSpec(names=["pp", "tp", "ep"], shape=[2, 4, 2]), world=8)
    assert unsupported(pp2_tp4, training, "1f1b", moe).startswith("MoE layers with fsdp 1 and efsdp")


def _reference_losses(folder: Path, steps: int = 2, token_split: int = 1) -> dict[int, list[float]]:
    """Per last-stage rank, its loss in each of the first ``steps`` steps from the unsplit
    model: per micro-batch the rank's whole sequence through it, the per-token losses
    averaged over the rank's own cp chunks, then the mean over micro-batches; backward of
    the mean over last-stage ranks, one AdamW step (the worker's settings) per step.
    ``token_split``: the MoE layers route the sequence in that many pieces, each with its own
    capacity, as tp ranks under SP route their own sequence shard (micro-batch 1, cp 1). Each
    distinct micro-batch runs once, all in one batch without capacity routing (tests/reference.py)."""
    from meshplan.runtime.execution.cp import chunk_positions
    from meshplan.runtime.execution.model import Transformer
    from meshplan.compute.routing import RoutingOptions
    from meshplan.runtime.execution.moe import moe_layers, set_routing
    from meshplan.runtime.execution.trainstep import adamw, batch
    from meshplan.runtime.execution.worker import load_plan
    from meshplan.mesh.tpsplit import padded_vocab

    plan, spec, training, mesh = load_plan(folder / "plan.json")
    tp, cp, pp = mesh.degree("tp"), mesh.degree("cp"), mesh.degree("pp")
    vocab = padded_vocab(spec.vocab, training.vocab_pad_divisor, tp)
    model = Transformer(spec, vocab=vocab, tp=tp)
    model.init_weights(seed=0)
    set_routing(model, RoutingOptions.of(training))
    for moe in moe_layers(model) if token_split > 1 else []:
        moe.forward = (lambda m: lambda x: torch.cat([type(m).forward(m, p) for p in x.chunk(token_split, 1)], 1))(moe)
    opt = adamw(model.parameters(), training)  # the AdamW the worker runs
    last = [r for r in range(mesh.world) if mesh.layout.coords_of(r)[mesh.layout.names.index("pp")] == pp - 1]
    micro = plan["mesh"]["micro_batches"]
    batched = token_split == 1 and all(moe.dropless for moe in moe_layers(model))  # tests/reference.py
    out = {r: [] for r in last}
    for step in range(steps):
        per_token = per_token_losses(model, [batch(training, mesh, r, step, mb, vocab, 0) for r in last
                                             for mb in range(micro)], batched)
        losses = []
        for i, r in enumerate(last):
            mine = chunk_positions(training.seq_len, cp, mesh.group_of(r, "cp").index(r) if cp > 1 else 0)
            per_mb = [per_token[i * micro + mb][:, mine].mean() for mb in range(micro)]
            losses.append(torch.stack(per_mb).mean())
            out[r].append(float(losses[-1].detach()))
        torch.stack(losses).mean().backward()
        opt.step()
        opt.zero_grad()
    return out


def _options(world: int, **kw) -> Options:
    opt = dict(worlds=(world,), layers=4, seq_len=32, vocab=512, steps=1, micro_batches=4, timeout_s=200, probe=False)
    return Options(**{**opt, **kw})


def shared_validate_runs() -> dict:
    """Every ``validate`` of this file, in the shared launches of tests/conftest.py
    (tests/validate_runs.py: one torch start-up and rendezvous per world, each config into its
    own evidence folder): the five 8-rank configs and the 4-rank pp 2 x cp 2."""
    import dataclasses

    tied = load_config(DATA / "validate_llama8b_pp2_tp2_sp.toml")
    tied = dataclasses.replace(tied, model=tied.model.model_copy(update={"tied_embeddings": True}))
    return {"pp2_cp2": (DATA / "validate_llama8b_pp2_cp2.toml", _options(4)),
            "pp2_cp2_tp2sp": (DATA / "validate_llama8b_pp2_cp2_tp2sp.toml", _options(8)),
            "tied": (tied, _options(8)),
            "moe_ep2": (DATA / "validate_mixtral_pp2_ep2_fsdp.toml", _options(8)),
            "moe_tp2sp_ep2": (DATA / "validate_mixtral_pp2_tp2sp_ep2_fsdp.toml", _options(8)),
            "moe_etp2": (DATA / "validate_mixtral_pp2_tp2sp_etp2_fsdp.toml", _options(8))}


def _take(runs, name: str):
    """(exit code, comparison, world folder) of the launched run ``name``, which must have been compared."""
    run = runs[name]
    assert run.results[0].get("stage") == "compare", run.results[0]["message"]
    return run.code, run.results[0]["comparison"], run.folder


def _check_exact(comp: dict, folder: Path, world: int) -> dict:
    """Every collective row equal on every rank to that rank's stage table; the rows by
    (axis, phase, op, bytes)."""
    assert comp["differences"] == [] and comp["group_differences"] == {}
    for row in comp["collectives"]:
        assert [row[f"rank{k}"] for k in range(world)] == [row[f"meshplan_rank{k}"] for k in range(world)], row
    for rank in range(world):
        assert json.loads((folder / f"rank{rank}" / "startup.json").read_text())["group_differences"] == []
    return {(r["axis"], r["phase"], r["op"], r["size_bytes"]): r for r in comp["collectives"]}


def _check_losses(folder: Path, token_split: int = 1) -> None:
    ref = _reference_losses(folder, token_split=token_split)
    for rank, want in ref.items():
        steps = json.loads((folder / f"rank{rank}" / "timings.json").read_text())["steps"]
        got = [next(s["loss"] for s in steps if s["kind"] == kind) for kind in ("recorded", "memory")]
        assert got == pytest.approx(want, rel=1e-5), (rank, got, want)
        assert all(math.isfinite(x) for x in got)


# pp x cp (Llama 3 405B trains with tp x cp x pp x dp): the first stage embeds the rank's two
# load-balanced chunks of s/cp tokens, every stage's attention gathers K and V over cp, and
# the P2P payload is the local (b, s/cp, h) activation, under SP (b, s/cp/tp, h); model: 4
# layers, hidden 256, 8 KV heads of 8, seq 32, micro-batch 1, 4 micro-batches.

@pytest.mark.slow
def test_4_ranks_pp2_cp2_1f1b_match_the_plan_and_the_reference(world4_runs):
    code, comp, folder = _take(world4_runs, "pp2_cp2")
    rows = _check_exact(comp, folder, 4)
    act = 1 * (32 // 2) * 256 * 4  # (b, s/cp, h) fp32
    assert [rows["pp", phase, "send/recv", act]["rank0"] for phase in ("forward", "backward")] == [4, 4]
    kv = 2 * 32 * 8 * 8 * 4  # K and V of all 32 tokens, 8 KV heads of 8
    assert [rows["cp", "forward", "all-gather", kv][f"rank{k}"] for k in range(4)] == [8] * 4  # 2 layers x 4 mb
    assert [rows["cp", "backward", "reduce-scatter", kv][f"rank{k}"] for k in range(4)] == [8] * 4
    _check_losses(folder)
    assert code == 0


@pytest.mark.slow
def test_8_ranks_pp2_cp2_tp2_sp_1f1b_match_the_plan_and_the_reference(world8_runs):
    code, comp, folder = _take(world8_runs, "pp2_cp2_tp2sp")
    rows = _check_exact(comp, folder, 8)
    shard = 1 * (32 // 2 // 2) * 256 * 4  # (b, s/cp/tp, h) fp32
    assert {k[:3] for k in rows if k[0] == "pp"} == {("pp", "forward", "send/recv"), ("pp", "backward", "send/recv")}
    assert [rows["pp", "forward", "send/recv", shard][f"rank{k}"] for k in range(8)] == [4] * 8
    kv = 2 * 32 * 4 * 8 * 4  # tp 2 splits the 8 KV heads
    assert [rows["cp", "forward", "all-gather", kv][f"rank{k}"] for k in range(8)] == [8] * 8
    _check_losses(folder)
    assert code == 0


# Tied embeddings with pp 2: the first stage holds the embedding, the last its copy as the
# output layer, equal at start; after the schedule each all-reduces its local gradient shard
# with the other over the embedding group (the pp group at pp 2), as Megatron-LM does. The
# second step's loss equals the tied reference's only if both copies took the summed gradient.

@pytest.mark.slow
def test_8_ranks_pp2_dp_shard2_tp2_sp_tied_embeddings_match_the_plan_and_the_reference(world8_runs):
    code, comp, folder = _take(world8_runs, "tied")  # the pp 2 x tp 2 + SP config, tied_embeddings true
    rows = _check_exact(comp, folder, 8)
    # one all-reduce per step of the local shard: 512 rows / tp 2 / dp_shard 2 x 256 fp32, pairs (k, k + 4)
    tied = rows["pp", "step", "all-reduce", 512 // 2 // 2 * 256 * 4]
    assert [tied[f"rank{k}"] for k in range(8)] == [1] * 8
    records = json.loads((folder / "rank1" / "collectives.json").read_text())["records"]
    assert [r["group"] for r in records if r["phase"] == "step" and r["op"] == "all-reduce"
            and r["size_bytes"] == 131072] == [[1, 5]]
    _check_losses(folder)
    assert code == 0


# MoE with pp 2: every stage module's MoE layers get EP (experts over ep 2, all-to-all
# dispatch and combine) and the routed experts their own FSDP2 unit over efsdp of the expert
# DeviceMesh (dp_shard 4 / ep 2 = 2), as parallelize() gives the unsplit model.

@pytest.mark.slow
def test_8_ranks_pp2_dp_shard4_ep2_moe_match_the_plan_and_the_reference(world8_runs):
    code, comp, folder = _take(world8_runs, "moe_ep2")
    rows = _check_exact(comp, folder, 8)
    # dropless (the toml sets no routing): 2 MoE layers per stage x 4 micro-batches x (dispatch,
    # combine), compared by count (their bytes are the router's); before each dispatch the
    # 8 experts' counts, 8 x 8 B int64
    assert [rows["ep", phase, "all-to-all", "routed"][f"rank{k}"] for phase in ("forward", "backward")
            for k in range(8)] == [16] * 16
    assert [rows["ep", "forward", "all-to-all", 64][f"rank{k}"] for k in range(8)] == [8] * 8
    assert {k[:3] for k in rows if k[0] == "efsdp"} == {("efsdp", "forward", "all-gather"),
                                                      ("efsdp", "backward", "all-gather"),
                                                      ("efsdp", "backward", "reduce-scatter")}
    start = json.loads((folder / "rank5" / "startup.json").read_text())
    assert start["groups"]["ep"] == [4, 5] and start["groups"]["efsdp"] == [5, 7]
    _check_losses(folder)
    assert code == 0


# MoE with pp 2 and tp 2 + SP: in each stage's MoE layers every tp rank routes its own
# sequence shard through the replicated router (no tp activation collective in the MoE
# block), the experts split over ep 2 (the ep group is the tp group) and sharded over efsdp =
# dp_shard x tp / ep = 2; the router's gradient is all-reduced over tp.

@pytest.mark.slow
def test_8_ranks_pp2_dp_shard2_tp2_sp_ep2_moe_match_the_plan_and_the_reference(world8_runs):
    code, comp, folder = _take(world8_runs, "moe_tp2sp_ep2")
    rows = _check_exact(comp, folder, 8)
    # 16 tokens per tp rank x top_k 2 over 8 experts: capacity 4, 8 x 4 rows x 256 x 4 B; 2 MoE
    # layers per stage x 4 micro-batches x (dispatch, combine)
    a2a = 8 * 4 * 256 * 4
    assert [rows["ep", phase, "all-to-all", a2a][f"rank{k}"] for phase in ("forward", "backward")
            for k in range(8)] == [16] * 16
    shard = 1 * (32 // 2) * 256 * 4  # (b, s/tp, h) fp32
    assert [rows["pp", "forward", "send/recv", shard][f"rank{k}"] for k in range(8)] == [4] * 8
    router = rows["tp", "backward", "all-reduce", 8 * 256 * 4]  # 2 MoE layers per stage, once per step
    assert [router[f"rank{k}"] for k in range(8)] == [2] * 8
    # the routed experts (4 per rank, 3 x 896 x 256 fp32) are one FSDP2 unit over efsdp, whose
    # group here is the dp_shard group
    experts = 4 * 3 * 896 * 256 * 4
    assert [rows["dp_shard", "backward", "reduce-scatter", experts][f"rank{k}"] for k in range(8)] == [2] * 8
    start = json.loads((folder / "rank5" / "startup.json").read_text())
    assert start["groups"]["ep"] == [4, 5] == start["groups"]["tp"] and start["groups"]["efsdp"] == [5, 7]
    _check_losses(folder, token_split=2)
    assert code == 0


# MoE with pp 2, tp 2 + SP and ep 1 (framework torch: etp = tp filled in): as torchtitan at ep 1
# each routed expert is sharded over tp (w_gate/w_up Shard(1), w_down Shard(2)) and every tp rank
# routes all the tokens, so the losses are the unsplit model's without any token split; the
# experts stay in their layer's FSDP2 unit over dp_shard (no efsdp rows).

@pytest.mark.slow
def test_8_ranks_pp2_dp_shard2_tp2_sp_etp2_moe_match_the_plan_and_the_reference(world8_runs):
    code, comp, folder = _take(world8_runs, "moe_etp2")
    rows = _check_exact(comp, folder, 8)
    assert not any(k[0] in ("efsdp", "ep") for k in rows)
    start = json.loads((folder / "rank5" / "startup.json").read_text())
    assert start["groups"]["etp"] == start["groups"]["tp"] == [4, 5]
    _check_losses(folder)
    assert code == 0
