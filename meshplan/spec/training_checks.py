"""The checks of a training's field combinations: each key that applies only to one framework,
engine, sharding or precision is refused elsewhere, in one line that names the key and the fix.
:class:`TrainingChecks` adds them, run when a training is built, to the precision rules
(:class:`meshplan.spec.training_precision.TrainingPrecision`); what each field means is documented
on :class:`meshplan.spec.training.TrainingSpec`, the class every caller uses.
"""

from __future__ import annotations

from typing import Optional

from pydantic import model_validator

from meshplan.errors import ConfigError
from meshplan.spec.training_fields import DEEPSPEED_ZERO3
from meshplan.spec.training_precision import TrainingPrecision

#: The keys of [training] that only framework "megatron" takes (Megatron-LM's flags), each with the
#: value that makes it Megatron-LM's and the line that refuses it under another framework
#: (``{framework}``: that one): the one list :meth:`TrainingChecks._check_megatron_only` refuses and
#: validate's refusal of a Megatron-LM plan names (:func:`megatron_only_keys`).
MEGATRON_ONLY: dict[str, tuple[bool, str]] = {
    "megatron_fsdp": (True, "megatron_fsdp is Megatron-LM's --use-megatron-fsdp (framework \"megatron\", without a "
                            "DeepSpeed engine): remove it or set framework = \"megatron\""),
    "overlap_grad_reduce": (True, "overlap_grad_reduce is Megatron-LM's --overlap-grad-reduce (framework \"megatron\"); "
                                  "framework {framework!r} overlaps its reductions as its runtime does: remove it"),
    "overlap_param_gather": (True, "overlap_param_gather is Megatron-LM's --overlap-param-gather (framework "
                                   "\"megatron\"); framework {framework!r} overlaps its reductions as its runtime "
                                   "does: remove it"),
    "pp_p2p_overlap": (False, "pp_p2p_overlap = false is Megatron-LM's --no-overlap-p2p-communication (framework "
                              "\"megatron\"); framework {framework!r} waits on its pipeline sends and receives where "
                              "torch.distributed.pipelining's schedule does, with no such flag: remove it"),
    "pp_p2p_overlap_warmup_flush": (True, "pp_p2p_overlap_warmup_flush is Megatron-LM's "
                                          "--overlap-p2p-communication-warmup-flush, which needs its p2p overlap on "
                                          "(framework \"megatron\", pp_p2p_overlap not false; Megatron-LM raises "
                                          "otherwise): remove it or set them"),
}


#: DeepSpeed ZeRO++'s [training] keys (:mod:`meshplan.comm.zeropp`), DeepSpeed's own names.
ZEROPP_KEYS = ("zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_gradients")


def zeropp_keys_set(training) -> list[str]:
    """The :data:`ZEROPP_KEYS` ``training`` turns on (hpZ's size above 1, the switches true), in that order.

    >>> from meshplan.spec.training import TrainingSpec
    >>> zeropp_keys_set(TrainingSpec(global_batch=8, seq_len=16, zero3_engine="deepspeed", zero_quantized_weights=True))
    ['zero_quantized_weights']
    """
    return [k for k in ZEROPP_KEYS if (training.zero_hpz_partition_size > 1 if k == "zero_hpz_partition_size"
                                        else getattr(training, k) is True)]


def zero3_engine_sharding_error(engine: str, sharding: str) -> str:
    """The error for a DeepSpeed ``zero3_engine`` under a ``sharding`` other than zero3: what
    that sharding is (HSDP does gather parameters, within dp_shard), and the two fixes.

    >>> print(zero3_engine_sharding_error("deepspeed", "zero1").split("; ")[1])
    sharding 'zero1' runs no ZeRO-3 parameter gathers: remove the key, or set sharding = "zero3"
    """
    what = ("is FSDP2's hybrid sharding (gathers within dp_shard, replicas over dp_replicate), which DeepSpeed's "
            "ZeRO-3 does not run (its node-local variant is ZeRO++ hpZ: zero_hpz_partition_size under sharding zero3)"
            if sharding == "hsdp" else "runs no ZeRO-3 parameter gathers")
    fsdp2 = " to plan FSDP2" if sharding == "hsdp" else ""
    return (f"zero3_engine {engine!r} is DeepSpeed's ZeRO stage 3 (sharding zero3); sharding {sharding!r} {what}: "
            f"remove the key{fsdp2}, or set sharding = \"zero3\"")


def megatron_only_keys(training) -> list[str]:
    """The :data:`MEGATRON_ONLY` keys ``training`` sets to Megatron-LM's value, in that list's order.

    >>> from meshplan.spec.training import TrainingSpec
    >>> megatron_only_keys(TrainingSpec(global_batch=8, seq_len=16, framework="megatron", sharding="zero1",
    ...                                 overlap_grad_reduce=True, pp_p2p_overlap=False))
    ['overlap_grad_reduce', 'pp_p2p_overlap']
    """
    return [k for k, (value, _) in MEGATRON_ONLY.items() if getattr(training, k) is value]


def check_op_sac_policy(training) -> None:
    """Check ``training.op_sac_policy`` against what reads it. Under framework torch something always
    does: torchtitan's op-level SAC under ``recompute = "op"``
    (:func:`meshplan.compute.recompute.op_sac_fuses_qkv`), and at every recompute the revision's model
    code (:attr:`~meshplan.spec.training_knobs.TrainingKnobs.torchtitan_revision`: b5bcd76's one
    ``wqkv`` GEMM and its CP refusal without flex attention) and its expert rule
    (:attr:`~meshplan.spec.training_engines.TrainingEngines.torchtitan_v022`: 238fa99 runs etp = tp).
    Under another framework (Megatron-LM, DeepSpeed: no torchtitan model code, no op-level SAC) a value
    given is read nowhere: a :class:`~meshplan.errors.ConfigError` naming the field and the fix, not a
    silent default; except "238fa99", what an unset policy plans and what ``import torchtitan`` writes (a
    torchtitan job re-planned under another framework keeps it harmlessly).

    >>> from meshplan.spec.training import TrainingSpec
    >>> check_op_sac_policy(TrainingSpec(global_batch=8, seq_len=16, op_sac_policy="b5bcd76", recompute="full"))
    >>> check_op_sac_policy(TrainingSpec(global_batch=8, seq_len=16, op_sac_policy="b5bcd76", framework="megatron",
    ...                                  sharding="zero1"))
    Traceback (most recent call last):
    ...
    meshplan.errors.ConfigError: training.op_sac_policy: "b5bcd76" names a torchtitan revision (its op-level SAC and model code), read only under framework "torch" (here 'megatron'): remove op_sac_policy
    """
    if training.op_sac_policy in (None, "238fa99") or training.framework == "torch":
        return
    raise ConfigError("training.op_sac_policy", f"\"{training.op_sac_policy}\" names a torchtitan revision (its "
                      f"op-level SAC and model code), read only under framework \"torch\" (here "
                      f"{training.framework!r}): remove op_sac_policy")


def async_tp_uncompiled(training) -> bool:
    """``tp_comm_overlap`` without ``torch_compile``: refused under framework "torch" (torchtitan's
    async TP needs torch.compile), Megatron-LM's TE overlap under framework "megatron"."""
    return bool(training.tp_comm_overlap and not training.torch_compile)


def megatron_dispatcher(training) -> bool:
    """``moe_dispatcher`` other than the default "alltoall": "deepep", DeepEP's dispatch and combine
    (Megatron-LM's flex token dispatcher, or torchtitan's ``expert_parallel_comm_backend = "deepep"``
    under framework torch: :func:`meshplan.config._check_dispatcher`)."""
    return training.moe_dispatcher != "alltoall"


#: torchtitan's DeepEP path (``parallelism.expert_parallel_comm_backend = "deepep"``, pytorch/torchtitan
#: 36a4b69 to 238fa99, e347b1e (v0.2.2) included): ``models/deepseek_v3/infra/parallelize.py``:100-121 at e347b1e
#: (llama4's the same, lines 114-135) raises on ep 1 and on etp > 1.
TORCH_DEEPEP_SOURCE = "pytorch/torchtitan e347b1e torchtitan/models/deepseek_v3/infra/parallelize.py:100-111"


def torch_deepep_reason(ep: int, etp: int) -> Optional[str]:
    """Why torchtitan refuses its DeepEP backend on ep x etp (:data:`TORCH_DEEPEP_SOURCE`), else None.

    >>> torch_deepep_reason(8, 1) is None, torch_deepep_reason(1, 1).split(";")[0]
    (True, 'deepep: ep 1: torchtitan raises "DeepEP requires expert parallelism (ep_degree > 1)"')
    """
    if ep < 2:
        return (f"deepep: ep {ep}: torchtitan raises \"DeepEP requires expert parallelism (ep_degree > 1)\"; set "
                f"mesh ep > 1 or training.moe_dispatcher = \"alltoall\"")
    if etp > 1:
        return (f"deepep: etp {etp}: torchtitan raises \"DeepEP with Expert Tensor Parallelism (ETP) is not supported "
                f"yet\"; set etp 1 or training.moe_dispatcher = \"alltoall\"")
    return None


def torch_refused_keys(training) -> list[str]:
    """The keys of ``training`` that framework "torch" would refuse: its :func:`megatron_only_keys`,
    then ``megatron_runtime`` and ``dataloader_attention_mask`` where set (:meth:`TrainingChecks._check_megatron_runtime`),
    ``recompute_modules`` other than Megatron-LM's default (:func:`meshplan.spec.recompute_modules.config_notes`)
    and ``pp_engine`` other than the framework's (:meth:`TrainingChecks._check_pp_engine`), then
    ``tp_comm_overlap`` where :func:`async_tp_uncompiled` (a Megatron-LM plan has no
    ``torch_compile``, which framework "megatron" refuses). Removed, the training loads as torch's
    (``moe_dispatcher = "deepep"`` is torchtitan's DeepEP backend there, since newcomer trial 48).

    >>> from meshplan.spec.training import TrainingSpec
    >>> torch_refused_keys(TrainingSpec(global_batch=8, seq_len=16, framework="megatron", sharding="zero1",
    ...                                 overlap_grad_reduce=True, tp_comm_overlap=True, moe_dispatcher="deepep",
    ...                                 megatron_runtime="core", recompute_modules=("core_attn", "mlp")))
    ['overlap_grad_reduce', 'megatron_runtime', 'recompute_modules', 'tp_comm_overlap']
    """
    return (megatron_only_keys(training)
            + [k for k in ("megatron_runtime", "dataloader_attention_mask") if getattr(training, k) is not None]
            + (["recompute_modules"] if tuple(training.recompute_modules) != ("core_attn",) else [])
            + (["pp_engine"] if training.pp_engine != "framework" else [])
            + (["tp_comm_overlap"] if async_tp_uncompiled(training) else []))


def deepspeed_refused_keys(training) -> list[str]:
    """The keys of ``training`` refused once it runs no DeepSpeed engine (``zero3_engine = "fsdp2"``,
    ``zero12_engine = "megatron"``, the engines validate runs): ``overlap_comm`` (DeepSpeed's alone),
    ``contiguous_gradients`` outside sharding zero3, and ZeRO++'s keys set (:func:`zeropp_keys_set`:
    DeepSpeed's ZeRO-3 alone), by :class:`TrainingChecks`' rules.

    >>> from meshplan.spec.training import TrainingSpec
    >>> deepspeed_refused_keys(TrainingSpec(global_batch=8, seq_len=16, sharding="zero2", zero12_engine="deepspeed",
    ...                                     overlap_comm=True, contiguous_gradients=True))
    ['overlap_comm', 'contiguous_gradients']
    """
    return ((["overlap_comm"] if training.overlap_comm else [])
            + (["contiguous_gradients"] if training.contiguous_gradients and training.sharding != "zero3" else [])
            + zeropp_keys_set(training))


class TrainingChecks(TrainingPrecision):
    """The combination checks of a training (module docstring), as one validator run after the fields."""

    @model_validator(mode="after")
    def _check(self):
        self._check_batch_and_dtypes()
        self._check_engines()
        self._check_megatron_only()
        self._check_megatron_overlap()
        self._check_megatron_runtime()
        self._check_torch_only()
        self._check_pp_p2p()
        self._check_zeropp()
        if self.pp_schedule_runs > 1 and self.framework != "torch":
            raise ValueError(f"pp_schedule_runs {self.pp_schedule_runs} is torchtitan's gradient accumulation under pp "
                             f"(one schedule.step() per accumulation step); framework {self.framework!r} runs one "
                             f"schedule over the step's micro-batches: remove the key")
        return self

    def _check_batch_and_dtypes(self) -> None:
        """The batch, clipping, AC interval and dtype keys (float8's refinements with them)."""
        if self.micro_batch > self.global_batch:
            raise ValueError(f"micro_batch {self.micro_batch} > global_batch {self.global_batch}")
        if self.grad_clip_norm is not None and not self.grad_clip:
            raise ValueError(f"grad_clip_norm {self.grad_clip_norm} is the norm clipping bounds the gradients to; "
                             f"grad_clip is false: remove grad_clip_norm, or set grad_clip = true")
        if self.ac_freq != 1 and self.recompute != "layer":
            raise ValueError(f"ac_freq is torchtitan's per-layer checkpointing interval; set recompute = \"layer\" "
                             f"or remove it (recompute is {self.recompute!r})")
        if self.recompute_num_layers is not None and (self.recompute != "full" or self.framework != "megatron"):
            raise ValueError(f"recompute_num_layers is Megatron-LM's --recompute-method block --recompute-num-layers "
                             f"(the first n layers of each model chunk checkpointed in full): set recompute = \"full\" "
                             f"and framework = \"megatron\", or remove it (recompute {self.recompute!r}, framework "
                             f"{self.framework!r})")
        if self.master_dtype == "int16" and self.keeps_master and self.param_dtype != "bf16":
            raise ValueError(f"master_dtype \"int16\" keeps the 16 low bits of an fp32 master whose high 16 bits "
                             f"are the bf16 parameter (TE FusedAdam store_param_remainders); param_dtype is "
                             f"{self.param_dtype!r}: set param_dtype = \"bf16\", or master_dtype \"fp32\"/\"fp16\"")
        if self.compute_dtype == "fp8":
            raise ValueError("compute_dtype \"fp8\" would make activations, norms and gathers 1 byte; float8 "
                             "training runs only the Linear GEMMs in fp8 with bf16 activations: set compute_dtype = "
                             "\"bf16\" and linear_dtype = \"fp8\"")
        if (self.fp8_all_gather or self.fp8_output_layer or self.fp8_param_gather or self.fp8_recipe != "tensorwise") \
                and self.linear_dtype != "fp8":
            key = "fp8_all_gather" if self.fp8_all_gather else "fp8_output_layer" if self.fp8_output_layer \
                else "fp8_param_gather" if self.fp8_param_gather else "fp8_recipe"
            raise ValueError(f"{key} applies to the float8 Linear layers; set linear_dtype = \"fp8\" or remove it")
        if self.torch_norm != "fused" and self.framework != "torch":
            raise ValueError("torch_norm is the RMSNorm module of framework \"torch\" (Megatron-LM runs its own "
                             "kernels): remove it")
        if self.fp8_all_gather and self.fp8_recipe == "rowwise":
            raise ValueError("fp8_all_gather is tensorwise scaling only (torchtitan refuses it with a rowwise "
                             "recipe_name): remove it or set fp8_recipe = \"tensorwise\"")
        if self.fp8_all_gather and self.sharding not in ("zero3", "hsdp"):
            raise ValueError(f"fp8_all_gather is FSDP2's float8 all-gather (sharding zero3 or hsdp); sharding "
                             f"{self.sharding!r} gathers nothing: remove it")
        if self.fp8_param_gather and (self.framework != "megatron" or self.sharding != "zero1"):
            raise ValueError(f"fp8_param_gather is Megatron-LM's --fp8-param-gather, planned with its distributed "
                             f"optimizer (framework \"megatron\", sharding \"zero1\"); framework {self.framework!r}, "
                             f"sharding {self.sharding!r}: remove it, or set those")

    def _check_engines(self) -> None:
        """Each ZeRO engine key against its sharding and the options it takes (pp's engine too)."""
        if self.zero3_engine != "fsdp2" and self.sharding != "zero3":
            raise ValueError(zero3_engine_sharding_error(self.zero3_engine, self.sharding))
        if self.zero3_engine != "fsdp2" and (self.grad_accumulation != "sync" or not self.reshard_after_forward
                                             or self.fp8_all_gather):
            raise ValueError(f"zero3_engine {self.zero3_engine!r} gathers every parameter in forward and again in "
                             "backward and reduces every micro-batch: remove grad_accumulation, reshard_after_forward "
                             "and fp8_all_gather (FSDP2 options)")
        if self.contiguous_gradients and self.sharding != "zero3" and not self.deepspeed_zero12:
            raise ValueError(f"contiguous_gradients is DeepSpeed's zero_optimization.contiguous_gradients (sharding "
                             f"zero3, or zero1/zero2 with zero12_engine = \"deepspeed\"); sharding {self.sharding!r}"
                             f" under zero12_engine {self.zero12_engine!r}: remove it")
        if self.zero0_engine != "ddp" and self.sharding != "none":
            raise ValueError(f"zero0_engine {self.zero0_engine!r} is DeepSpeed's engine without ZeRO (sharding none); "
                             f"sharding {self.sharding!r}: remove the key (zero12_engine or zero3_engine name its engine)")
        if self.zero0_engine == "deepspeed" and self.param_dtype == "bf16":
            raise ValueError("zero0_engine \"deepspeed\" with bf16 parameters is DeepSpeed's BF16_Optimizer, which "
                             "partitions the fp32 master weights and Adam states over dp as ZeRO-1 (runtime/"
                             "bf16_optimizer.py): write sharding = \"zero1\", zero12_engine = \"deepspeed\", "
                             "grad_dtype = \"fp32\" in place of zero0_engine")
        self._check_pp_engine()
        if self.zero12_engine != "megatron" and self.sharding not in ("zero1", "zero2"):
            raise ValueError(f"zero12_engine {self.zero12_engine!r} is DeepSpeed's ZeRO stage 1/2 (sharding zero1 or "
                             f"zero2); sharding {self.sharding!r} does not run it: remove the key")
        if self.offload_optimizer != "none" and not (self.deepspeed_zero12 or self.zero3_engine != "fsdp2") \
                or self.offload_optimizer != "none" and self.optimizer == "sgd":
            raise ValueError(f"offload_optimizer {self.offload_optimizer!r} is DeepSpeed's zero_optimization."
                             "offload_optimizer with DeepSpeedCPUAdam (sharding zero1/zero2 with zero12_engine = "
                             "\"deepspeed\", or zero3 with a DeepSpeed zero3_engine; optimizer adam or adamw): set "
                             "them or remove the key")
        if self.overlap_comm and self.zero12_engine != "deepspeed" and self.zero3_engine != "deepspeed":
            raise ValueError("overlap_comm is DeepSpeed's zero_optimization.overlap_comm (sharding zero1 or zero2 with "
                             "zero12_engine = \"deepspeed\", or zero3 with zero3_engine = \"deepspeed\"): set the "
                             "engine or remove it")

    def _check_torch_only(self) -> None:
        """The keys of framework torch's runtime (compile, eager optimizer, head resharding, FSDP2's
        accumulation, ring CP) and Megatron-LM's p2p CP, each refused elsewhere."""
        if self.framework == "torch" and async_tp_uncompiled(self):
            raise ValueError("tp_comm_overlap under framework \"torch\" is torchtitan's async TP, which needs "
                             "torch.compile (torchtitan raises \"Async TP requires torch.compile\"): set "
                             "torch_compile = true, or remove tp_comm_overlap")
        if not self.torch_compile_loss and not self.torch_compile:
            raise ValueError("torch_compile_loss = false leaves the loss eager beside a compiled model; without "
                             "torch_compile everything runs eagerly already: remove the key")
        if self.optimizer_impl != "fused" and self.framework != "torch":
            raise ValueError(f"optimizer_impl {self.optimizer_impl!r} is torch's multi-tensor Adam; framework "
                             f"{self.framework!r} runs apex/TE's fused Adam: remove the key")
        if self.torch_compile and self.framework != "torch":
            raise ValueError(f"torch_compile is torch.compile of a torch model; framework {self.framework!r} runs its "
                             f"own kernels: remove the key")
        if self.reshard_head_after_forward and not (self.torchtitan_units and self.reshard_after_forward):
            raise ValueError("reshard_head_after_forward is torchtitan's fsdp_reshard_after_forward = \"always\" "
                             "(framework torch, sharding zero3 or hsdp with FSDP2, reshard_after_forward true); "
                             f"here framework {self.framework!r}, sharding {self.sharding!r}, reshard_after_forward "
                             f"{str(self.reshard_after_forward).lower()}: remove it")
        if self.grad_accumulation != "sync" and self.sharding not in ("zero3", "hsdp"):
            raise ValueError(f"grad_accumulation {self.grad_accumulation!r} is an FSDP2 mode (sharding zero3 or "
                             f"hsdp); sharding {self.sharding!r} keeps the default 'sync': remove the key")
        if self.cp_attention == "ring" and self.framework != "torch":
            raise ValueError("cp_attention \"ring\" is torch's context_parallel ring attention (framework \"torch\"); "
                             f"framework {self.framework!r} runs its own CP: remove the key")
        if self.cp_attention == "ring" and not self.flash_attention:
            raise ValueError("cp_attention \"ring\" runs torch's fused SDPA kernels only (flash, efficient, cuDNN); "
                             "flash_attention false: remove one of the two keys")
        if self.cp_rotate != "allgather" and not (self.framework == "torch" and self.cp_kind == "ring"):
            raise ValueError(f"cp_rotate {self.cp_rotate!r} is torch's ring attention's K/V rotation (framework \"torch\", "
                             f"cp_attention \"ring\"); here framework {self.framework!r}, cp_attention {self.cp_kind!r}: "
                             "remove the key")
        if self.cp_attention == "p2p" and self.framework != "megatron":
            raise ValueError("cp_attention \"p2p\" is Transformer Engine's p2p ring as Megatron-LM runs it (framework "
                             f"\"megatron\"); framework {self.framework!r} runs its own CP: remove the key or use "
                             "\"allgather\"")

    def _check_pp_p2p(self) -> None:
        """``pp_p2p_overlap_warmup_flush`` only with Megatron-LM's p2p overlap on
        (:class:`~meshplan.spec.training.TrainingSpec`; under another framework
        :meth:`_check_megatron_only` refuses it)."""
        if self.pp_p2p_overlap_warmup_flush and self.pp_p2p_overlap is False:
            raise ValueError(MEGATRON_ONLY["pp_p2p_overlap_warmup_flush"][1])

    def _check_pp_engine(self) -> None:
        """``pp_engine = "deepspeed"`` only where DeepSpeed's PipelineEngine runs: framework "megatron"
        (Megatron-DeepSpeed's GPTModelPipe) under DeepSpeed's engine without ZeRO or with ZeRO-1."""
        if self.pp_engine == "deepspeed" and (self.framework != "megatron" or self.sharding == "zero2" or "deepspeed"
                                              not in (self.zero0_engine, self.zero12_engine)):
            raise ValueError("pp_engine \"deepspeed\" is DeepSpeed's PipelineEngine running Megatron-DeepSpeed's "
                             "GPTModelPipe (framework \"megatron\" under DeepSpeed's engine without ZeRO or with "
                             "ZeRO-1: zero0_engine or zero12_engine \"deepspeed\"; the engine refuses ZeRO-2 and "
                             "ZeRO-3, runtime/pipe/engine.py): set them or remove pp_engine")

    def _check_zeropp(self) -> None:
        """DeepSpeed ZeRO++'s keys (``zero_hpz_partition_size`` above 1, ``zero_quantized_weights``,
        ``zero_quantized_gradients``) only under DeepSpeed's ZeRO-3 of today (sharding zero3,
        ``zero3_engine = "deepspeed"``; :mod:`meshplan.comm.zeropp`): stage3.py alone reads them
        (deepspeedai/DeepSpeed edaa722 ``runtime/engine.py:2441-2457`` passes them to stage 3 only)."""
        key = next(iter(zeropp_keys_set(self)), None)
        if key and (self.sharding != "zero3" or self.zero3_engine != "deepspeed"):
            raise ValueError(f"{key} is DeepSpeed ZeRO++ (zero_optimization.{key}), which DeepSpeed's ZeRO-3 runs "
                             f"(sharding \"zero3\", zero3_engine \"deepspeed\"); here sharding {self.sharding!r}, "
                             f"zero3_engine {self.zero3_engine!r}: set them or remove {key}")

    def _check_megatron_only(self) -> None:
        """Under a framework other than "megatron", the first of :data:`MEGATRON_ONLY`'s keys set to
        Megatron-LM's value, refused in its line."""
        keys = megatron_only_keys(self) if self.framework != "megatron" else []
        if keys:
            raise ValueError(MEGATRON_ONLY[keys[0]][1].format(framework=self.framework))

    def _check_megatron_runtime(self) -> None:
        """``megatron_runtime`` only under framework "megatron", ``dataloader_attention_mask`` only
        under its "core" generation (Megatron-LM 2022 builds the mask on the GPU in every
        ``get_batch``, whatever the data loader does), and "core" not under a DeepSpeed engine:
        framework "megatron" there is Megatron-DeepSpeed, whose ``get_batch`` and ``get_batch_pipe``
        (microsoft/Megatron-DeepSpeed f4157be ``pretrain_gpt.py``) broadcast ``['text']`` with
        ``broadcast_data`` and build the masks on the GPU as Megatron-LM 2022 did (its import plans
        "2022": :func:`meshplan.interop.megatron_flags.runtime`)."""
        if self.megatron_runtime is not None and self.framework != "megatron":
            raise ValueError(f"megatron_runtime is the Megatron-LM generation the step model follows (framework "
                             f"\"megatron\"); framework {self.framework!r}: remove it or set framework = \"megatron\"")
        deepspeed = self.pp_engine == "deepspeed" or "deepspeed" in (self.zero0_engine, self.zero12_engine) or (
            self.sharding == "zero3" and self.zero3_engine in DEEPSPEED_ZERO3)
        if self.megatron_core and deepspeed:
            raise ValueError("megatron_runtime \"core\" is Megatron Core's get_batch, timers and p2p; a DeepSpeed engine "
                             "under framework \"megatron\" is Megatron-DeepSpeed, whose pretrain_gpt.py get_batch and "
                             "get_batch_pipe run 2022's broadcast_data and GPU masks: set megatron_runtime = \"2022\" "
                             "or remove it")
        if self.dataloader_attention_mask is not None and not self.megatron_core:
            raise ValueError("dataloader_attention_mask is Megatron Core's --create-attention-mask-in-dataloader "
                             "(framework \"megatron\", megatron_runtime = \"core\"): set megatron_runtime = \"core\" "
                             "or remove it")

    def _check_megatron_overlap(self) -> None:
        """Under framework "megatron" (:meth:`_check_megatron_only` refuses them elsewhere):
        ``overlap_grad_reduce`` / ``overlap_param_gather`` only where Megatron-LM's DDP buffers
        run (:class:`~meshplan.spec.training.TrainingSpec`), the second only with the first and the
        distributed optimizer; ``megatron_fsdp`` only under Megatron-LM's own engines."""
        if self.megatron_fsdp and (self.zero12_engine != "megatron" or self.zero3_engine != "fsdp2"
                                   or self.zero0_engine != "ddp"):
            raise ValueError(MEGATRON_ONLY["megatron_fsdp"][1])
        key = "overlap_grad_reduce" if self.overlap_grad_reduce else "overlap_param_gather"
        if not (self.overlap_grad_reduce or self.overlap_param_gather):
            return
        if self.sharding not in ("none", "zero1") or self.zero12_engine != "megatron":
            runs = "runs DeepSpeed's engine (overlap_comm)" if self.zero12_engine != "megatron" else \
                "runs Megatron FSDP, which forces both on"
            raise ValueError(f"{key} applies to Megatron-LM's DDP buffers (sharding none or zero1, zero12_engine "
                             f"\"megatron\"); sharding {self.sharding!r} {runs}: remove it")
        if self.overlap_param_gather and not (self.overlap_grad_reduce and self.sharding == "zero1"):
            raise ValueError("overlap_param_gather needs overlap_grad_reduce and sharding \"zero1\" (Megatron-LM asserts "
                             "--overlap-grad-reduce and --use-distributed-optimizer): set them or remove it")
