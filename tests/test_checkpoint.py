"""Checkpoint portability (issue 6 item 7, handed case C13).

- Real gloo runs (torch.multiprocessing spawn, file:// rendezvous in tmp_path, no ports):
  save under (dp_shard 2, tp 2) on 4 ranks after one AdamW step, load under
  (dp_shard 4, tp 1) on 4 ranks and under (dp_shard 1, tp 2) and (dp_shard 2, tp 1) on 2
  ranks: every parameter, exp_avg, exp_avg_sq and step is bit-identical (full_tensor()
  against the saved-from values); the per-dp-rank loader position errors at another dp
  degree and comes back per dp rank at the same degree.
- C13 fused gate/up: exact small tensors, and DCP on a fused tp-2 weight showing the
  ranks-concatenated layout that unfuse_gate_up repairs.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict
from datetime import timedelta

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from meshplan.atomic_write import write_json_atomic  # noqa: E402
from meshplan.errors import CheckpointError, ConfigError  # noqa: E402
from meshplan.mesh.resolve import resolve_mesh  # noqa: E402
from meshplan.runtime.execution import checkpoint as C  # noqa: E402
from meshplan.spec.mesh import MeshSpec  # noqa: E402
from meshplan.spec.model import ModelSpec  # noqa: E402
from meshplan.spec.training import TrainingSpec  # noqa: E402
from tests.conftest import spawn_ranks  # noqa: E402

SPEC = ModelSpec(layers=2, hidden=32, ffn=64, q_heads=4, kv_heads=2, vocab=64)
TRAINING = TrainingSpec(global_batch=4, seq_len=8, micro_batch=1, param_dtype="fp32", compute_dtype="fp32")
TIMEOUT_S = 90


def _mesh(names, shape):
    return resolve_mesh(MeshSpec(names=list(names), shape=list(shape)), world=math.prod(shape))


# --------------------------------------------------------------------------- pure: C13 fused


def test_c13_fused_gate_up_tp2_loads_at_tp1_in_order():
    w = [torch.full((1, 3), float(i)) for i in range(4)]          # gate rows w0..w3
    v = [torch.full((1, 3), 100.0 + i) for i in range(4)]         # up rows v0..v3
    rank0, rank1 = torch.cat([w[0], w[1], v[0], v[1]]), torch.cat([w[2], w[3], v[2], v[3]])
    full = C.unfuse_gate_up([rank0, rank1], tp=2)
    assert torch.equal(full, torch.cat(w + v))                     # [w0 w1 w2 w3 v0 v1 v2 v3]
    assert not torch.equal(full, torch.cat([rank0, rank1]))        # not the ranks concatenated
    assert [t.tolist() for t in C.refuse_gate_up(full, tp=2)] == [rank0.tolist(), rank1.tolist()]
    assert torch.equal(C.refuse_gate_up(full, tp=1)[0], full)
    four = C.refuse_gate_up(full, tp=4)                            # tp 2 -> tp 4 goes through the full form
    assert [t[:, 0].tolist() for t in four] == [[0, 100], [1, 101], [2, 102], [3, 103]]
    assert torch.equal(C.unfuse_gate_up(four, tp=4), full)


def test_c13_fused_gate_up_on_another_dim_and_errors():
    full = torch.arange(2 * 8).reshape(2, 8)                        # (hidden, 2*ffn): fused along dim 1
    assert torch.equal(C.unfuse_gate_up(C.refuse_gate_up(full, 2, dim=1), 2, dim=1), full)
    with pytest.raises(ConfigError, match="3 shards for tp 2"):
        C.unfuse_gate_up([full] * 3, tp=2)
    with pytest.raises(ConfigError, match="not divisible by 2 \\* tp"):
        C.refuse_gate_up(torch.zeros(6), tp=2)
    with pytest.raises(ConfigError, match="equal gate and up"):
        C.unfuse_gate_up([torch.zeros(3), torch.zeros(3)], tp=2)


# --------------------------------------------------------------------------- pure: dp-dependent state


def _meta(dp_state, dp=4):
    return C.CheckpointMeta(("dp_shard", "tp"), (dp, 1), dp, dp, 7, dp_state, {"consumed_samples": 28})


def test_c13_dp_state_saved_at_dp4_refuses_dp2_with_one_line():
    meta = _meta({"loader_position": [10, 11, 12, 13]})
    with pytest.raises(CheckpointError) as err:
        C.check_resume(meta, _mesh(("dp_shard", "tp"), (2, 2)), "ckpt")
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith("ckpt: saved at dp 4 (dp_shard 4 x tp 1), loading at dp 2 (dp_shard 2 x tp 2)")
    assert "'loader_position'" in msg and "dropping or repeating" in msg and "discard_dp_state=True" in msg
    assert isinstance(err.value, ConfigError)                      # the CLI's one-line error path
    C.check_resume(meta, _mesh(("dp_shard", "tp"), (4, 1)), "ckpt")                   # same dp: fine
    C.check_resume(meta, _mesh(("dp_shard", "tp"), (2, 2)), "ckpt", discard_dp_state=True)  # explicit
    C.check_resume(_meta({}), _mesh(("dp_shard", "tp"), (2, 2)), "ckpt")             # nothing dp-dependent


def test_meta_file_round_trip_and_refusals(tmp_path):
    meta = _meta({"loader_position": [10, 11, 12, 13]})
    (tmp_path / "c").mkdir()
    write_json_atomic(tmp_path / "c" / C.META_NAME, asdict(meta))
    assert C.read_meta(tmp_path / "c") == meta
    assert [p.name for p in (tmp_path / "c").iterdir()] == [C.META_NAME]          # no temporary left
    with pytest.raises(CheckpointError, match="its save did not finish"):
        C.read_meta(tmp_path)
    (tmp_path / C.META_NAME).write_text('{"version": 1, "mesh_names": ["dp"], "mesh_shape": [2], "world": 2, '
                                        '"dp": 2, "step": 1, "dp_state": {"pos": [1]}}')
    with pytest.raises(CheckpointError, match="one value per dp rank"):
        C.read_meta(tmp_path)


# --------------------------------------------------------------------------- gloo runs


def _spawn(fn, world, *args):
    """Run fn(rank, world, *args) on ``world`` gloo processes (tests.conftest.spawn_ranks)."""
    spawn_ranks(fn, world, *args, timeout_s=TIMEOUT_S)


def _init(rank, world, tmp, tag):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    store = f"file://{tmp}/{tag}"                                   # one fresh file per run
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))


def _build(names, shape, seed):
    from meshplan.runtime.execution.model import Transformer
    from meshplan.runtime.execution.parallelize import init_mesh, parallelize

    mesh = _mesh(names, shape)
    dm = init_mesh(mesh)
    model = Transformer(SPEC, tp=mesh.degree("tp"))
    model.init_weights(seed=seed)
    parallelize(model, dm, mesh, TRAINING, loss_parallel=False)
    return mesh, dm, model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _save_worker(rank, world, tmp, tag):
    from torch.distributed.tensor import DTensor, Shard

    _init(rank, world, tmp, tag)
    try:
        mesh, dm, model, opt = _build(("dp_shard", "tp"), (2, 2), seed=0)
        d = C.dp_rank(mesh, rank)
        tokens = torch.randint(0, SPEC.vocab, (1, 9), generator=torch.Generator().manual_seed(d))
        logits = model(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        opt.step()
        C.save_checkpoint(tmp / "ckpt", model, opt, mesh, step=1, dp_state={"loader_position": 1000 + d},
                          state={"consumed_samples": 2})
        ref = C.full_state(model, opt)
        # C13: a Megatron-style fused gate/up weight, tp rank i holding [w_2i w_2i+1 v_2i v_2i+1]
        t = dm["tp"].get_local_rank()
        local = torch.tensor([[2.0 * t], [2.0 * t + 1], [100 + 2.0 * t], [101 + 2.0 * t]])
        fused = DTensor.from_local(local, dm["tp"], [Shard(0)])
        import torch.distributed.checkpoint as dcp

        dcp.save({"fused": fused}, checkpoint_id=str(tmp / "fused"))
        if rank == 0:
            torch.save(ref, tmp / "ref.pt")
    finally:
        dist.destroy_process_group()


def _load_and_compare(rank, tmp, names, shape, discard):
    mesh, dm, model, opt = _build(names, shape, seed=1)      # other values, empty optimizer
    loaded = C.load_checkpoint(tmp / "ckpt", model, opt, mesh, discard_dp_state=discard)
    got = C.full_state(model, opt)
    want = torch.load(tmp / "ref.pt")
    assert C.bitwise_differences(want, got) == [], (names, shape)
    steps = {k: v.item() for k, v in got.items() if k.endswith(".step")}
    assert steps and set(steps.values()) == {1.0}
    assert any(k.endswith("mlp.w_gate.weight") for k in got) and any(k.endswith("mlp.w_up.weight") for k in got)
    assert any(v.abs().sum() > 0 for k, v in got.items() if k.endswith("exp_avg_sq"))
    assert loaded.meta.step == 1 and loaded.meta.state == {"consumed_samples": 2}
    return mesh, loaded


def _load4_worker(rank, world, tmp, tag):
    _init(rank, world, tmp, tag)
    try:
        mesh, dm, model, opt = _build(("dp_shard", "tp"), (4, 1), seed=1)
        with pytest.raises(CheckpointError, match="saved at dp 2 .* loading at dp 4"):
            C.load_checkpoint(tmp / "ckpt", model, opt, mesh)
        _, loaded = _load_and_compare(rank, tmp, ("dp_shard", "tp"), (4, 1), discard=True)
        assert loaded.dp_state is None
        # C13 through DCP: at tp 1 the fused weight loads as the ranks concatenated ...
        import torch.distributed.checkpoint as dcp

        sd = {"fused": torch.zeros(8, 1)}
        dcp.load(sd, checkpoint_id=str(tmp / "fused"))
        assert sd["fused"].flatten().tolist() == [0, 1, 100, 101, 2, 3, 102, 103]
        # ... and unfuse_gate_up with the saved tp gives the tp-1 weight
        fixed = C.unfuse_gate_up(list(sd["fused"].chunk(2)), tp=2)
        assert fixed.flatten().tolist() == [0, 1, 2, 3, 100, 101, 102, 103]
    finally:
        dist.destroy_process_group()


def _load2_worker(rank, world, tmp, tag):
    _init(rank, world, tmp, tag)
    try:
        _, loaded = _load_and_compare(rank, tmp, ("dp_shard", "tp"), (1, 2), discard=True)
        assert loaded.dp_state is None
        _, loaded = _load_and_compare(rank, tmp, ("dp_shard", "tp"), (2, 1), discard=False)  # same dp 2
        assert loaded.dp_state == {"loader_position": 1000 + rank}
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(4 * TIMEOUT_S)
def test_dcp_reshard_between_meshes_is_bit_identical(tmp_path):
    t0 = time.monotonic()
    for tag, (fn, world) in enumerate([(_save_worker, 4), (_load4_worker, 4), (_load2_worker, 2)]):
        _spawn(fn, world, tmp_path, f"store{tag}")
    meta = C.read_meta(tmp_path / "ckpt")
    assert (meta.mesh_names, meta.mesh_shape, meta.world, meta.dp) == (("dp_shard", "tp"), (2, 2), 4, 2)
    assert meta.dp_state == {"loader_position": [1000, 1001]}
    assert time.monotonic() - t0 < 3 * TIMEOUT_S
