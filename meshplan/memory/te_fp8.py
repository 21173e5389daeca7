"""Transformer Engine's fp8 weights under Megatron-LM (framework megatron with ``--fp8-format``:
``training.linear_dtype = "fp8"``), on one rank: the fp8 weight cache TE keeps across micro-batches
(:func:`cache_bytes_per_element`), the parameters ``--fp8-param-gather`` keeps in fp8
(``training.fp8_param_gather``: :func:`param_bytes_per_element`) and the casts each step runs
(:func:`cast_bytes`). One home for these rules: the state (:mod:`meshplan.memory.state`), the
timeline's init (:func:`cache_entry`), the collective table's parameter all-gather
(:mod:`meshplan.comm.megatron_buckets`, :mod:`meshplan.comm.dp_rows`), the step end
(:func:`meshplan.schedule.step_end.te_fp8_cast_s`) and the search's state read them.

**Which weights** (:func:`is_weight`): those of TE's linears whose GEMMs the plan runs in fp8,
:meth:`~meshplan.spec.training_precision.TrainingPrecision.float8_linear` under framework megatron:
the attention's and the dense MLP's projections; not the embedding, the output layer (Megatron-Core's
own ``ColumnParallelLinear`` unless converted), the norms or the router.

**The cache** (NVIDIA/TransformerEngine d0067d0, ``transformer_engine/pytorch/module/linear.py``; the
same in ``layernorm_linear.py`` 352-357 and 1763, ``layernorm_mlp.py`` 505-528): Megatron-Core passes
``is_first_microbatch`` to every TE linear (NVIDIA/Megatron-LM d98e8a6
``megatron/core/extensions/transformer_engine.py:1336-1345`` and 1585-1602: True on the model chunk's
first micro-batch of the step, ``set_is_first_microbatch`` in ``pipeline_parallel/schedules.py:496-497``,
then False; None only under ``--disable-parameter-transpose-cache``, not planned). With it not None TE
keeps the quantized weight in the module's ``_fp8_workspaces["weight"]`` (linear.py:1958-1960,
2068-2071), a tensor that persists for the run, and quantizes into it again only where
``update_workspace`` (``is_first_microbatch``, linear.py:479; ``module/base.py`` ``quantize_weight``
855-871): one cast per weight per step, the later micro-batches reuse it. The workspace holds the
row-wise fp8 data (1 B a value) and, since the backward's data-gradient GEMM reads the weight the
other way (``columnwise_usage`` with gradients enabled, linear.py:463-470), its column-wise form: on
a GPU whose fp8 GEMMs take only the TN layout a transposed copy ``_transpose``, 1 B more
(``tensor/float8_tensor.py:423-427``); ``utils.py:658-664`` ``is_non_tn_fp8_gemm_supported``: compute
capability 10.x, 11.x and from 13.0 take the other layouts from the one copy (:func:`tn_only`). So
2 B a weight value on Hopper (sm 90), 1 B on Blackwell (sm 100), beside the bf16 parameter.

**--fp8-param-gather** (Megatron-LM d98e8a6 ``training/arguments.py:2016-2018``: "Keep the compute param
in fp8 (do not use any other intermediate dtype) and perform the param all-gather in fp8"; refused
without the distributed optimizer or an FSDP, 1095-1097): the linears are built under TE's
``fp8_model_init`` (``core/fp8_utils.py:848-880``, ``get_fp8_context(is_init=True)`` under
``config.fp8_param``), so their weights are ``Float8Tensor`` parameters, no bf16 copy; the DDP buffer of
these parameters is uint8 (``core/distributed/param_and_grad_buffer.py:921-923``, a buffer apart from
the bf16 one's), so the parameter takes 1 B a value and the distributed optimizer's all-gather of the
updated parameters moves 1 B a value. After the step the fp32 main shard is cast into the parameter's
fp8 shard (``fp8_utils.py`` ``quantize_param_shard`` 672-679, TE ``tensor/utils.py``
``cast_master_weights_to_fp8`` 347), and after the all-gather TE builds the transpose on a TN-only GPU
(TE ``tensor/utils.py:1404-1427`` ``post_all_gather_processing``: ``_create_transpose``; Megatron
``fp8_utils.py:687-708``), kept with the parameter. ``quantize_weight`` returns an fp8 parameter as it
is (base.py:835-846): no workspace. So 1 B a value + 1 B for the transpose on Hopper. The gradient
buffer keeps its dtype (the parameter's nominal bf16, or fp32 under ``grad_reduce_in_fp32``), the
master its own.

Llama-3-70B at tp 8, one stage of 20 layers (pp 4): a layer's linear weights 855,638,016 / 8 =
106,954,752 a rank, 2,139,095,040 on the stage; on H100 the cache is 2 x that, 4,278,190,080 B (3.98
GiB); under ``--fp8-param-gather`` the parameters 2,139,095,040 B less and a transpose of as many:

>>> cache_bytes_per_element(True, False, 90) * 2_139_095_040, cache_bytes_per_element(True, True, 90)
(4278190080, 1)
>>> cache_bytes_per_element(True, False, 100), cache_bytes_per_element(True, True, 100), param_bytes_per_element(True, 2)
(1, 0, 1)

Not modelled: TE's grouped linears of MoE experts (``grouped_linear.py``, the routed experts are not
planned in fp8), the cache's per-tensor scales (a few floats a weight), block-scaled recipes (mxfp8,
blockwise: the import notes them).
"""

from __future__ import annotations

from meshplan.units import human_bytes

#: TE's ``is_non_tn_fp8_gemm_supported`` ranges of compute capability x 10 (utils.py:658-664).
NON_TN_SM = ((100, 120), (130, 10 ** 4))


def applies(training) -> bool:
    """Whether TE's fp8 linears run: framework megatron with ``linear_dtype = "fp8"``."""
    return training.framework == "megatron" and training.linear_dtype == "fp8"


def is_weight(training, tensor) -> bool:
    """Whether ``tensor`` is the weight of a TE fp8 linear (module docstring: which weights)."""
    return applies(training) and training.float8_linear(tensor)


def tn_only(cuda_sm: int) -> bool:
    """Whether the GPU's fp8 GEMMs take only the TN layout (TE keeps a transposed copy): every
    compute capability outside :data:`NON_TN_SM`; an unknown one (0) counted as TN-only.

    >>> tn_only(90), tn_only(89), tn_only(100), tn_only(120), tn_only(0)
    (True, True, False, True, True)
    """
    return not any(lo <= cuda_sm < hi for lo, hi in NON_TN_SM)


def cache_bytes_per_element(te: bool, param_gather: bool, cuda_sm: int) -> int:
    """Bytes TE holds beside the parameter per fp8 weight value (module docstring): the workspace's
    row-wise data and, on a TN-only GPU, its transpose; under ``param_gather`` (the parameter is the
    fp8 data) the transpose only. 0 where ``te`` (:func:`applies`) is false."""
    if not te:
        return 0
    return (0 if param_gather else 1) + (1 if tn_only(cuda_sm) else 0)


def param_bytes_per_element(param_gather: bool, param_bytes: int) -> int:
    """Bytes of a TE fp8 weight's parameter: 1 under ``--fp8-param-gather``, else ``param_bytes``."""
    return 1 if param_gather else param_bytes


def stage_bytes(fp8, param_gather, param_bytes: int, cuda_sm: int):
    """(parameter bytes ``--fp8-param-gather`` saves, bytes of TE's copies beside the parameters) of
    ``fp8`` weight values (:func:`param_bytes_per_element`, :func:`cache_bytes_per_element`): the
    state's and the timeline's, in one formula for the search's arrays (``fp8`` and the booleans
    ``param_gather`` broadcast) and a plan's scalars.

    >>> stage_bytes(2_139_095_040, False, 2, 90), stage_bytes(2_139_095_040, True, 2, 90)
    ((0, 4278190080), (2139095040, 2139095040))
    """
    saved = fp8 * param_gather * (param_bytes - param_bytes_per_element(True, param_bytes))
    kept = param_gather * cache_bytes_per_element(True, True, cuda_sm) \
        + (1 - param_gather) * cache_bytes_per_element(True, False, cuda_sm)
    return saved, fp8 * kept


def cache_entry(numel: int, training, cuda_sm: int) -> tuple:
    """The memory timeline's init entry (kind ``params``) of TE's fp8 copies of the stage's ``numel``
    fp8 weight values (:func:`cache_bytes_per_element`); none where it is 0."""
    per = cache_bytes_per_element(applies(training), training.fp8_param_gather, cuda_sm)
    if not per or not numel:
        return ()
    what = ("the transposes of the fp8 parameters (--fp8-param-gather, post_all_gather_processing)"
            if training.fp8_param_gather else
            "fp8 weight cache (_fp8_workspaces, cast on each step's first micro-batch)"
            + (" with its transposes" if tn_only(cuda_sm) else ""))
    return ((None, "params", numel * per, f"Transformer Engine {what}: {numel:,} x {per} B "
             f"({'TN-only fp8 GEMMs' if tn_only(cuda_sm) else 'non-TN fp8 GEMMs'}, sm {cuda_sm}): "
             f"{human_bytes(numel * per)}"),)


def cast_bytes(numel: int, shard: int, training, cuda_sm: int, param_bytes: int) -> int:
    """HBM bytes of one step's fp8 weight casts on a rank holding ``numel`` fp8 weight values
    (``shard`` of them its distributed-optimizer shard): without ``--fp8-param-gather`` TE's cast of
    the bf16 weight into the cache on the first micro-batch, fused with the transpose under delayed
    scaling (``tex.quantize`` into the workspace: read ``param_bytes``, write 1 + 1 on a TN-only GPU);
    with it the cast of the fp32 main shard into the fp8 shard (read 4, write 1 a shard value) and,
    on a TN-only GPU, the transpose after the all-gather (read 1, write 1). 0 without TE's fp8.

    >>> from types import SimpleNamespace as S
    >>> t = S(framework="megatron", linear_dtype="fp8", fp8_param_gather=False)
    >>> cast_bytes(1000, 125, t, 90, 2), cast_bytes(1000, 125, S(**{**vars(t), "fp8_param_gather": True}), 90, 2)
    (4000, 2625)
    """
    if not applies(training):
        return 0
    t = 1 if tn_only(cuda_sm) else 0
    if training.fp8_param_gather:
        return shard * (4 + 1) + numel * 2 * t
    return numel * (param_bytes + 1 + t)
