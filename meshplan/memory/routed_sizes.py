"""The routed experts of one MoE layer, bytes on the busiest rank of one micro-batch: what they
keep for backward (:func:`routed_sizes`, under Megatron-LM's selective recompute modules
:func:`routed_kept`), their backward and checkpointed forward's working sets, and the all-to-all
outputs torchtitan's op-level AC saves; an MLP's backward steps (:func:`mlp_step_work`), which
the dense layers of :mod:`meshplan.memory.workingset` share. Split from that module (review rv48:
it had grown past the project's 400 lines); its module docstring states the working sets.

MoE layers (an estimate): attention and shared experts as a dense layer
of width ``shared_experts x shared_expert_ffn``; routed experts keep, per row the busiest
rank's local experts compute (:func:`meshplan.compute.routing.routing` of the tokens each rank
routes, :func:`~meshplan.compute.routing.routed_tokens`: ``experts x C`` padded rows with a
capacity, the hottest expert's rank's share when dropless; under Megatron-LM at etp > 1 times etp,
the rows its etp all-gather collects), the expert MLP terms at width
``expert_ffn / etp`` (gated: 4 columns, 3 with ``fused_glu``; GeLU: 2) plus the dispatched input and the expert output (``2 a h`` each) and
the fp32 router logits ``4 experts`` per token.
"""

from __future__ import annotations

from math import ceil

from meshplan.compute.routing import RoutingOptions, routed_tokens, routing
from meshplan.mesh.resolve import Mesh
from meshplan.spec.model import ModelSpec
from meshplan.spec.training import TrainingSpec
from meshplan.units import dtype_bytes


def routed_sizes(model: ModelSpec, training: TrainingSpec, mesh: Mesh, tok: int, tp: int,
                 fused: bool) -> tuple[int, int, int, int]:
    """(kept activations, backward working set, checkpointed forward's working set, all-to-all
    outputs), bytes of the routed experts of one MoE layer on the busiest rank (module docstring),
    at the received rows of :func:`meshplan.compute.routing.routing`. The last is what torchtitan's
    op-level selective AC keeps of them: the outputs of the ep dispatch's and combine's
    ``all_to_all_single`` (in its save list: torchtitan 238fa99
    ``models/deepseek_v3/infra/parallelize.py`` lines 33-48, ``distributed/expert_parallel.py``
    lines 138 and 175), ``a h`` per received and per returned row; none at ep 1 (no all-to-all);
    the grouped GEMMs' outputs are recomputed (``torch._grouped_mm`` is not in the list). The
    per-expert counts' all-to-all output (``experts`` int64) is not counted."""
    a, h = dtype_bytes(training.compute_dtype), model.hidden
    # the tokens a rank routes, and the etp ranks whose received rows its experts take (Megatron-LM's
    # etp all-gather; torch: the tp ranks split the tokens, runtime.moe): compute.routing.routed_tokens
    routed_tok, g = routed_tokens(tok, tp, mesh.etp, training.framework)
    r = routing(RoutingOptions.of(training), routed_tok, model.top_k, model.experts, mesh.ep)
    copies, width = g * r.recv_rows, ceil(model.moe_ffn / mesh.etp)  # rows the busiest rank computes
    kept = 3 if fused else 4 if model.gated_mlp else 2  # f-wide columns per row (activations module)
    full = copies * (a * width * kept + 2 * a * h) + 4 * routed_tok * model.experts
    widest = max(mlp_step_work(a * copies * width, a * copies * h, model.gated_mlp)) + scores_grad(model, training,
                                                                                                   routed_tok)
    fwd = a * h * (r.send_rows + 2 * copies) + (3 if model.gated_mlp else 2) * a * copies * width
    return full, widest, fwd, a * h * (copies + r.send_rows) if mesh.ep > 1 else 0


def scores_grad(model: ModelSpec, training: TrainingSpec, routed_tok: int) -> int:
    """Bytes of the routing scores' gradient that waits through the routed experts' backward under
    torch: the combine multiplies the experts' output by the top-k scores (fp32 in torchtitan,
    ``routed_output.to(torch.float32) * top_scores_experts_sorted.reshape(-1, 1)``,
    ``torchtitan/models/moe.py``; :mod:`meshplan.runtime.execution.moe` ``_dropless``), so its backward,
    the layer's first, writes a (tokens x top_k) fp32 gradient for the scores, which autograd holds
    in the router's node (made before the experts' in forward, so run after them) until the
    experts' backward is done: ``4 routed_tok top_k``. Measured: at world 2 and 4 of
    ``tests/data/validate_mixtral_ep2_fsdp.toml`` the temporaries row was 256 B (32 tokens x 2 x 4 B)
    and 512 B (64 x 2 x 4 B) over the plan's step once the received rows were the run's. Megatron-LM
    applies the probabilities in its unpermute (not read here): 0."""
    return 4 * routed_tok * model.top_k if training.framework == "torch" else 0


def routed_kept(model: ModelSpec, training: TrainingSpec, mesh: Mesh, tok: int, tp: int, fused: bool,
                parts: frozenset) -> int:
    """Bytes the routed experts of one MoE layer keep under selective recompute ``parts``
    (:func:`meshplan.spec.recompute_modules.layer_parts`): none under ``moe`` (the whole MoE layer
    checkpointed with its input, the norm's output, counted with the layer's terms); under
    ``moe_act`` those of :func:`routed_sizes` less the activation's output, fc2's input, one
    f-wide column per received row (Megatron-LM's ``TEGroupedMLP`` discards it and keeps the
    activation's input, fc1's output: :mod:`meshplan.spec.recompute_modules`).

    Mixtral (h 4096, 8 experts, top 2, expert ffn 14336), 4,096 tokens at ep 1, bf16, fused SwiGLU:
    8,192 rows x (3 x 14,336 + 2 x 4,096) x 2 B + 4 B x 4,096 tokens x 8 experts = 838,991,872 B kept
    without recompute; moe_act frees fc2's input, 8,192 x 14,336 x 2 B = 234,881,024 B of them (gated
    unfused: the SiLU output and the product, two columns; GeLU: one):

    >>> from meshplan import catalog
    >>> from meshplan.mesh.resolve import resolve_mesh
    >>> from meshplan.spec.mesh import MeshSpec
    >>> m, t = catalog.model("mixtral-8x7b"), TrainingSpec(global_batch=8, seq_len=4096, framework="megatron")
    >>> mesh = resolve_mesh(MeshSpec(names=["dp_shard"], shape=[1]), 1)
    >>> routed_sizes(m, t, mesh, 4096, 1, True)[0], routed_kept(m, t, mesh, 4096, 1, True, frozenset({"moe_act"}))
    (838991872, 604110848)
    """
    if "moe" in parts:
        return 0
    full = routed_sizes(model, training, mesh, tok, tp, fused)[0]
    routed_tok, g = routed_tokens(tok, tp, mesh.etp, training.framework)
    r = routing(RoutingOptions.of(training), routed_tok, model.top_k, model.experts, mesh.ep)
    kept = 3 if fused else 4 if model.gated_mlp else 2  # as routed_sizes; the checkpoint keeps fc1's output
    freed = kept - (2 if model.gated_mlp else 1)
    return full - freed * dtype_bytes(training.compute_dtype) * g * r.recv_rows * ceil(model.moe_ffn / mesh.etp)


def mlp_step_work(F: int, H: int, gated: bool) -> tuple[int, int]:
    """Working sets (bytes) of an MLP's activation and w_in backward steps over the same rows,
    ``F`` bytes of one f-wide tensor, ``H`` of one h-wide (module docstring): gated 3F (d of
    the w_out input, of silu's output, of up) and max(2F + H, 3H) (the two GEMMs' dX and their
    sum); GeLU 2F and F + H. A dense layer's MLP and, per received row, an MoE layer's routed
    experts.

    >>> mlp_step_work(10, 4, True), mlp_step_work(10, 4, False)
    ((30, 24), (20, 14))
    """
    return (3 * F, max(2 * F + H, 3 * H)) if gated else (2 * F, F + H)
