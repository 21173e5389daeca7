"""The least time two serial queues of collectives that share the rank's NIC take to run, per
candidate (:func:`two_queues_s`): the step-time bound's floor for FSDP2's all-gathers and
reduce-scatters, which torch runs on two streams at once (:func:`meshplan.search.layer_bounds._fsdp_backward`).

The rank timeline (:mod:`meshplan.schedule.unit_events`) runs each network collective at
``min(1, share / demand)`` of its speed alone, the shares the max-min fair shares of one NIC of
capacity 1 among the network collectives running (:func:`meshplan.schedule.nic_fair.max_min_shares`),
each ``demand`` the share it holds alone (:func:`meshplan.schedule.row_shares.nic_share`: its NIC
seconds over its seconds). Two queues A and B, each running its calls one after another, hold work
``W_A`` and ``W_B`` (seconds alone). Over the time ``T`` in which they all run, the rates of the
running calls add up to ``W_A + W_B``; while one queue runs alone its rate is at most 1, so
``T >= W_A + W_B - E``, ``E`` the integral over the time both run of ``r_a + r_b - 1`` (their rates).

Bounding ``E``: with both running, the water level ``L`` of the max-min shares is at most the level
of the two alone (any other network collective running only lowers it), and for ``L`` below that
level ``(r_a + r_b - 1) / r_a`` with ``r = min(1, L / demand)`` only falls as ``L`` falls (piecewise
in ``L``: ``L / d_b`` while A runs at 1, else ``1 + d_a / d_b - d_a / L``). So at every instant
``r_a + r_b - 1 <= k_a r_a`` with ``k_a = (rho_a + rho_b - 1) / rho_a``, ``rho`` the rates of the two
alone, and likewise for B; integrating, ``E <= min(sum k_a W_a, sum k_b W_b)`` (each call's ``k`` the
largest over the other queue's kinds of call). Two calls off the network (demand 0) run at once
freely: ``rho`` 1 each, ``k`` 1, the bound ``max(W_A, W_B)``; two whose demands fit the NIC the same.
The NIC's capacity gives a second floor, the sum of every call's NIC seconds (``rho_a d_a + rho_b d_b
<= 1``); the larger of the two is taken.
"""

from __future__ import annotations

import numpy as np

from meshplan.schedule.nic_fair import max_min_shares


def _pair_rates(d_a: float, d_b: float) -> tuple[float, float]:
    """(rate of a, rate of b) when two network collectives of NIC demands ``d_a``, ``d_b`` run
    alone together, as the rank timeline runs them (:mod:`meshplan.schedule.unit_events`: shares
    are the demands where they fit the NIC, else :func:`~meshplan.schedule.nic_fair.max_min_shares`);
    a demand of 0 (off the network) runs at its speed alone.

    Demands 0.93 and 0.93: half the NIC each, 0.5 / 0.93 = 0.538 of their speed; 0.2 and 0.9: 0.2
    runs at 1, 0.9 at 0.8 / 0.9; 0.3 and 0.5 fit: both at 1.

    >>> [round(x, 4) for x in _pair_rates(0.93, 0.93) + _pair_rates(0.2, 0.9) + _pair_rates(0.3, 0.5)]
    [0.5376, 0.5376, 1.0, 0.8889, 1.0, 1.0]
    """
    d = [x for x in (d_a, d_b) if x > 0]
    shares = d if sum(d) <= 1.0 else max_min_shares(d)
    rate = iter(min(1.0, s / x) for s, x in zip(shares, d))
    return tuple(next(rate) if x > 0 else 1.0 for x in (d_a, d_b))  # type: ignore[return-value]


def _excess_per_work(d_a: np.ndarray, d_b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(k_a, k_b) per element (module docstring): ``(rho_a + rho_b - 1) / rho``, what running beside
    a call of the other queue can save per second of a call's work, at most 1."""
    pairs, inv = np.unique(np.stack([np.ravel(d_a), np.ravel(d_b)], axis=1), axis=0, return_inverse=True)
    rates = np.array([_pair_rates(a, b) for a, b in pairs.tolist()]).reshape(-1, 2)[np.ravel(inv)]
    ra, rb = rates[:, 0].reshape(np.shape(d_a)), rates[:, 1].reshape(np.shape(d_a))
    return (ra + rb - 1.0) / ra, (ra + rb - 1.0) / rb


def two_queues_s(a_calls: list[tuple], b_calls: list[tuple]) -> np.ndarray:
    """Least seconds in which queue A's and queue B's calls all run (module docstring). Each call
    kind is ``(count, seconds, NIC seconds)``, arrays that broadcast (counts may be 0); a kind's
    demand is its NIC seconds over its seconds.

    Queue A: 80 all-gathers of 4.306 ms (NIC 4.011 ms, demand 0.932); queue B: 78 reduce-scatters of
    8.565 ms (NIC 8.023 ms, 0.937). While they run together each gets half the NIC, 0.537 and 0.534 of
    their speed, 0.0706 s of work a second beyond one queue alone: k_a = 0.0706 / 0.537 = 0.131, so
    E <= 80 x 4.306 x 0.131 = 45.3 ms; T >= 344.5 + 668.1 - 45.3 = 967.3 ms, above the NIC's 320.9 +
    625.8 = 946.7 ms and below the sum, 1012.6 ms:

    >>> one = lambda *x: tuple(np.array([v]) for v in x)
    >>> round(float(two_queues_s([one(80, 4.306e-3, 4.011e-3)], [one(78, 8.565e-3, 8.023e-3)])[0]) * 1e3, 1)
    967.3

    Off the network the two queues overlap whole: max(344.5, 668.0) ms.

    >>> round(float(two_queues_s([one(80, 4.306e-3, 0.0)], [one(78, 8.565e-3, 0.0)])[0]) * 1e3, 1)
    668.1
    """
    dem = lambda t, nic: np.where(t > 0, nic / np.where(t > 0, t, 1.0), 0.0)  # noqa: E731
    w_a = sum(n * t for n, t, _ in a_calls)
    w_b = sum(n * t for n, t, _ in b_calls)
    nic = sum(n * x for n, _, x in a_calls + b_calls)
    ka = [np.zeros(np.shape(w_a + w_b)) for _ in a_calls]
    kb = [np.zeros(np.shape(w_a + w_b)) for _ in b_calls]
    for i, (na, ta, xa) in enumerate(a_calls):
        for j, (nb, tb, xb) in enumerate(b_calls):
            k_a, k_b = _excess_per_work(*np.broadcast_arrays(dem(ta, xa), dem(tb, xb)))
            both = (na * ta > 0) & (nb * tb > 0)  # kinds that meet: both present
            ka[i] = np.maximum(ka[i], np.where(both, k_a, 0.0))
            kb[j] = np.maximum(kb[j], np.where(both, k_b, 0.0))
    saved = np.minimum(sum(k * n * t for k, (n, t, _) in zip(ka, a_calls)),
                       sum(k * n * t for k, (n, t, _) in zip(kb, b_calls)))
    return np.maximum(w_a + w_b - saved, nic)
