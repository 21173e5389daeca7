"""Chunks without a transformer layer at the model's ends: Llama 3 405B's 126 layers at pp 16
with vpp 8 (Dubey et al. 2024, 3.3.2) give (126 + 2) / (16 x 8) = 1 slot per virtual stage, the
embedding alone in the first and the output layer (with the loss) alone in the last, as
Megatron-Core builds them under ``--account-for-embedding-in-pipeline-split
--account-for-loss-in-pipeline-split`` (``get_num_layers_to_build``: the first and last
virtual stage build one layer fewer, here none).

By hand, 405B: virtual stage j = chunk x 16 + stage holds layer j - 1 (1 <= j <= 126); stage 0's
chunk c >= 1 holds layer 16c - 1 (15, 31, ..., 111), stage 15's chunk c <= 6 layer 16c + 14
(14, 30, ..., 110); stage k in 1..14 holds layers k - 1 + 16c.

Tiny model (TINY of test_schedule_semantics with 6 layers: h 64, ffn 256 GeLU, 4 heads, vocab
256, untied), pp 2 x dp_shard 2, vpp 4, split [0, 1, 1, 1, 1, 1, 1, 0] ((6 + 2) / 8 = 1): stage 0
holds [], [1], [3], [5] and the embedding, stage 1 [0], [2], [4], [] and [norm, output].
A layer: qkv 64 x 192 + out 64 x 64 + mlp 2 x 64 x 256 = 49,152 weights and 2 x 64 = 128 norm
elements; embedding and output 256 x 64 = 16,384 each, final norm 64. zero3 over 2 ranks, bf16
parameters, fp32 gradients, master and Adam (2 x 4 B): (2 + 4 + 4 + 8) / 2 = 9 B per element.
"""

from collections import Counter

import pytest

from meshplan.config import config_from_dict, load_config
from meshplan.interop.export import export
from meshplan.interop.megatron import accounted_split
from meshplan.interop.torchtitan_tables import model_parts
from meshplan.mesh.layers import last_stage, stage_layers
from meshplan.plan import build_plan
from meshplan.schedule.steptime import step_time
from test_schedule_semantics import TINY, plan_of, table_counts, timeline_counts

from conftest import EXAMPLES

LLAMA3 = [0] + [1] * 126 + [0]  # per virtual stage
TINY6 = {**TINY, "layers": 6}
MESH = {"names": ["pp", "dp_shard"], "shape": [2, 2], "world": 4, "pp_schedule": "interleaved_1f1b",
        "virtual_stages": 4, "pp_layer_split": [0, 1, 1, 1, 1, 1, 1, 0]}
LAYER, NORMS, END = 49_152, 128, 256 * 64


def test_llama3_405b_vpp8_layers_by_hand():
    stages = stage_layers(126, 16, 8, LLAMA3)
    assert stages[0] == [[]] + [[16 * c - 1] for c in range(1, 8)]
    assert stages[15] == [[16 * c + 14] for c in range(7)] + [[]]
    assert all(stages[k] == [[k - 1 + 16 * c] for c in range(8)] for k in range(1, 15))
    # the per-stage form (one layer fewer on the first and the last stage) spreads to the same chunks
    assert stage_layers(126, 16, 8, [7] + [8] * 14 + [7]) == stages
    assert last_stage(stages) == 15  # the head-only chunk, not the stage of layer 125 (stage 14)
    assert accounted_split(126, 16, 8) == LLAMA3
    # only the model's ends may be empty
    assert "virtual stage 1 no layer" in stage_layers(126, 16, 8, [1, 0] + [1] * 124 + [1, 0])
    assert "stage 0 a chunk with no layer" in stage_layers(126, 16, 8, [6] + [8] * 14 + [8])
    # a chunk may hold an end alone, a stage not (vpp 1; or both ends of a V on stage 0)
    assert "stages 0, 3 no layer" in stage_layers(4, 4, 1, [0, 2, 2, 0])
    v_shape = lambda c, k, p, v: k if c == 0 else 2 * p - 1 - k  # noqa: E731
    assert "stage 0 no layer" in stage_layers(4, 2, 2, [0, 2, 2, 0], virtual_stage=v_shape)
    assert "would hold no layer" in accounted_split(14, 16, 1)


def test_tiny_state_per_stage_by_hand():
    plan = plan_of(MESH, model=TINY6)
    assert plan.feasible, plan.reasons
    assert plan.stages == [[[], [1], [3], [5]], [[0], [2], [4], []]]
    assert [plan.stage(k).last for k in (0, 1)] == [False, True]
    first = 3 * (LAYER + NORMS) + END            # 164,224 elements
    last = 3 * (LAYER + NORMS) + 64 + END        # 164,288
    assert [plan.state[k].params.total for k in (0, 1)] == [first, last]
    assert [plan.state[k].total_bytes for k in (0, 1)] == [first // 2 * 18, last // 2 * 18]  # 1,478,016; 1,478,592
    # pp > 1 reduces once per step: at stage 1's peak every chunk's unsharded fp32 gradient
    # accumulators are held, the empty chunk's [norm, output] too
    assert plan.timelines[1].peak.by_kind["grad_buffers"] == last * 4  # 657,152 B


def test_tiny_schedule_and_collectives_count_the_empty_chunks():
    """m = 8 / (1 x 2) = 4 micro-batches: each stage runs 4 x 4 = 16 forward and 16 backward
    units, the empty chunks' included (the embedding's and the head's passes). Their units gather
    no layer: the timeline's FSDP all-gathers per step equal the table's, which counts each
    chunk's gathering passes (fsdp_gather_flags) times its layers, and so do the memory passes."""
    plan = plan_of(MESH, model=TINY6)
    st = step_time(plan)
    units = Counter((e.stage, e.name[0]) for e in st.pipeline.events if e.stream == "compute")
    assert units == {(0, "F"): 16, (0, "B"): 16, (1, "F"): 16, (1, "B"): 16}
    for s in range(2):
        assert timeline_counts(st, s) == table_counts(plan, s)
    inner = {ie.name for e in st.pipeline.events if e.stage == 0 and e.stream == "compute" and e.name.endswith(".c0")
             for ie in st.units.of_event(e).events}
    assert "embedding" in inner and not any(n.startswith("L") or "fsdp AG L" in n for n in inner)
    table = {(r.phase, r.op): r.per_step for r in plan.stage(0).collectives
             if r.axis == "dp_shard" and r.cadence == "every layer"}
    # each all-gather is copied out once, by the pass that needs it: at FSDP2's hook or, under this
    # multi-stage schedule, at its wait for torch's UNSHARD, whose all-gather outputs the pass the
    # UNSHARD comes before allocates (up to 2 chunks ahead, so maybe a pass of the other phase)
    layers = [e for e in plan.timelines[0].events() if e.label.startswith("layer ")]
    gathers = Counter(e.phase for e in layers if ": copy-out" in e.label)
    assert gathers == {"forward": table[("forward", "all-gather")], "backward": table[("backward", "all-gather")]}
    assert sum("(UNSHARD of chunk" in e.label for e in layers) == sum("copy-out at the wait" in e.label for e in layers) \
        == sum(gathers.values())
    # reshard_after_forward unset is false at pp > 1 (torchtitan's default): chunk 1 gathers in F1.0 and
    # F1.2 (torch's window of 3 local stages evicted it between), chunks 2, 3 in their first forward
    # (the empty chunk 0's 2 not); resharded after forward, chunks 1, 2, 3 gather in 4, 3, 3 forwards
    assert table[("forward", "all-gather")] == 2 + 1 + 1
    resharded = plan_of(MESH, model=TINY6, reshard_after_forward=True)
    assert sum(r.per_step for r in resharded.stage(0).collectives if r.axis == "dp_shard" and r.cadence == "every layer"
               and (r.phase, r.op) == ("forward", "all-gather")) == 4 + 3 + 3


@pytest.fixture(scope="module")
def llama3_vpp8():
    cfg = load_config(EXAMPLES / "llama3-405b_16384xh100_tp8-pp16-dp128.toml")
    mesh = cfg.mesh.model_copy(update={"virtual_stages": 8, "pp_schedule": "interleaved_1f1b",
                                       "pp_layer_split": LLAMA3})
    return cfg.__class__(**{**cfg.__dict__, "mesh": mesh})


def test_llama3_405b_vpp8_plans_and_exports(llama3_vpp8):
    plan = build_plan(llama3_vpp8)
    assert plan.feasible, plan.reasons
    assert plan.stages[0][0] == [] and plan.stages[15][7] == []
    st = step_time(plan)
    units = Counter((e.stage, e.name[0]) for e in st.pipeline.events if e.stream == "compute" and e.stage in (0, 15))
    assert set(units.values()) == {16 * 8}  # 16 micro-batches x 8 chunks, forward and backward, on both end stages
    cfg = llama3_vpp8.__class__(**{**llama3_vpp8.__dict__, "training": llama3_vpp8.training.model_copy(update={
        "framework": "megatron", "sharding": "zero1", "grad_reduce_dtype": "param"})})
    text, _ = export(cfg, "megatron", "x")
    assert "--num-virtual-stages-per-pipeline-rank 8" in text
    assert "--account-for-embedding-in-pipeline-split" in text and "--account-for-loss-in-pipeline-split" in text
    parts = model_parts(LLAMA3)
    assert parts[0] == ["tok_embeddings"] and parts[1] == ["layers.0"] and parts[-1] == ["norm", "output"]


def test_runtime_stage_modules_of_empty_chunks_compute_the_full_models_logits():
    """The runtime's stage modules (meshplan.runtime.execution.pipelined.StageModule) of a split
    with an embedding-only first and a head-only last virtual stage: 2 layers, pp 2, vpp 2,
    [0, 1, 1, 0] ((2 + 2) / 4 = 1 slot); the four virtual stages in order compute the model."""
    torch = pytest.importorskip("torch")
    from meshplan.runtime.execution.model import Transformer
    from meshplan.runtime.execution.pipelined import StageModule, init_stage_weights
    from meshplan.spec.model import ModelSpec

    spec = ModelSpec(layers=2, hidden=64, ffn=128, q_heads=4, kv_heads=2, vocab=100)
    ref = Transformer(spec)
    ref.init_weights(seed=3)
    tokens = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    pp, vpp = 2, 2
    layers = stage_layers(2, pp, vpp, [0, 1, 1, 0])
    assert layers == [[[], [1]], [[0], []]]
    with torch.device("meta"):
        full = Transformer(spec)
    mods = [StageModule(full, layers[v % pp][v // pp], first=v == 0, last=v == pp * vpp - 1) for v in range(pp * vpp)]
    for m in mods:
        m.to_empty(device="cpu")
    init_stage_weights(full, seed=3)
    assert list(mods[0].state_dict()) == ["embedding.weight"]
    assert "output.weight" in mods[3].state_dict() and not any(k.startswith("layers.") for k in mods[3].state_dict())
    x = tokens
    for m in mods:
        x = m(x)
    assert torch.allclose(x, ref(tokens), atol=1e-6)
