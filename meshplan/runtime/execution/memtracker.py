"""FSDPMemTracker for FSDP2 units of several modules.

torch 2.13's ``torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker`` instruments FSDP
modules one at a time. A unit of several modules (torchtitan's ``fully_shard([norm,
output])``, as :func:`~meshplan.runtime.execution.parallelize.apply_fsdp` wraps the head)
has one ``FSDPState`` shared by its modules, so the second module overwrites the hook
handles the first one stored: the tracker's hooks on the first module stay installed after
the tracker exits (the next forward raises "FSDPMemTracker does not support memory tracking
for multiple iterative calls"), the unit's ``pre_backward`` / ``post_backward`` stay wrapped,
and FSDP's group hooks (pre-forward on every module, post-forward once after the unit's
last module) come back as one plain hook per module, so the unit's post-forward runs after
each of its modules.

:class:`UnitMemTracker` instruments each state once, through FSDP's own group hooks where
the unit has several modules, and restores exactly the hooks ``fully_shard`` installed.
A unit of one module is instrumented as torch does it.

:class:`LabelledMemTracker` also logs every update of the tracker's running snapshot and
:func:`relabelled_kinds` re-reads that log with each storage under the last label the tracker
gave it, as meshplan's kinds (the one home of that mapping, used by ``memcheck`` on the fake
process group and by the validate worker's memory step). Why: torch 2.13's FSDPMemTracker labels
a storage when it first sees it and some ops later relabels it, and its peak snapshot keeps the
first label. Measured in ``meshplan validate examples/mini_2x4_tp2-dp4.toml --worlds 4``
(newcomer trial 21): at the tracker's peak the raw categories read params -32%, grads -35%,
temporaries +7809% against the plan while the total was -2%, since autograd's unsharded
gradients (FSDPMemTracker installs no gradient hook) and the unit gathered ahead of the one in
backward were still ``Temp`` there. The categories were assigned differently, the plan was not
wrong: relabelled, each kind compares like with like (``tests/test_validate_memory_kinds.py``).
"""

from __future__ import annotations

import weakref
from functools import wraps
from typing import Optional

import torch
from torch.distributed._tools.fsdp2_mem_tracker import (_TOTAL_KEY, FSDPMemTracker, _FSDPModMemStats, _FSDPRefType,
                                                        _FSDPState)
from torch.distributed._tools.mem_tracker import _UpdateType
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_state import _register_group_forward_hooks

from meshplan.memory.timeline import TRACKER_CATEGORIES


def fsdp_units(root) -> list:
    """(first module, FSDPState) of each FSDP unit with parameters under ``root``, in module
    order; a unit of several modules (``fully_shard([norm, output])``) appears once, as does one
    of several parameter groups (torchtitan's MoE block under ep > 1: its experts over efsdp)."""
    seen: dict[int, tuple] = {}
    for m in root.modules():
        if isinstance(m, FSDPModule):
            state = m._get_fsdp_state()
            if state._fsdp_param_groups and id(state) not in seen:
                seen[id(state)] = (m, state)
    return list(seen.values())


def outside_fsdp(root) -> list:
    """The parameters under ``root`` that no FSDP2 unit manages: the routed experts of an MoE
    layer at efsdp 1 (``fully_shard(..., ignored_params=...)``: each ep rank holds its
    ``E / ep`` experts whole, :mod:`meshplan.runtime.execution.parallelize`). torch 2.13's
    ``FSDPMemTracker`` labels only its units' sharded parameters and gradients
    (``fsdp2_mem_tracker.py`` 176-190, ``_instrument_fsdp_sharded_params_grads``) and its
    ``track_external`` is a no-op (498-501), so these were never labelled as parameters: the
    first view an op made of one (an expert's weight sliced in forward) took its whole storage
    as ``Activation`` and its gradient stayed ``Temp``. Measured at world 2 of
    ``tests/data/validate_mixtral_ep2_fsdp.toml`` (dp_shard 2 x ep 2, efsdp 1; 4 experts of
    3 x 256 x 896 fp32 per rank and MoE layer, 2 layers: 22,020,096 B): params 1,190,400 B measured
    against 23,210,496 B predicted (-95%), grads the same, activations +753%."""
    managed = {id(fp.sharded_param) for _, state in fsdp_units(root) for group in state._fsdp_param_groups
               for fp in group.fsdp_params}
    return [p for p in root.parameters() if id(p) not in managed]


def _hook_forward(state, pre, post, always_call: bool) -> None:
    """Install ``pre``/``post`` as ``state``'s forward hooks, as ``FSDPState.init`` does
    (one module: plain hooks; several: FSDP's group hooks)."""
    mods = state._modules
    if len(mods) == 1:
        state._pre_forward_hook_handle = mods[0].register_forward_pre_hook(pre, prepend=True, with_kwargs=True)
        state._post_forward_hook_handle = mods[0].register_forward_hook(post, prepend=False,
                                                                        always_call=always_call)
    else:
        handle = _register_group_forward_hooks(mods, pre, post, state._modules_to_run_forward,
                                               state._cast_output_dtype)
        state._pre_forward_hook_handle = state._post_forward_hook_handle = handle


class UnitMemTracker(FSDPMemTracker):
    """``FSDPMemTracker`` instrumenting each FSDP unit once (see the module docstring); a
    unit's statistics are kept under its first module. A unit of several parameter groups
    (torchtitan's MoE block under ep > 1, a per-parameter mesh) is instrumented group by group:
    torch 2.13's wrappers read ``FSDPState._fsdp_param_group``, which raises for such a state
    (``_fsdp_state.py`` 84-101), so its pre-forward and post-backward wrappers are
    :meth:`_groups_pre_forward` and :meth:`_group_post_backward`."""

    def _instrument_fsdp_module(self) -> None:
        self._saved_groups: list = []  # (group, its pre_backward, its post_backward)
        self._units: list = []  # the first module of each unit instrumented
        for mod, state in fsdp_units(self._root_mod):
            groups = state._fsdp_param_groups
            state._pre_forward_hook_handle.remove()
            if state._post_forward_hook_handle is not state._pre_forward_hook_handle:
                state._post_forward_hook_handle.remove()
            self._units.append(mod)  # before the wrappers: a failed entry re-hooks FSDP's own (trainstep._enter)
            pre = self._fsdp_state_pre_forward if len(groups) == 1 else self._groups_pre_forward
            _hook_forward(state, pre(mod, state._pre_forward),
                          self._fsdp_state_post_forward(mod, state._post_forward), always_call=True)
            for group in groups:
                self._instrument_fsdp_sharded_params_grads(group)
                self._saved_groups.append((group, group.pre_backward, group.post_backward))
                post = (self._fsdp_param_group_post_backward(mod, group.post_backward) if len(groups) == 1
                        else self._group_post_backward(mod, group, group.post_backward))
                group.pre_backward = self._fsdp_param_group_pre_backward(mod, group.pre_backward)
                group.post_backward = post
        # torch's tracker labels FSDP's own parameters alone; its snapshot has _FSDPRefType's keys only
        # (MemTracker's "Parameter" raises KeyError there): an ep rank's experts are its ep shard
        for param in outside_fsdp(self._root_mod):
            self._update_and_maybe_create_winfos(param, _FSDPRefType.SHARDED_PARAM)
            if param.grad is not None:
                self._update_and_maybe_create_winfos(param.grad, _FSDPRefType.SHARDED_GRAD)
        for buffer in self._root_mod.buffers():
            self._update_and_maybe_create_winfos(buffer, _FSDPRefType.BUFFER)

    def _groups_pre_forward(self, mod, orig):
        """torch 2.13's pre-forward wrapper (``fsdp2_mem_tracker.py`` 192-263) for a unit of
        several parameter groups: the module's statistics entry, every group's unsharded
        parameters labelled, and the recompute region entered (``_in_ac``) when it runs in backward."""
        @wraps(orig)
        def inner(*args, **kwargs):
            self._fsdp_state = _FSDPState.PRE_FW
            if mod not in self.memory_tracking:
                stat = self.memory_tracking[mod] = _FSDPModMemStats(self._mod_tracker.get_known_fqn(mod))
                stat.local_peak = {dev: snap[_TOTAL_KEY] for dev, snap in self.get_tracker_snapshot().items()}
            args, kwargs = orig(*args, **kwargs)
            for group in mod._get_fsdp_state()._fsdp_param_groups:
                for fp in group.fsdp_params:
                    self._update_and_maybe_create_winfos(fp.unsharded_param, _FSDPRefType.UNSHARDED_PARAM)
            if self._mod_tracker.is_bw and self._ac_mod is None:
                self._ac_mod, self._in_ac = weakref.ref(mod), True
            self._fsdp_state = _FSDPState.FW
            return args, kwargs

        return inner

    def _group_post_backward(self, mod, group, orig):
        """torch 2.13's post-backward wrapper (``fsdp2_mem_tracker.py`` 326-367) for one group of
        a unit of several: its unsharded gradients labelled before, its sharded ones after."""
        @wraps(orig)
        def inner(*args, **kwargs):
            for fp in group.fsdp_params:
                if fp._unsharded_param.grad is not None:
                    self._update_and_maybe_create_winfos(fp._unsharded_param.grad, _FSDPRefType.UNSHARDED_GRAD,
                                                         update_existing=True)
            self._fsdp_state = _FSDPState.POST_BW
            orig(*args, **kwargs)
            for fp in group.fsdp_params:
                if fp.sharded_param.grad is not None:
                    self._update_and_maybe_create_winfos(fp.sharded_param.grad, _FSDPRefType.SHARDED_GRAD)

        return inner

    def _deregister_module_and_optimizer_hooks(self) -> None:
        for mod in getattr(self, "_units", ()):
            state = mod._get_fsdp_state()
            state._pre_forward_hook_handle.remove()
            if state._post_forward_hook_handle is not state._pre_forward_hook_handle:
                state._post_forward_hook_handle.remove()
            _hook_forward(state, state._pre_forward, state._post_forward, always_call=False)
        for group, pre, post in getattr(self, "_saved_groups", ()):
            group.pre_backward, group.post_backward = pre, post
        self._saved_groups, self._units = [], []
        super()._deregister_module_and_optimizer_hooks()  # the optimizer's hooks (no unit saved there)


def category_label(reftype) -> str:
    """A tracker category as its string: ``_FSDPRefType.SHARDED_PARAM`` -> ``"Sharded Param"``."""
    return str(getattr(reftype, "value", reftype))


class LabelledMemTracker(UnitMemTracker):
    """:class:`UnitMemTracker` that also logs every update of its running snapshot, so the
    step can be re-read with the refined labels of :func:`relabelled_kinds`. ``phase`` is set
    by the step (``forward``, the loss included; ``backward``; ``step``, the optimizer's)."""

    def __init__(self, mod, optm=None):
        super().__init__(mod, optm)
        self.phase = "forward"
        self.log: list[tuple] = []  # (storage info, delta bytes, label, phase)
        self._recomputes = 0
        self._was_in_ac = False

    def _track(self, reftype, t):
        if reftype == _FSDPRefType.OPT:  # steady state: the step allocates only temporaries
            reftype = _FSDPRefType.TEMP
        super()._track(reftype, t)

    def _update_snap(self, u_type, winfo, old_mem_consumed=None, old_reftype=None):
        super()._update_snap(u_type, winfo, old_mem_consumed, old_reftype)
        delta = {_UpdateType.ADD: winfo.mem_consumed, _UpdateType.DEL: -winfo.mem_consumed,
                 _UpdateType.REF: 0}.get(u_type, winfo.mem_consumed - (old_mem_consumed or 0))
        if self._in_ac and not self._was_in_ac:
            self._recomputes += 1
        self._was_in_ac = self._in_ac
        phase = f"recompute {self._recomputes}" if self._in_ac else self.phase
        self.log.append((winfo, delta, category_label(winfo.reftype), phase))

    def label_grads(self, model: torch.nn.Module) -> list:
        """Post-accumulate-grad hooks labelling each gradient as it is accumulated: on every FSDP
        unsharded parameter ``Unsharded Grad``, on every parameter outside FSDP (:func:`outside_fsdp`)
        ``Sharded Grad`` (its gradient is the one the optimizer reads, as a sharded gradient is for
        FSDP's: meshplan's ``grads``); returns the handles."""
        def hook(p):
            self._update_and_maybe_create_winfos(p.grad, _FSDPRefType.UNSHARDED_GRAD)

        def outside(p):
            self._update_and_maybe_create_winfos(p.grad, _FSDPRefType.SHARDED_GRAD)

        return ([fp.unsharded_param.register_post_accumulate_grad_hook(hook) for _, state in fsdp_units(model)
                 for group in state._fsdp_param_groups for fp in group.fsdp_params]
                + [p.register_post_accumulate_grad_hook(outside) for p in outside_fsdp(model)])


#: The kind of a temporary the size of a reduce-scatter's input, allocated in backward while
#: that input lives: measured on gloo (validate's CPU runs, one per FSDP2 unit's reduce-scatter,
#: e.g. 1,705,984 B beside each layer's 1,705,984 B input at world 4 of
#: examples/mini_2x4_tp2-dp4.toml) and absent on the fake process group
#: (tests/test_memory_vs_tracker.py): the backend's copy, which the plan does not model.
RS_COPY_KIND = "reduce_scatter_copies"


def relabelled_kinds(log: list[tuple], phases: Optional[dict] = None) -> tuple[dict, int, dict]:
    """(maximum per meshplan kind, largest total, kinds at it) over a :class:`LabelledMemTracker` log,
    each storage under the last label the tracker gave it, for its whole life (the tracker
    labels an all-gather output, a gradient or a reduce-scatter input only some ops after
    allocating it), an ``Activation`` allocated and freed within the forward or within
    one recompute counted as a temporary (``Temp``): meshplan's activations are what
    backward keeps (and recomputes); and a backward ``Temp`` the size of a live reduce-scatter
    input as :data:`RS_COPY_KIND`. ``phases``, when given, receives the phase of each kind's
    maximum (``forward``, ``backward``, ``step``, ``recompute N``)."""
    final: dict = {}
    born: dict = {}
    died: dict = {}
    for w, delta, label, phase in log:
        final[w] = label
        born.setdefault(w, phase)
        if delta < 0:
            died[w] = phase
    label = {w: "Temp" if lab == "Activation" and born[w] == died.get(w) and born[w] != "backward" else lab
             for w, lab in final.items()}
    where = {c: k for k, cats in TRACKER_CATEGORIES.items() for c in cats}
    cur: dict[str, int] = {}
    live_rs: dict = {}  # reduce-scatter inputs alive now -> their bytes
    top, total = 0, 0
    at_top: dict = {}
    kmax: dict = {}
    for w, delta, _, phase in log:
        if not delta:
            continue
        k = where.get(label[w], "other")
        if label[w] == "Reduce Scatter":
            live_rs[w] = delta
            if delta < 0:
                live_rs.pop(w)
        elif k == "temporaries" and delta > 0 and born[w] == "backward" and delta in live_rs.values():
            label[w] = RS_COPY_KIND
        if label[w] == RS_COPY_KIND:
            k = RS_COPY_KIND
        cur[k] = cur.get(k, 0) + delta
        total += delta
        if cur[k] > kmax.get(k, 0) and phases is not None:
            phases[k] = phase
        kmax[k] = max(kmax.get(k, 0), cur[k])
        if total > top:
            top, at_top = total, {k: v for k, v in cur.items() if v}
    return kmax, top, at_top
