"""`meshplan validate` of an MoE mesh with expert parallelism (meshplan.runtime.moe).

Slow (4 gloo ranks, ~30-40 s on 2 cores): Mixtral-8x7B shapes scaled down, FSDP2 over
dp_shard 4, the 8 experts over ep 2 (4 per rank) and sharded over efsdp 2. Every rank's
collectives must equal the plan's table exactly, with the all-to-all bytes the capacity rule
predicts; each rank's losses of the first two steps must equal a single-process reference
that runs every rank's batch through the unsplit model (same weights; capacity is per rank
of tokens in both) and one AdamW step on the mean gradient, which checks the all-to-all
permutation and the experts' gradient scale. Fast: what the runner refuses, by name.
"""

import json
from pathlib import Path

import pytest

from meshplan.mesh import resolve_mesh
from meshplan.spec.mesh import MeshSpec
from meshplan.spec.training import TrainingSpec

torch = pytest.importorskip("torch")

MOE_EP2 = Path(__file__).parent / "data" / "validate_mixtral_ep2_fsdp.toml"


def test_runner_refuses_etp_and_moe_with_tp_by_name():
    from meshplan.runtime.parallelize import _unsupported

    training = TrainingSpec(global_batch=8, seq_len=16)
    etp = resolve_mesh(MeshSpec(names=["dp_shard", "ep", "etp"], shape=[4, 2, 2]), world=4)
    assert _unsupported(etp, training, moe=True).startswith("etp > 1:")
    tp = resolve_mesh(MeshSpec(names=["dp_shard", "tp", "ep"], shape=[2, 2, 2]), world=4)
    assert _unsupported(tp, training, moe=True).startswith("tp > 1 with MoE layers")
    assert _unsupported(tp, training, moe=False) is None
    ep = resolve_mesh(MeshSpec(names=["dp_shard", "ep"], shape=[4, 4]), world=4)
    assert _unsupported(ep, training, moe=True) is None


def _reference_losses(plan_json: Path, world: int, steps: int = 2) -> list[list[float]]:
    """Per step, each rank's loss from the unsplit model: every rank's micro-batch through it
    separately, the mean loss backward, one AdamW step (the worker's settings) per step."""
    import torch.nn.functional as F

    from meshplan.runtime.model import Transformer
    from meshplan.runtime.trainstep import batch
    from meshplan.runtime.worker import load_plan
    from meshplan.tpsplit import padded_vocab

    _, spec, training, mesh = load_plan(plan_json)
    vocab = padded_vocab(spec.vocab, training.vocab_pad_divisor, 1)
    model = Transformer(spec, vocab=vocab)
    model.init_weights(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    out = []
    for step in range(steps):
        losses = []
        for r in range(world):
            tokens, labels = batch(training, mesh, r, step, 0, vocab, 0)
            losses.append(F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten()))
        torch.stack(losses).mean().backward()
        opt.step()
        opt.zero_grad()
        out.append([float(x.detach()) for x in losses])
    return out


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_4_ranks_ep2_dp_shard4_match_the_plan_exactly(tmp_path):
    from meshplan.runtime.validate import Options, validate
    from meshplan.spec.config import load_config

    out = tmp_path / "ev"
    code, res = validate(load_config(MOE_EP2), Options(worlds=(4,), layers=2, seq_len=32, vocab=512, steps=1,
                                                       timeout_s=200), out, echo=lambda *_: None)
    assert code == 0, res[0]["message"]
    comp = res[0]["comparison"]
    assert comp["differences"] == [] and comp["group_differences"] == {}
    rows = comp["collectives"]
    assert all(row[f"rank{r}"] == row["meshplan"] for row in rows for r in range(4))
    assert {row["axis"] for row in rows} == {"dp_shard", "efsdp", "ep"}
    # hidden 4096 / 16 = 256, 32 tokens x top_k 2 over 8 experts: capacity 8 per expert, so
    # each dispatch and combine moves 8 experts x 8 rows x 256 x 4 B = 65536 B; 2 MoE layers
    a2a = {row["phase"]: row for row in rows if row["op"] == "all-to-all"}
    assert a2a["forward"]["size_bytes"] == a2a["backward"]["size_bytes"] == 8 * 8 * 256 * 4
    assert a2a["forward"]["meshplan"] == a2a["backward"]["meshplan"] == 4
    # routed experts: 4 per rank, their own FSDP2 unit over efsdp 2 (gather, re-gather, reduce)
    experts = sorted((row["phase"], row["op"], row["meshplan"]) for row in rows if row["axis"] == "efsdp")
    assert experts == [("backward", "all-gather", 2), ("backward", "reduce-scatter", 2), ("forward", "all-gather", 2)]
    assert {row["size_bytes"] for row in rows if row["axis"] == "efsdp"} == {3 * 4 * 896 * 256 * 4}
    n = len(json.loads((out / "world4" / "rank0" / "collectives.json").read_text())["records"])
    assert n == sum(row["meshplan"] for row in rows) == 22
    start = json.loads((out / "world4" / "rank1" / "startup.json").read_text())
    assert start["groups"]["ep"] == [0, 1] and start["groups"]["efsdp"] == [1, 3]
    assert start["local_shapes"]["layers.0.moe.experts.w_gate"] == {
        "local": [2, 896, 256], "global": [4, 896, 256], "placements": ["S(0)"]}
    # numerics: EP + FSDP2 give each rank the single-process model's losses, before and
    # after one optimizer step
    ref = _reference_losses(out / "world4" / "plan.json", 4)
    for step, kind in enumerate(("recorded", "memory")):
        got = [next(s["loss"] for s in json.loads((out / "world4" / f"rank{r}" / "timings.json").read_text())["steps"]
                    if s["kind"] == kind) for r in range(4)]
        assert got == pytest.approx(ref[step], rel=1e-5), (kind, got, ref[step])
