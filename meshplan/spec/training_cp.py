"""How context parallelism runs attention under a training (:class:`TrainingCp`): torch's ring,
Transformer Engine's p2p ring or the all-gather, as the framework resolves an unset ``cp_attention``;
properties of the fields (:class:`meshplan.spec.training_fields.TrainingFields`) every caller reaches
through :class:`meshplan.spec.training.TrainingSpec`. Split from :mod:`meshplan.spec.training_engines`
(past the project's 400 lines).
"""

from __future__ import annotations

from meshplan.spec.training_recompute import TrainingRecompute


class TrainingCp(TrainingRecompute):
    """The context-parallel attention rules of a training (module docstring)."""

    @property
    def cp_kind(self) -> str:
        """How context parallelism runs attention: ``cp_attention``, or unset the framework's own:
        torch's ring attention under ``framework = "torch"`` (torchtitan's ``context_parallel``),
        Transformer Engine's p2p ring under ``"megatron"`` (Megatron-LM's ``--cp-comm-type``
        default ``p2p``: arguments.py and ``TEDotProductAttention`` at NVIDIA/Megatron-LM d98e8a6,
        which passes ``cp_comm_type = "p2p"`` for None). The one rule the CP rows
        (:func:`meshplan.spec.axes.cp.cp_rows`), the ring's kernels
        (:func:`meshplan.compute.kernel_choices.framework_kernels`) and the search's bound read.

        >>> from meshplan.spec.training import TrainingSpec
        >>> [TrainingSpec(global_batch=8, seq_len=16, **kw).cp_kind for kw in (
        ...  {}, {"cp_attention": "allgather"}, {"framework": "megatron"},
        ...  {"framework": "megatron", "cp_attention": "allgather"}, {"flash_attention": False})]
        ['ring', 'allgather', 'p2p', 'allgather', 'allgather']

        Without ``flash_attention`` torch's default is all-gather CP: its ring runs the flash,
        efficient or cuDNN SDPA kernels only (``_sdpa_handler`` raises "CP only supports flash
        attention and memory efficient attention now", torch 2.13 ``_context_parallel/_attention.py``).
        """
        if self.cp_attention:
            return self.cp_attention
        if self.framework == "torch":
            return "ring" if self.flash_attention else "allgather"
        return "p2p"

    @property
    def cp_ring(self) -> bool:
        """Whether context parallelism runs torch's ring attention (:attr:`cp_kind` ``"ring"``).

        >>> from meshplan.spec.training import TrainingSpec
        >>> [TrainingSpec(global_batch=8, seq_len=16, **kw).cp_ring for kw in (
        ...  {}, {"cp_attention": "allgather"}, {"framework": "megatron"}, {"flash_attention": False})]
        [True, False, False, False]
        """
        return self.cp_kind == "ring"

    @property
    def cp_p2p(self) -> bool:
        """Whether context parallelism runs Transformer Engine's p2p ring (:attr:`cp_kind` ``"p2p"``:
        Megatron-LM's default, :func:`meshplan.spec.axes.cp.p2p_rows`).

        >>> from meshplan.spec.training import TrainingSpec
        >>> [TrainingSpec(global_batch=8, seq_len=16, **kw).cp_p2p for kw in (
        ...  {}, {"framework": "megatron"}, {"framework": "megatron", "cp_attention": "allgather"})]
        [False, True, False]
        """
        return self.cp_kind == "p2p"
