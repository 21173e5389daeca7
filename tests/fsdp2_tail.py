"""What FSDP2's one reduce-scatter in flight (nic49: ``Overlap.fsdp_rs_queue``, schedule/grad_reduce.py
``rs_buffer_wait``; torch 2.13 ``_fsdp_param_group.py`` lines 639-658) adds to a pp-1 step, by hand,
for the tests whose pins moved with it (test_restart_kind, test_newcomer8).

Without pp every micro-batch's backward unit ends the same way: layer 0's copy-in, its reduce-scatter
(``rs`` seconds, the collective table's time, alone on the NIC: no all-gather is left to issue), the
embedding's tp all-gather and its gradient on the compute stream (``before`` seconds), then the
embedding unit's copy-in (``copy_in``) and reduce-scatter (``rs_embed``).

- One queue (main before nic49): the copy-in follows the embedding's gradient at once, so the
  unit's compute ends ``before + copy_in`` after layer 0's reduce-scatter starts, and the embedding's
  reduce-scatter queues behind layer 0's: the unit's tail past its compute is ``rs - before -
  copy_in + rs_embed`` (where ``rs > before + copy_in``).
- One reduce-scatter in flight: the copy-in waits for layer 0's reduce-scatter to end first, so each
  backward unit's compute is ``w = rs - before`` longer (exposed fsdp), and the embedding's
  reduce-scatter then runs alone: the tail is ``rs_embed``.

The unit's start moves too (``h``): the head unit's reduce-scatter (``rs_head``, demand ``d_head`` of
the NIC) is issued at ``T``, the last layer's first kernel (``lead``) runs, then layer n-2's all-gather
(``ag``, demand ``d_ag``) is issued. One queue: the all-gather waits for the reduce-scatter, so it ends
at ``T + rs_head + ag``. Two queues: both run, each at the max-min level 1/2 (both demands above it),
the all-gather at ``0.5 / d_ag`` of its speed for ``a2 = ag x d_ag / 0.5``, the reduce-scatter at
``0.5 / d_head`` meanwhile, alone before and after: it ends ``E = rs_head + a2 x (1 - 0.5 / d_head)``
after ``T``. The last layer's backward frees the compute stream ``F`` after ``T``; its copy-in
(``copy_layer``) then waits for the reduce-scatter before (one in flight), and layer n-2's first kernel
waits for the copy-in and its all-gather: it starts ``max(F, E) + copy_layer`` after ``T`` against
``max(F + copy_layer, rs_head + ag)`` on one queue: ``h`` the difference (0 where the compute is the
longer both ways).

The step (pp 1: the units one after another, the last one's tail after them) moves by ``m x (w + h) -
(w - copy_in)`` over ``m`` micro-batches. Elsewhere in the unit nothing moves where each layer's
all-gather, sharing the NIC with the reduce-scatter before it, still ends before its layer's backward
needs it (checked by each test against the model's step, not assumed here).

Under pp the reduce-scatters wait for the chunk's last backward (:func:`deferred_wait`): one in flight
serializes each layer's copy-in behind the reduce-scatter before it.

The inputs are the model's own: ``rs`` and ``rs_embed`` the collective table's (size over busbw,
tested elsewhere), their demands the table's NIC shares (comm_times.nic_share), ``before``, ``copy_in``,
``lead``, ``F`` and ``copy_layer`` the compute stream's kernels (their durations, none of which shares
a NIC), read from the backward unit the step plays."""

from __future__ import annotations

from dataclasses import dataclass

from meshplan.schedule import unit_times
from meshplan.schedule.steptime import step_time

RS = ("shard", "layer", "backward", "reduce-scatter")
RS_EMBED = ("shard", "root_embed", "backward", "reduce-scatter")
RS_HEAD = ("shard", "root_head", "backward", "reduce-scatter")
AG = ("shard", "layer", "backward", "all-gather")
#: the compute stream's kernels between layer 0's reduce-scatter and the embedding unit's copy-in
BEFORE = ("tp all-gather (embedding)", "embedding tp wait", "embedding grad")


@dataclass(frozen=True)
class Tail:
    """A pp-1 plan's backward end (seconds): the module docstring's ``rs``, ``before``, ``copy_in``,
    ``rs_embed``; ``m`` micro-batches."""

    rs: float
    before: float
    copy_in: float
    rs_embed: float
    m: int
    rs_head: float = 0.0
    ag: float = 0.0
    d_head: float = 0.0
    d_ag: float = 0.0
    lead: float = 0.0
    free: float = 0.0
    copy_layer: float = 0.0

    @property
    def w(self) -> float:
        """Each backward unit's wait for layer 0's reduce-scatter before the embedding's copy-in."""
        return self.rs - self.before

    @property
    def h(self) -> float:
        """The next layer's start moved at the unit's head: ``max(F, E) + copy_layer - max(F + copy_layer,
        rs_head + ag)`` (module docstring)."""
        assert min(self.d_head, self.d_ag) > 0.5, "both above the max-min level 1/2"
        a2 = self.ag * self.d_ag / 0.5
        assert self.lead + a2 * 0.5 / self.d_head < self.rs_head, "the all-gather ends first"
        e = self.rs_head + a2 * (1 - 0.5 / self.d_head)
        return max(self.free, e) + self.copy_layer - max(self.free + self.copy_layer, self.rs_head + self.ag)

    @property
    def step_delta(self) -> float:
        """The step's change from one queue to one reduce-scatter in flight: m x (w + h) - (w - copy_in)."""
        assert self.w > self.copy_in > 0, "the derivation holds where layer 0's reduce-scatter outlasts both"
        return self.m * (self.w + self.h) - (self.w - self.copy_in)


def units_of(plan) -> tuple[list, float]:
    """([(flags, UnitSim, CommTimes) of each backward unit the step plays], the step in seconds):
    ``flags`` the keywords :func:`~meshplan.schedule.backward_pass.backward_unit` was called with."""
    seen = []
    real = unit_times.backward_unit

    def keep(kind, chunk, comm, w, ov, **kw):
        sim = real(kind, chunk, comm, w, ov, **kw)
        seen.append((kw, sim, comm))
        return sim
    unit_times.backward_unit = keep
    try:
        step = step_time(plan).step_s
    finally:
        unit_times.backward_unit = real
    return seen, step


def tail_of(plan) -> tuple[Tail, float]:
    """(``plan``'s :class:`Tail`, its step in seconds): the step played once, its backward unit kept."""
    units, step = units_of(plan)
    _, sim, comm = units[0]
    ev = list(sim.events)
    dur = {e.name: e.end_s - e.start_s for e in ev}
    top = next(e for e in ev if e.name == "fsdp RS root_head").start_s
    copy = next(e for e in ev if e.name.startswith("fsdp RS copy-in L"))  # the last layer's, issued first
    last = copy.name.split()[-1]
    free = max(e.end_s for e in ev if e.stream == "compute" and e.end_s <= copy.start_s
               and e.name != "fsdp RS buffer wait")
    return Tail(comm.t[RS], sum(dur.get(n, 0.0) for n in BEFORE), dur["fsdp RS copy-in root_embed"],
                comm.t[RS_EMBED], plan.micro_batches, comm.t[RS_HEAD], comm.t[AG], comm.nic[RS_HEAD],
                comm.nic[AG], dur[last], free - top, copy.end_s - copy.start_s), step


def deferred_wait(plan) -> tuple[float, float]:
    """(seconds the one reduce-scatter in flight adds to stage 0's deferred reduction, the step). Under pp
    FSDP2 reduce-scatters after the chunk's last backward (torch's ``perform_reduce_grad``:
    backward_pass.backward_unit ``deferred``), the embedding's unit first, then each layer's (copy-in,
    reduce-scatter). One queue: the copy-ins ran back to back on the compute stream while the
    reduce-scatters queued one behind the other, so the stage ended with the last reduce-scatter, each
    copy-in shorter than the reduce-scatter before it; one in flight: each layer's copy-in waits for the
    reduce-scatter before it, so the stage's end moves by the layers' copy-ins, their sum returned (the
    step moves by it where stage 0's last backward ends the step: checked by the test, not assumed)."""
    units, step = units_of(plan)
    _, sim, comm = next(u for u in units if u[0].get("deferred") and u[0].get("stage_last")
                        and u[0].get("last_grad_unit") and any(e.name == "embedding grad" for e in u[1].events))
    copies = [e.end_s - e.start_s for e in sim.events if e.name.startswith("fsdp RS copy-in L")]
    assert copies and max(copies) < min(comm.t[RS], comm.t[RS_EMBED]), "each copy-in shorter than a reduce-scatter"
    return sum(copies), step
