"""RoPE frequency scaling of a model (``[model] rope_scaling``): Llama 3.1's, carried through
import and export and named in the plan past the original context; it costs no time or memory
of note. The model it belongs to: :class:`meshplan.spec.model.ModelSpec`.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from meshplan.limits import BOUNDS


class RopeScaling(BaseModel):
    """Llama 3.1's RoPE frequency scaling (``rope_type = "llama3"``; Dubey et al. 2024,
    arXiv 2407.21783, section 3.4.2: the context extended from 8K to 128K): each inverse
    frequency of wavelength above ``original_max_position / low_freq_factor`` is divided by
    ``factor``, those below ``original_max_position / high_freq_factor`` are kept, the ones
    between are interpolated. The defaults are Llama 3.1's (factor 8, low 1, high 4, original
    8192 positions: the ``rope_scaling`` of meta-llama/Llama-3.1-8B's config.json, the constants
    of Megatron-LM d98e8a6 ``RotaryEmbedding._apply_scaling``,
    megatron/core/models/common/embeddings/rotary_pos_embedding.py, and of torchtitan b5bcd76
    ``RoPE.Config``, torchtitan/models/common/rope.py).

    It costs no time or memory of note: the frequencies are computed once (a ``head_dim / 2``
    vector, and the cos/sin table of ``max_position x head_dim`` that RoPE precomputes with or
    without it), and the per-token rotation is the same. It is carried so that an import keeps
    it and an export writes it (Megatron-LM ``--use-rope-scaling`` ``--rope-scaling-factor``);
    the plan mentions it only where training goes past ``original_max_position``.

    >>> RopeScaling(factor=8.0).note(131072)
    'RoPE scaled as Llama 3.1 (factor 8, low/high frequency factors 1/4, original 8192 positions): training.seq_len 131072 goes past the original 8192 on the scaled frequencies; no time or memory of note (a precomputed frequency table)'
    >>> RopeScaling(factor=8.0).note(8192)
    ''
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    factor: float = Field(default=8.0, ge=1, le=BOUNDS["rope_scaling_factor"].value)
    low_freq_factor: float = Field(default=1.0, gt=0, le=BOUNDS["rope_scaling_factor"].value)
    high_freq_factor: float = Field(default=4.0, gt=0, le=BOUNDS["rope_scaling_factor"].value)
    original_max_position: int = Field(default=8192, gt=0, le=BOUNDS["max_position"].value)

    @model_validator(mode="after")
    def _check(self):
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(f"rope_scaling.high_freq_factor {self.high_freq_factor:g} must be more than "
                             f"low_freq_factor {self.low_freq_factor:g} (Llama 3.1: 4 and 1)")
        return self

    def note(self, seq_len: int) -> str:
        """One line for the plan when ``seq_len`` goes past ``original_max_position`` (where
        the scaling is what the later positions rely on); else empty."""
        if seq_len <= self.original_max_position:
            return ""
        return (f"RoPE scaled as Llama 3.1 (factor {self.factor:g}, low/high frequency factors "
                f"{self.low_freq_factor:g}/{self.high_freq_factor:g}, original {self.original_max_position} positions): "
                f"training.seq_len {seq_len} goes past the original {self.original_max_position} on the scaled "
                f"frequencies; no time or memory of note (a precomputed frequency table)")
