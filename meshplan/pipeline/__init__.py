"""Pipeline schedules (layer 5): one module per schedule (:mod:`.gpipe`, :mod:`.one_f_one_b`,
:mod:`.interleaved`, :mod:`.zb_h1`, and the V-shaped :mod:`.zbv` and :mod:`.dualpipev` sharing
:mod:`.vshape`), each a :class:`~.base.PipelineSchedule` owning its
per-stage op order, chunk-to-virtual-stage map, warm-up and in-flight counts, whether
backward splits into B and W, its bubble formula, its feasibility rule and the
torch.distributed.pipelining class that runs it; :mod:`.registry` maps each
:class:`~meshplan.spec.mesh.Schedule` to its object; :mod:`.simulate` is the event
simulation of one step (bubble, critical path; its Perfetto trace in :mod:`.trace`), :mod:`.fast` the same on arrays
(the orders and dependencies of every stage in :mod:`.orders`, the list scheduling in
:mod:`.rounds`). Pure functions of (schedule, p, m, v); no model or cluster.
"""

__all__ = ["base", "gpipe", "one_f_one_b", "interleaved", "zb_h1", "vshape", "zbv", "dualpipev", "registry", "simulate",
           "trace", "orders", "rounds", "fast"]
