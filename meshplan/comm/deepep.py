"""DeepEP's dispatch and combine (``training.moe_dispatcher = "deepep"``: Megatron-LM's
``--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend deepep``): one home for their
copies per token, bytes per link class and time, which the collective table
(:func:`meshplan.comm.ep_rows.ep_rows`), hence the timeline, and the search
(:func:`meshplan.search.comm_bounds.comm_times`) read.

**torchtitan** (framework torch; its job TOML's ``parallelism.expert_parallel_comm_backend = "deepep"``,
pytorch/torchtitan 36a4b69 (#2107) to 238fa99, e347b1e = v0.2.2 included) calls the same V1 normal kernels:
``torchtitan/distributed/deepep/deepep.py`` at e347b1e ``buffer.dispatch`` / ``buffer.combine`` (lines 100-111,
152-158, 189-194, 219-230) on a ``deep_ep.Buffer`` sized as Megatron-LM's is (``get_buffer``, lines 288-317: the
NVL and RDMA size hints of ``Buffer.get_dispatch_config`` / ``get_combine_config`` at hidden x max(element
bytes, 2), Buffer's default 20 SMs), over the ep group (no etp:
:func:`~meshplan.spec.training_checks.torch_deepep_reason`). So one home times both.
Its ``models/moe/moe_deepep.py`` runs the shared experts while the combine is in flight (lines 39-77); the timeline
overlaps them likewise (:func:`shared_forward_s`; Megatron-LM's flex dispatcher waits for its combine). Later torchtitan (9810191 on, Python
configs) moved to ``moe_comm_backend`` and, from 756213e (2026-06-28), DeepEP v2's ElasticBuffer, and added
"hybridep" (HybridEP's TMA kernels for GB200 NVL72, 156db2e): neither is modelled.

**What DeepEP sends** (deepseek-ai/DeepEP README, V1 "normal kernels with NVLink and RDMA
forwarding", the kernels Megatron-LM's ``fused_a2a.py`` calls): a token goes ONCE over RDMA to
each node holding one of its experts (to the GPU of the same local index there), which forwards
it over NVLink to each GPU of that node holding one of its experts; inside one node (ep on one
NVLink domain) it goes once to each destination GPU. An all-to-all instead sends one copy per
routed expert (:mod:`meshplan.comm.ep_rows`). The combine sends the same copies back, and the
backward's two are the same again. Megatron-LM's flex dispatcher exchanges no counts apart
(DeepEP's layout and notify run inside the dispatch): no count rows.

**Copies per token, closed form under uniform routing.** The ep group of ``ep`` ranks spans
``N`` nodes, ``g = ep / N`` ranks on each, in rank order; rank r holds the consecutive experts
``[r E/ep, (r+1) E/ep)`` (Megatron-LM's local experts), so node j holds ``E/N`` consecutive
experts and each "unit" (node or rank) a block. Group-limited routing (ModelSpec ``n_group`` G,
``topk_group`` M; DeepSeek-V3 2.1.2) divides the experts into G groups of ``E/G`` consecutive
ones; without it G = M = 1. The uniform model: a token's M groups are a uniform M-subset S of
the G, and its ``k = top_k`` experts a uniform k-subset of the ``P = M E/G`` experts of S (the
test's Monte-Carlo samples exactly this). A unit j with ``A_j(S)`` of its experts in S receives
none of the token's experts with probability ``C(P - A_j(S), k) / C(P, k)``, so

    P_j(hit) = 1 - sum over M-subsets S of C(G, M)^-1 C(P - A_j(S), k) / C(P, k)

(the sum over S by a count of the subsets per value of ``A_j(S)``, :func:`hit_probabilities`).
Expected distinct destination units per token: ``sum_j P_j(hit)``. For a token of a uniformly
random node, its own node is each node with probability 1/N, so the expected distinct OTHER
nodes are ``(N - 1)/N x sum_j P_j(hit)``. Two cases in closed form:

- plain top-k (G = 1): every node ``1 - C(E - E/N, k)/C(E, k)``;
- ep's node span N = G: node j holds group j exactly (the groups map to the nodes), chosen with
  probability M/G and then hit unless the k experts all fall in the other M - 1 groups:
  ``P(hit) = M/G (1 - C((M-1) E/G, k) / C(M E/G, k))``. 8 nodes x 8 GPUs, E 256, k 8, G 8,
  M 4: ``1/2 (1 - C(96, 8)/C(128, 8)) = 0.45363``, 3.6290 nodes, 3.1754 other nodes per token
  (plain top-k: 5.2947 and 4.6328).

**Dropped copies** (a capacity factor under deepep, :mod:`meshplan.compute.routing` without
padding): Megatron-LM's router drops the copies over the capacity and ``_DeepepManager`` masks them
(index -1) before ``fused_dispatch``, so DeepEP sends a token to a unit only for its kept copies.
With ``q`` the routing module's kept share of the copies (kept / T k), each copy modelled as kept
independently with probability q, a unit holding ``a`` of the token's experts misses it with
probability ``(1 - q)^a``; ``a`` given S is hypergeometric, so the miss term becomes
``sum_a C(A_j(S), a) C(P - A_j(S), k - a) (1 - q)^a / C(P, k)`` (q = 1: the term a = 0 alone, as
above). Balanced routing at a capacity factor >= 1 keeps every copy (q = 1): the dropless bytes.

Where N differs from G the experts of a node cover part of a group or several groups; the sum
above holds as it is under the stated layout (consecutive experts per rank, ranks g per node in
order), which is the assumption there.

**Bytes per rank per call** (T distinct tokens routed by a rank, ``b`` bytes per token, h x the
compute dtype): through the NIC ``T x other_nodes x b``; on NVLink the fan-out copies to the
other GPUs of a destination node, ``T x ranks x (g - 1)/g x b`` (``ranks`` = expected distinct
destination ranks, of which on average 1/g is the forwarding GPU itself).

**Time**: DeepEP's published bandwidths (catalog ``deepep.toml``, a microbenchmark on H800 with
one CX7 400 Gb/s NIC per GPU) are logical: RDMA bytes counted as ``T x nodes x b`` (own node
included), NVLink bytes as ``T x ranks x b``. meshplan times each at the published rate scaled
to the path's link (the rate over the measured line, times the rank's own NIC share
:attr:`~meshplan.comm.row.Path.nic_bandwidth_bytes_per_s`, the one-NIC-per-GPU share the
all-to-all model uses, or the node's fabric bandwidth): across nodes the slower of the two, the
RDMA part at the published internode rate of the nearest EP size (16, 32, 64), the NVLink part
at the intranode rate; inside a node the NVLink part alone. No latency term (the published
rates are whole-kernel rates at 4096 tokens).

**Expert tensor parallelism (etp > 1)**: Megatron-LM's flex dispatcher runs over the ``tp_ep``
group, ep x etp ranks with etp innermost (``MoEFlexTokenDispatcher``, NVIDIA/Megatron-LM d98e8a6
token_dispatcher.py lines 1834-1843: ``group=self.tp_ep_group``, ``router_topk = tp_size x topk``,
``num_experts = tp_size x E``, tp_size the expert tp), and ``_initialize_metadata`` (lines
1894-1920) replicates each routed expert's column over the etp ranks of its ep rank: a token goes
to every etp rank of each destination ep rank, and each rank dispatches its own tokens, the
sequence-parallel share ``b s/cp / tp`` (:func:`meshplan.compute.routing.routed_tokens`, as the
all-to-all dispatcher's ranks do before their etp all-gather). So over ``ep x etp`` ranks on N nodes (``g``
on each): ``ranks = etp x`` the ep ranks hit; a node holds ``g / etp`` whole ep ranks (``E/N``
consecutive experts: the node sum above) when ``etp <= g``, else each ep rank's etp ranks cover
``etp / g`` nodes (the node sum is ``etp/g x`` the ep ranks' hits); the NVLink fan-out
``ranks (g - 1)/g``, the published rates at the nearest size of ``ep x etp``. At ep 1 Megatron-LM
dispatches over the etp ranks alone; meshplan has no ep rows there (as under alltoall).

>>> c = copies(256, 8, 64, 8, 8, 4)
>>> round(c.nodes, 4), round(c.other_nodes, 4), round(c.ranks, 4)
(3.629, 3.1754, 7.3594)
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from math import comb, log2
from typing import Optional

from meshplan import catalog
from meshplan.compute.ops import Cost
from meshplan.compute.routing import RoutingOptions, routing
from meshplan.spec.training_checks import torch_deepep_reason

GB = 1e9


@dataclass(frozen=True)
class Copies:
    """Expected copies of one token (module docstring): ``nodes`` distinct destination nodes (its own
    included: DeepEP's RDMA count), ``other_nodes`` of them other than its own (through the NIC),
    ``ranks`` distinct destination ranks (DeepEP's NVLink count), ``nvlink`` fan-out copies to
    other GPUs of a node (``ranks (g - 1)/g``); ``span`` nodes of the ep x etp group."""

    nodes: float
    other_nodes: float
    ranks: float
    nvlink: float
    span: int


def _subset_sums(sizes: list[int], m: int) -> dict[int, int]:
    """{A: number of m-subsets of ``sizes`` summing to A} (a count by dynamic programming)."""
    table: list[dict[int, int]] = [{0: 1}] + [{} for _ in range(m)]
    for a in sizes:
        for c in range(m, 0, -1):
            for s, n in table[c - 1].items():
                table[c][s + a] = table[c].get(s + a, 0) + n
    return table[m]


@lru_cache(maxsize=None)
def hit_probabilities(experts: int, top_k: int, units: int, n_group: int = 1, topk_group: int = 1,
                      keep: float = 1.0) -> tuple:
    """P(unit j receives at least one of a token's ``top_k`` experts) for j = 0..units-1, the
    units (nodes or ranks) holding equal blocks of consecutive experts, under group-limited
    uniform routing over ``n_group`` groups of which ``topk_group`` are chosen (module
    docstring), each copy kept with probability ``keep`` (module docstring, dropped copies). Plain
    top-k, 8 nodes of 32 experts: ``1 - C(224, 8)/C(256, 8)``; 8 experts, top-2, 2 units of 4, half
    the copies kept: miss ``(C(4,2) + 4 x 4 x 1/2 + C(4,2) x 1/4) / C(8,2) = 15.5/28``:

    >>> round(hit_probabilities(256, 8, 8)[0], 5), round(hit_probabilities(256, 8, 8, 8, 4)[0], 5)
    (0.66183, 0.45363)
    >>> round(hit_probabilities(8, 2, 2, keep=0.5)[0], 6), round(1 - 15.5 / 28, 6)
    (0.446429, 0.446429)
    """
    per_group, per_unit = experts // n_group, experts // units
    pool = topk_group * per_group
    total, denom = comb(n_group, topk_group), comb(pool, top_k)
    out = []
    for j in range(units):
        lo, hi = j * per_unit, (j + 1) * per_unit
        sizes = [max(0, min(hi, (g + 1) * per_group) - max(lo, g * per_group)) for g in range(n_group)]
        miss = sum(n * _miss(pool, a, top_k, keep) for a, n in _subset_sums(sizes, topk_group).items())
        out.append(1.0 - miss / (total * denom))
    return tuple(out)


def _miss(pool: int, held: int, top_k: int, keep: float) -> float:
    """``C(pool, k)`` x P(a unit holding ``held`` of the ``pool`` experts gets none of a token's kept
    copies): ``sum_a C(held, a) C(pool - held, k - a) (1 - keep)^a`` (module docstring)."""
    if keep >= 1.0:
        return float(comb(pool - held, top_k))
    return sum(comb(held, a) * comb(pool - held, top_k - a) * (1.0 - keep) ** a for a in range(min(held, top_k) + 1))


@lru_cache(maxsize=None)
def copies(experts: int, top_k: int, ep: int, nodes: int, n_group: Optional[int] = None,
           topk_group: Optional[int] = None, keep: float = 1.0, etp: int = 1) -> Copies:
    """:class:`Copies` of a token over the flex dispatcher's group of ``ep x etp`` ranks on ``nodes``
    nodes (module docstring; etp innermost), ``n_group`` / ``topk_group`` None for plain top-k,
    ``keep`` the kept share of the routed copies (1: dropless or nothing dropped). DeepSeek-V3 at
    ep 32 x etp 2 on 8 nodes: the nodes hold the same experts as at ep 64 (3.629 nodes per token);
    an ep rank holds 8 experts of a group of 32, chosen with probability 1/2 and then hit unless the
    8 experts all miss it among the 4 groups' 128: ``32 x 1/2 (1 - C(120, 8)/C(128, 8)) = 6.5965`` ep
    ranks, 13.193 ranks at etp 2, of which 7/8 on GPUs other than the forwarding one: 11.544 NVLink
    copies:

    >>> from math import comb
    >>> c = copies(256, 8, 32, 8, 8, 4, etp=2)
    >>> round(c.nodes, 3), round(c.ranks, 4), round(2 * 32 / 2 * (1 - comb(120, 8) / comb(128, 8)), 4), round(c.nvlink, 3)
    (3.629, 13.193, 13.193, 11.544)
    """
    g_, m_ = (n_group, topk_group) if n_group and topk_group else (1, 1)
    span = max(1, nodes)
    g = ep * etp // span
    hit_e = sum(hit_probabilities(experts, top_k, ep, g_, m_, keep))
    hit_n = sum(hit_probabilities(experts, top_k, span, g_, m_, keep)) if etp <= g else etp // g * hit_e
    hit_r = etp * hit_e
    return Copies(hit_n, (span - 1) / span * hit_n, hit_r, hit_r * (g - 1) / g, span)


def _nearest(ep: int, sizes: list[int]) -> int:
    """Index of the published EP size nearest ``ep`` on a log scale (ties: the smaller)."""
    return min(range(len(sizes)), key=lambda i: (abs(log2(ep / sizes[i])), sizes[i]))


def rates(ep: int, internode: bool, nic_bytes_per_s: float, fabric_bytes_per_s: float) -> dict[str, float]:
    """Achievable bytes/s per link class and phase (module docstring: the published rate over its
    line, times this path's line): ``rdma_dispatch``, ``rdma_combine`` (internode, at the nearest
    published EP size), ``nvl_dispatch``, ``nvl_combine``. One CX7 400 Gb/s NIC per GPU (50 GB/s)
    and EP 64 give the published 51 / 50 GB/s:

    >>> {k: round(v / 1e9, 1) for k, v in rates(64, True, 50e9, 450e9).items()}
    {'rdma_dispatch': 51.0, 'rdma_combine': 50.0, 'nvl_dispatch': 430.3, 'nvl_combine': 444.4}
    """
    r = catalog.deepep_rates()
    out = {}
    if internode:
        i = _nearest(ep, r["internode_ep"])
        for ph in ("dispatch", "combine"):
            out[f"rdma_{ph}"] = r[f"internode_{ph}_gb_per_s"][i] / r["rdma_line_gb_per_s"] * nic_bytes_per_s
    for ph in ("dispatch", "combine"):
        out[f"nvl_{ph}"] = r[f"intranode_{ph}_gb_per_s"] / r["nvlink_line_gb_per_s"] * fabric_bytes_per_s
    return out


@dataclass(frozen=True)
class Call:
    """One deepep dispatch or combine of a rank (mean of the two: a layer runs one of each):
    ``time_s`` seconds per call, ``nvlink_bytes`` and ``network_bytes`` sent per call, ``copies``."""

    time_s: float
    nvlink_bytes: float
    network_bytes: float
    copies: Copies


def call(model, tokens: int, token_bytes: float, ep: int, nodes: int, nic_bytes_per_s: float,
         fabric_bytes_per_s: float, keep: float = 1.0, etp: int = 1) -> Call:
    """:class:`Call` of ``tokens`` distinct tokens of ``token_bytes`` each over an ep group of ``ep``
    ranks (x ``etp``: the flex dispatcher's group) on ``nodes`` nodes (module docstring), the rank's NIC share and the fabric's per-GPU
    bandwidth in bytes/s, ``keep`` the routed copies' kept share (:func:`keep_share`). DeepSeek-V3 (E 256, k 8, G 8, M 4) at ep 64 on 8 nodes, 4096 tokens of
    7168 x 2 B: 3.1754 x 4096 x 14336 B = 186.5 MB through the NIC; RDMA logical bytes 3.629 x
    58.7 MB over 51 (dispatch) and 50 (combine) GB/s: 4.18 and 4.26 ms, mean 4.22 ms:

    >>> from meshplan import catalog
    >>> c = call(catalog.model("deepseek-v3"), 4096, 7168 * 2, 64, 8, 50e9, 450e9)
    >>> round(c.network_bytes / 1e6, 1), round(c.time_s * 1e3, 2)
    (186.5, 4.22)
    """
    c = copies(model.experts, model.top_k, ep, nodes, model.n_group, model.topk_group, keep, etp)
    r = rates(ep * etp, c.span > 1, nic_bytes_per_s, fabric_bytes_per_s)
    per = tokens * token_bytes
    times = []
    for ph in ("dispatch", "combine"):
        t = per * c.ranks / r[f"nvl_{ph}"] if r[f"nvl_{ph}"] else 0.0
        if c.span > 1:
            t = max(t, per * c.nodes / r[f"rdma_{ph}"] if r[f"rdma_{ph}"] else float("inf"))
        times.append(t)
    return Call(sum(times) / 2, per * c.nvlink, per * c.other_nodes, c)


def keep_share(training, model, tokens: int, ep: int) -> float:
    """The kept share of a rank's routed copies, kept / (T x top_k), of ``training``'s routing
    (:func:`meshplan.compute.routing.routing` without padding: the capacity's drops); 1 dropless.
    DeepSeek-V3, T 4096, balanced: 1 at capacity factor 1.25 (128 copies per expert, C = 160),
    1/2 at 0.5 (C = 64):

    >>> from types import SimpleNamespace as N
    >>> from meshplan.spec.training import TrainingSpec
    >>> m, t = N(top_k=8, experts=256), lambda f: TrainingSpec(global_batch=8, seq_len=16, framework="megatron",
    ...                                                         moe_dispatcher="deepep", moe_capacity_factor=f)
    >>> keep_share(t(1.25), m, 4096, 64), keep_share(t(0.5), m, 4096, 64)
    (1.0, 0.5)
    """
    ro = RoutingOptions.of(training)
    if ro.dropless:
        return 1.0
    r = routing(ro, tokens, model.top_k, model.experts, ep)
    return min(1.0, r.send_rows / r.copies)


def call_on(path, cluster, model, tokens: int, token_bytes: float, ep: int, keep: float = 1.0,
            etp: int = 1) -> Call:
    """:func:`call` on the ep x etp group's :class:`~meshplan.comm.row.Path` in ``cluster``: its nodes and
    the rank's own NIC share across nodes (else the node's fabric inside one), the node's fabric
    bandwidth for NVLink. The one call of the collective table and of the search."""
    fabric = cluster.node.fabric.bandwidth_bytes_per_s
    if path.kind != "network":
        return call(model, tokens, token_bytes, ep, 1, 0.0, fabric, keep, etp)
    nic = path.nic_bandwidth_bytes_per_s or path.bandwidth_bytes_per_s
    return call(model, tokens, token_bytes, ep, path.nodes, nic, fabric, keep, etp)


def group_reason(ep: int, etp: int, framework: str = "megatron") -> Optional[str]:
    """The reason a plan under the deepep dispatcher is infeasible where its ep x etp group is 1 rank
    (``MoEFlexTokenDispatcher`` asserts "DeepEP dispatcher requires TPxEP > 1", NVIDIA/Megatron-LM
    d98e8a6 token_dispatcher.py line 1836) or a size DeepEP has no kernel config for
    (``Buffer.get_dispatch_config`` asserts, deepseek-ai/DeepEP 92fe2de ``deep_ep/buffer.py`` lines
    245-259; catalog ``deepep.toml`` ``[buffer] group_sizes``), else None; the search's rule ``deepep``.
    Under framework torch first torchtitan's (:func:`~meshplan.spec.training_checks.torch_deepep_reason`).

    >>> group_reason(32, 2) is None, group_reason(12, 1).split(";")[0]
    (True, 'deepep: ep 12 x etp 1 = 12 ranks, a group size DeepEP has no dispatch config for (2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 144, 160)')
    >>> group_reason(1, 1).split(";")[0]
    "deepep: ep 1 x etp 1: Megatron-LM's flex dispatcher asserts TPxEP > 1 (no group to dispatch over)"
    """
    sizes = catalog.deepep_buffer()["group_sizes"]
    if framework == "torch" and (why := torch_deepep_reason(ep, etp)):
        return why
    if ep * etp < 2:
        return (f"deepep: ep {ep} x etp {etp}: Megatron-LM's flex dispatcher asserts TPxEP > 1 (no group to dispatch "
                f"over); set ep (or etp) > 1 or training.moe_dispatcher = \"alltoall\"")
    if ep * etp in sizes:
        return None
    return (f"deepep: ep {ep} x etp {etp} = {ep * etp} ranks, a group size DeepEP has no dispatch config for "
            f"({', '.join(map(str, sizes))}); set ep x etp to one of them or training.moe_dispatcher = \"alltoall\"")


def describe(model, ep: int, nodes: int, keep: float = 1.0, etp: int = 1) -> str:
    """What is modelled, in one phrase, for the step's routing note (``nodes``: the ep x etp group's)."""
    c = copies(model.experts, model.top_k, ep, nodes, model.n_group, model.topk_group, keep, etp)
    grouped = model.n_group and model.topk_group
    how = ((f"group-limited (n_group {model.n_group}, topk_group {model.topk_group}"
            + (f": the groups are ep's {c.span} nodes)" if model.n_group == c.span else
               f"; ep spans {c.span} nodes, experts consecutive per rank)")) if grouped else "plain top-k")
    return (f"deepep dispatch modelled: {c.other_nodes:.2f} of {model.top_k} copies per token cross nodes "
            f"(once per other destination node, {how}, uniform routing"
            + (f", {keep:.3g} of the copies kept by the capacity" if keep < 1 else "") + f"), {c.nvlink:.2f} NVLink fan-out "
            f"copies" + (f" (each destination ep rank's {etp} etp ranks; the group is ep x etp = {ep * etp})"
                         if etp > 1 else "") + "; timed at DeepEP's published bandwidths (catalog deepep.toml)")


def shared_forward_s(c: Cost, phase: str, recompute: Optional[bool] = None) -> float:
    """Seconds of an MoE layer's shared-expert GEMMs among ``c``'s forward ops of ``phase`` and
    ``recompute`` (``shared_w_up``, ``shared_w_down``; a replay's ``(recompute)`` copies), which
    torchtitan's ``DeepEPMoE`` runs while DeepEP's combine is in flight: pytorch/torchtitan e347b1e
    (v0.2.2, whose job TOML's ``expert_parallel_comm_backend = "deepep"`` meshplan reads)
    ``models/moe/moe_deepep.py`` lines 39-81 (the routed experts' hook issues the combine, which
    returns at once; ``self.shared_experts(x)``; then ``sync_combine()``) and
    ``distributed/deepep/deepep.py`` lines 171-202 (``buffer.combine(..., async_finish=True)``, its
    event kept for ``sync_combine``, 247-285). The dispatch (lines 85-122) and the backward's two
    (132-168, 211-235) wait at once (``after_event.current_stream_wait()``): no overlap there. The
    activation of the shared experts is not split from the routed experts' here (it stays before
    the combine: the overlap is, if anything, understated). torchtitan b5bcd76's DeepEP dispatcher
    waits right after the combine (``models/common/token_dispatcher.py``:875-887): no overlap; meshplan's
    deepep under torch is the job TOML's (:mod:`meshplan.interop.torchtitan_ep`)."""
    return sum(o.seconds for o in c.ops if o.block == "mlp" and o.kind == "gemm" and o.phase == phase
               and recompute in (None, o.recompute) and o.name.startswith("shared_") and "." not in o.name)
