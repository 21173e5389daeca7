"""NCCL's protocols and latency model as data, each constant with its source: per-call base and
per-step latencies of the ring and tree algorithms for LL, LL128 and Simple
(:data:`NCCL_LATENCY_US`), the protocols' data efficiencies, the per-step reference a link's
``latency_us`` is scaled against (:data:`REFERENCE_STEP_S`), the single-protocol stand-ins for
gloo, a calibrated link and no latency, and NVLS's latency and bandwidth gain. The formulas that
read them: :mod:`meshplan.comm.alphabeta`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Protocol:
    """One NCCL protocol: base latency and per-step latency (seconds) on NVLink and on the
    network, and the fraction of link bandwidth it carries data at."""

    name: str
    base_s: float
    step_nvlink_s: float
    step_network_s: float
    efficiency: float


#: NCCL's latency model, microseconds per call (base) and per algorithm step on NVLink and on
#: the network, for protocols LL / LL128 / Simple: NVIDIA/nccl src/graph/tuning.cc (baseLat,
#: hwLat; v2.30.7 @5067397), public-facts.md "Collectives" and public-microbenchmarks.md 4e
#: [S20]. The one copy of these numbers: the catalog's per-step link latencies (NVLink 3.4 us,
#: network 14 us) are the Simple ring values below.
NCCL_LATENCY_US = {
    "ring": {"base": (6.6, 14.0, 8.4), "nvlink": (0.6, 1.9, 3.4), "network": (2.7, 4.0, 14.0)},
    "tree": {"base": (6.8, 14.0, 8.4), "nvlink": (0.6, 1.25, 4.0), "network": (5.0, 8.5, 14.0)},
}
PROTOCOLS = ("LL", "LL128", "Simple")
#: data bytes per line: LL 4 of 8, LL128 120 of 128, Simple all (NCCL protocol definitions).
PROTOCOL_EFFICIENCY = (0.5, 120 / 128, 1.0)
#: Per-step latency a link's ``latency_us`` is scaled against (the Simple ring values): a
#: link at its NCCL default has ``latency_scale`` 1.
REFERENCE_STEP_S = {"nvlink": NCCL_LATENCY_US["ring"]["nvlink"][2] * 1e-6,
                    "network": NCCL_LATENCY_US["ring"]["network"][2] * 1e-6}


def _protocols(algorithm: str) -> tuple[Protocol, ...]:
    t = NCCL_LATENCY_US[algorithm]
    return tuple(Protocol(name, t["base"][i] * 1e-6, t["nvlink"][i] * 1e-6, t["network"][i] * 1e-6,
                          PROTOCOL_EFFICIENCY[i]) for i, name in enumerate(PROTOCOLS))


NCCL_RING = _protocols("ring")
NCCL_TREE = _protocols("tree")
NO_LATENCY = (Protocol("ideal", 0.0, 0.0, 0.0, 1.0),)
#: gloo (torch's CPU backend) has one protocol: each ring step costs the link's own latency
#: (the per-step values are :data:`REFERENCE_STEP_S`, which ``latency_scale`` is taken against,
#: so the scaled step equals the link's ``latency_us``), no base, full bandwidth.
GLOO_RING = (Protocol("gloo", 0.0, REFERENCE_STEP_S["nvlink"], REFERENCE_STEP_S["network"], 1.0),)
#: A link class calibrated by the user's nccl-tests fit (``meshplan calibrate``, ``bench comm``):
#: ``t = steps(op, n) * alpha_step + bytes_sent / beta``, one protocol with no base and full
#: bandwidth, ``alpha_step`` the link's ``latency_us`` (the fitted per-call alpha / the steps of
#: the measured op over the measured ranks, :class:`meshplan.comm.calibration.CalibratedLink`), so
#: at the measured op and rank count it is the fit itself; other rank counts scale alpha per step.
CALIBRATED = (Protocol("calibrated", 0.0, REFERENCE_STEP_S["nvlink"], REFERENCE_STEP_S["network"], 1.0),)
#: NVLS all-reduce latency, NCCL's own model (NVIDIA/nccl src/graph/tuning.cc, v2.30.7 @5067397;
#: public-microbenchmarks.md 4e [S20]): hwLat of NVLS / Simple is 25 us on NVLink (18 us on the
#: network), its baseLat 0, and ``ncclTopoTuneModel`` sets an NVLS collective's latency to that one
#: intra-node hwLat (``latencies[coll][NVLS][p] = intraLat``, plus one network hwLat across nodes):
#: one step of 25 us whatever the rank count (:data:`NVLS_STEPS`), scaled like the other per-step
#: latencies by the link's ``latency_scale``. No published 8-GPU NVLS small-message time was found
#: to take instead (NVIDIA/nccl issue #1259: about 6 us on 2 H100 with NCCL_ALGO=NVLSTree under
#: CUDA graphs, NCCL 2.20.5; at 1 KiB NCCL picks the LL ring anyway, S16).
NVLS = (Protocol("NVLS", 0.0, 25e-6, 18e-6, 1.0),)
NVLS_STEPS = 1

#: NVLS all-reduce bus bandwidth over the NVLink per-direction rate: 480 GB/s busbw measured on
#: 8x H200 with NVLink SHARP against the 450 GB/s link (togethercomputer/together-nccl-tests;
#: stas00/ml-engineering network README; public-facts.md).
NVLS_GAIN = 480 / 450
