"""Megatron Core's data-loader attention mask in a plan's memory advice (newcomer trial nc59 #1).

Megatron Core's ``GPTDataset`` builds a ``[b, 1, s, s]`` boolean causal mask for every sample unless
``--no-create-attention-mask-in-dataloader`` is given (``training.dataloader_attention_mask = false``,
:attr:`~meshplan.spec.training_fields.TrainingFields.core_attention_mask`), and ``get_batch`` holds it
on the GPU through the first chunk's forward (:func:`meshplan.memory.sizes.batch_mask_bytes`):
``b x s x s`` bytes, 16 GiB at s = 131072, 64 GiB at 262144 (1 B an element), beside a local K/V of
a few hundred MiB. Transformer Engine's and Megatron Core's own attention build the causal mask
themselves (``attn_mask_type`` causal), so a long-context run drops the loader's; a data set that
needs per-document masks (``--reset-attention-mask``) is what keeps it.

- :func:`mask_variant`: the memory ``fix:`` line's variant without the mask
  (:func:`meshplan.plan_fix.memory_fix`, outside its :data:`~meshplan.plan_fix.MAX_VARIANTS`); in a
  Megatron-LM file's words ``--no-create-attention-mask-in-dataloader``
  (:data:`meshplan.interop.keymaps.SETTINGS`).
- :func:`mask_note`: where a mesh fits but keeps under 15% free (the headroom rule,
  :func:`meshplan.memory.headroom.tight`) and dropping the mask lowers its peak by at least
  :data:`MIN_GAIN` bytes, a ``note`` with the peak without it (``plan``, ``report``, ``step``:
  :func:`meshplan.report.plan_warnings.plan_warnings`).

Llama-3-70B at seq 262144, dp 2 x cp 16 x tp 8, full recompute, distributed optimizer on 32 dgx-h100
(tests/test_nc59_fixes.py): 116.8 GiB with the mask (64 GiB of it), 56.8 GiB without, where the line
offered only Megatron FSDP (69.0 GiB, tight).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from meshplan.compute.batch_input import core_key_bytes
from meshplan.config import Config
from meshplan.interop.keymaps import keymap_of
from meshplan.keymap import OWN, KeyMap
from meshplan.memory.headroom import tight
from meshplan.plan import Plan
from meshplan.plan_variant import planned
from meshplan.units import GiB

#: The fix's setting in meshplan's words; a Megatron-LM file's flag for it: :data:`meshplan.interop.keymaps.SETTINGS`.
SETTING = "training.dataloader_attention_mask = false"
#: The least drop of the peak a tight plan's note names (1 GiB): below it the mask is a rounding
#: beside the planned peak's measured error (0.2-10.7% of it, docs/fidelity.md).
MIN_GAIN = GiB


def mask_words(micro_batch: int, seq_len: int) -> str:
    """``the data loader's 1 x 1 x 262144 x 262144 bool attention mask (64.0 GiB)``: b x s x s B.

    >>> mask_words(1, 131072)   # 131072^2 B = 2^34 B
    "the data loader's 1 x 1 x 131072 x 131072 bool attention mask (16.0 GiB)"
    """
    size = core_key_bytes("attention_mask", micro_batch, seq_len)
    return f"the data loader's {micro_batch} x 1 x {seq_len} x {seq_len} bool attention mask ({size / GiB:.1f} GiB)"


def _mask_words(plan: Plan) -> str:
    """:func:`mask_words` of ``plan``'s micro-batch and sequence."""
    return mask_words(plan.config.training.micro_batch, plan.config.training.seq_len)


def mask_variant(plan: Plan, keys: KeyMap = OWN) -> list[tuple[str, Config]]:
    """(words, config) of ``plan``'s config without Megatron Core's data-loader mask, in ``keys``'
    names; [] where the plan builds none (another framework or generation, or the flag given) or
    one under :data:`MIN_GAIN` (b x s x s B < 1 GiB: seq below 32768 at micro-batch 1), which would
    only lengthen a fix line's list of variants that do not fit.

    >>> from meshplan.config import config_from_dict
    >>> from meshplan.plan import build_plan
    >>> def at(s):
    ...     return build_plan(config_from_dict({"model": {"catalog": "llama3-8b", "max_position": s},
    ...         "cluster": {"system": "dgx-h100", "nodes": 1}, "training": {"global_batch": 8, "seq_len": s,
    ...         "framework": "megatron", "megatron_runtime": "core"},
    ...         "mesh": {"names": ["dp", "tp"], "shape": [1, 8]}}))
    >>> print(mask_variant(at(32768))[0][0].replace("mask (", "mask\\n("))   # 32768^2 B = 2^30 B
    training.dataloader_attention_mask = false (the data loader's 1 x 1 x 32768 x 32768 bool attention mask
    (1.0 GiB), not built)
    >>> mask_variant(at(16384))   # 16384^2 B = 256 MiB
    []
    """
    t = plan.config.training
    if not t.core_attention_mask or core_key_bytes("attention_mask", t.micro_batch, t.seq_len) < MIN_GAIN:
        return []
    cfg = replace(plan.config, training=t.model_copy(update={"dataloader_attention_mask": False}))
    return [(f"{keys.setting(SETTING)} ({_mask_words(plan)}, not built)", cfg)]


def mask_note(plan: Plan) -> Optional[str]:
    """The ``note`` of a fitting, tight plan whose peak the loader's mask raises by at least
    :data:`MIN_GAIN` (module docstring), in the config's own format's words; None otherwise."""
    tl = plan.timeline
    frag = plan.config.memory.fragmentation_fraction
    if not plan.feasible or not tight(tl.peak.total_bytes, tl.usable_bytes, frag):  # tight_warning's rule
        return None
    keys = keymap_of(plan.config)
    variant = mask_variant(plan, keys)
    if not variant:
        return None
    p = planned(variant[0][1])
    if p is None or tl.verdict_bytes - p.timeline.verdict_bytes < MIN_GAIN:
        return None
    free = 1 - p.timeline.verdict_bytes / p.timeline.usable_bytes
    return (f"note: {_mask_words(plan)} is on the GPU at this mesh's peak; Megatron Core's attention (causal mask "
            f"type) builds the mask itself: {keys.setting(SETTING)} -> {p.timeline.verdict_words()} "
            f"({free:.1%} of the usable "
            f"{tl.usable_bytes / GiB:.1f} GiB free; keep the mask where the data needs --reset-attention-mask's "
            f"per-document masks)")
