"""Validate's memory rows by kind compare like with like (newcomer trial 21).

The trial read, at world 4 of ``examples/mini_2x4_tp2-dp4.toml``, the total -2% but params
-32%, grads -35% and temporaries +7809%: the rows were FSDPMemTracker's own labels at its peak,
where autograd's unsharded gradients and a gathered unit were still ``Temp``. The worker now
relabels every storage with its final label (``runtime.execution.memtracker.relabelled_kinds``)
and each row is the kind's maximum over the step on both sides. Tolerances, from what differs:
the persistent state and the FSDP buffers are the same tensors on both sides (exact; AdamW's
step counters aside, 4 B per parameter tensor); activations within 20% (the bound of
``tests/test_memory_vs_tracker.py``: the timeline models a layer pass's working set, the
tracker single ops); temporaries within 20% too: the plan's working sets and the optimizer
step's of ``training.optimizer_impl``, the AdamW the worker runs (fused by default: its step
allocates nothing; the worker's single-tensor AdamW before it, 3 parameter-shard temporaries
the plan left out, made this row +282% on the MoE config); gloo's reduce-scatter copy
one per reduce-scatter input, not predicted. An MoE layer's routed working sets are compared at the run's routing: the plan takes
balanced routing (128 received rows per rank and layer here), the run's router is not balanced,
so its measured rows (``memory.json`` ``expert_counts``) move the expected bytes by the plan's
per-row bytes, derived below.
"""

import json
import math
from pathlib import Path
from typing import Optional

import pytest

pytest.importorskip("torch")

from meshplan.runtime.execution.memtracker import RS_COPY_KIND, relabelled_kinds  # noqa: E402

EXAMPLE = Path(__file__).parent.parent / "examples" / "mini_2x4_tp2-dp4.toml"


def test_relabelled_kinds_reads_final_labels_and_names_gloo_reduce_scatter_copies():
    # (storage, delta bytes, label at that update, phase); a storage is any hashable record
    log = [("sh", 100, "Sharded Param", "forward"),
           ("act", 40, "Activation", "forward"),         # kept for backward: activations
           ("tmp", 30, "Activation", "forward"),         # allocated and freed in forward: a temporary
           ("tmp", -30, "Activation", "forward"),
           ("g", 64, "Temp", "backward"),                # labelled later: an unsharded gradient
           ("g", 0, "Unsharded Grad", "backward"),
           ("rs", 64, "Reduce Scatter", "backward"),     # a reduce-scatter input ...
           ("cp", 64, "Temp", "backward"),               # ... and a temporary of its size: gloo's copy
           ("other", 8, "Temp", "backward"),             # any other temporary stays one
           ("cp", -64, "Temp", "backward"), ("rs", -64, "Reduce Scatter", "backward"),
           ("g", -64, "Unsharded Grad", "backward"), ("other", -8, "Temp", "backward"),
           ("act", -40, "Activation", "backward")]
    kmax, top, at_top = relabelled_kinds(log)
    assert kmax == {"params": 100, "activations": 40, "temporaries": 30, "grad_buffers": 128,
                    RS_COPY_KIND: 64}
    assert top == 100 + 40 + 64 + 64 + 64 + 8  # after "other": every storage of the backward alive
    assert at_top == {"params": 100, "activations": 40, "grad_buffers": 128, RS_COPY_KIND: 64, "temporaries": 8}


def _assert_temporaries(tmp: dict, want: Optional[int] = None) -> None:
    """The temporaries row within 20% of ``want`` (default: the plan's), the working sets'
    tolerance: the fused AdamW's step adds none on either side."""
    want = tmp["predicted"] if want is None else want
    assert abs(tmp["measured"] / want - 1) <= 0.20, (tmp, want)


def shared_validate_runs() -> dict:
    """``meshplan validate CONFIG --worlds 4 --steps 1 --no-probe --timeout-s 80`` (validate's
    seq 64) of :data:`EXAMPLE` with ``optimizer_impl = "foreach"`` and of :data:`MOE` under full
    recompute, as the Options the CLI builds, in the shared 4-rank launch (tests/conftest.py
    ``world4_runs``, tests/validate_runs.py)."""
    import dataclasses

    from meshplan.config import load_config
    from meshplan.runtime.validation.validate import Options

    def changed(path: Path, **training):
        base = load_config(path)
        assert all(getattr(base.training, k) != v for k, v in training.items())  # a real change
        return dataclasses.replace(base, training=base.training.model_copy(update=training))

    opt = Options(worlds=(4,), steps=1, probe=False, timeout_s=80)
    return {"foreach_adamw": (changed(EXAMPLE, optimizer_impl="foreach"), opt),
            "moe_full_recompute": (changed(MOE, recompute="full"), opt)}


def _validated_world4(run) -> tuple[dict, dict]:
    """A shared world-4 run (:func:`shared_validate_runs`) that passed: (its rows by quantity, the
    ``memory max: KIND`` rows by kind)."""
    assert run.code == 0, run.stdout
    return _memory_rows(run.out)


def _memory_rows(out: Path) -> tuple[dict, dict]:
    """World 4's rows of the evidence in ``out`` by quantity, and its ``memory max: KIND`` rows by kind."""
    rows = {r["quantity"]: r for r in json.loads((out / "world4" / "predicted_vs_measured.json").read_text())}
    return rows, {q.removeprefix("memory max: "): r for q, r in rows.items() if q.startswith("memory max: ")}


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_validate_world4_memory_rows_compare_like_with_like(staged_tp2_fsdp):
    # EXAMPLE's tables at world 4, read from the staged run tests/test_validate.py checks too
    # (tests/conftest.py: tests/data/validate_llama8b_tp2sp_fsdp.toml holds the same tables;
    # validate's seq 64 as before, the probe after the steps, which the memory step does not see):
    # one launch for both. At seq 32 (tried for this merge) the temporaries row reads +39%, 262,144 B
    # measured against 188,416 B predicted, outside the 20% below: not looked into yet
    tables = [[ln for ln in f.read_text().splitlines() if not ln.startswith("#")]
              for f in (EXAMPLE, Path(__file__).parent / "data" / "validate_llama8b_tp2sp_fsdp.toml")]
    assert tables[0] == tables[1]
    out, cp = staged_tp2_fsdp
    assert cp.returncode == 0, cp.stdout + cp.stderr
    rows, kind = _memory_rows(out)
    assert not any(q.startswith("peak memory: ") for q in rows)  # the raw tracker-label rows are gone
    for k in ("params", "grads", "gathered_params", "grad_buffers"):
        assert kind[k]["measured"] == kind[k]["predicted"] > 0, (k, kind[k])
    start = json.loads((out / "world4" / "rank0" / "startup.json").read_text())["local_shapes"]
    n_tensors = len(start)
    opt = kind["optimizer"]
    assert 0 <= opt["measured"] - opt["predicted"] <= 4 * n_tensors, opt
    act = kind["activations"]
    assert abs(act["error"]) <= 0.20, act
    _assert_temporaries(kind["temporaries"])
    # gloo's copy: the size of a dp_shard reduce-scatter input of the plan's table, not predicted
    plan = json.loads((out / "world4" / "plan.json").read_text())
    rs_in = {r["size_bytes"] for r in plan["collectives"]["stage 0"]  # nccl-tests' size: the input's bytes
             if r["op"] == "reduce-scatter" and r["axis"] == "dp_shard"}
    copy = kind[RS_COPY_KIND]
    assert copy["predicted"] is None and copy["measured"] in rs_in, (copy, rs_in)


def test_the_worker_runs_the_adamw_of_optimizer_impl():
    import torch

    from meshplan.runtime.execution.trainstep import adamw
    from meshplan.spec.training import TrainingSpec

    t = TrainingSpec(global_batch=8, seq_len=16)  # optimizer_impl unset: "fused", torchtitan's default
    w = torch.nn.Parameter(torch.ones(4))
    fused, foreach = adamw([w], t), adamw([w], t.model_copy(update={"optimizer_impl": "foreach"}))
    assert (fused.defaults["fused"], fused.defaults["foreach"]) == (True, False)
    assert (foreach.defaults["fused"], foreach.defaults["foreach"]) == (False, True)


@pytest.mark.slow
def test_validate_world4_foreach_adamw_temporary_is_one_state(world4_runs):
    """``optimizer_impl = "foreach"``: the worker runs torch's ``_multi_tensor_adam``, whose
    ``exp_avg_sq_sqrt`` (one state-sized tensor per parameter, torch/optim/adam.py) is the
    step's temporary, and the plan counts one optimizer state
    (``MemoryOptions.optimizer_temp_states_for``): an fp32 state is the fp32 parameter shard,
    half the 2-state optimizer row. Measured the same (1,968,640 B on rank 0), in the step."""
    _, kind = _validated_world4(world4_runs["foreach_adamw"])
    tmp = kind["temporaries"]
    assert tmp["predicted"] == kind["params"]["predicted"] == kind["optimizer"]["predicted"] // 2
    _assert_temporaries(tmp)
    assert tmp["note"].endswith("measured max in step"), tmp["note"]


MOE = Path(__file__).parent / "data" / "validate_mixtral_ep2_fsdp.toml"
#: Mixtral scaled by validate at world 4 (hidden 4096 / 16, expert ffn 14336 / 16, fp32): the
#: bytes one received row adds to a layer's routed working sets, the plan's terms
#: (meshplan.memory.workingset): 3 f-wide gradients in backward (the activation step);
#: in full recompute's checkpointed forward 3 f-wide (two grouped GEMMs' outputs and silu's) and
#: 2 h-wide (the all-to-all's output and its expert-major copy); recomputed, 4 f-wide kept
#: (gate, up, silu, product) and the dispatched input and expert output.
H, F, A = 256, 896, 4
ROW_BACKWARD, ROW_FORWARD, ROW_KEPT = 3 * F * A, 3 * F * A + 2 * H * A, 4 * F * A + 2 * H * A
BALANCED_ROWS = 64 * 2  # 64 tokens x top 2 per rank, balanced over the ep 2 ranks' experts (8 / 2 each)


def _received_rows(out: Path, rank: int, replayed: bool) -> int:
    """The most rows ``rank``'s local experts received in one MoE layer of the memory step: the
    copies its ep group's routers sent them (``memory.json`` ``expert_counts``, each rank's
    copies per expert; a full-recompute replay routes them again, counted twice)."""
    plan = json.loads((out / "world4" / "plan.json").read_text())
    group = next(g for g in plan["groups"]["ep"] if rank in g)
    counts = [json.loads((out / "world4" / f"rank{r}" / "memory.json").read_text())["expert_counts"] for r in group]
    n = len(counts[0]["layers.0.moe"]) // len(group)
    i = group.index(rank)
    rows = max(sum(sum(c[layer][i * n:(i + 1) * n]) for c in counts) for layer in counts[0])
    return rows // 2 if replayed else rows


@pytest.mark.slow
def test_validate_world4_moe_memory_rows_compare_like_with_like(moe_ep2_fsdp):
    # Mixtral's shapes scaled down, dp_shard 4 x ep 2 at world 4: the experts Shard(0) over efsdp 2
    # (efsdp x ep = 4 <= 8 experts), a second parameter group of their block's unit. Before: gathered
    # params -32% (the worker lacked torchtitan's explicit forward prefetch under ep > 1, which the
    # plan models) and temporaries +1698% (SelectBackward's zero (E, n, k) gradient per expert of
    # the per-expert loop; now one grouped mm, as torchtitan's grouped_mm): runtime.execution.parallelize.
    # set_forward_prefetch and runtime.execution.moe._GroupedMM.
    # MOE at world 4, seq 64, one step, no probe: tests/conftest.py's run, which
    # tests/test_validate_moe.py checks too (collectives, losses, router load): one launch for both
    out, code, res = moe_ep2_fsdp
    assert code == 0, res[0]["message"]
    _, kind = _memory_rows(out)
    # grad_buffers: torchtitan's block (one FSDP state, the experts a second parameter group,
    # moe_parallel.per_param_mesh) reduces both groups after its whole backward, as the plan counts;
    # the worker's experts as a unit of their own reduced alone, before the dense gradients
    # existed: 22,020,096 B measured against 23,351,296 B (-5.7%) until valmoe3
    for k in ("params", "grads", "gathered_params", "grad_buffers"):
        assert kind[k]["measured"] == kind[k]["predicted"] > 0, (k, kind[k])
    start = json.loads((out / "world4" / "rank0" / "startup.json").read_text())["local_shapes"]
    opt = kind["optimizer"]
    assert 0 <= opt["measured"] - opt["predicted"] <= 4 * len(start), opt
    assert abs(kind["activations"]["error"]) <= 0.20, kind["activations"]
    # temporaries: the backward's activation step, 3 gradients per received row beside dY (the
    # plan counted dX and 2 until valmoe3: 983,040 B against 1,797,120 B at 161 rows, with the
    # fused AdamW). The worker's single-tensor AdamW made the row its step's 3 temporaries of the
    # largest shard (the experts' 4 x 896 x 256 / efsdp 2 x 4 B = 1,835,008 B): 5,505,024 B
    # against 1,441,792 B on rank 1 (+282%); with the fused AdamW of optimizer_impl, 1,797,120 B
    # in backward against 1,441,792 + 33 rows x 10,752 B = 1,796,608 B at 161 rows (+0.03%); the 512 B left
    # were the routing scores' fp32 gradient, 64 tokens x top 2 x 4 B, now planned (routed_sizes.scores_grad;
    # tests/test_validate_moe.py's efsdp-1 run: exact at world 2): 1,442,304 + 354,816 = 1,797,120 B, exact
    tmp = kind["temporaries"]
    assert tmp["measured"] == tmp["predicted"] + ROW_BACKWARD * (_received_rows(out, tmp["rank"], False)
                                                                 - BALANCED_ROWS), tmp
    experts = sum(math.prod(v["global"]) * 4 for n, v in start.items() if n.startswith("layers.0.moe.experts."))
    copy = kind[RS_COPY_KIND]  # gloo's copy of the largest reduce-scatter input: the experts'
    assert copy["predicted"] is None and copy["measured"] == experts, (copy, experts)


@pytest.mark.slow
def test_validate_world4_moe_full_recompute_memory_rows(world4_runs):
    # The same config under full recompute. valmoe2: the replayed forward of a layer's experts unit
    # once prefetched the units ahead (3 collective differences, gathered params +1.5%); torchtitan's
    # block never does (tests/test_forward_prefetch_recompute.py). valmoe3, measured before on rank 1:
    # grad_buffers -5.7% (as above), activations +25% (the worker kept the logits through backward,
    # 131,072 B, where torchtitan deletes them: trainstep.Runner), temporaries 5,505,024 B against
    # 1,048,576 B (+425%: the single-tensor AdamW's 3 temporaries of the largest shard, still the
    # maximum, and the checkpointed forward's routed working set, 2,146,944 B on rank 0 with a fused
    # AdamW, which the plan did not count: 1,900,544 B now at 128 rows).
    run = world4_runs["moe_full_recompute"]
    out = run.out
    _, kind = _validated_world4(run)
    for k in ("params", "grads", "gathered_params", "grad_buffers"):
        assert kind[k]["measured"] == kind[k]["predicted"] > 0, (k, kind[k])
    act, tmp = kind["activations"], kind["temporaries"]
    want = act["predicted"] + ROW_KEPT * (_received_rows(out, act["rank"], True) - BALANCED_ROWS)  # recomputed
    assert abs(act["measured"] / want - 1) <= 0.20, (act, want)
    _assert_temporaries(tmp, tmp["predicted"] + ROW_FORWARD * (_received_rows(out, tmp["rank"], True)
                                                              - BALANCED_ROWS))
