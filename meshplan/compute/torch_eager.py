"""The elementwise kernels torch runs around a torchtitan decoder layer's GEMMs when the model
is not compiled, as HBM bytes per element of the tensors they touch (``b``: bytes of an
activation element, 2 for bf16; fp32 intermediates 4 B).

torch.compile (inductor) fuses each chain below into one kernel: the step model's fused op list
(:func:`meshplan.compute.layer.layer_costs`) is that compiled layer. Without it every torch op is
its own kernel and writes its result to HBM. torchtitan compiles only with ``[compile] enable =
true`` (``components`` "model" and "loss"; off by default, ``torchtitan/config/job_config.py``),
so a torchtitan job without it runs these (``TrainingSpec.torch_compile``).

Sources (read, not copied): torchtitan ``models/llama3/model/model.py`` @018740b and
``components/loss.py`` @00a388d; autograd's derivatives of the same ops
(``tools/autograd/derivatives.yaml``: ``mul`` gives one product per input, ``silu`` one
``silu_backward``, ``_to_copy`` casts the gradient back).

- **SwiGLU** ``w2(F.silu(w1(x)) * w3(x))``: forward ``silu`` (read, write) and ``mul`` (read 2,
  write 1): ``5 b`` per gate element against the fused kernel's ``3 b``; backward ``mul``'s two
  products (read 2, write 1 each) and ``silu_backward`` (read 2, write 1): ``9 b`` against ``5 b``.
- **RoPE** ``apply_rotary_emb``: per element of q and of k, ``x.float()`` (read b, write 4),
  the complex multiply by ``freqs_cis`` (read 4, write 4; the table itself, ``s x d/2`` complex,
  is not counted) and ``type_as`` (read 4, write b): ``2 b + 16`` each way (the backward runs
  the same three: the downcast's gradient upcast, the multiply by the conjugate, the upcast's
  gradient downcast) against the fused ``2 b``.
- **RMSNorm, decomposed** (``TrainingSpec.torch_norm = "decomposed"``): torchtitan's own
  ``RMSNorm`` before 2025 (``torchtitan/models/norms.py`` @9dec370, ``norm_type = "rmsnorm"``,
  the default of ``config_manager.py`` and of every llama3 preset there):
  ``self._norm(x.float()).type_as(x) * self.weight``, ``_norm(x) = x * torch.rsqrt(x.pow(2).mean(-1,
  keepdim=True) + eps)``. Per element of the normed tensor, forward: ``x.float()`` (read b, write
  4), ``pow`` (read 4, write 4), ``mean`` (read 4), ``x * rstd`` (read 4, write 4), ``type_as``
  (read 4, write b), ``* weight`` (read b, write b): ``4 b + 28`` against the fused kernel's
  ``2 b``; the per-row ``+ eps`` and ``rsqrt`` are two more kernels (4 B a row each way).
  Backward (derivatives.yaml; ``pow_backward`` in ``FunctionsManual.cpp``: ``grad * (exp *
  self.pow(exp - 1))``): ``* weight``'s two products (read b write b; read 2 b write b) and the
  weight gradient's sum over rows (read b), the ``type_as`` gradient upcast (read b, write 4),
  ``x * rstd``'s two products (read 4 write 4; read 8 write 4) and the sum of the second over
  ``h`` (read 4), ``mean``'s gradient expanded and divided (write 4), ``pow``'s: ``self.pow(1)``
  (a copy: read 4, write 4), ``2 *`` it (read 4, write 4) and ``grad *`` it (read 8, write 4),
  the two gradients of ``x.float()`` accumulated (read 8, write 4) and cast back (read 4, write
  b): ``8 b + 76`` against the fused ``3 b``; the per-row ``rsqrt`` gradient ``-0.5 * grad *
  result.pow(3)`` is three more kernels. torch.compile fuses the chain (the fused kernel).
- **Cross entropy** ``F.cross_entropy(pred.float(), labels)``: per logit, forward the upcast
  (read b, write 4) and ``log_softmax`` (read 4, write 4; ``nll_loss`` gathers one logit per
  token): ``b + 12``; backward ``nll_loss_backward`` (zero-filled gradient, write 4),
  ``log_softmax_backward`` (read the gradient and the output, write 4: 12) and the upcast's
  gradient (read 4, write b): ``b + 20``. Fused: ``b + 4`` and ``4 + b``. A lower bound: torch's
  softmax kernel over a 128k-wide row may read it more than once.

:func:`repeat_kv_bytes` is not an eager-only cost: torchtitan before ff0829c (v0.2.2) materialises
the repeated K and V heads for ``scaled_dot_product_attention`` compiled or not (``repeat_kv``:
``expand`` then ``reshape``, a copy whenever ``n_rep > 1``); planned with ``[memory] kv_expanded``
alone (:func:`meshplan.spec.axes.tp.sdpa_kv_heads`): ff0829c and later pass ``enable_gqa=True``
instead, no copy.
"""

from __future__ import annotations


def swiglu_bytes(b: int, eager: bool) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """(forward, backward) kernels of the gated activation as (name, bytes per gate element).

    >>> swiglu_bytes(2, True)
    ([('silu', 4), ('silu x up', 6)], [('silu grad', 6), ('silu x up grad', 12)])
    >>> swiglu_bytes(2, False)
    ([('silu x up', 6)], [('silu x up', 10)])
    """
    if not eager:
        return [("silu x up", 3 * b)], [("silu x up", 5 * b)]
    return [("silu", 2 * b), ("silu x up", 3 * b)], [("silu grad", 3 * b), ("silu x up grad", 6 * b)]


def rope_bytes(b: int, eager: bool) -> list[tuple[str, int]]:
    """Kernels of RoPE on one tensor (q or k), the same list forward and backward, as (name,
    bytes per element).

    >>> rope_bytes(2, True), sum(n for _, n in rope_bytes(2, True))
    ([('rope upcast', 6), ('rope complex mul', 8), ('rope downcast', 6)], 20)
    >>> rope_bytes(2, False)
    [('rope', 4)]
    """
    if not eager:
        return [("rope", 2 * b)]
    return [("rope upcast", b + 4), ("rope complex mul", 8), ("rope downcast", 4 + b)]


def repeat_kv_bytes(b: int, q_heads: int, kv_heads: int, tokens: int, head_dim: int) -> tuple[int, int]:
    """(forward, backward) bytes of ``repeat_kv`` on K and V of one rank (``q_heads`` and
    ``kv_heads`` local): forward reads each ``tokens x kv_heads x head_dim`` and writes it
    ``q_heads / kv_heads`` times; backward sums the repeated gradient back (read the repeated,
    write the original). 0 without grouped heads.

    Llama 3 8B on one GPU, 8,192 tokens: 32 q and 8 KV heads of 128, bf16: each of K and V reads
    16.8 MB and writes 67.1 MB:

    >>> repeat_kv_bytes(2, 32, 8, 8192, 128)
    (167772160, 167772160)
    """
    if q_heads <= kv_heads:
        return 0, 0
    per = b * tokens * head_dim * (q_heads + kv_heads)
    return 2 * per, 2 * per


def cross_entropy_bytes(b: int, eager: bool) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """(forward, backward) kernels of torch's cross entropy over fp32-upcast logits as (name,
    bytes per local logit).

    >>> cross_entropy_bytes(2, True)
    ([('logits upcast', 6), ('log_softmax', 8)], [('nll_loss grad', 4), ('log_softmax grad', 12), ('logits upcast grad', 6)])
    >>> cross_entropy_bytes(2, False)
    ([('cross entropy', 6)], [('cross entropy', 6)])
    """
    if not eager:
        return [("cross entropy", b + 4)], [("cross entropy", 4 + b)]
    return ([("logits upcast", b + 4), ("log_softmax", 8)],
            [("nll_loss grad", 4), ("log_softmax grad", 12), ("logits upcast grad", 4 + b)])


def rmsnorm_bytes(b: int) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """(forward, backward) kernels of the decomposed RMSNorm run eagerly (module docstring) as
    (name, bytes per element of the normed tensor); :data:`RMSNORM_ROW_KERNELS` has the per-row
    ones.

    >>> f, bw = rmsnorm_bytes(2)
    >>> len(f), sum(n for _, n in f), len(bw), sum(n for _, n in bw)
    (6, 36, 13, 92)
    """
    fwd = [("upcast", b + 4), ("pow", 8), ("mean", 4), ("x * rstd", 8), ("downcast", 4 + b), ("* weight", 2 * b)]
    bwd = [("* weight grad", 2 * b), ("weight grad mul", 3 * b), ("weight grad sum", b), ("downcast grad", b + 4),
           ("x * rstd grad", 8), ("rstd grad mul", 12), ("rstd grad sum", 4), ("mean grad", 4),
           ("pow grad x^1", 8), ("pow grad 2x", 8), ("pow grad mul", 12), ("x grad accumulate", 12),
           ("upcast grad", 4 + b)]
    return fwd, bwd


#: Per-row kernels of the decomposed RMSNorm, (forward, backward) as (name, bytes per row):
#: ``+ eps`` and ``rsqrt`` (read 4, write 4 each); ``rsqrt``'s gradient ``-0.5 * grad *
#: result.pow(3)``: ``pow`` and ``-0.5 *`` (8 each) and the product (read 8, write 4).
RMSNORM_ROW_KERNELS = ([("+ eps", 8), ("rsqrt", 8)], [("rsqrt grad pow", 8), ("rsqrt grad scale", 8),
                                                       ("rsqrt grad mul", 12)])
