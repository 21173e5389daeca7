"""DeepSpeed ZeRO-Offload (``training.offload_optimizer = "cpu"``, meshplan.memory.offload): host bytes,
the GPU state it removes, the CPU Adam and PCIe times, host-memory overflow, the DeepSpeed JSON round
trip and refusals, and the newcomer's question (trial 52: Llama-3-70B, ZeRO-3 + offload_optimizer on
4 nodes of 8x A100 40GB). DeepSpeed read at edaa722 (meshplan/memory/offload.py's docstring)."""

from __future__ import annotations

import json

import pytest

from meshplan.catalog import node
from meshplan.errors import ConfigError
from meshplan.interop.deepspeed_offload import refuse_offload
from meshplan.memory.offload import CPU_ADAM_PARAMS_PER_S_PER_CORE, cpu_adam_s, host_link_bytes_per_s
from meshplan.memory.offload_host import host_bytes, host_memory_reasons, partition_elements
from meshplan.memory.state import most_loaded, state_bytes
from meshplan.mesh.layers import stage_layers
from meshplan.mesh.resolve import resolve_mesh
from meshplan.schedule.offload_step import grad_copy_bytes
from meshplan.spec.mesh import MeshSpec
from meshplan.spec.model import ModelSpec
from meshplan.spec.training import TrainingSpec
from tests.cli_run import run_cli

TINY = ModelSpec(layers=4, hidden=16, ffn=64, gated_mlp=False, q_heads=4, vocab=32, tied_embeddings=True,
                 norm="layernorm")
MESH = resolve_mesh(MeshSpec(names=["dp"], shape=[4]), world=4)


def _z3(offload: str) -> TrainingSpec:
    return TrainingSpec(global_batch=8, seq_len=16, sharding="zero3", zero3_engine="deepspeed", param_dtype="bf16",
                        compute_dtype="bf16", vocab_pad_divisor=1, offload_optimizer=offload)


def test_host_bytes_and_gpu_drop():
    """Tiny GPT (handed case C9's model) at ZeRO-3 over dp 4. Parameters by hand: a layer 3 x 16 x 16 (qkv)
    + 16 x 16 (out) + 2 x 16 x 64 (MLP) = 3072, its two LayerNorms 2 x 32 = 64; 4 layers 12,544, final norm
    32, tied embedding 32 x 16 = 512: 13,088. Each rank's partition ceil(13,088 / 4) = 3,272. DeepSpeed's
    host per element (stage3.py:742-746, 1107-1111, 1287-1292): fp32 master 4 + Adam m, v 8 + fp32
    gradient 4 + the bf16 gradient partition buffer 2 = 18 B: 58,896 B. The GPU keeps the bf16 parameter
    partition only, 3,272 x 2 = 6,544 B; without offload it also holds the gradient partition (bf16,
    DeepSpeed's grad_accum_dtype unset) 2, master 4 and Adam 8: 3,272 x 16 = 52,352 B."""
    on, off = (most_loaded(state_bytes(TINY, MESH, _z3(o), stage_layers(4, 1))) for o in ("cpu", "none"))
    assert partition_elements(on, MESH) == 3272
    assert host_bytes(on, MESH, _z3("cpu"), 1) == 58_896
    assert host_bytes(off, MESH, _z3("none"), 1) == 0
    assert on.total_bytes == 6_544 and {i.kind for i in on.items} == {"params"}
    assert off.total_bytes == 52_352


def test_zero2_accumulator_and_stage1_grads():
    """Stages 1/2 (stage_1_and_2.py): the bf16 staging buffer of the partition (:498-507) is 2 B an
    element; with more than one micro-batch the host accumulator of each gradient (:1525-1531, the
    parameter's dtype) 2 B more: 18 then 20 B. ZeRO-1 keeps param.grad whole on the GPU (not
    partitioned): its GPU state is params 13,088 x 2 + grads 13,088 x 2 = 52,352 B."""
    z2 = TrainingSpec(global_batch=8, seq_len=16, sharding="zero2", zero12_engine="deepspeed", param_dtype="bf16",
                      compute_dtype="bf16", vocab_pad_divisor=1, offload_optimizer="cpu")
    st = most_loaded(state_bytes(TINY, MESH, z2, stage_layers(4, 1)))
    assert host_bytes(st, MESH, z2, 1) == 3272 * 18 and host_bytes(st, MESH, z2, 2) == 3272 * 20
    z1 = z2.model_copy(update={"sharding": "zero1"})
    assert most_loaded(state_bytes(TINY, MESH, z1, stage_layers(4, 1))).total_bytes == 52_352


def test_cpu_adam_and_pcie_times():
    """CPU Adam: Ren et al. (ATC'21, arXiv 2101.06840) Table 4, CPU-Adam 10B parameters in 2.57 s on
    a DGX-2 (its Table 2: 2 Xeon Platinum 8168, 24 cores each): 10e9 / (2.57 x 48) = 81.06e6 params/s
    a core (the table's 4B row gives 4e9 / (1.03 x 48) = 80.9e6, its 2B row 81.7e6). A DGX A100 rank
    gets 64 cores / 4 GPUs = 16: 1.297e9/s, so its 2.2e9-parameter partition (70B / 32) takes 1.696 s. PCIe: Gen4 x16 31.5 GB/s shared by the 2
    GPUs of a DGX A100 PCIe switch = 15.75 GB/s; the bf16 partition back to the GPU, 4.4e9 B, 0.279 s.
    ZeRO-3's gradient copies with 1 micro-batch: bf16 partition 2 B + its fp32 cast 4 B = 6 B an element."""
    a100 = node("dgx-a100-40gb")
    assert CPU_ADAM_PARAMS_PER_S_PER_CORE == pytest.approx(81.06e6, rel=1e-3)
    assert 4e9 / (1.03 * 48) == pytest.approx(CPU_ADAM_PARAMS_PER_S_PER_CORE, rel=0.005)  # the 4B row agrees
    assert cpu_adam_s(2_200_000_000, a100) == pytest.approx(1.696, abs=1e-3)
    assert host_link_bytes_per_s(a100) == 15.75e9
    assert 4.4e9 / host_link_bytes_per_s(a100) == pytest.approx(0.279, abs=1e-3)
    assert grad_copy_bytes(2_200_000_000, _z3("cpu"), 1) == 13_200_000_000


def test_host_overflow_reason():
    """Llama-3-70B (70,553,706,496 parameters) at ZeRO-3 on one DGX A100 320GB: ceil(70,553,706,496 / 8) =
    8,819,213,312 a rank x 18 B = 158.7 GB, 8 ranks 1,270.0 GB > the datasheet's 1 TB (1000 GB)."""
    from meshplan.catalog import model
    m = model("llama3-70b")
    mesh = resolve_mesh(MeshSpec(names=["dp"], shape=[8]), world=8)
    t = TrainingSpec(global_batch=8, seq_len=4096, sharding="zero3", zero3_engine="deepspeed", param_dtype="bf16",
                     compute_dtype="bf16", vocab_pad_divisor=1, offload_optimizer="cpu")
    states = state_bytes(m, mesh, t, stage_layers(m.layers, 1))
    (why,) = host_memory_reasons(states, mesh, t, node("dgx-a100-40gb"), 1)
    assert "8 ranks x 158.7 GB" in why and "8,819,213,312 params x 18 B" in why and "1270.0 GB > the node's 1000 GB" in why
    assert host_memory_reasons(states, mesh, t, node("dgx-a100"), 1) == ()  # the 640GB system's 2 TB
    with pytest.raises(ConfigError, match="host_memory_gb"):
        host_memory_reasons(states, mesh, t, node("dgx-a100").model_copy(update={"host_memory_gb": None}), 1)


def test_refusals():
    """NVMe and parameter offload stay refused by name; the CPU optimizer is read (not refused)."""
    refuse_offload({"offload_optimizer": {"device": "cpu"}, "cpu_offload": True})
    with pytest.raises(ConfigError, match=r"^zero_optimization.offload_optimizer: device 'nvme'"):
        refuse_offload({"offload_optimizer": {"device": "nvme"}})
    with pytest.raises(ConfigError, match=r"^zero_optimization.offload_param: device 'cpu'"):
        refuse_offload({"offload_param": {"device": "cpu"}})
    with pytest.raises(ConfigError, match="offload_optimizer"):  # Megatron-DeepSpeed's reader does not read it
        refuse_offload({"offload_optimizer": {"device": "cpu"}}, optimizer_cpu=False)
    with pytest.raises(ValueError, match="offload_optimizer 'cpu' is DeepSpeed's"):
        TrainingSpec(global_batch=8, seq_len=16, sharding="zero3", offload_optimizer="cpu")  # FSDP2


DS = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
      "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True}}}


def _import(tmp_path, capsys, nodes: int, name: str, ds=DS) -> tuple[int, str]:
    src = tmp_path / f"{name}.json"
    src.write_text(json.dumps(ds))
    out = tmp_path / f"{name}.toml"
    code, _, err = run_cli(["import", "deepspeed", src, "--cluster", "dgx-a100-40gb", "--nodes", nodes, "--model",
                            "llama3-70b", "--seq-len", 4096, "--gradient-checkpointing", "-o", out], capsys)
    return code, out if code == 0 else err


def test_round_trip_and_nvme(tmp_path, capsys):
    """import reads offload_optimizer.device cpu into training.offload_optimizer; export writes the device
    back and carries the user's pin_memory (true here; false below, kept as written); device nvme is a
    one-line error naming the key."""
    code, toml = _import(tmp_path, capsys, 4, "a")
    assert code == 0 and 'offload_optimizer = "cpu"' in toml.read_text()
    code, _, err = run_cli(["export", toml, "--to", "deepspeed", "-o", tmp_path / "back.json"], capsys)
    assert code == 0, err
    back = json.loads((tmp_path / "back.json").read_text())
    assert back["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    pageable = json.loads(json.dumps(DS))
    pageable["zero_optimization"]["offload_optimizer"]["pin_memory"] = False
    code, toml = _import(tmp_path, capsys, 4, "p", pageable)
    code, _, err = run_cli(["export", toml, "--to", "deepspeed", "-o", tmp_path / "p_back.json"], capsys)
    assert code == 0, err
    back = json.loads((tmp_path / "p_back.json").read_text())
    assert back["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": False}
    nvme = json.loads(json.dumps(DS))
    nvme["zero_optimization"]["offload_optimizer"]["device"] = "nvme"
    code, err = _import(tmp_path, capsys, 4, "n", nvme)
    assert code != 0 and "zero_optimization.offload_optimizer: device 'nvme'" in err and "Traceback" not in err


def test_newcomer_70b_offload(tmp_path, capsys):
    """Trial 52's question: Llama-3-70B, ZeRO-3 + offload_optimizer cpu, 4 nodes of 8x A100 40GB (seq 4096,
    micro-batch 1, activation checkpointing). Host: ceil(70,553,706,496 / 32) = 2,204,803,328 x 18 B =
    39.7 GB a rank, 317.5 GB a node of 1 TB: fits. GPU: the bf16 partition 4.41 GB plus the gathered
    layers and checkpointed activations fits the 35.5 GiB usable. The step shows the host rows: CPU Adam
    2,204,803,328 / 1.297e9 = 1,700 ms, the params back 4.41e9 B / 15.75 GB/s = 280 ms. On 1 node the
    host is the limit (test_host_overflow_reason): plan exits 1 naming it."""
    code, toml = _import(tmp_path, capsys, 4, "q")
    assert code == 0
    code, out, err = run_cli(["plan", toml], capsys)
    assert code == 0, out + err
    assert ("ZeRO-Offload host memory: 8 ranks x 39.7 GB (2,204,803,328 params x 18 B) = 317.5 GB of the node's "
            "1000 GB") in " ".join(out.split())
    code, out, err = run_cli(["step", toml], capsys)
    assert code == 0, err
    adam = next(x for x in out.splitlines() if "offload: CPU Adam" in x)
    h2d = next(x for x in out.splitlines() if "offload: updated params host->GPU" in x)
    start, end = (float(v) for v in adam.split()[-2].split("-"))
    assert end - start == pytest.approx(1700.0, abs=1.0)
    start, end = (float(v) for v in h2d.split()[-2].split("-"))
    assert end - start == pytest.approx(280.0, abs=1.0)
    line = next(x for x in out.splitlines() if x.startswith("offload (DeepSpeed ZeRO-Offload"))
    assert "gradient copies to host hidden behind the backward" in line  # 13.2 GB / 15.75 GB/s = 0.84 s < backward
    assert "CPU Adam (DeepSpeedCPUAdam) 1699.90 ms" in line and "updated params host->GPU 279.98 ms" in line
    assert "assumed: CPU Adam at 81.1e6 parameters/s a core" in line  # 10e9 / 2.57 s / 48 cores (Table 4)
    assert "Table 4 rate on a DGX-2's 48 Xeon cores taken as linear in cores" in line and "not re-read" not in line
    code, toml1 = _import(tmp_path, capsys, 1, "one")
    code, out, err = run_cli(["plan", toml1], capsys)
    assert code == 1 and "host memory: 8 ranks x 158.7 GB" in " ".join(out.split())


def test_checkpoint_holds_the_host_state():
    """A checkpoint saves the optimizer state wherever it lives (DeepSpeed engine.py:5409-5411,
    ``_save_zero_checkpoint`` writes ``self.optimizer.state_dict()``): the tiny GPT's checkpoint per rank
    under offload is the GPU-resident plan's, params 3,272 x 2 + master 3,272 x 4 + Adam 3,272 x 8 =
    45,808 B, not the 6,544 B of the GPU's state alone."""
    from meshplan.checkpoint_bytes import checkpoint_size
    from meshplan.memory.offload_host import saved_states
    stages = stage_layers(4, 1)
    on = saved_states(state_bytes(TINY, MESH, _z3("cpu"), stages), TINY, MESH, _z3("cpu"), stages)
    assert checkpoint_size(on, MESH).per_rank_bytes == 45_808


def test_hf_trainer_auto_json(tmp_path, capsys):
    """The HF Trainer's ZeRO-3 JSON ("auto" batch, dtype and buckets, as its docs' zero3 example, with
    offload_optimizer {"device": "cpu", "pin_memory": true}) reads the offload as a hand-written one does;
    pin_memory false adds the note that pageable copies are timed as pinned."""
    hf = {"bf16": {"enabled": "auto"}, "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
          "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
          "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                "offload_param": {"device": "none"}, "overlap_comm": True,
                                "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto"}}
    for pin, note in ((True, False), (False, True)):
        hf["zero_optimization"]["offload_optimizer"]["pin_memory"] = pin
        src = tmp_path / "hf.json"
        src.write_text(json.dumps(hf))
        code, out, err = run_cli(["import", "deepspeed", src, "--cluster", "dgx-a100-40gb", "--nodes", 4, "--model",
                                  "llama3-70b", "--seq-len", 4096, "--micro-batch", 1, "--grad-accum", 1, "--dtype",
                                  "bf16", "-o", tmp_path / f"hf{pin}.toml"], capsys)
        assert code == 0, err
        assert 'offload_optimizer = "cpu"' in (tmp_path / f"hf{pin}.toml").read_text()
        assert ("pin_memory false" in " ".join((out + err).split())) == note


def test_zero2_copies_exposed_without_overlap_comm(tmp_path, capsys):
    """ZeRO-2 + offload_optimizer cpu, Llama-3-8B (8,030,261,248 parameters) on one DGX A100 40GB, 2
    micro-batches. DeepSpeed's stage-2 default overlap_comm is false: the copies run on the compute stream
    (stage_1_and_2.py:1719-1729), all exposed. Partition ceil(8,030,261,248 / 8) = 1,003,782,656; bytes a
    step 4 (fp32 at the boundary) + 2 x 2 (bf16 out each micro-batch) + 2 x 1 (back in on the second) =
    10 B an element: 10,037,826,560 B / 15.75 GB/s = 637.32 ms; CPU Adam 1,003,782,656 / 1.297e9 = 773.92 ms;
    params back 2,007,565,312 B / 15.75 GB/s = 127.46 ms."""
    ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2, "bf16": {"enabled": True},
          "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    src = tmp_path / "z2.json"
    src.write_text(json.dumps(ds))
    code, _, err = run_cli(["import", "deepspeed", src, "--cluster", "dgx-a100-40gb", "--nodes", 1, "--model",
                            "llama3-8b", "--seq-len", 2048, "--gradient-checkpointing", "-o", tmp_path / "z2.toml"], capsys)
    assert code == 0, err
    code, out, err = run_cli(["step", tmp_path / "z2.toml"], capsys)
    assert code == 0, err
    line = next(x for x in out.splitlines() if x.startswith("offload (DeepSpeed ZeRO-Offload"))
    assert "gradient copies to host (exposed) 637.32 ms, CPU Adam (DeepSpeedCPUAdam) 773.92 ms, " \
           "updated params host->GPU 127.46 ms" in line


def test_node_without_host_memory_is_one_line(tmp_path, capsys):
    """grand-teton-h100 (Meta's torchtitan host) states no host memory in the catalog: planning an offload
    on it is a one-line error naming cluster.node.host_memory_gb and how to give it (exit 2), never a
    default."""
    src = tmp_path / "gt.json"
    src.write_text(json.dumps(DS))
    code, _, err = run_cli(["import", "deepspeed", src, "--cluster", "grand-teton-h100", "--nodes", 4, "--model",
                            "llama3-70b", "--seq-len", 4096, "-o", tmp_path / "gt.toml"], capsys)
    assert code == 0, err
    code, out, err = run_cli(["plan", tmp_path / "gt.toml"], capsys)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("error: cluster.node.host_memory_gb: node 'grand-teton-h100' states no host memory")
