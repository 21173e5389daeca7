"""The output layer's float8 work (``training.fp8_output_layer``: torchtitan's ``filter_fqns`` without
``"output"``; off by default: ``Float8Handler`` at 9dec370 converted every Linear but ``fqn !=
"output"``, and since torchtitan a6524d8 (April 2025, ``filter_fqns``, default ``[]``) its
presets list ``"output"``): its casts run eagerly, as torchtitan's ``apply_compile`` compiles
the TransformerBlocks alone (9dec370 and today, ``parallelize_llama.py``), so each is counted
as an eager Linear's (:func:`head_kernels`, with
:mod:`meshplan.compute.float8`'s per-tensor kernels): the input ``[tokens, h]`` and the output gradient
``[tokens, V / tp]`` an amax and a cast each plus the weight-gradient GEMM's transposed copy,
and the weight's kernels (:func:`~meshplan.compute.float8.weight_kernels`). The logits' gradient dominates: Llama 3 8B at
16,384 tokens, 16,384 x 128,256 elements at 3 x 2 + 2 + 25 + 2 B = 35 B, 73.5 GB a micro-batch.
Not counted there: under TP the amax all-reduce of its vocabulary-sharded output gradient
(torchtitan's output layer keeps plain ``ColwiseParallel``), and its saved float8 input.
"""

from __future__ import annotations

from meshplan.compute.float8 import activation_kernels, applies, rescale_kernels, weight_kernels


def head_kernels(w, g, b: int) -> list[tuple[str, str, str, float]]:
    """(name, block, phase, bytes) of the output layer's float8 kernels per micro-batch when it
    is a float8 Linear (``"output" in w.float8_gemms``: ``training.fp8_output_layer``), eager
    (module docstring); ``g``: its GEMM (M tokens, N = V / tp, K = h).

    Llama 3 8B, 16,384 tokens, tensorwise, weights gathered in float8: the input 16,384 x 4096
    at 3 b + (b + 25) + 2 = 35 B (b = 2), the logits' gradient 16,384 x 128,256 at 35 B, the
    weight's transposed copy 128,256 x 4096 at 2 B:

    >>> from meshplan.compute.ops import Workload
    >>> from meshplan.compute.shapes import Gemm
    >>> w = Workload(seq_len=8192, micro_batch=2, linear_dtype="fp8", fp8_all_gather=True,
    ...              float8_gemms=frozenset({"output"}))
    >>> k = head_kernels(w, Gemm("output", 16384, 128256, 4096), 2)
    >>> [(n, ph) for n, _, ph, _ in k][:3], len(k)
    ([('float8 amax (head input)', 'forward'), ('float8 cast (head input)', 'forward'), ('float8 transpose (head input, output wgrad)', 'backward_input')], 7)
    >>> sum(x[3] for x in k) == 35 * 16384 * (4096 + 128256) + 2 * 128256 * 4096 == 76946604032
    True
    """
    if not applies(w) or "output" not in w.float8_gemms:
        return []
    rowwise, m, n, k = w.fp8_rowwise, g.m, g.n * g.count, g.k
    out: list[tuple[str, str, str, float]] = []
    for what, phase, cols in (("head input", "forward", k), ("output grad", "backward_input", n)):
        out += [(f"float8 {kn} ({what})", "head", phase, float(nb * m * cols))
                for kn, nb in activation_kernels(rowwise, True, b, False)]
        if not rowwise:  # eager: the weight-gradient GEMM's transposed copy (mm)
            out.append((f"float8 transpose ({what}" + (", output wgrad)" if phase == "forward" else ")"), "head",
                        "backward_input", 2.0 * m * cols))
    out += [(f"float8 {kn} (output weight)", "head", phase, float(nb * n * k))
            for kn, phase, nb in weight_kernels(rowwise, True, b, w.fp8_all_gather and not rowwise)]
    out += [(f"float8 rescale (output {which})", "head", phase, float(nb * rows * k))
            for which, phase, nb, rows in rescale_kernels(rowwise, True, b, m, n)]
    return out
