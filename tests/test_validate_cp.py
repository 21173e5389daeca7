"""`meshplan validate` of context parallelism (meshplan.runtime.execution.cp: Llama 3's all-gather CP).

Slow (4 gloo ranks, both configs in the shared 4-rank launch, tests/conftest.py ``world4_runs``):
Llama-3-8B shapes scaled down, cp 2 x dp_shard 2 (FSDP2 over fsdp = dp_shard x cp) and cp 2 x
tp 2 + SP. Every rank's collectives must equal the plan's table exactly (the K/V all-gather and dK/dV reduce-scatter over cp
included), and each rank's losses of the first two steps must equal a single-process
reference: the unsplit model on each rank's whole sequence, the per-token losses averaged
over that rank's own load-balanced chunks, and one AdamW step on the mean over ranks (which
checks the chunking, the global rotary positions, the causal mask across chunks and the
gradient scale of the dK/dV reduce-scatter and FSDP2's average over dp_shard x cp).
Fast: the chunk positions and what the runner still refuses, by name.
"""

import json
from pathlib import Path

import pytest

from meshplan.mesh.resolve import resolve_mesh
from meshplan.spec.mesh import MeshSpec
from meshplan.spec.training import TrainingSpec

torch = pytest.importorskip("torch")

DATA = Path(__file__).parent / "data"


def test_chunks_are_load_balanced_and_cover_the_sequence():
    from meshplan.errors import ConfigError
    from meshplan.runtime.execution.cp import chunk_positions, shard_sequence

    assert chunk_positions(16, 4, 1).tolist() == [2, 3, 12, 13]
    every = torch.cat([chunk_positions(32, 4, r) for r in range(4)])
    assert sorted(every.tolist()) == list(range(32))
    # causal work per rank (keys at or before each query) is equal across ranks
    work = [int((chunk_positions(32, 4, r) + 1).sum()) for r in range(4)]
    assert len(set(work)) == 1
    x = torch.arange(16).view(1, 16)
    assert shard_sequence(x, 2, 1).tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]]
    with pytest.raises(ConfigError, match="training.seq_len"):
        chunk_positions(12, 4, 0)


def test_runner_refuses_cp_with_moe_by_name_and_builds_cp_with_pp():
    from meshplan.runtime.execution.parallelize import unsupported_mesh
    from meshplan.runtime.execution.pipelined import unsupported

    training = TrainingSpec(global_batch=8, seq_len=16, cp_attention="allgather")
    cp = resolve_mesh(MeshSpec(names=["dp_shard", "cp", "tp"], shape=[2, 2, 2]), world=8)
    assert unsupported_mesh(cp, training) is None
    # torch's ring attention (cp_attention unset under framework torch) is planned, not built
    assert unsupported_mesh(cp, TrainingSpec(global_batch=8, seq_len=16)) == (
        "cp > 1 with training.cp_attention 'ring' (torch's context_parallel ring attention, the default under "
        "framework torch): the runtime builds Llama 3's all-gather CP only; set cp_attention = \"allgather\"")
    assert unsupported_mesh(cp, training, moe=True).startswith("cp > 1 with MoE layers")
    pp = resolve_mesh(MeshSpec(names=["pp", "dp_shard", "cp"], shape=[2, 2, 2]), world=8)
    assert unsupported(pp, training, "1f1b") is None  # tests/test_validate_pp_combos.py runs it


def _reference_losses(plan_json: Path, world: int, steps: int = 2) -> list[list[float]]:
    """Per step, each rank's loss from the unsplit model: the rank's whole sequence through
    it, per-token losses averaged over the rank's own cp chunks; the mean over ranks
    backward and one AdamW step (the worker's settings) per step."""
    import torch.nn.functional as F

    from meshplan.runtime.execution.cp import chunk_positions
    from meshplan.runtime.execution.model import Transformer
    from meshplan.runtime.execution.trainstep import adamw, batch
    from meshplan.runtime.execution.worker import load_plan
    from meshplan.mesh.tpsplit import padded_vocab

    _, spec, training, mesh = load_plan(plan_json)
    tp, cp = mesh.degree("tp"), mesh.degree("cp")
    vocab = padded_vocab(spec.vocab, training.vocab_pad_divisor, tp)
    model = Transformer(spec, vocab=vocab, tp=tp)
    model.init_weights(seed=0)
    opt = adamw(model.parameters(), training)  # the AdamW the worker runs
    out = []
    for step in range(steps):
        losses = []
        for r in range(world):
            tokens, labels = batch(training, mesh, r, step, 0, vocab, 0)
            per_token = F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten(), reduction="none")
            mine = chunk_positions(training.seq_len, cp, mesh.group_of(r, "cp").index(r))
            losses.append(per_token.view(tokens.shape)[:, mine].mean())
        torch.stack(losses).mean().backward()
        opt.step()
        opt.zero_grad()
        out.append([float(x.detach()) for x in losses])
    return out


def _check(out: Path, res, world: int, axes: set[str], act_within: float = 0.02) -> list[dict]:
    comp = res[0]["comparison"]
    assert comp["differences"] == [] and comp["group_differences"] == {}
    rows = comp["collectives"]
    assert all(row[f"rank{r}"] == row["meshplan"] for row in rows for r in range(world))
    assert {row["axis"] for row in rows} == axes
    n = len(json.loads((out / f"world{world}" / "rank0" / "collectives.json").read_text())["records"])
    assert n == sum(row["meshplan"] for row in rows)
    ref = _reference_losses(out / f"world{world}" / "plan.json", world)
    for step, kind in enumerate(("recorded", "memory")):
        got = [next(s["loss"] for s in json.loads((out / f"world{world}" / f"rank{r}" / "timings.json").read_text())
                    ["steps"] if s["kind"] == kind) for r in range(world)]
        assert got == pytest.approx(ref[step], rel=1e-5), (kind, got, ref[step])
    # all-gather CP's SDPA keeps the whole sequence's K and V (meshplan.memory.cp_buffers): the activations'
    # maximum within 2% of FSDPMemTracker's (measured 943,180 B against 938,320 cp2 x dp_shard2, 514,988 against
    # 510,288 cp2 x tp2; with the local K/V the plan was 65,536 and 32,768 B short: +8.1% and +7.8%)
    act = next(r for r in res[0]["comparison"]["predicted_vs_measured"] if r["quantity"] == "memory max: activations")
    assert abs(act["error"]) < act_within, act
    # cp peers see the same sequence, each its own chunks: different losses
    peer = json.loads((out / f"world{world}" / "rank0" / "startup.json").read_text())["groups"]["cp"][1]
    assert ref[0][0] != ref[0][peer]
    return rows


def shared_validate_runs() -> dict:
    """Both configs' ``validate`` at world 4, in the shared 4-rank launch (tests/conftest.py
    ``world4_runs``, tests/validate_runs.py); no in-run probe: nothing here reads it (it runs in
    tests/test_validate.py)."""
    from meshplan.runtime.validation.validate import Options

    opt = Options(worlds=(4,), layers=2, seq_len=32, vocab=512, steps=1, timeout_s=200, probe=False)
    return {"cp2_fsdp": (DATA / "validate_llama8b_cp2_fsdp.toml", opt),
            "cp2_tp2sp": (DATA / "validate_llama8b_cp2_tp2sp.toml", opt)}


def _run(runs, name: str):
    run = runs[name]
    assert run.code == 0, run.results[0]["message"]
    return run.out, run.results


@pytest.mark.slow
def test_4_ranks_cp2_dp_shard2_match_the_plan_and_the_reference(world4_runs):
    out, res = _run(world4_runs, "cp2_fsdp")
    rows = _check(out, res, 4, {"cp", "fsdp"})
    # hidden 4096 / 16 = 256, head_dim 8, 8 KV heads: K and V of 32 tokens = 2 x 32 x 8 x 8 x 4 B
    cp = sorted((row["phase"], row["op"], row["size_bytes"], row["meshplan"]) for row in rows if row["axis"] == "cp")
    kv = 2 * 32 * 8 * 8 * 4
    assert cp == [("backward", "reduce-scatter", kv, 2), ("forward", "all-gather", kv, 2)]
    start = json.loads((out / "world4" / "rank1" / "startup.json").read_text())
    assert start["groups"]["cp"] == [0, 1] and start["groups"]["fsdp"] == [0, 1, 2, 3]


@pytest.mark.slow
def test_4_ranks_cp2_tp2_sp_match_the_plan_and_the_reference(world4_runs):
    out, res = _run(world4_runs, "cp2_tp2sp")
    rows = _check(out, res, 4, {"cp", "tp"})
    # tp 2 splits the 8 KV heads: each rank gathers 4 heads of the 32 tokens. dp_shard is 1 at
    # 4 ranks, so fsdp = cp and FSDP2's rows are named cp too (the unit sizes, larger): the
    # smallest unit is the embedding's (torchtitan's units), vocab 512 / tp 2 x hidden 256 x 4 B
    # = 262144 B = 32 kv
    kv = 2 * 32 * 4 * 8 * 4
    cp = sorted((row["phase"], row["op"], row["meshplan"]) for row in rows
                if row["axis"] == "cp" and row["size_bytes"] == kv)
    assert cp == [("backward", "reduce-scatter", 2), ("forward", "all-gather", 2)]
    assert min(row["size_bytes"] for row in rows if row["axis"] == "cp" and row["size_bytes"] != kv) == 512 // 2 * 256 * 4
