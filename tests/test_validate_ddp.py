"""`meshplan validate` of plain data parallelism: DDP (``training.sharding = "none"``).

Slow (4 gloo ranks, ~30 s on 2 cores): Llama-3-8B shapes scaled down, dp 4, tp 1, two
micro-batches per step (DDP's ``no_sync`` on the first). Every rank's collectives must equal
the plan's table exactly: in torch 2.13 DDP's first step (the recorded one) all-reduces
every gradient in one bucket during the last backward (``find_unused_parameters=False``
puts all parameters in one bucket until the rebuild after the first step), so one
all-reduce of all parameters' bytes (fp32) over dp. Each rank's losses of the first two
steps must equal a single-process reference (the unsplit model on each rank's micro-batches,
the per-rank sums of micro-batch losses averaged over ranks, one AdamW step), which checks
that the gradients are combined over dp and accumulated under ``no_sync`` (AdamW hides a
uniform gradient scale).
Fast: what the runner still refuses with sharding "none", by name; the table's DDP row.
"""

import json
from pathlib import Path

import pytest

from meshplan.mesh.resolve import resolve_mesh
from meshplan.spec.mesh import MeshSpec
from meshplan.spec.training import TrainingSpec

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("names, shape, moe, why", [
    (["dp", "tp"], [2, 2], False, "sharding 'none' with tp > 1"),
    (["dp", "cp"], [2, 2], False, "sharding 'none' with cp > 1"),
    (["dp"], [4], True, "sharding 'none' with MoE layers"),
])
def test_runner_refuses_ddp_beyond_plain_data_parallelism_by_name(names, shape, moe, why):
    from meshplan.runtime.execution.parallelize import unsupported_mesh

    training = TrainingSpec(global_batch=8, seq_len=16, sharding="none")
    mesh = resolve_mesh(MeshSpec(names=names, shape=shape), world=4)
    assert unsupported_mesh(mesh, training, moe=moe).startswith(why)
    assert unsupported_mesh(resolve_mesh(MeshSpec(names=["dp"], shape=[4]), world=4), training) is None
    zero1 = TrainingSpec(global_batch=8, seq_len=16, sharding="zero1")
    assert unsupported_mesh(resolve_mesh(MeshSpec(names=["dp"], shape=[4]), world=4), zero1).startswith("sharding 'zero1'")


def _reference(plan_json: Path, world: int, steps: int = 2) -> tuple[list[list[float]], int]:
    """(per step, each rank's mean micro-batch loss from the unsplit model; the model's
    parameter bytes). Backward of the mean over ranks of each rank's summed micro-batch
    losses (the worker accumulates micro-batches, DDP averages over dp), one AdamW step."""
    import torch.nn.functional as F

    from meshplan.runtime.execution.model import Transformer
    from meshplan.runtime.execution.trainstep import adamw, batch
    from meshplan.runtime.execution.worker import load_plan
    from meshplan.mesh.tpsplit import padded_vocab

    _, spec, training, mesh = load_plan(plan_json)
    vocab = padded_vocab(spec.vocab, training.vocab_pad_divisor, 1)
    model = Transformer(spec, vocab=vocab, tp=1)
    model.init_weights(seed=0)
    opt = adamw(model.parameters(), training)  # the AdamW the worker runs
    micro = training.global_batch // (training.micro_batch * mesh.dp)
    out = []
    for step in range(steps):
        per_rank = []
        for r in range(world):
            losses = [F.cross_entropy(model(t).flatten(0, 1), y.flatten())
                      for t, y in (batch(training, mesh, r, step, mb, vocab, 0) for mb in range(micro))]
            per_rank.append(losses)
        torch.stack([sum(ls) for ls in per_rank]).mean().backward()
        opt.step()
        opt.zero_grad()
        out.append([float(sum(ls).detach()) / micro for ls in per_rank])
    return out, sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.slow
def test_4_ranks_ddp_dp4_match_the_plan_and_the_reference(ddp4_world4):
    # tests/conftest.py's run (no in-run probe: nothing here reads it, it runs in tests/test_validate.py),
    # which tests/test_checkpoint_writes.py reads too: one launch for both
    out, code, res = ddp4_world4
    assert code == 0, res[0]["message"]
    comp = res[0]["comparison"]
    assert comp["differences"] == [] and comp["group_differences"] == {}
    ref, param_bytes = _reference(out / "world4" / "plan.json", 4)
    # one bucket of every gradient, fp32, over dp = [0, 1, 2, 3], in the second micro-batch's backward
    rows = [(row["axis"], row["phase"], row["op"], row["size_bytes"], row["dtype"], row["meshplan"],
             *(row[f"rank{r}"] for r in range(4))) for row in comp["collectives"]]
    assert rows == [("dp", "backward", "all-reduce", param_bytes, "fp32", 1, 1, 1, 1, 1)]
    assert param_bytes == 7_869_440  # 1,967,360 parameters: hidden 256, ffn 896, vocab 512, 2 layers
    for r in range(4):
        recs = json.loads((out / "world4" / f"rank{r}" / "collectives.json").read_text())["records"]
        assert [(c["torch_op"], c["group"], c["size_bytes"]) for c in recs] == \
            [("c10d::allreduce_", [0, 1, 2, 3], param_bytes)]
    for step, kind in enumerate(("recorded", "memory")):
        got = [next(s["loss"] for s in json.loads((out / "world4" / f"rank{r}" / "timings.json").read_text())
                    ["steps"] if s["kind"] == kind) for r in range(4)]
        assert got == pytest.approx(ref[step], rel=1e-5), (kind, got, ref[step])
    assert len(set(ref[0])) == 4  # each dp rank its own batch
