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
"""

from __future__ import annotations

from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType, _SavedFSDPMethods
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_state import _register_group_forward_hooks


def fsdp_units(root) -> list:
    """(first module, FSDPState) of each FSDP unit with parameters under ``root``, in module
    order; a unit of several modules (``fully_shard([norm, output])``) appears once."""
    seen: dict[int, tuple] = {}
    for m in root.modules():
        if isinstance(m, FSDPModule):
            state = m._get_fsdp_state()
            if state._fsdp_param_group is not None and id(state) not in seen:
                seen[id(state)] = (m, state)
    return list(seen.values())


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
    unit's statistics are kept under its first module."""

    def _instrument_fsdp_module(self) -> None:
        for mod, state in fsdp_units(self._root_mod):
            group = state._fsdp_param_group
            state._pre_forward_hook_handle.remove()
            if state._post_forward_hook_handle is not state._pre_forward_hook_handle:
                state._post_forward_hook_handle.remove()
            self._instrument_fsdp_sharded_params_grads(group)
            _hook_forward(state, self._fsdp_state_pre_forward(mod, state._pre_forward),
                          self._fsdp_state_post_forward(mod, state._post_forward), always_call=True)
            self._fsdp_mod_to_saved_methods[mod] = _SavedFSDPMethods(group.pre_backward, group.post_backward)
            group.pre_backward = self._fsdp_param_group_pre_backward(mod, group.pre_backward)
            group.post_backward = self._fsdp_param_group_post_backward(mod, group.post_backward)
        for buffer in self._root_mod.buffers():
            self._update_and_maybe_create_winfos(buffer, _FSDPRefType.BUFFER)

    def _deregister_module_and_optimizer_hooks(self) -> None:
        for mod, saved in list(self._fsdp_mod_to_saved_methods.items()):
            state = mod._get_fsdp_state()
            state._pre_forward_hook_handle.remove()
            if state._post_forward_hook_handle is not state._pre_forward_hook_handle:
                state._post_forward_hook_handle.remove()
            _hook_forward(state, state._pre_forward, state._post_forward, always_call=False)
            group = state._fsdp_param_group
            group.pre_backward, group.post_backward = saved.pre_backward, saved.post_backward
        self._fsdp_mod_to_saved_methods.clear()
        super()._deregister_module_and_optimizer_hooks()  # the optimizer's hooks
