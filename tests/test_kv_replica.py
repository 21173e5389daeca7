"""Replicated KV heads kept in sync (handed case C6, tp > kv_heads): the runtime sums the
copies' wk/wv gradients over each replica group before the optimizer, and what torch issues
equals the plan's ``kv_replica`` row (count, bytes, dtype, group).

- fake process group, one process per recorded rank (as tests/test_table_vs_torch.py): the
  whole step's collectives against the table, under FSDP2 (dp_shard 2 x tp 4);
- gloo, 4 processes (tp 4, 2 KV heads: replica groups [0, 1] and [2, 3]): the copies start
  equal, are equal after a step with the sync, and differ after a step without it; the
  recorded all-reduces are the table's row.

Model: 8 q heads, 2 KV heads of 8, h 64, 2 layers. At tp 4 each rank holds one KV head: wk
and wv of 8 x 64 = 512 elements each, one flattened buffer of 1024 fp32 elements (4096 B)
per layer; FSDP2 over dp_shard 2 keeps 4 of the 8 rows of each: 2048 B.
"""

from __future__ import annotations

import json
import os
from datetime import timedelta
from math import prod

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from meshplan import catalog  # noqa: E402
from meshplan.comm.collectives import collective_table  # noqa: E402
from meshplan.mesh.resolve import resolve_mesh  # noqa: E402
from meshplan.placement.assign import place  # noqa: E402
from meshplan.runtime.validation.compare import (differences, rank_extra_groups, tally_records,  # noqa: E402
                                                 tally_table)
from meshplan.runtime.validation.dryrun import dry_run  # noqa: E402
from meshplan.spec.mesh import MeshSpec  # noqa: E402
from meshplan.spec.model import ModelSpec  # noqa: E402
from meshplan.spec.training import TrainingSpec  # noqa: E402
from tests.conftest import spawn_ranks  # noqa: E402

pytestmark = pytest.mark.timeout(240)

C6 = ModelSpec(name="c6-tiny", layers=2, hidden=64, ffn=128, q_heads=8, kv_heads=2, head_dim=8, vocab=256)
FP32 = dict(param_dtype="fp32", compute_dtype="fp32", reduce_dtype="fp32", recompute="none")
TIMEOUT_S = 120


def _mesh(names, shape):
    return resolve_mesh(MeshSpec(names=list(names), shape=list(shape)), world=prod(shape))


def _table(model, training, mesh):
    cluster = catalog.system("dgx-h100", nodes=max(1, mesh.world // 8))
    return collective_table(model, training, mesh, cluster, place(cluster, mesh.world), list(range(model.layers)),
                            micro_batches=1)


def _kv_rows(rows):
    return [(r.axis, r.phase, r.op, r.size_bytes, r.dtype, r.per_microbatch, r.per_step, r.example_ranks)
            for r in rows if r.axis == "kv_replica"]


@pytest.mark.parametrize("rank", [0, 5])
def test_fake_pg_fsdp2_step_matches_the_table(rank):
    """dp_shard 2 x tp 4 (world 8): rank 5's replica group is [4, 5]; its two all-reduces (one
    per layer) of 2 x 4 x 64 fp32 = 2048 B, in phase step, are the table's row, and every other
    collective of the step matches too."""
    training = TrainingSpec(global_batch=8, seq_len=16, **FP32)
    mesh = _mesh(("dp_shard", "tp"), (2, 4))
    run = dry_run(C6, training, mesh, rank=rank, optimizer_step=False)
    extra = rank_extra_groups(mesh, C6, rank)
    assert extra == {"kv_replica": [0, 1] if rank == 0 else [4, 5]}
    kv = [r for r in run.records if tuple(r.group) == tuple(extra["kv_replica"])]
    assert [(r.phase, r.op, r.size_bytes, r.dtype) for r in kv] == [("step", "all-reduce", 2048, "fp32")] * 2
    table = _table(C6, training, mesh)
    assert _kv_rows(table) == [("kv_replica", "step", "all-reduce", 2 * 4 * 64 * 4, "fp32", 0, 2, (0, 1))]
    assert differences(tally_records(run.records, mesh, rank, extra),
                       tally_table(table, mesh, rank, extra=extra)) == []
    # without the model's groups the copies' all-reduce is on no axis: the comparison says so
    assert any(k[0] == "?[0, 1]" or k[0] == "?[4, 5]" for k in tally_records(run.records, mesh, rank))


def test_no_replication_no_sync():
    """tp 2 with 2 KV heads: one head per rank, no copies, no kv_replica row or collective."""
    training = TrainingSpec(global_batch=8, seq_len=16, **FP32)
    mesh = _mesh(("dp_shard", "tp"), (2, 2))
    run = dry_run(C6, training, mesh, rank=0, optimizer_step=False)
    assert _kv_rows(_table(C6, training, mesh)) == []
    assert rank_extra_groups(mesh, C6, 0) == {}
    assert differences(tally_records(run.records, mesh, 0), tally_table(_table(C6, training, mesh))) == []


# --------------------------------------------------------------------------- gloo, 4 ranks


class _Status:
    def set(self, *a, **kw):
        pass


def _worker(rank, world, tmp, sync):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store-{sync}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        from meshplan.mesh.tpsplit import padded_vocab
        from meshplan.runtime.execution.model import Transformer
        from meshplan.runtime.execution.parallelize import init_mesh, parallelize
        from meshplan.runtime.execution.recorder import CollectiveRecorder
        from meshplan.runtime.execution.trainstep import Runner

        mesh = _mesh(("tp",), (4,))
        training = TrainingSpec(global_batch=1, seq_len=16, micro_batch=1, sharding="zero3", **FP32)
        vocab = padded_vocab(C6.vocab, training.vocab_pad_divisor, 4)
        dm = init_mesh(mesh)
        with torch.device("meta"):
            model = Transformer(C6, vocab=vocab, tp=4)
        parallelize(model, dm, mesh, training, loss_parallel=True)
        model.to_empty(device="cpu")
        model.init_weights(seed=0)
        runner = Runner(model, training, mesh, rank, vocab, 0, _Status(), "cpu")
        if not sync:
            runner.kv_sync = None

        def heads():  # (layer, tensor) -> 4 heads of (8, 64), the copies in tp order
            return {(i, n): getattr(b.attention, n).weight.full_tensor().view(4, 8, 64).clone()
                    for i, b in model.layers.items() for n in ("wk", "wv")}

        before = heads()
        with CollectiveRecorder() as rec:
            runner.step(0, rec)
        after = heads()
        out = {"equal_before": all(torch.equal(h[0], h[1]) and torch.equal(h[2], h[3]) for h in before.values()),
               "equal_after": all(torch.equal(h[0], h[1]) and torch.equal(h[2], h[3]) for h in after.values()),
               "moved": all(not torch.equal(before[k], after[k]) for k in before),
               "records": [{**r.__dict__, "group": list(r.group)} for r in rec.records]}
        with open(f"{tmp}/rank{rank}-{sync}.json", "w") as f:
            json.dump(out, f)
    finally:
        dist.destroy_process_group()


def _spawn(world, *args):
    spawn_ranks(_worker, world, *args, timeout_s=TIMEOUT_S)


@pytest.mark.slow
def test_gloo_copies_stay_equal_and_torch_issues_the_table_row(tmp_path):
    """tp 4 on 4 gloo ranks, one AdamW step through the worker's Runner: with the sync the
    copies (heads 0 = 1, 2 = 3 of the global wk and wv) are equal before and after the step
    and did move; without it they differ after the step. Torch's collectives of the step,
    rank by rank, equal the table's (the kv_replica row: 2 all-reduces of 4096 B fp32 on
    [0, 1] or [2, 3], phase step)."""
    from meshplan.runtime.execution.recorder import Collective

    for sync in (True, False):
        _spawn(4, str(tmp_path), sync)
    training = TrainingSpec(global_batch=1, seq_len=16, micro_batch=1, sharding="zero3", **FP32)
    mesh = _mesh(("tp",), (4,))
    table = _table(C6, training, mesh)
    assert _kv_rows(table) == [("kv_replica", "step", "all-reduce", 2 * 8 * 64 * 4, "fp32", 0, 2, (0, 1))]
    for rank in range(4):
        on = json.loads((tmp_path / f"rank{rank}-True.json").read_text())
        off = json.loads((tmp_path / f"rank{rank}-False.json").read_text())
        assert on["equal_before"] and on["equal_after"] and on["moved"]
        assert off["equal_before"] and not off["equal_after"]
        mine = [0, 1] if rank < 2 else [2, 3]
        kv = [(r["phase"], r["op"], r["size_bytes"], r["dtype"]) for r in on["records"] if r["group"] == mine]
        assert kv == [("step", "all-reduce", 4096, "fp32")] * 2
        assert not [r for r in off["records"] if r["group"] == mine]
        recs = [Collective(**{**r, "group": tuple(r["group"])}) for r in on["records"]]
        extra = rank_extra_groups(mesh, C6, rank)
        assert differences(tally_records(recs, mesh, rank, extra),
                           tally_table(table, mesh, rank, per_step=True, extra=extra)) == []


def test_copies_compute_the_real_models_logits():
    """Built for tp 4 (4 KV heads: each of the 2 real heads copied twice) and initialised,
    the single-process model gives the real 2-KV-head model's logits: the copies hold the
    real heads (drawn once, in the same order), and the q heads of a copy's rank use it. A
    pipeline stage (``init_stage_weights``) draws the same."""
    from meshplan.runtime.execution.model import Transformer
    from meshplan.runtime.execution.pipelined_stage import StageModule, init_stage_weights

    ref = Transformer(C6)
    ref.init_weights(seed=3)
    copied = Transformer(C6, tp=4)
    copied.init_weights(seed=3)
    assert copied.kv_heads == 4 and copied.layers["0"].attention.wk.weight.shape == (32, 64)
    wk = copied.layers["1"].attention.wk.weight.view(4, 8, 64)
    real = ref.layers["1"].attention.wk.weight.view(2, 8, 64)
    assert torch.equal(wk[0], real[0]) and torch.equal(wk[1], real[0]) and torch.equal(wk[3], real[1])
    assert torch.equal(copied.output.weight, ref.output.weight)  # drawn after the copies: same order
    tokens = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    assert torch.allclose(copied(tokens), ref(tokens), atol=1e-6)
    with torch.device("meta"):
        full = Transformer(C6, tp=4)
    stage = StageModule(full, [0, 1], first=True, last=True)
    stage.to_empty(device="cpu")
    init_stage_weights(full, seed=3)
    assert torch.equal(stage.layers["1"].attention.wv.weight, copied.layers["1"].attention.wv.weight)


def test_validate_probes_no_kv_replica_group_under_megatron():
    """``validate``'s collective probe of a framework megatron plan at dp_shard 2 x tp 4 past 2 KV
    heads: Megatron-LM replicates no KV head (spec/axes/tp_kv.py), so no kv_replica group is probed
    (before: the copies' 2048 B all-reduce); the fused QKV output's all-gather and reduce-scatter
    are probed on the tp groups: b 1 x s 16 x (8 + 2 x 2) heads x 8 x 4 B (fp32) = 6,144 B. Under
    torch tp 4 past 2 KV heads is infeasible (rule torch_kv_heads: torchtitan b5bcd76 replicates
    no KV head)."""
    from meshplan.config import config_from_dict
    from meshplan.plan import build_plan
    from meshplan.runtime.validation.probe import probe_spec

    plan = build_plan(config_from_dict({
        "model": C6.model_dump(exclude={"name"}), "cluster": {"system": "dgx-h100", "nodes": 1},
        "training": {"global_batch": 8, "seq_len": 16, "sharding": "zero3", "framework": "megatron", **FP32},
        "mesh": {"names": ["dp_shard", "tp"], "shape": [2, 4]}}))
    spec = probe_spec(plan)
    assert not [e for e in spec if e["axis"] == "kv_replica"]
    assert [e["op"] for e in spec if e["axis"] == "tp" and e["size_bytes"] == 16 * 12 * 8 * 4] == \
        ["all-gather", "reduce-scatter"]


def test_validate_refuses_tp_past_the_kv_heads(tmp_path):
    """``meshplan validate`` runs framework torch only, and under torch pp 2 x tp 4 with 2 KV heads
    is infeasible (rule torch_kv_heads: torchtitan b5bcd76 shards wk/wv colwise over tp and
    replicates no KV head), so validate says so in one line and runs nothing. Before, it ran the
    KV copies on 8 gloo ranks against the plan (test_validate_pp2_tp4_kv_replicated_matches_the_plan_exactly,
    removed with the rule; the copies' runtime stays tested above on gloo and the fake process group)."""
    import dataclasses
    from pathlib import Path

    from meshplan.config import load_config
    from meshplan.runtime.validation.validate import Options, validate

    cfg = load_config(Path(__file__).parent / "data" / "validate_llama8b_pp2_tp2_sp.toml")
    cfg = dataclasses.replace(cfg, model=cfg.model.model_copy(update={"kv_heads": 2}),
                              mesh=cfg.mesh.model_copy(update={"shape": [2, 1, 4]}))
    code, res = validate(cfg, Options(worlds=(8,), layers=4, seq_len=32, vocab=512, steps=1, micro_batches=4,
                                      timeout_s=300), tmp_path / "ev", echo=lambda *_: None)
    assert code != 0
    assert res[0]["message"].startswith("the scaled plan is infeasible: framework torch: tp 4 with kv_heads 2: "
                                        "torchtitan shards wk/wv colwise over tp"), res[0]


@pytest.mark.parametrize("sp,names,shape,extra", [
    (True, ("dp_shard", "tp"), (2, 4), {}),
    (False, ("dp_replicate", "dp_shard", "tp"), (2, 2, 4), {"sharding": "hsdp", "micro_batch": 2})])
def test_fake_pg_biases_mixed_precision_hsdp(sp, names, shape, extra):
    """With K/V biases (``qkv_bias``), bf16 compute (FSDP2 mixed precision, fp32 reduce), SP
    or HSDP: rank 5's buffer per layer is wk + wv (4 of 8 rows x 64 each) + their biases (4 of
    8 each) = 520 fp32 elements = 2080 B, twice, and the whole step matches the table."""
    model = C6.model_copy(update={"qkv_bias": True})
    training = TrainingSpec(global_batch=8, seq_len=16, param_dtype="fp32", compute_dtype="bf16",
                            reduce_dtype="fp32", recompute="none", **extra)
    mesh = resolve_mesh(MeshSpec(names=list(names), shape=list(shape), sequence_parallel=sp), world=prod(shape))
    run = dry_run(model, training, mesh, rank=5, optimizer_step=False, mixed_precision=True)
    ex = rank_extra_groups(mesh, model, 5)
    recorded = tally_records(run.records, mesh, 5, ex)
    assert recorded[("kv_replica", "step", "all-reduce", (2 * 4 * 64 + 2 * 4) * 4, "fp32")] == 2
    assert differences(recorded, tally_table(_table(model, training, mesh), mesh, 5, extra=ex)) == []


# --------------------------------------------------------------------------- DCP, 4 gloo ranks

MQA = ModelSpec(name="mqa-tiny", layers=2, hidden=32, ffn=64, q_heads=4, kv_heads=1, head_dim=8, vocab=64)


def _kv_ckpt_worker(rank, world, tmp):
    """dp_shard 2 x tp 2 on an MQA model: 1 real KV head, built twice (tp ranks 0, 1 of each
    tp group hold a copy); FSDP2 halves every copy. One AdamW step with the KV sync, a DCP
    save, the copies and the optimizer moments made to differ, a load; then a load into
    dp_shard 4 x tp 1 (no copies). Writes what it saw to ``tmp/kv<rank>.json``."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store-kv", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        from meshplan.runtime.execution import checkpoint as C
        from meshplan.runtime.execution.kvsync import kv_replica_sync
        from meshplan.runtime.execution.model import Transformer
        from meshplan.runtime.execution.parallelize import init_mesh, parallelize

        training = TrainingSpec(global_batch=4, seq_len=8, micro_batch=1, **FP32)

        def build(shape, seed):
            mesh = _mesh(("dp_shard", "tp"), shape)
            dm = init_mesh(mesh)
            model = Transformer(MQA, tp=shape[1])
            model.init_weights(seed=seed)
            parallelize(model, dm, mesh, training, loss_parallel=False)
            return mesh, model, torch.optim.AdamW(model.parameters(), lr=1e-2)

        mesh, model, opt = build((2, 2), seed=0)
        sync = kv_replica_sync([model], MQA, mesh)
        tokens = torch.randint(0, MQA.vocab, (1, 9), generator=torch.Generator().manual_seed(C.dp_rank(mesh, rank)))
        torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
        sync()
        opt.step()
        ref = C.full_state(model, opt)
        C.save_checkpoint(tmp / "ckpt", model, opt, mesh, step=1)
        att = model.layers["0"].attention
        with torch.no_grad():  # every rank's local halves of both copies, weights and moments, made different
            for p in (att.wk.weight, att.wv.weight):
                p.to_local().add_(1.0 + rank)
                opt.state[p]["exp_avg"].to_local().mul_(3.0 + rank)
        C.load_checkpoint(tmp / "ckpt", model, opt, mesh)
        got = C.full_state(model, opt)
        kv = [k for k in got if ("attention.wk.weight" in k or "attention.wv.weight" in k) and got[k].dim()]
        out = {"restored": C.bitwise_differences(ref, got), "kv_tensors": len(kv),
               "copies_equal": all(torch.equal(got[k].view(2, -1)[0], got[k].view(2, -1)[1]) for k in kv)}
        _, one, opt1 = build((4, 1), seed=1)  # no copies: the checkpoint's shape is the real model's
        C.load_checkpoint(tmp / "ckpt", one, opt1, _mesh(("dp_shard", "tp"), (4, 1)))
        tp1 = C.full_state(one, opt1)
        out["tp1_equal"] = [torch.equal(tp1[k], ref[k][:8]) for k in kv]
        with open(f"{tmp}/kv{rank}.json", "w") as f:
            json.dump(out, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_dcp_saves_each_kv_head_once_and_loads_it_into_every_copy(tmp_path):
    """The checkpoint holds the real model's KV tensors: wk/wv of 1 head x 8 rows x 32 and
    their AdamW moments, each element written once (two chunks of 4 rows: FSDP2's halves;
    before: 16 rows, both copies written, a shape only tp 2 could load). A load makes the
    copies equal again (weights and moments bit-identical to before the save) and loads at
    tp 1 too."""
    import torch.distributed.checkpoint as dcp

    spawn_ranks(_kv_ckpt_worker, 4, tmp_path, timeout_s=TIMEOUT_S)
    meta = dcp.FileSystemReader(str(tmp_path / "ckpt" / "dcp")).read_metadata().state_dict_metadata
    kv = {k: v for k, v in meta.items() if k.endswith(("attention.wk.weight", "attention.wv.weight"))
          or ".attention.wk.weight." in k or ".attention.wv.weight." in k}
    kv = {k: v for k, v in kv.items() if hasattr(v, "chunks") and len(v.size) == 2}
    assert len(kv) == 2 * 2 * 3  # 2 layers x (wk, wv) x (weight, exp_avg, exp_avg_sq)
    for k, v in kv.items():
        assert tuple(v.size) == (8, 32), k
        assert sorted((tuple(c.offsets), tuple(c.sizes)) for c in v.chunks) == [((0, 0), (4, 32)), ((4, 0), (4, 32))], k
    for rank in range(4):
        out = json.loads((tmp_path / f"kv{rank}.json").read_text())
        assert out == {"restored": [], "kv_tensors": 12, "copies_equal": True, "tp1_equal": [True] * 12}, rank
