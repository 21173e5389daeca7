"""Precision rules of a training: which GEMMs run in float8, the dtype each collective moves
(FSDP gathers, TP gathers, gradient reductions), the dtype of the peak MFU divides by, and the
optimizer state kept per parameter. :class:`TrainingPrecision` adds them to the engine rules
(:class:`meshplan.spec.training_engines.TrainingEngines`: the reduction dtypes follow the
engine); every caller reaches them through :class:`meshplan.spec.training.TrainingSpec`.
"""

from __future__ import annotations

from meshplan.spec.training_knobs import TrainingKnobs
from meshplan.spec.training_fields import Dtype


#: The weights of ``nn.Linear`` modules (torchtitan's model files; Megatron-LM's Transformer Engine
#: linears): attention (dense and MLA), the dense MLP and the shared experts, the MoE router's gate
#: and the output layer. Everything else is a norm, an embedding, a bias or a routed experts'
#: grouped weight (``GroupedExperts``, which the Linear converter leaves alone).
LINEAR_WEIGHTS = frozenset({"wq", "wk", "wv", "wo", "wq_a", "wq_b", "wkv_a", "wkv_b", "w_gate", "w_up", "w_down",
                            "shared_w_gate", "shared_w_up", "shared_w_down", "router", "output"})


class TrainingPrecision(TrainingKnobs):
    """The dtype rules of a training (module docstring), as properties and methods."""

    def float8_linear(self, tensor) -> bool:
        """Whether the GEMMs of weight ``tensor`` (a :class:`~meshplan.spec.model.Tensor`) run in
        float8 (``linear_dtype = "fp8"``): the one rule for the GEMM timing and the float8
        all-gather. As torchtitan's ``module_filter_fn`` (components/quantization/utils.py):
        ``nn.Linear`` weights (:data:`LINEAR_WEIGHTS`) whose two dims are multiples of 16
        (float8 tensor cores), not filtered: the output layer only with ``fp8_output_layer``;
        under ``framework = "megatron"`` the router stays in the compute dtype (Megatron-Core's
        ``TopKRouter`` multiplies with ``torch.nn.functional.linear``, not a Transformer Engine
        linear).

        >>> from meshplan.spec.training import TrainingSpec
        >>> from meshplan.spec.model import Tensor
        >>> t = TrainingSpec(global_batch=8, seq_len=16, linear_dtype="fp8")
        >>> [t.float8_linear(Tensor(n, r * c, "column", rows=r)) for n, r, c in
        ...  [("wq", 64, 32), ("router", 60, 32), ("attn_norm", 32, 1), ("output", 128, 32)]]
        [True, False, False, False]
        """
        if self.linear_dtype != "fp8" or tensor.name not in LINEAR_WEIGHTS:
            return False
        if (tensor.name == "output" and not self.fp8_output_layer) or (
                tensor.name == "router" and self.framework == "megatron"):
            return False
        rows = tensor.rows or tensor.numel
        return rows % 16 == 0 and (tensor.numel // rows) % 16 == 0

    def gather_dtype(self, tensor) -> Dtype:
        """The dtype FSDP2 all-gathers one weight in (a :class:`~meshplan.spec.model.Tensor`):
        float8 for a float8 Linear weight (:meth:`float8_linear`) under ``fp8_all_gather``
        (not a tied output layer: that weight is the embedding's), else the compute dtype.

        >>> from meshplan.spec.training import TrainingSpec
        >>> from meshplan.spec.model import Tensor
        >>> t = TrainingSpec(global_batch=8, seq_len=16, linear_dtype="fp8", fp8_all_gather=True)
        >>> [t.gather_dtype(Tensor(n, 16 * r, s, rows=r)) for n, r, s in [("wq", 64, "column"),
        ...  ("wo_bias", 1, "replicated"), ("attn_norm", 1, "replicated"), ("output", 128, "vocab")]]
        ['fp8', 'bf16', 'bf16', 'bf16']
        """
        if self.fp8_all_gather and self.float8_linear(tensor) and not tensor.tied:
            return "fp8"
        return self.compute_dtype

    def at_dp_shard(self, dp_shard: int):
        """This training as a mesh of data-parallel shard degree ``dp_shard`` (the data axes FSDP
        shards over, cp not counted: ``dp_shard``, or meshplan's ``dp`` under zero3) runs it:
        ``fp8_all_gather`` off where ``dp_shard`` is 1, torchtitan's rule (``enable_fsdp_float8_all_gather =
        parallel_dims.dp_shard_enabled and float8_config.enable_fsdp_float8_all_gather``,
        pytorch/torchtitan e347b1e ``torchtitan/components/quantization/float8.py``:87-89;
        ``dp_shard_enabled`` is ``dp_shard > 1``, ``distributed/parallel_dims.py``:322-323): FSDP
        shards over cp alone then and gathers in the compute dtype. ``build_plan`` and the search's
        rows (:func:`meshplan.search.candidate.candidate_config`) apply it; the field stays as set, so
        an export writes the user's setting.

        >>> from meshplan.spec.training import TrainingSpec
        >>> t = TrainingSpec(global_batch=8, seq_len=16, linear_dtype="fp8", fp8_all_gather=True)
        >>> t.at_dp_shard(1).fp8_all_gather, t.at_dp_shard(2).fp8_all_gather
        (False, True)
        """
        if not self.fp8_all_gather or dp_shard > 1:
            return self
        return type(self).model_construct(_fields_set=set(self.model_fields_set),
                                          **{**dict(self), "fp8_all_gather": False})

    @property
    def float8_tp_gathers(self) -> bool:
        """Whether TP (under sequence parallelism) all-gathers the float8 Linears' inputs and
        output gradients in float8: float8 Linears (``linear_dtype``) with tensorwise scaling
        (``fp8_recipe``) under ``framework = "torch"``, unless ``fp8_tp`` is false (a torchtitan whose
        parallelize does not see its converter's name, :mod:`meshplan.interop.torchtitan_float8`). torchtitan applies torchao's float8 TP
        styles then (9dec370 ``parallelisms/parallelize_llama.py`` ``apply_tp``; 820504e
        ``models/llama3/parallelize_llama.py``: ``enable_float8_tensorwise_tp = enable_float8_linear
        and not float8_is_rowwise``), and torchao (eab345c ``torchao/float8/float8_tensor_parallel.py``)
        casts before the redistribute: ``PrepareFloat8ModuleInput`` casts the attention's and the
        MLP's Shard(1) input to float8 e4m3 before its Shard(1) -> Replicate all-gather ("so that
        if there are multiple float8 users of the input activation, we perform fp8 allgather only
        once"); ``Float8RowwiseParallel._prepare_output_fn`` reduce-scatters the wo / w2 output
        in the compute dtype, then wraps it in ``NoopFwToFloat8BwDynamic`` (backward: cast to
        float8 e5m2), so backward casts the output gradient before the reduce-scatter's mirror
        all-gather; the float8 tensor's all-gather moves its 1-byte data (``float8_ops.py``
        ``allgather_fp8``). The input gradients stay in the compute dtype (the float8 cast's
        backward passes the gradient through), so the reduce-scatters do. Not the embedding's
        and the output layer's collectives (plain ``RowwiseParallel`` / ``ColwiseParallel``).

        >>> from meshplan.spec.training import TrainingSpec
        >>> t = TrainingSpec(global_batch=8, seq_len=16, linear_dtype="fp8")
        >>> t.float8_tp_gathers, t.model_copy(update={"fp8_recipe": "rowwise"}).float8_tp_gathers
        (True, False)
        >>> t.model_copy(update={"fp8_tp": False}).float8_tp_gathers
        False
        """
        return self.linear_dtype == "fp8" and self.fp8_recipe == "tensorwise" and self.framework == "torch" \
            and self.fp8_tp

    @property
    def peak_dtype(self) -> Dtype:
        """The dtype whose dense peak MFU divides by: fp8 when the Linear GEMMs run in fp8
        (``linear_dtype``; the bound they run against), else the compute dtype. torchtitan's
        own MFU divides by the bf16 peak in both cases (``get_peak_flops``)."""
        return self.linear_dtype or self.compute_dtype

    @property
    def dtype_words(self) -> str:
        """The dtypes of the plan's setting line (``plan``'s ``train`` line and the HTML report's):
        parameters, the Linear GEMMs where they differ from the compute dtype (``linear_dtype``:
        fp8 runs only those GEMMs, newcomer trial 49 #3), gradients, their reduction, and the Adam
        moments and master copy where not fp32.

        >>> from meshplan.spec.training import TrainingSpec
        >>> TrainingSpec(global_batch=8, seq_len=16, framework="megatron", linear_dtype="fp8").dtype_words
        'params bf16, linear GEMMs fp8, grads fp32, reduce fp32'
        >>> TrainingSpec(global_batch=8, seq_len=16, framework="megatron", grad_dtype="bf16", optimizer_dtype="bf16",
        ...              master_dtype="int16").dtype_words
        'params bf16, grads bf16, reduce fp32, moments bf16, master int16'
        """
        out = [f"params {self.param_dtype}"] + ([f"linear GEMMs {self.linear_dtype}"] if self.linear_dtype else [])
        out += [f"grads {self.grad_dtype}", f"reduce {self.gradient_reduce_dtype}"]
        out += [f"moments {self.optimizer_dtype}"] * (self.optimizer_states > 0 and self.optimizer_dtype != "fp32")
        out += [f"master {self.master_dtype}"] * (self.keeps_master and self.master_dtype != "fp32")
        return ", ".join(out)

    @property
    def optimizer_states(self) -> int:
        """Optimizer state tensors per parameter: Adam keeps two moments (Kingma & Ba 2015)."""
        return 2 if self.optimizer in ("adam", "adamw") else 0

    @property
    def keeps_master(self) -> bool:
        """A master copy exists when parameters are stored below fp32."""
        return self.master_weights and self.param_dtype != "fp32"

    @property
    def master_bytes(self) -> int:
        """Bytes a master copy keeps per parameter (0 without one, :attr:`keeps_master`):
        ``master_dtype`` fp32 4, fp16 2, int16 2 (Transformer Engine's ``FusedAdam`` with
        ``store_param_remainders``: beside a bf16 parameter only the 16 low bits of its fp32 master,
        ``torch.zeros_like(param, dtype=torch.int16)``; NVIDIA/TransformerEngine d0067d0
        ``transformer_engine/pytorch/optimizers/fused_adam.py`` lines 213-215, 414-415, 626).

        >>> from meshplan.spec.training import TrainingSpec
        >>> t = TrainingSpec(global_batch=8, seq_len=16, param_dtype="bf16")
        >>> [t.model_copy(update={"master_dtype": d}).master_bytes for d in ("fp32", "fp16", "int16")]
        [4, 2, 2]
        """
        return {"fp32": 4, "fp16": 2, "int16": 2}[self.master_dtype] if self.keeps_master else 0

    @property
    def fsdp_reduce_dtype(self) -> Dtype:
        """The dtype of the FSDP reduce-scatter (and HSDP's all-reduce of its output) of a
        zero3/hsdp plan under this training, whatever sharding ``training`` itself names (the
        search asks it for candidates of every sharding): ``grad_reduce_dtype`` when set, else
        the parameter dtype under DeepSpeed's ZeRO-3 (:attr:`searched_zero3_engine`: it reduces in
        ``communication_data_type``, unset the model's dtype),
        else ``reduce_dtype`` (FSDP2's ``MixedPrecisionPolicy.reduce_dtype``). It is
        :attr:`gradient_reduce_dtype` of the zero3/hsdp plan: the one rule for the collective
        table's FSDP rows, the memory timeline's reduce-scatter input, FSDP2's copy-in and the
        search's bounds and timing.

        >>> from meshplan.spec.training import TrainingSpec
        >>> t = TrainingSpec(global_batch=8, seq_len=16, sharding="hsdp", grad_reduce_dtype="bf16")
        >>> t.fsdp_reduce_dtype, t.reduce_dtype, t.gradient_reduce_dtype
        ('bf16', 'fp32', 'bf16')
        >>> TrainingSpec(global_batch=8, seq_len=16, sharding="none").fsdp_reduce_dtype
        'fp32'
        """
        if self.grad_reduce_dtype is not None:
            return self.param_dtype if self.grad_reduce_dtype == "param" else self.grad_reduce_dtype
        if self.sharding != "hsdp" and self.searched_zero3_engine != "fsdp2":  # DeepSpeed's communication_data_type
            return self.param_dtype  # unset (its zero3 rows under DeepSpeed's ZeRO-1/2 too: searched_zero3_engine)
        return self.reduce_dtype

    @property
    def zero12_reduce_dtype(self) -> Dtype:
        """The dtype of a zero1/zero2 plan's gradient reduction under this training, whatever
        sharding ``training`` itself names (the search asks it for its zero1 candidates):
        ``grad_reduce_dtype`` when set, else the parameter dtype under ``zero12_engine =
        "deepspeed"`` (DeepSpeed's ``communication_data_type`` unset), else ``reduce_dtype``. It
        is :attr:`gradient_reduce_dtype` of the zero1/zero2 plan: the collective table's
        reduce-scatter (or DeepSpeed's bucket all-reduces) and the search's timing.

        >>> from meshplan.spec.training import TrainingSpec
        >>> t = TrainingSpec(global_batch=8, seq_len=16, grad_reduce_dtype="bf16")
        >>> t.zero12_reduce_dtype, t.model_copy(update={"sharding": "zero1"}).gradient_reduce_dtype, t.reduce_dtype
        ('bf16', 'bf16', 'fp32')
        >>> TrainingSpec(global_batch=8, seq_len=16, sharding="zero1", zero12_engine="deepspeed").zero12_reduce_dtype
        'bf16'
        """
        if self.grad_reduce_dtype is not None:
            return self.param_dtype if self.grad_reduce_dtype == "param" else self.grad_reduce_dtype
        # DeepSpeed: communication_data_type unset is the model's dtype (engine.py
        # ``communication_data_type``: fp16 / bf16 when enabled, else fp32)
        return self.param_dtype if self.zero12_engine == "deepspeed" else self.reduce_dtype

    @property
    def gradient_reduce_dtype(self) -> Dtype:
        """The dtype gradients are reduced in over the data axes (see ``grad_reduce_dtype``).

        >>> from meshplan.spec.training import TrainingSpec
        >>> TrainingSpec(global_batch=8, seq_len=16, sharding="none").gradient_reduce_dtype  # torch: fp32 params
        'fp32'
        >>> TrainingSpec(global_batch=8, seq_len=16, sharding="none", param_dtype="bf16").gradient_reduce_dtype
        'bf16'
        >>> TrainingSpec(global_batch=8, seq_len=16, sharding="none", grad_reduce_dtype="fp32").gradient_reduce_dtype
        'fp32'
        >>> TrainingSpec(global_batch=8, seq_len=16, sharding="zero3").gradient_reduce_dtype
        'fp32'
        >>> TrainingSpec(global_batch=8, seq_len=16, sharding="none", framework="megatron").gradient_reduce_dtype
        'fp32'
        >>> TrainingSpec(global_batch=8, seq_len=16, param_dtype="fp16", zero3_engine="deepspeed-2021").gradient_reduce_dtype
        'fp16'
        >>> TrainingSpec(global_batch=8, seq_len=16, sharding="zero2", zero12_engine="deepspeed").gradient_reduce_dtype
        'bf16'
        """
        if self.sharding in ("zero3", "hsdp"):
            return self.fsdp_reduce_dtype
        if self.sharding in ("zero1", "zero2"):
            return self.zero12_reduce_dtype
        if self.grad_reduce_dtype is None:  # DDP (sharding none)
            return "fp32" if self.framework == "megatron" and self.param_dtype == "bf16" else self.param_dtype
        return self.param_dtype if self.grad_reduce_dtype == "param" else self.grad_reduce_dtype
