"""The NICs a ``meshplan calibrate`` run of several ranks per host drove (:mod:`meshplan.comm.calibrate_file`'s
module docstring): ``--nics-per-host N`` or the catalog node ``--system NODE`` names
(:func:`asked_nics`), checked against the log's ranks per host (:func:`nic_split`: N divides
them, ranks share NICs evenly), the note that says which option gave the count
(:func:`split_note`), the line-rate warning of a per-NIC fit (:func:`nic_warning`) and the
warning when ``--system``'s GPU is not the log's (:func:`system_gpu_warning`)."""

from __future__ import annotations

from typing import Optional

from meshplan import catalog
from meshplan.comm.calibration_kinds import host_share
from meshplan.comm.calibration_warnings import same_gpu
from meshplan.comm.linkfit import LinkFit
from meshplan.errors import ConfigError
from meshplan.units import GB


def catalog_nic_gb_per_s(gpu: Optional[str], node: Optional[str] = None) -> tuple[float, str]:
    """(GB/s, catalog node) of the fastest NIC (line rate / 8) of the catalog nodes whose GPU
    is ``gpu`` (:func:`~meshplan.comm.calibration_warnings.same_gpu`), of every catalog node when none
    is or ``gpu`` is None; of catalog node ``node`` alone when given (``--system``).

    >>> catalog_nic_gb_per_s("NVIDIA H100 80GB HBM3"), catalog_nic_gb_per_s("NVIDIA A100-SXM4-80GB")
    ((50.0, 'dgx-h100'), (25.0, 'dgx-a100'))
    >>> catalog_nic_gb_per_s("NVIDIA H100 80GB HBM3", "seed-8x8-2nic")
    (50.0, 'seed-8x8-2nic')
    """
    nodes = [(n, catalog_node(n)) for n in ([node] if node else catalog.names("node"))]
    mine = [(n, e) for n, e in nodes if gpu and not node and same_gpu(gpu, e["gpu"])] or nodes
    return max(((nic["rate_gbit_per_s"] / 8, n) for n, e in mine for nic in e.get("nics", [])),
               key=lambda x: x[0], default=(float("inf"), ""))


#: The share of a NIC's line rate below which a per-NIC fit is warned as too low (:func:`nic_warning`):
#: a plain ratio, not a measured bound: NCCL's ring over NDR 400 Gb/s reaches 46-48 of 50 GB/s per NIC
#: (92-96%, catalog ``nccl.toml`` ``ib-ndr-400-8nic``, [S19] NVIDIA/nccl-tests issue #290), and an
#: all-to-all per NIC ~70% (trial 28's 34.66 GB/s), so below half is a transport fault more likely than
#: a pattern: NCCL on sockets (NET/Socket over a TCP interface) or on HCAs other than the GPUs' rail NICs.
LOW_SHARE = 0.5


def nic_warning(fit: LinkFit, name: str, system: Optional[str] = None,
                split: Optional[tuple[int, int]] = None) -> Optional[str]:
    """A ``warning:`` line when ``nic`` fit ``fit`` of file ``name`` (per NIC) is above the
    fastest catalog NIC of its GPU model, or of catalog node ``system`` when given
    (:func:`catalog_nic_gb_per_s`), or below :data:`LOW_SHARE` of the line rate of ``system``'s NICs
    (only with ``--system``: without it the fastest catalog NIC need not be the measured nodes'; newcomer
    48: a 5.72 GB/s all-gather per NIC on 400 Gb/s NICs, planned without a word), else None. ``split``: (ranks per
    host k, NICs per host N) when the NICs were given (``--nics-per-host`` or ``--system``, :func:`nic_split`)."""
    line, node = catalog_nic_gb_per_s(fit.gpu, system)
    beta = fit.bandwidth_bytes_per_s / GB
    if fit.link != "nic" or fit.backend == "gloo" or (beta <= line and (system is None or beta >= LOW_SHARE * line)):
        return None
    if beta < LOW_SHARE * line:
        return (f"warning: {name}: nic {beta:.2f} GB/s per NIC is {beta / line:.0%} of the {line:g} GB/s line rate "
                f"of {node}'s NICs ({line * 8:g} Gb/s), below half of it, where a ring over InfiniBand reaches 92-96% "
                f"(catalog nccl.toml ib-ndr-400-8nic, nccl-tests issue #290): NCCL may have fallen back to sockets "
                f"(NET/Socket) or used the wrong HCAs; check NCCL_DEBUG=INFO's NET/IB lines and NCCL_IB_HCA before "
                f"planning with it")
    which = "the node --system names" if system else f"the fastest catalog NIC{' for ' + fit.gpu if fit.gpu else ''}"
    why, check = "each rank drove several NICs", "the hosts of its '#  Rank' lines"
    if split is not None:
        why = f"each host's {split[0]} ranks drove more than {split[1]} NIC{'s' * (split[1] > 1)}"
        check = "--nics-per-host and " + check
    return (f"warning: {name}: nic {beta:.2f} GB/s per NIC is above the {line:g} GB/s line rate of {node}'s NICs "
            f"({line * 8:g} Gb/s), {which}: a NIC carries at most its line rate, so {why} or the nodes' NICs are "
            f"faster than the catalog's; check {check}")


def catalog_node(name: str) -> dict:
    """Catalog node ``name``'s entry (nodes.toml); a ConfigError naming ``--system`` when
    there is none."""
    try:
        return catalog.entry("node", name)
    except ConfigError as err:
        raise ConfigError("--system", err.message) from None


def asked_nics(nics_per_host: Optional[int], system: Optional[str]) -> Optional[tuple[int, str]]:
    """(NICs per host, the option that said it) that a ``nic`` run's busbw is split over:
    ``nics_per_host`` (``--nics-per-host``), else the length of catalog node ``system``'s
    ``nics`` (``--system``); None without either (one NIC per rank). A ConfigError naming the
    option for fewer than 1 NIC or a node without NICs.

    >>> asked_nics(None, None), asked_nics(4, "dgx-h100"), asked_nics(None, "seed-8x8-2nic")
    (None, (4, '--nics-per-host'), (2, '--system'))
    >>> asked_nics(0, None)
    Traceback (most recent call last):
    ...
    meshplan.errors.ConfigError: --nics-per-host: 0 NICs per host; give the NICs each host's ranks drove, a divisor of its ranks per host (they share NICs evenly), or leave it out for one NIC per rank
    """
    if nics_per_host is not None:
        if isinstance(nics_per_host, bool) or not isinstance(nics_per_host, int) or nics_per_host < 1:
            raise ConfigError("--nics-per-host", f"{nics_per_host} NICs per host; give the NICs each host's ranks "
                                                 "drove, a divisor of its ranks per host (they share NICs evenly), "
                                                 "or leave it out for one NIC per rank")
        return nics_per_host, "--nics-per-host"
    if system is None:
        return None
    nics = len(catalog_node(system).get("nics", []))
    if not nics:
        raise ConfigError("--system", f"{system} has no NIC in the catalog (nodes.toml nics); pass --nics-per-host N")
    return nics, "--system"


def nic_split(per_node: int, where: str, asked: Optional[tuple[int, str]] = None) -> int:
    """NICs per host N that file ``where``'s busbw (a ``nic`` run of ``per_node`` ranks per
    host) is split over: ``per_node`` (one NIC per rank) without ``asked``
    (:func:`asked_nics`); ``--nics-per-host``'s N; a ``--system`` node's NICs, at most
    ``per_node`` (a rank drives one). N must divide ``per_node``: the ranks of a host share
    its NICs evenly (8 GPUs on 4 NICs: two under each NIC's PCIe switch), so each NIC carries
    the same share of the host's busbw; a ConfigError naming the option and the divisors
    otherwise.

    >>> nic_split(8, "x.txt"), nic_split(8, "x.txt", (4, "--nics-per-host")), nic_split(4, "x.txt", (8, "--system"))
    (8, 4, 4)
    >>> nic_split(4, "x.txt", (8, "--nics-per-host"))
    Traceback (most recent call last):
    ...
    meshplan.errors.ConfigError: --nics-per-host: 8 NICs per host, but x.txt ran 4 ranks per host and a rank drives one NIC; give 1, 2 or 4 (the divisors of 4), or leave it out for one NIC per rank
    >>> nic_split(8, "x.txt", (3, "--nics-per-host"))
    Traceback (most recent call last):
    ...
    meshplan.errors.ConfigError: --nics-per-host: 3 NICs per host, but x.txt ran 8 ranks per host, which share a host's NICs evenly (8 / 3 is not whole); give 1, 2, 4 or 8 (the divisors of 8), or leave it out for one NIC per rank
    """
    if asked is None:
        return per_node
    nics, by = asked
    used = min(nics, per_node) if by == "--system" else nics
    if used <= per_node and per_node % used == 0:
        return used
    ranks = f"{per_node} rank{'s' * (per_node > 1)} per host"
    why = (f"{ranks} and a rank drives one NIC" if used > per_node else
           f"{ranks}, which share a host's NICs evenly ({per_node} / {used} is not whole)")
    if by == "--system":
        node = f"the node's {nics} NICs" if used == nics else f"{used} of the node's {nics} NICs (a rank drives one)"
        raise ConfigError(by, f"{node}, but {where} ran {why}; pass --nics-per-host with {_divisors(per_node)}, "
                              "the NICs each host's ranks drove")
    raise ConfigError(by, f"{nics} NICs per host, but {where} ran {why}; give {_divisors(per_node)}, or leave it "
                          "out for one NIC per rank")


def _divisors(n: int) -> str:
    """The counts of NICs ``n`` ranks share evenly, in words.

    >>> _divisors(1), _divisors(8), _divisors(6)
    ('1', '1, 2, 4 or 8 (the divisors of 8)', '1, 2, 3 or 6 (the divisors of 6)')
    """
    d = [str(k) for k in range(1, n + 1) if n % k == 0]
    return d[0] if n == 1 else f"{', '.join(d[:-1])} or {d[-1]} (the divisors of {n})"


def split_note(name: str, fit: LinkFit, per_node: int, nics: int, asked: Optional[tuple[int, str]],
                system: Optional[str]) -> str:
    """The note of a ``nic`` run of ``per_node`` > 1 ranks per host split over ``nics`` NICs
    (``fit`` already per NIC): ``x.txt: 8 ranks per host over 4 NICs (--nics-per-host): nic
    all-reduce 40.00 GB/s per NIC = 160.00 / 4``; one NIC per rank as it always said. With
    both options given the count is ``--nics-per-host``'s, and the note says so:
    ``(--nics-per-host, not --system dgx-h100's 8: the explicit option wins)``. An all-to-all's
    busbw is per rank, the share ``(n - g) / (n - 1)`` of it leaving the host
    (:func:`~meshplan.comm.calibration_kinds.host_share`): ``nic all-to-all 35.72 GB/s per NIC
    = 37.80 x (128 - 8) / (128 - 1)``."""
    total = _split_words(fit, per_node, nics)
    if asked is None:
        return f"{name}: {per_node} ranks per host, each on its own NIC: nic {fit_gbs(fit)} per NIC = {total}"
    both = (f", not --system {system}'s {len(catalog_node(system).get('nics', []))}: the explicit option wins"
            if system is not None else "")
    by = (f"--nics-per-host{both}" if asked[1] == "--nics-per-host" else f"{system}'s, --system" if nics == asked[0]
          else f"{nics} of {system}'s {asked[0]}, --system: a rank drives one")
    return f"{name}: {per_node} ranks per host over {nics} NICs ({by}): nic {fit_gbs(fit)} per NIC = {total}"


def _split_words(fit: LinkFit, g: int, nics: int) -> str:
    """How a per-NIC ``fit`` of a run of ``g`` ranks per host over ``nics`` NICs per host came
    from its busbw (:func:`~meshplan.comm.calibration_kinds.host_share`), as the note prints it.

    >>> _split_words(LinkFit("nic", "all-to-all", 128, 0, 37.8e9 * 120 / 127, 0, 0, 2), 8, 8)
    '37.80 x (128 - 8) / (128 - 1) (the share of its bytes that leaves the host, each rank on its own NIC)'
    >>> _split_words(LinkFit("nic", "all-reduce", 16, 0, 45e9, 0, 0, 2), 8, 8)
    '360.00 / 8'
    """
    share = host_share(fit.op, fit.n_ranks, g)
    busbw = fit.bandwidth_bytes_per_s * nics / share / GB
    if fit.op != "all-to-all" or share == 1.0:
        return f"{busbw:.2f} / {nics}"
    n = fit.n_ranks
    ranks = "" if nics == g else f" x {g} / {nics}"
    return (f"{busbw:.2f} x ({n} - {g}) / ({n} - 1){ranks} (the share of its bytes that leaves the host, "
            f"each rank on its own NIC)")


def fit_gbs(fit: LinkFit) -> str:
    """``all-reduce 40.00 GB/s``: a fit's collective and its bandwidth (GB = 1e9 B) as the notes print it."""
    return f"{fit.op} {fit.bandwidth_bytes_per_s / 1e9:.2f} GB/s"


def system_gpu_warning(system: Optional[str], models: dict[str, str]) -> Optional[str]:
    """A ``warning:`` line when catalog node ``system`` (``--system``) holds another GPU than
    the one the logs' ``#  Rank`` lines name (``models``: GPU model -> the first file naming
    it, one model at most; :func:`~meshplan.comm.calibration_warnings.same_gpu`), else None: its NIC
    count and line rate are then another machine's.

    >>> system_gpu_warning("dgx-h100", {"NVIDIA H100 80GB HBM3": "x.txt"})
    >>> print(system_gpu_warning("dgx-a100", {"NVIDIA H100 80GB HBM3": "x.txt"}))
    warning: --system dgx-a100 holds a100-sxm-80gb GPUs, but the '#  Rank' lines of x.txt name NVIDIA H100 80GB HBM3: its NIC count and line rate may not be the measured nodes'; pass the catalog node the runs ran on, or --nics-per-host
    """
    if system is None:
        return None
    node_gpu = catalog_node(system)["gpu"]
    for gpu, name in models.items():
        if not same_gpu(gpu, node_gpu):
            return (f"warning: --system {system} holds {node_gpu} GPUs, but the '#  Rank' lines of {name} name "
                    f"{gpu}: its NIC count and line rate may not be the measured nodes'; pass the catalog node the "
                    "runs ran on, or --nics-per-host")
    return None


#: The share of a catalog node's NIC rate below which ``[cluster] nic``'s rate is warned
#: (:func:`config_nic_warning`): a plain ratio, not a measured bound: two NIC generations down
#: (400 -> 200 -> 100 Gb/s) is a plausible cheaper build of the node; 1/8 is a rate in GB/s typed
#: in the Gb/s field (50 for 400 Gb/s NICs, newcomer trial 54 #5).
CONFIG_LOW_SHARE = 0.25


def config_nic_warning(cluster) -> Optional[str]:
    """A ``warning:`` line when the NICs of ``cluster``'s node (a ClusterSpec; its
    ``[cluster] nic`` override, if any) run below :data:`CONFIG_LOW_SHARE` of the rate of the
    catalog node of that name, naming the field's unit, and the GB/s slip where the rate is 1/8 of
    it (within 5%); None for a node not in the catalog, without NICs, or at a rate above that.

    >>> from meshplan.catalog import system
    >>> c = system("dgx-h100", nodes=2)
    >>> nics = [n.model_copy(update={"rate_gbit_per_s": 50.0}) for n in c.node.nics]
    >>> print(config_nic_warning(c.model_copy(update={"node": c.node.model_copy(update={"nics": nics})})))
    warning: cluster.nic: rate_gbit_per_s 50 Gb/s (6.25 GB/s per NIC) is 1/8 of dgx-h100's catalog NICs (400 Gb/s): the field is in gigabits per second, and 50 GB/s is 400 Gb/s; if the NICs are 400 Gb/s, write rate_gbit_per_s = 400.0
    >>> config_nic_warning(c) is None
    True
    """
    node = cluster.node
    if node.name not in catalog.names("node") or not node.nics:
        return None
    known = [n["rate_gbit_per_s"] for n in catalog.entry("node", node.name).get("nics", [])]
    rate = min(n.rate_gbit_per_s for n in node.nics)
    if not known or rate >= CONFIG_LOW_SHARE * max(known):
        return None
    top = max(known)
    slip = abs(rate * 8 / top - 1) <= 0.05
    share = "1/8" if slip else f"{rate / top:.0%}"
    unit = (f", and {rate:g} GB/s is {rate * 8:g} Gb/s; if the NICs are {top:g} Gb/s, write rate_gbit_per_s = "
            f"{top:.1f}" if slip else f"; check it against the NICs' datasheet (ibstat's Rate, ethtool's Speed)")
    return (f"warning: cluster.nic: rate_gbit_per_s {rate:g} Gb/s ({rate / 8:g} GB/s per NIC) is {share} of "
            f"{node.name}'s catalog NICs ({top:g} Gb/s): the field is in gigabits per second{unit}")


def curve_nic_warning(name: str, op: str, ranks: int, per_host: int, nics: int, busbw_gb_per_s: list[float],
                      line: tuple[float, str]) -> Optional[str]:
    """A ``warning:`` line when a point of file ``name``'s ``nic`` curve (``op`` over ``ranks``, ``per_host``
    ranks per host split over ``nics`` NICs; ``busbw_gb_per_s`` as written, GB/s) is above the catalog NIC
    line rate ``line`` ((GB/s, node): :func:`catalog_nic_gb_per_s`) per NIC, where the fit need not be
    (:func:`nic_warning` checks the fit alone; newcomer trial 54 #1). Per NIC as the fit is: busbw x the
    host share (:func:`~meshplan.comm.calibration_kinds.host_share`) / ``nics``.

    >>> print(curve_nic_warning("ar.txt", "all-reduce", 16, 8, 8, [328.6, 412.0], (50.0, "dgx-h100")))
    warning: ar.txt: its nic curve reaches 51.50 GB/s per NIC (busbw 412.00 / 8 NICs), above the 50 GB/s line rate of dgx-h100's NICs (400 Gb/s), which a NIC cannot pass; check that size's row
    >>> curve_nic_warning("ar.txt", "all-reduce", 16, 8, 8, [328.6], (50.0, "dgx-h100")) is None
    True
    """
    share = host_share(op, ranks, per_host) / nics
    top = max(busbw_gb_per_s, default=0.0)
    if top * share <= line[0]:
        return None
    return (f"warning: {name}: its nic curve reaches {top * share:.2f} GB/s per NIC (busbw {top:.2f} / {nics} NICs"
            f"{'' if share * nics == 1.0 else ', x the share leaving the host'}), above the {line[0]:g} GB/s line "
            f"rate of {line[1]}'s NICs ({line[0] * 8:g} Gb/s), which a NIC cannot pass; check that size's row")
