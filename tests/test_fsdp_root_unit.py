"""torchtitan before 83e6941 (#1094): one FSDP2 root unit of the embedding, the final norm and the
output layer (``training.fsdp_root_unit``; :attr:`meshplan.spec.training.TrainingSpec.torchtitan_units`),
on torchtitan's T1 FSDP run (Llama 3 8B, dp_shard 8, 2 x 8192 tokens a GPU, eager) as
benchmarks/torchtitan_h100.py writes it."""

from dataclasses import replace

from meshplan.interop.common import ImportOptions
from meshplan.interop.foreign import load_any
from meshplan.plan import build_plan
from meshplan.schedule.steptime import step_time

T1 = """[model]
name = "llama3"
flavor = "8B"
norm_type = "rmsnorm"

[training]
local_batch_size = 2
seq_len = 8192

[parallelism]
data_parallel_shard_degree = 8

[optimizer]
fused = false

[compile]
enable = false
components = ["model"]

[activation_checkpoint]
mode = "selective"
selective_ac_option = "op"
"""


def _plan(tmp_path, root_unit: bool):
    path = tmp_path / "t1.toml"
    path.write_text(T1)
    cfg = load_any(path, "torchtitan", ImportOptions(cluster="grand-teton-h100", nodes=1))
    return build_plan(replace(cfg, training=cfg.training.model_copy(update={"fsdp_root_unit": root_unit})))


def _root_rows(plan):
    return sorted((r.op, r.phase, r.size_bytes, r.cadence) for r in plan.collectives["stage 0"] if "root" in r.cadence)


def test_one_root_unit_gathers_once_and_reduces_both_ends(tmp_path):
    """torchtitan 9dec370 ``parallelize_llama.py:325-339``: ``fully_shard`` on each block, then on the
    model alone, so the embedding (128,256 x 4,096 = 525,336,576), the final norm (4,096) and the
    output (525,336,576) are one unit of 1,050,677,248 elements (divisible by 8: no padding). FSDP2
    keeps the root gathered from its forward to its backward (``_lazy_init``: the root's
    ``post_forward_mesh_info = None``), so no backward all-gather: one all-gather of 2 B x
    1,050,677,248 = 2,101,354,496 B (bf16, ``mixed_precision_param``) and one reduce-scatter of
    4 B x 1,050,677,248 = 4,202,708,992 B (fp32, ``mixed_precision_reduce``). Split as torchtitan
    83e6941 wraps them: the embedding 2 x 525,336,576 = 1,050,673,152 B gathered twice (resharded
    after forward as a block) and reduced in 2,101,346,304 B; [norm, output] 2 x 525,340,672 =
    1,050,681,344 B gathered once, reduced in 2,101,362,688 B."""
    assert _root_rows(_plan(tmp_path, True)) == [
        ("all-gather", "forward", 2_101_354_496, "per root (embedding/norm/output)"),
        ("reduce-scatter", "backward", 4_202_708_992, "per root (embedding/norm/output)")]
    assert _root_rows(_plan(tmp_path, False)) == [
        ("all-gather", "backward", 1_050_673_152, "per root (embedding)"),
        ("all-gather", "forward", 1_050_673_152, "per root (embedding)"),
        ("all-gather", "forward", 1_050_681_344, "per root (norm/output)"),
        ("reduce-scatter", "backward", 2_101_346_304, "per root (embedding)"),
        ("reduce-scatter", "backward", 2_101_362_688, "per root (norm/output)")]


def test_root_gather_and_reduce_are_both_exposed(tmp_path):
    """The root's all-gather is the step's first collective: the embedding waits for all of it
    (FSDP2's root pre-forward unshards before the embedding runs). Its reduce-scatter runs in
    ``_root_post_backward_final_callback`` (the token ids need no gradient, so no earlier
    post-backward hook), after the embedding's backward, and the compute stream waits for its
    event before the optimizer step (torch ``_fsdp_state.py``). So exposed fsdp is at least the two
    rows' times (5.0138 + 10.0056 ms on the catalog's NVLink4 curve at 2.10 GB and 4.20 GB), where the
    split units exposed the embedding's two only (2.5178 + 5.0138 ms) and hid the head's behind
    layer 31's forward and the backward: 8.71 ms exposed in all there, under 15.02 ms."""
    plan = _plan(tmp_path, True)
    times = {r.op: r.time_s for r in plan.collectives["stage 0"] if "root" in r.cadence}
    exposed = step_time(plan).parts_s()["exposed fsdp"]
    assert exposed >= times["all-gather"] + times["reduce-scatter"] > 0.0150
    assert step_time(_plan(tmp_path, False)).parts_s()["exposed fsdp"] < 0.0150
