"""The single-process reference's forward over many ranks' micro-batches, shared by
tests/test_validate_pp_combos.py and tests/test_validate_moe.py: the unsplit model's per-token
losses of each (tokens, labels) pair, each distinct pair run once (the ranks of one tp or cp group
hold the same micro-batch: ``meshplan.runtime.execution.trainstep.batch``) and, where no
MoE layer routes with a capacity, all of them in one batch.

Why it is the same reference: a duplicate's losses are the same tensor, so the mean over ranks
counts it as often as before and its gradient is the same sum; the dense layers and dropless
routing treat every sequence of a batch alone (attention within the sequence, each token's
experts its own), so one (N, seq) batch gives each sequence the losses a (1, seq) call gives, to
float rounding (the GEMMs' row count differs: ~1e-7 relative, under the tests' 1e-5). A capacity
(``ceil(f x T x top_k / experts)`` of the ``T`` tokens of the call) depends on the call's
tokens, so those models run one call per distinct pair.

Measured on 2 shared cores (tests/test_validate_pp_combos.py, Mixtral scaled, pp 2 x dp_shard 4 x
ep 2, 4 last-stage ranks x 4 micro-batches x 2 steps): 12.4 s one call per rank and micro-batch,
most of it the per-call grouped-GEMM backward of the experts; see the commit message for after."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def per_token_losses(model, pairs: list, batched: bool) -> list:
    """``pairs``: (tokens, labels) int64 tensors of shape (b, s); returns, in their order, each
    pair's per-token cross-entropy (b, s) of ``model`` (logits (b, s, vocab)), one tensor per
    distinct pair (a repeated pair gets the first one's tensor). ``batched``: the distinct pairs in
    one forward (only where the model treats each sequence alone: no capacity routing)."""
    keys = [(t.shape, t.numpy().tobytes(), y.numpy().tobytes()) for t, y in pairs]
    first = {k: i for i, k in reversed(list(enumerate(keys)))}
    distinct = sorted(set(first.values()))
    if batched:
        tokens = torch.cat([pairs[i][0] for i in distinct])
        labels = torch.cat([pairs[i][1] for i in distinct])
        flat = F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten(), reduction="none")
        losses = list(flat.view(tokens.shape).split([pairs[i][0].shape[0] for i in distinct]))
    else:
        losses = [F.cross_entropy(model(pairs[i][0]).flatten(0, 1), pairs[i][1].flatten(), reduction="none")
                  .view(pairs[i][0].shape) for i in distinct]
    by_first = dict(zip(distinct, losses))
    return [by_first[first[k]] for k in keys]
