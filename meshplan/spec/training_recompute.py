"""Which layers a training checkpoints (:class:`TrainingRecompute`): every layer under ``full``,
torchtitan's every ``ac_freq``-th under ``layer``, Megatron-LM's first ``recompute_num_layers`` of each
model chunk under its block recompute (``--recompute-method block``), as properties of the fields
(:class:`meshplan.spec.training_fields.TrainingFields`); every caller reaches them through
:class:`meshplan.spec.training.TrainingSpec`. Split from :mod:`meshplan.spec.training_engines` (past
the project's 400 lines with block recompute).
"""

from __future__ import annotations

from meshplan.spec.training_fields import TrainingFields


class TrainingRecompute(TrainingFields):
    """The per-layer recompute rules of a training (module docstring)."""

    def layer_recomputed(self, position: int, chunk_position: int | None = None) -> bool:
        """Whether the layer at ``position`` (0-based, among the rank's stage layers, counted over
        its chunks in order) is checkpointed in full: every layer under ``full``, every
        ``ac_freq``-th under ``layer`` (torchtitan counts the blocks it wraps on the rank), and
        under Megatron-LM's block recompute (``recompute_num_layers`` n) the first n of its model
        chunk: ``chunk_position`` (0-based within its chunk; None: ``position``, the chunk being
        the stage at vpp 1) ``< n``. Megatron-Core's ``checkpointed_forward`` loops
        ``for layer_idx in range(self.num_layers_per_pipeline_rank)`` and checkpoints
        ``layer_idx < recompute_num_layers`` (NVIDIA/Megatron-LM d98e8a6,
        ``megatron/core/recompute.py:167-181``), ``num_layers_per_pipeline_rank`` being the
        TransformerBlock's own layers (``len(self.layers)``, ``transformer_block.py:334``), one
        block per virtual stage; 2022's ``ParallelTransformer._checkpointed_forward`` the same
        (``for l in range(self.num_layers): if l < self.recompute_num_layers``, e1c334b
        ``megatron/model/transformer.py:990-1000``). Under fp8 Megatron-Core skips the layers whose
        input does not require grad (a first stage's input, which the embedding's output always
        does): not modelled.

        >>> from meshplan.spec.training import TrainingSpec
        >>> t = TrainingSpec(global_batch=8, seq_len=16, recompute="layer", ac_freq=3)
        >>> [t.layer_recomputed(i) for i in range(6)]
        [False, False, True, False, False, True]
        >>> b = TrainingSpec(global_batch=8, seq_len=16, recompute="full", framework="megatron", recompute_num_layers=2)
        >>> [b.layer_recomputed(i, i % 4) for i in range(8)]  # two chunks of 4 layers
        [True, True, False, False, True, True, False, False]
        """
        if self.recompute == "layer":
            return (position + 1) % self.ac_freq == 0
        if self.recompute == "full" and self.recompute_num_layers is not None:
            return (position if chunk_position is None else chunk_position) < self.recompute_num_layers
        return self.recompute == "full"

    def stage_recomputed(self, chunks) -> tuple[bool, ...]:
        """:meth:`layer_recomputed` of each layer of a stage whose ``chunks`` (lists of model layer
        indices, :func:`meshplan.mesh.layers.stage_layers`' ``stages[k]``) hold them, in stage order.

        >>> from meshplan.spec.training import TrainingSpec
        >>> b = TrainingSpec(global_batch=8, seq_len=16, recompute="full", framework="megatron", recompute_num_layers=1)
        >>> b.stage_recomputed([[0, 1], [4, 5, 6]])
        (True, False, True, False, False)
        """
        return tuple(self.layer_recomputed(len(done) + j, j)
                     for done, chunk in ((sum(map(list, chunks[:c]), []), ch) for c, ch in enumerate(chunks))
                     for j in range(len(chunk)))

    @property
    def per_layer_recompute(self) -> bool:
        """Whether the layers of a stage differ in recompute (:meth:`layer_recomputed`): torchtitan's
        per-layer AC (``recompute = "layer"``) or Megatron-LM's block recompute (``recompute = "full"``
        with ``recompute_num_layers``); each layer then is planned as ``full`` or ``none``.

        >>> from meshplan.spec.training import TrainingSpec
        >>> TrainingSpec(global_batch=8, seq_len=16, recompute="full").per_layer_recompute
        False
        """
        return self.recompute == "layer" or (self.recompute == "full" and self.recompute_num_layers is not None)

    def layer_policy(self, checkpointed: bool) -> str:
        """The recompute policy of one layer: under :attr:`per_layer_recompute` ``full`` for a
        checkpointed layer and ``none`` otherwise, else ``recompute`` itself.

        >>> from meshplan.spec.training import TrainingSpec
        >>> TrainingSpec(global_batch=8, seq_len=16, recompute="layer", ac_freq=2).layer_policy(False)
        'none'
        """
        if not self.per_layer_recompute:
            return self.recompute
        return "full" if checkpointed else "none"

    def block_layers_text(self, stages) -> str:
        """Which layers Megatron-LM's block recompute (``recompute_num_layers``) checkpoints on the plan's
        ``stages`` (:func:`meshplan.mesh.layers.stage_layers` output), for the plan's and the step's
        recompute line: the count per stage and stage 0's model layer indices; "" for another policy.

        >>> from meshplan.spec.training import TrainingSpec
        >>> b = TrainingSpec(global_batch=8, seq_len=16, recompute="full", framework="megatron", recompute_num_layers=2)
        >>> b.block_layers_text([[[0, 1, 2, 3], [8, 9, 10, 11]], [[4, 5, 6, 7], [12, 13, 14, 15]]])
        'recomputed: 4 of 8 layers per stage (stage 0: layers 0, 1, 8, 9)'
        """
        if self.recompute != "full" or self.recompute_num_layers is None:
            return ""
        marks = [self.stage_recomputed(chunks) for chunks in stages]
        counts = sorted({(sum(m), len(m)) for m in marks})
        per = ", ".join(f"{k} of {n}" for k, n in counts)
        first = [i for i, ck in zip((i for chunk in stages[0] for i in chunk), marks[0]) if ck]
        return f"recomputed: {per} layers per stage (stage 0: layers {', '.join(map(str, first))})"
