"""Which runtime runs what under a training: the engine a sharding runs on (FSDP2, DeepSpeed's
ZeRO-1/2 and ZeRO-3, Megatron-LM's distributed optimizer), the DeepSpeed defaults in effect,
the engine a search's candidates run under, recompute and routing as the runtime resolves them,
(which plan knobs act: :mod:`meshplan.spec.training_knobs`; which layers are checkpointed:
:mod:`meshplan.spec.training_recompute`; how context parallelism runs attention:
:mod:`meshplan.spec.training_cp`). :class:`TrainingEngines` adds them to the fields
(:class:`meshplan.spec.training_fields.TrainingFields`) as properties; every caller reaches them
through :class:`meshplan.spec.training.TrainingSpec`.
"""

from __future__ import annotations

from meshplan.spec.training_cp import TrainingCp
from meshplan.spec.recompute_words import recompute_words
from meshplan.spec.wording import runtime


class TrainingEngines(TrainingCp):
    """The engine rules of a training (module docstring), as properties of its fields."""

    @property
    def op_sac(self) -> str:
        """The op-level SAC policy planned (``training.op_sac_policy``; unset: "238fa99", the save lists of
        every TOML-reading torchtitan: :func:`meshplan.compute.recompute.op_sac_fuses_qkv`)."""
        return self.op_sac_policy or "238fa99"

    @property
    def torchtitan_v022(self) -> bool:
        """Whether the plan targets a torchtitan that reads TOML job files (<= v0.2.2, e347b1e; 238fa99 has the
        same ``_apply_op_sac`` and ``ParallelDims``): ``training.op_sac_policy`` given as "238fa99", the one home
        of "which torchtitan" (``meshplan import torchtitan`` writes it). There, with ep > 1, etp = tp runs
        (``ExpertTensorParallel``: e347b1e ``distributed/parallel_dims.py``:58-59 allows ETP = TP or 1), which
        c4b409a (2026-04-30, after 9810191 ended TOML job files) removed; unset or "b5bcd76" plans b5bcd76
        (:data:`~meshplan.spec.axes.moe_tp.TORCH_ETP`)."""
        return self.op_sac_policy == "238fa99"

    @property
    def torchtitan_units(self) -> bool:
        """Whether the model's ends are FSDP2 units as torchtitan wraps them (framework torch,
        FSDP2 sharding): the embedding one unit, resharded after forward as the layers are,
        ``[norm, output]`` another, not resharded after forward unless
        ``reshard_head_after_forward`` (torchtitan
        ``torchtitan/distributed/fsdp.py`` ``apply_fsdp_to_decoder`` at b5bcd76, 2026-08-21;
        these units since #1094, 83e6941), at every pp on the stages holding them (torchtitan
        applies it to each pipeline model part); tied embeddings: one unit of the three, resharded
        only with ``reshard_head_after_forward`` (under pp the first stage's embedding alone,
        likewise). DeepSpeed's ZeRO-3 (``zero3_engine = "deepspeed"``) has the same ends: it fetches
        each module's parameters at its own forward (``fetch_sub_module``), the embedding alone,
        released after it and fetched again in backward once the parameters used in between pass
        ``stage3_max_reuse_distance`` (1e9 elements; a model of more than 1e9 parameters), the
        output layer kept for its backward, which follows at once. Megatron and
        DeepSpeed-2021 keep one root unit of both ends.

        >>> from meshplan.spec.training import TrainingSpec
        >>> TrainingSpec(global_batch=8, seq_len=16, sharding="zero3").torchtitan_units
        True
        >>> TrainingSpec(global_batch=8, seq_len=16, sharding="zero3", zero3_engine="deepspeed-2021").torchtitan_units
        False

        ``fsdp_root_unit`` (torchtitan before 83e6941, #1094, 2025-07-28: 9dec370 and 820504e, the
        revisions of its published H100 runs): ``apply_fsdp`` wraps each block and then
        ``fully_shard(model)`` alone (9dec370 ``torchtitan/parallelisms/parallelize_llama.py:325-339``,
        820504e ``torchtitan/models/llama3/parallelize_llama.py:344-367``), so the embedding, the final
        norm and the output layer are one FSDP2 unit, the root's: gathered once in the root's
        pre-forward and kept gathered to the end of backward (FSDP2's ``_lazy_init``: "For the root, do
        not reshard after forward", ``post_forward_mesh_info = None``), reduced once in
        ``_root_post_backward_final_callback`` (the root's forward input, the token ids, needs no
        gradient, so no post-backward hook runs earlier), whose end the compute stream waits for
        (torch ``distributed/fsdp/_fully_shard/_fsdp_state.py``, read in a public copy of early 2025,
        where the root rule is unconditional; torch 2.13 applies it only when ``reshard_after_forward``
        is left unset; torch 1963fc8 not read). Planned as the one root unit below: not torchtitan's
        later units.

        >>> TrainingSpec(global_batch=8, seq_len=16, sharding="zero3", fsdp_root_unit=True).torchtitan_units
        False
        """
        return self.framework == "torch" and self.sharding in ("zero3", "hsdp") and \
            self.zero3_engine != "deepspeed-2021" and not self.fsdp_root_unit

    def reshard_default(self, pp: int) -> bool:
        """``reshard_after_forward`` where the config leaves it unset, at pipeline degree ``pp``:
        false under framework torch with FSDP2 (sharding zero3 or hsdp, ``zero3_engine = "fsdp2"``)
        and ``pp > 1``, as torchtitan runs it: its ``fsdp_reshard_after_forward = "default"`` is
        ``reshard_after_forward = not pp_enabled`` (pytorch/torchtitan b5bcd76,
        ``torchtitan/distributed/fsdp.py:124-133``, ``get_fsdp_reshard_after_forward_policy``: "For
        PP, by default do not reshard after forward to avoid per-microbatch all-gathers"), so each
        chunk's parameters stay gathered from its forward to its backward. True elsewhere: FSDP2's
        own default (``fully_shard(reshard_after_forward=True)``), Megatron FSDP (its post-forward
        hook reshards every unit) and DeepSpeed's ZeRO-3 (it gathers again in backward), and with
        ``reshard_head_after_forward`` (torchtitan's ``"always"``, which reshards the blocks too).

        >>> from meshplan.spec.training import TrainingSpec
        >>> t = TrainingSpec(global_batch=8, seq_len=16)
        >>> t.reshard_default(1), t.reshard_default(2), t.model_copy(update={"framework": "megatron"}).reshard_default(2)
        (True, False, True)
        """
        fsdp2 = self.framework == "torch" and self.sharding in ("zero3", "hsdp") and self.zero3_engine == "fsdp2"
        return not (fsdp2 and pp > 1 and not self.reshard_head_after_forward)

    def reshard_defaulted(self, pp: int) -> bool:
        """Whether ``reshard_after_forward`` is unset (not in the config) and its default at ``pp``
        (:meth:`reshard_default`) is false, the value FSDP2 alone would not choose: the plan says so
        in one line (:mod:`meshplan.schedule.reshard_note`)."""
        return "reshard_after_forward" not in self.model_fields_set and not self.reshard_default(pp)

    def at_pp(self, pp: int):
        """This training as a mesh of ``pp`` pipeline stages runs it: ``reshard_after_forward``, where
        the config leaves it unset, set to :meth:`reshard_default` of ``pp``; a value the config gives
        is kept. The result still counts the field unset (``model_fields_set``), so a plan of another
        mesh resolves it again from its own pp (the search varies pp; ``build_plan`` calls this).

        >>> from meshplan.spec.training import TrainingSpec
        >>> t = TrainingSpec(global_batch=8, seq_len=16)
        >>> [t.at_pp(p).reshard_after_forward for p in (1, 2)], t.at_pp(2).at_pp(1).reshard_after_forward
        ([True, False], True)
        >>> t.model_copy(update={"reshard_after_forward": True}).at_pp(2).reshard_after_forward
        True
        """
        value = self.reshard_default(pp)
        if "reshard_after_forward" in self.model_fields_set or self.reshard_after_forward == value:
            return self
        return type(self).model_construct(_fields_set=set(self.model_fields_set),
                                          **{**dict(self), "reshard_after_forward": value})

    @property
    def searched_zero3_engine(self) -> str:
        """The engine a search's zero3 candidates run under (:func:`meshplan.search.candidate.candidate_config`):
        ``zero3_engine``, except that DeepSpeed's ZeRO-1/2 (``zero12_engine = "deepspeed"``, a DeepSpeed
        stage 1 or 2 config) and its engine without ZeRO (``zero0_engine = "deepspeed"``, stage 0) plan
        them with DeepSpeed's ZeRO-3, ``deepspeed``: the same runtime at
        another stage, not FSDP2.

        >>> from meshplan.spec.training import TrainingSpec
        >>> TrainingSpec(global_batch=8, seq_len=16, sharding="zero2", zero12_engine="deepspeed").searched_zero3_engine
        'deepspeed'
        >>> TrainingSpec(global_batch=8, seq_len=16).searched_zero3_engine
        'fsdp2'
        >>> TrainingSpec(global_batch=8, seq_len=16, sharding="none", zero0_engine="deepspeed").searched_zero3_engine
        'deepspeed'
        """
        deepspeed = self.zero12_engine == "deepspeed" or self.zero0_engine == "deepspeed"
        return "deepspeed" if self.zero3_engine == "fsdp2" and deepspeed else self.zero3_engine

    @property
    def searched_zero12_engine(self) -> str:
        """The engine a search's zero1 and zero2 candidates run under
        (:func:`meshplan.search.candidate.candidate_config`): ``zero12_engine``, except that DeepSpeed's
        ZeRO-3 (``zero3_engine = "deepspeed"``, a DeepSpeed stage 3 config) and its engine without
        ZeRO (``zero0_engine = "deepspeed"``, stage 0) plan them with
        DeepSpeed's ZeRO-1/2, ``deepspeed``: the same runtime at another ``zero_optimization.stage``,
        as :attr:`searched_zero3_engine` does the other way (ZeRO-3 of 2021 keeps ``megatron``:
        its DeepSpeed, v0.3.13-v0.5.4, predates the ZeRO-1/2 engine meshplan models, v0.12.4).

        >>> from meshplan.spec.training import TrainingSpec
        >>> TrainingSpec(global_batch=8, seq_len=16, zero3_engine="deepspeed").searched_zero12_engine
        'deepspeed'
        >>> TrainingSpec(global_batch=8, seq_len=16, zero3_engine="deepspeed-2021").searched_zero12_engine
        'megatron'
        >>> TrainingSpec(global_batch=8, seq_len=16, sharding="none", zero0_engine="deepspeed").searched_zero12_engine
        'deepspeed'
        """
        return "deepspeed" if self.zero3_engine == "deepspeed" or self.zero0_engine == "deepspeed" else self.zero12_engine

    @property
    def searched_pp_engine(self) -> str:
        """The pipeline engine a search's zero1 candidates run under
        (:func:`meshplan.search.candidate.sharding_knobs`): ``pp_engine``, except that Megatron-DeepSpeed
        (framework ``megatron`` under a DeepSpeed engine, ``zero0_engine``, ``zero12_engine`` or
        ``zero3_engine = "deepspeed"``: ``meshplan search --framework megatron_deepspeed``) plans them
        under DeepSpeed's ``PipelineEngine``, ``deepspeed``, as its import does without
        ``--no-pipeline-parallel`` (:func:`meshplan.interop.megatron_deepspeed.deepspeed_engine`):
        ``pretrain_gpt.py`` builds ``GPTModelPipe`` under ``--deepspeed`` at any pp, and pp > 1 has no
        other engine (``--no-pipeline-parallel`` asserts pp 1, microsoft/Megatron-DeepSpeed 060fb40
        ``megatron/arguments.py``). Its zero2/zero3 rows stay ``framework``: the engine refuses them.

        >>> from meshplan.spec.training import TrainingSpec
        >>> mds = TrainingSpec(global_batch=8, seq_len=16, framework="megatron", zero3_engine="deepspeed")
        >>> mds.searched_pp_engine, TrainingSpec(global_batch=8, seq_len=16, framework="megatron").searched_pp_engine
        ('deepspeed', 'framework')
        >>> TrainingSpec(global_batch=8, seq_len=16, zero3_engine="deepspeed").searched_pp_engine  # DeepSpeed on torch
        'framework'
        """
        ds = "deepspeed" in (self.zero0_engine, self.zero12_engine, self.zero3_engine)
        return "deepspeed" if self.framework == "megatron" and ds else self.pp_engine

    @property
    def overlaps_comm(self) -> bool:
        """DeepSpeed's ``zero_optimization.overlap_comm`` in effect: ``overlap_comm`` when given,
        else DeepSpeed's default, true at stage 3 and false at stages 1 and 2
        (deepspeedai/DeepSpeed edaa722 ``runtime/zero/config.py:138`` ``overlap_comm: Optional[bool]
        = None`` and ``overlap_comm_valid``, 382-386: ``self.overlap_comm = self.stage ==
        ZeroStageEnum.weights``): true under ``zero3_engine = "deepspeed"``, false otherwise.

        >>> from meshplan.spec.training import TrainingSpec
        >>> [TrainingSpec(global_batch=8, seq_len=16, **kw).overlaps_comm for kw in (
        ...  {"zero3_engine": "deepspeed"}, {"zero3_engine": "deepspeed", "overlap_comm": False},
        ...  {"sharding": "zero2", "zero12_engine": "deepspeed"}, {})]
        [True, False, False, False]
        """
        if self.overlap_comm is not None:
            return self.overlap_comm
        return self.sharding == "zero3" and self.zero3_engine == "deepspeed"

    @property
    def moe_routing(self) -> tuple[float, bool]:
        """The MoE routing as it resolves, (capacity factor, dropless): a capacity factor given
        means dropping with it; ``moe_dropless`` given is that choice (false: factor 1); neither
        given is the engine's own default, dropless under either framework: torchtitan's
        ``TokenChoiceTopKRouter`` and ``GroupedExperts`` run every routed copy (pytorch/torchtitan
        b5bcd76 ``torchtitan/models/common/moe.py``), and Megatron-LM's
        ``moe_expert_capacity_factor: Optional[float] = None`` ("None means no token will be
        dropped", NVIDIA/Megatron-LM d98e8a6 ``megatron/core/transformer/transformer_config.py``
        line 917; ``megatron/training/arguments.py`` line 2373 builds ``--moe-expert-capacity-factor``
        from that field with ``ArgumentGroupFactory(TransformerConfig)``). The one rule;
        :meth:`meshplan.compute.routing.RoutingOptions.of` and the exporters read it.

        >>> from meshplan.spec.training import TrainingSpec
        >>> t = lambda **kw: TrainingSpec(global_batch=8, seq_len=16, **kw).moe_routing
        >>> t(), t(framework="megatron"), t(moe_capacity_factor=1.25), t(moe_dropless=False)
        ((1.0, True), (1.0, True), (1.25, False), (1.0, False))
        """
        f, d = self.moe_capacity_factor, self.moe_dropless
        dropless = d if d is not None else f is None
        return (1.0 if f is None else f), bool(dropless)

    @property
    def clip_norm(self) -> float | None:
        """The norm the gradients are clipped to as it resolves: ``grad_clip_norm``, unset 1.0
        (the default of torchtitan's ``max_norm``, Megatron-LM's ``--clip-grad`` and DeepSpeed's
        ``gradient_clipping`` since v0.19.3); None without clipping. Unset and 1.0 given agree.

        >>> from meshplan.spec.training import TrainingSpec
        >>> t = lambda **kw: TrainingSpec(global_batch=8, seq_len=16, **kw).clip_norm
        >>> t(), t(grad_clip_norm=0.3), t(grad_clip=False)
        (1.0, 0.3, None)
        """
        return (1.0 if self.grad_clip_norm is None else self.grad_clip_norm) if self.grad_clip else None

    @property
    def contiguous_grads(self) -> bool:
        """DeepSpeed's ``zero_optimization.contiguous_gradients`` in effect:
        ``contiguous_gradients`` when given, else the default of the engine's DeepSpeed: false
        under ``zero3_engine = "deepspeed-2021"`` (v0.3.12-v0.4.2), true under ``deepspeed`` and
        under DeepSpeed's ZeRO-1/2 (``zero12_engine = "deepspeed"``; edaa722
        ``runtime/zero/config.py:102``, ``contiguous_gradients: bool = True``, one field for every stage).

        >>> from meshplan.spec.training import TrainingSpec
        >>> [TrainingSpec(global_batch=8, seq_len=16, zero3_engine=e).contiguous_grads for e in ("deepspeed", "deepspeed-2021")]
        [True, False]
        >>> TrainingSpec(global_batch=8, seq_len=16, sharding="zero2", zero12_engine="deepspeed").contiguous_grads
        True
        """
        if self.contiguous_gradients is not None:
            return self.contiguous_gradients
        return self.zero3_engine == "deepspeed" or self.deepspeed_zero12

    @property
    def deepspeed_zero12(self) -> bool:
        """Whether DeepSpeed's ZeRO-1/2 engine runs this training: sharding zero1 or zero2 under
        ``zero12_engine = "deepspeed"``."""
        return self.sharding in ("zero1", "zero2") and self.zero12_engine == "deepspeed"

    @property
    def bf16_optimizer(self) -> bool:
        """Whether DeepSpeed's ``BF16_Optimizer`` runs this training: sharding ``zero1`` under
        ``zero12_engine = "deepspeed"`` with bf16 parameters and fp32 gradients, what a DeepSpeed JSON
        of ZeRO stage 0 with bf16 imports to (:func:`meshplan.interop.deepspeed_zero.bf16_optimizer_training`).
        DeepSpeed picks it for bf16 without ZeRO (microsoft/DeepSpeed v0.6.5 8164ea9 ``runtime/engine.py:1111-1146``;
        38327e0 ``engine.py:1300-1348``, also at stage 1 with fp32 ``grad_accum_dtype``). Per rank
        (``runtime/bf16_optimizer.py``, v0.6.5 130-220) it holds the bf16 parameters, the fp32 master
        and Adam states of its ``1/dp`` partition, fp32 gradients of every parameter, and the bf16
        ``param.grad`` (:func:`meshplan.memory.buffers.bf16_lp_grad_bytes`); once a step it all-reduces
        the fp32 gradients in ``communication_data_type`` (bf16 unset, v0.6.5 ``engine.py:733-742``;
        its bucket: :func:`meshplan.memory.buffers.bf16_step_bucket_bytes`), updates its partition and
        all-gathers the bf16 parameters: DeepSpeed's ZeRO-1 rows (:mod:`meshplan.comm.deepspeed_zero12`).

        >>> from meshplan.spec.training import TrainingSpec
        >>> t = TrainingSpec(global_batch=8, seq_len=16, sharding="zero1", zero12_engine="deepspeed", grad_dtype="fp32")
        >>> t.bf16_optimizer, t.model_copy(update={"grad_dtype": "bf16"}).bf16_optimizer
        (True, False)
        """
        return (self.sharding == "zero1" and self.zero12_engine == "deepspeed" and self.param_dtype == "bf16"
                and self.grad_dtype == "fp32" and self.offload_optimizer == "none")  # offloaded: ZeRO's (engine.py:1994-1997)

    @property
    def megatron_deepspeed(self) -> bool:
        """Whether Megatron-DeepSpeed runs this training, so that its arguments are written in its
        parser's spellings (:mod:`meshplan.interop.megatron_deepspeed_args`): framework ``megatron``
        with the sharding under one of DeepSpeed's engines (none ``zero0_engine``, zero1 and zero2
        ``zero12_engine``, zero3 ``zero3_engine`` = "deepspeed"), which Megatron-LM cannot start
        (its parser has no ``--deepspeed``) and an import of ``--deepspeed --zero-stage N`` gives
        (:func:`meshplan.interop.megatron_deepspeed.deepspeed_engine`), as ``export`` writes it.

        >>> from meshplan.spec.training import TrainingSpec
        >>> mds = TrainingSpec(global_batch=8, seq_len=16, framework="megatron", sharding="zero1", zero12_engine="deepspeed")
        >>> mds.megatron_deepspeed, mds.model_copy(update={"zero12_engine": "megatron"}).megatron_deepspeed
        (True, False)
        """
        engine = {"none": self.zero0_engine, "zero1": self.zero12_engine, "zero2": self.zero12_engine,
                  "zero3": self.zero3_engine}.get(self.sharding)
        return self.framework == "megatron" and engine == "deepspeed"

    @property
    def has_op_recompute(self) -> bool:
        """Whether the training's framework has torchtitan's op-level selective AC
        (``recompute = "op"``): torch with FSDP2, not Megatron-LM nor either DeepSpeed engine
        (ZeRO-3 of 2021, or ZeRO-1/2 under ``zero12_engine = "deepspeed"``: DeepSpeed's config has
        no key for it, so an export to it could not say it); what ``meshplan search`` tries.

        >>> from meshplan.spec.training import TrainingSpec
        >>> TrainingSpec(global_batch=8, seq_len=16).has_op_recompute
        True
        >>> [TrainingSpec(global_batch=8, seq_len=16, **kw).has_op_recompute for kw in (
        ...  {"framework": "megatron"}, {"sharding": "zero1", "zero12_engine": "deepspeed"})]
        [False, False]
        """
        return not self.op_recompute_blocker

    @property
    def op_recompute_blocker(self) -> str:
        """The field whose runtime has no op-level selective AC (:attr:`has_op_recompute`):
        ``framework`` (Megatron-LM), ``zero12_engine`` (DeepSpeed's ZeRO-1/2), ``zero0_engine``
        (DeepSpeed without ZeRO), ``zero3_engine`` (DeepSpeed's ZeRO-3); empty where the runtime has it.

        >>> from meshplan.spec.training import TrainingSpec
        >>> TrainingSpec(global_batch=8, seq_len=16, sharding="zero2", zero12_engine="deepspeed").op_recompute_blocker
        'zero12_engine'
        """
        if self.framework != "torch":
            return "framework"
        if self.zero12_engine != "megatron":
            return "zero12_engine"
        if self.zero0_engine != "ddp":
            return "zero0_engine"
        return "zero3_engine" if self.zero3_engine != "fsdp2" else ""

    @property
    def has_zero1_engine(self) -> bool:
        """Whether a runtime runs sharding ``zero1`` (optimizer state and master weights sharded,
        parameters and gradients whole) under this training: not under ``framework = "torch"``
        without DeepSpeed's engine (``zero12_engine = "deepspeed"``). meshplan's zero1 under the
        default ``zero12_engine = "megatron"`` is Megatron-LM's distributed optimizer (one
        reduce-scatter of the gradient buffer, one all-gather of the parameters per step); torch
        has no such engine: FSDP2's ``fully_shard`` always shards the parameters
        (``reshard_after_forward=False`` keeps them gathered between forward and backward,
        ZeRO-2-like, torch 2.13 ``distributed/fsdp/_fully_shard/_fully_shard.py``), torch's
        ``ZeroRedundancyOptimizer`` runs under DDP (every gradient all-reduced, then the updated
        shards broadcast: not the collectives meshplan plans for zero1), torchtitan has no key for
        either and meshplan's own runtime does not build it
        (:mod:`meshplan.runtime.execution.parallelize`). The search rejects zero1 candidates where
        it is false (rule ``framework``), plan and step warn.

        >>> from meshplan.spec.training import TrainingSpec
        >>> [TrainingSpec(global_batch=8, seq_len=16, **kw).has_zero1_engine for kw in
        ...  ({}, {"framework": "megatron"}, {"sharding": "zero1", "zero12_engine": "deepspeed"})]
        [False, True, True]
        """
        return self.framework != "torch" or self.searched_zero12_engine == "deepspeed"

    @property
    def recompute_name(self) -> str:
        """The recompute policy in its runtime's words, the runtime told by this training alone
        (:func:`meshplan.spec.wording.runtime`; the text of a config read from a DeepSpeed JSON
        passes its origin there).

        >>> from meshplan.spec.training import TrainingSpec
        >>> TrainingSpec(global_batch=8, seq_len=16, flash_attention=False, framework="megatron").recompute_name
        'Megatron-LM selective recompute (--recompute-activations: attention core)'
        >>> TrainingSpec(global_batch=8, seq_len=16, flash_attention=False).recompute_name.split(":")[0]
        "attention-core recompute, modelled as Megatron-LM's selective recompute (--recompute-activations)"
        """
        return recompute_words(self, runtime(self))
