"""The optimizer step's temporaries follow ``training.optimizer_impl`` (issue 11): torch's fused
AdamW (the default) updates in place, its foreach AdamW allocates ``exp_avg_sq.sqrt()`` for every
parameter (torch 2.13.0, torch/optim/adam.py ``_fused_adam`` / ``_multi_tensor_adam``).

The config: tests/test_memory_timeline.py's tiny model (10,320 parameters: the embedding 2,048,
two layers 3,104 each, the final norm and output 2,064), fp32 throughout, DDP over 2 ranks
(sharding none), one micro-batch of one 4-token sequence, NCCL 1000 B x 2 channels x 2 peers,
workspace 500 B."""

import pytest

from meshplan.spec.memory import MemoryOptions
from tests.test_memory_timeline import EMBED, HEAD, LAYER, MEM, plan_of

DDP = dict(names=["dp_replicate"], shape=[2], world=2)
PARAMS = 10_320 * 4                    # fp32 parameters, and as much again for the fp32 gradients
STATE = 2 * PARAMS                     # Adam's two fp32 moments
FIXED = 1000 * 2 * 2 + 500             # one communicator (dp_replicate), the cuBLAS workspace


def peak(**training):
    return plan_of(mesh=DDP, sharding="none", global_batch=2, seq_len=4, **training).timeline.peak


def test_fused_default_has_no_step_temporary_and_foreach_one_state():
    """foreach: the step is the peak, params + grads + moments + one moment-sized ``sqrt``
    (10,320 x 4 B) + NCCL and workspace = 210,900 B. fused: no temporary, so the peak moves to
    the head's forward: the same state and buffers with the 4-token activations (token ids 32 B,
    two layers 2,112 B each, the head's 2,356 B: half of the 8-token sizes of
    test_memory_timeline) and the bf16 logits of the output GEMM (2 x 4 x 128 = 1,024 B):
    177,256 B, 33,644 B less."""
    state = PARAMS + PARAMS + STATE + FIXED
    assert (state, EMBED // 2 + LAYER + HEAD // 2) == (169_620, 6_612)
    foreach, fused = peak(optimizer_impl="foreach"), peak()
    assert foreach.label == "optimizer step: 1 state-sized temporaries"
    assert foreach.total_bytes == state + STATE // 2 == 210_900
    assert foreach.by_kind["temporaries"] == 41_280
    assert fused.label == "head: final norm and output inputs, logits and loss saved"
    assert fused.total_bytes == state + 6_612 + 2 * 4 * 128 == 177_256
    assert foreach.total_bytes - fused.total_bytes == 33_644


def test_stated_temporaries_win_over_the_default():
    """``[memory] optimizer_temp_states = 1`` under the fused step prices foreach's temporary
    (a stated assumption), and 0 under foreach removes it."""
    one = plan_of(mesh=DDP, sharding="none", global_batch=2, seq_len=4, memory={**MEM, "optimizer_temp_states": 1.0})
    assert one.timeline.peak.total_bytes == 210_900
    zero = plan_of(mesh=DDP, sharding="none", global_batch=2, seq_len=4, optimizer_impl="foreach",
                   memory={**MEM, "optimizer_temp_states": 0.0})
    assert zero.timeline.peak.total_bytes == 177_256


@pytest.mark.parametrize("impl, states, expected", [("fused", None, 0), ("foreach", None, 20_640),
                                                    ("fused", 0.5, 10_320)])
def test_temp_bytes_of_a_shard(impl, states, expected):
    """One state of a 41,280 B two-moment shard is 20,640 B."""
    t = plan_of().config.training.model_copy(update={"optimizer_impl": impl})
    assert MemoryOptions(optimizer_temp_states=states).optimizer_temp_bytes(t, 41_280) == expected
