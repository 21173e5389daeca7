"""Job configs the tests share, built as TOML text from their sections: a test file names only the
fields its job sets, and a job two files use is written once here.

The text has no blank lines, one ``key = value`` line per field in the order given, so a test can
point at a line (``training.seq_len (line 8)``) or replace one (``text.replace("seq_len = 8192", ...)``).
"""

from __future__ import annotations

from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

#: The suite's mesh that does not fit: the seed's tensor-4 alternative at micro-batch 2
#: (examples/seed-64gpu-tp4-mb2.toml; Llama-3-70B, dp_shard 16 x tp 4 on 8 x 8 H100, zero3, selective).
#: usable = 79.11 GiB (catalog h100-sxm5-80gb device_memory_gib) x (1 - reserve 0.10) = 71.199 GiB.
#: Its peak, at the head's forward of the second micro-batch: activations = 2 x 50.63 GiB (micro-batch
#: 1's saved activations, two sequences instead of one) + the head's 2.08 GiB (norm/output inputs,
#: logits, loss) = 103.34 GiB, plus params 4.11 + optimizer 8.21 + grads 4.11 + gathered 0.49 +
#: temporaries 0.98 + NCCL/cuBLAS 0.28 = 18.18 GiB: 121.5 GiB > 71.2 GiB, 50.3 GiB short (each kind to the
#: byte by hand, 130,469,699,584 B: tests/test_seed_mb2_peaks.py).
#: (examples/seed-64gpu-tp4.toml, micro-batch 1, peaks at 69.72 GiB: it fits, 1.48 GiB free, tight.)
TP4_MB2 = EXAMPLES / "seed-64gpu-tp4-mb2.toml"


def seed_mb2_toml() -> str:
    """examples/seed-64gpu.toml (dp_shard 8 x tp 8) at micro-batch 2, TP4_MB2's training on the seed's
    mesh: its peak, 69.1 GiB (74,207,051,776 B by hand: tests/test_seed_mb2_peaks.py), fits 71.2 GiB usable, so a
    pair with TP4_MB2 differs in the mesh alone and only the tp 8 side fits."""
    text = (EXAMPLES / "seed-64gpu.toml").read_text(encoding="utf-8")
    assert "micro_batch = 1\n" in text
    return text.replace("micro_batch = 1\n", "micro_batch = 2\n", 1)


def toml_value(value) -> str:
    """One TOML value: strings in double quotes, booleans lower case, lists inline.

    >>> toml_value(["dp_shard", "tp"]), toml_value([True]), toml_value(8192)
    ('["dp_shard", "tp"]', '[true]', '8192')
    """
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return str(value)


def job_toml(model: str | dict = "llama3-8b", *, system: str = "dgx-h100", nodes: int = 1, training: dict,
             mesh: dict | None = None, search: dict | None = None) -> str:
    """A job's TOML: ``[model]`` (a catalog name, or the table's fields), ``[cluster]``,
    ``[training]``, then ``[mesh]`` and ``[search]`` where given.

    >>> print(job_toml(training={"global_batch": 8}, mesh={"names": ["tp"], "shape": [8]}), end="")
    [model]
    catalog = "llama3-8b"
    [cluster]
    system = "dgx-h100"
    nodes = 1
    [training]
    global_batch = 8
    [mesh]
    names = ["tp"]
    shape = [8]
    """
    sections = {"model": {"catalog": model} if isinstance(model, str) else model,
                "cluster": {"system": system, "nodes": nodes}, "training": training, "mesh": mesh, "search": search}
    lines = []
    for name, table in sections.items():
        if table is not None:
            lines += [f"[{name}]"] + [f"{k} = {toml_value(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"


def llama8b_node_search(sharding: list[str], **search) -> str:
    """Llama-3-8B on one dgx-h100, seq 8192, global batch 16; the search over ``sharding`` at
    micro-batch 2, pp 1, cp 1, tp 1 or 2, recompute none or full, parameters resharded
    (``len(sharding)`` x 2 x 2 candidates); ``search`` adds or overrides ``[search]`` fields.
    tests/test_search_count_bars.py and tests/test_search_headroom.py (the same zero3 rows)."""
    return job_toml(training={"global_batch": 16, "seq_len": 8192},
                    search={"sharding": sharding, "pp": [1], "cp": [1], "tp": [1, 2], "micro_batch": [2],
                            "recompute": ["none", "full"], "reshard_after_forward": [True], **search})


def example_toml(name: str, **training) -> str:
    """The example ``examples/<name>`` as text with ``training`` fields it does not set written as
    the first lines of its ``[training]`` table, for a tmp copy a test loads (a key the example sets
    would be a key given twice).

    >>> text = example_toml("deepseek-v3_2048xh100_pp16-ep64-dp128.toml", moe_dispatcher="deepep")
    >>> text.split("[training]\\n", 1)[1].splitlines()[:2]
    ['moe_dispatcher = "deepep"', 'global_batch = 15360']
    """
    head, rest = (EXAMPLES / name).read_text(encoding="utf-8").split("[training]\n", 1)
    return head + "[training]\n" + "".join(f"{k} = {toml_value(v)}\n" for k, v in training.items()) + rest


def torch_op_job(model: str, *, nodes: int, global_batch: int, shape: list[int]) -> str:
    """A torch job at seq 8192, micro-batch 1, zero3, op-level recompute, 10% memory reserve (some of
    these keys at their default values, written all the same), on ``nodes`` dgx-h100, mesh dp_shard x tp
    of ``shape`` with sequence parallelism. tests/test_export_runnable.py: the newcomer trial's Llama-3-70B
    CHOSEN on 64 nodes and a Llama-3-8B job on one node."""
    return job_toml(model, nodes=nodes,
                    training={"global_batch": global_batch, "seq_len": 8192, "micro_batch": 1, "sharding": "zero3",
                              "recompute": "op", "memory_reserve": 0.10, "framework": "torch"},
                    mesh={"names": ["dp_shard", "tp"], "shape": shape, "sequence_parallel": True})


#: Mixtral-8x22B's shape (config.json of mistralai/Mixtral-8x22B-v0.1: num_hidden_layers 56,
#: hidden_size 6144, intermediate_size 16384, num_attention_heads 48, num_key_value_heads 8, head_dim
#: 6144 / 48 = 128, vocab_size 32768, num_local_experts 8, num_experts_per_tok 2, rope_theta 1e6,
#: max_position_embeddings 65536, tie_word_embeddings false), as a [model] table.
MIXTRAL_8X22B = {"layers": 56, "hidden": 6144, "ffn": 16384, "gated_mlp": True, "q_heads": 48, "kv_heads": 8,
                 "head_dim": 128, "vocab": 32768, "tied_embeddings": False, "norm": "rmsnorm",
                 "position_embedding": "rope", "max_position": 65536, "rope_theta": 1000000.0, "experts": 8,
                 "top_k": 2}


def mixtral_ep1_etp2_node_job() -> str:
    """A small Megatron-Core job at ep 1, etp 2 (etp = tp): Mixtral-8x22B cut to 2 layers on one
    dgx-h100, seq 4096, micro-batch 1, global batch 4 (one micro-batch a rank), zero1, no
    recompute, mesh dp 4 x tp 2 (SP) x ep 1 x etp 2 (tests/test_moe_etp.py)."""
    return job_toml({**MIXTRAL_8X22B, "layers": 2}, nodes=1,
                    training={"global_batch": 4, "seq_len": 4096, "micro_batch": 1, "sharding": "zero1",
                              "recompute": "none", "framework": "megatron"},
                    mesh={"names": ["dp", "tp", "ep", "etp"], "shape": [4, 2, 1, 2], "sequence_parallel": True})


def mixtral_8x22b_etp_job(etp: int = 2, framework: str = "megatron", sharding: str = "zero1") -> str:
    """The newcomer trial's Megatron-Core job: Mixtral-8x22B on 64 dgx-h100 (512 H100), seq 4096,
    micro-batch 1, global batch 512, full recompute, mesh pp 8 x dp 32 x tp 2 (SP) x ep 8 x etp
    ``etp`` (tests/test_moe_etp.py)."""
    return job_toml(MIXTRAL_8X22B, nodes=64,
                    training={"global_batch": 512, "seq_len": 4096, "micro_batch": 1, "sharding": sharding,
                              "recompute": "full", "framework": framework},
                    mesh={"names": ["pp", "dp", "tp", "ep", "etp"], "shape": [8, 32, 2, 8, etp],
                          "sequence_parallel": True})


#: Newcomer trial 29's float8 job (``meshplan import torchtitan`` of its torchtitan TOML, /tmp/nc29/job.toml,
#: comments and [source] left out): Llama-3-70B at seq 131,072 on 32 x 8 H200, dp_shard 4 x cp 8 x tp 8, zero3,
#: full AC, float8 Linears with float8 all-gathers. :func:`nc29_bf16_toml` is its bf16 variant.
NC29_FP8_TOML = job_toml("llama3-70b", system="dgx-h200", nodes=32, training={
    "global_batch": 32, "seq_len": 131072, "micro_batch": 1, "param_dtype": "fp32", "sharding": "zero3",
    "compute_dtype": "bf16", "reduce_dtype": "fp32", "reshard_head_after_forward": False, "tp_comm_overlap": True,
    "recompute": "full", "torch_compile": True, "grad_clip": True, "grad_clip_norm": 1.0, "linear_dtype": "fp8",
    "fp8_output_layer": False, "fp8_all_gather": True, "optimizer": "adamw", "optimizer_impl": "fused"},
    mesh={"names": ["dp_shard", "cp", "tp"], "shape": [-1, 8, 8], "sequence_parallel": True, "loss_parallel": True})


def nc29_bf16_toml() -> str:
    """:data:`NC29_FP8_TOML` without float8 (newcomer trial 29's /tmp/nc29/job_bf16.toml)."""
    out = NC29_FP8_TOML
    for line in ('linear_dtype = "fp8"\n', "fp8_output_layer = false\n", "fp8_all_gather = true\n"):
        assert line in out
        out = out.replace(line, "", 1)
    return out


#: Newcomer trial 31's search top (/tmp/nc31/top1.toml, ``meshplan search`` of its Megatron-LM job exported,
#: comments and [source] left out): Llama-3-70B at seq 131,072 on 32 x 8 H100, dp_shard 4 x cp 32 x tp 2,
#: Megatron FSDP (zero3), Transformer Engine's p2p CP ring: the cp sends and the FSDP all-gathers share NICs.
NC31_TOP1_TOML = job_toml("llama3-70b", nodes=32, training={
    "global_batch": 32, "seq_len": 131072, "micro_batch": 1, "param_dtype": "bf16", "compute_dtype": "bf16",
    "sharding": "zero3", "recompute": "none", "flash_attention": True, "vocab_pad_divisor": 128,
    "grad_reduce_dtype": "fp32", "tp_comm_overlap": False, "grad_clip": True, "grad_clip_norm": 1.0,
    "framework": "megatron", "overlap_grad_reduce": False, "overlap_param_gather": False, "cp_attention": "p2p"},
    mesh={"names": ["dp_shard", "cp", "tp"], "shape": [4, 32, 2], "sequence_parallel": True}) + "[memory]\ndropout = true\n"
