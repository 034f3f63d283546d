"""The scale model: the fan-out's measured per-GB costs extrapolated to a fleet of predictors x ranks.

What bench/README.md's scale table shows (``python -m bench.plots --tables``).
"""

from __future__ import annotations

from typing import Any


def scale_model(
    tree: dict[str, Any],
    *,
    predictors: int = 4096,
    ranks: int = 64,
    delta_mb_per_s: tuple[float, ...] = (1.0, 10.0, 50.0),
    core_budget: float = 0.5,
    nic_gbps: float = 1.25,
    fleet: dict[str, Any] | None = None,
    pulls_per_s: float = 1.0,
) -> dict[str, Any]:
    """Extrapolate the measured per-GB costs to ``predictors`` x ``ranks``.

    Each predictor reads every rank; each serving node (sidecar or relay) serves one rank to
    F consumers, each at the rank's delta rate D (bytes/s). A node sustains F while
    ``F * D * c_send <= core_budget`` cores (c_send: its measured CPU-s per delivered GB, at
    the largest N measured) and ``F * D <= nic_gbps``; a relay also pays ``D * c_mirror`` to
    mirror (measured over its idle cost) and its idle cost (its Status polls of the upstream
    and its spool poll, measured in cores). Relays per level follow from F; freshness p99 at level L is the measured p99 of
    level L (the sidecar's poll plus L relay hops), extended linearly with the measured
    per-hop increment for deeper trees.

    With a measured ``fleet`` (:mod:`bench.fleet`: 64/256 consumers per node) the consumer's
    cost on its node is ``pulls_per_s x fixed + D x marginal``: the fleet's sidecar CPU per
    pull split at two window sizes into a fixed part per pull and a part per GB. Without it
    (or if the split is missing), ``D x c_send``.
    """
    pts = tree.get("points", [])
    if not pts:
        return {}
    top = max(p["consumers"] for p in pts)
    sends = [p["serving_cpu_s_per_gb"] for p in pts if p["consumers"] == top]
    c_send = max(sends)  # the dearest level: conservative
    mirrors = [m["relay_cpu_s_per_gb"] for m in tree.get("mirror", [])]
    c_mirror = max(mirrors) if mirrors else None
    idle = tree.get("idle_cores") or []
    idle_relay = max(idle[1:], default=None)  # a relay's own polling, per relay
    fresh = {f["level"]: f["p99_s"] for f in tree.get("freshness", []) if f["p99_s"] is not None}
    hop = (
        (fresh[max(fresh)] - fresh[0]) / max(fresh)
        if fresh and max(fresh) > 0 and 0 in fresh
        else None
    )
    split = (fleet or {}).get("per_pull_cost") or {}
    fixed = split.get("fixed_cpu_s_per_pull")
    marginal = split.get("cpu_s_per_gb_marginal")
    use_split = fixed is not None and marginal is not None
    fleet_pts = (fleet or {}).get("points") or []
    fleet_top = max((p["consumers"] for p in fleet_pts), default=None)
    fleet_send = [
        p["serving_cpu_s_per_gb"]
        for p in fleet_pts
        if p["consumers"] == fleet_top and p["serving_cpu_s_per_gb"] is not None
    ]

    def per_consumer_cores(d_gb: float) -> float:
        if fixed is not None and marginal is not None:
            return pulls_per_s * float(fixed) + d_gb * float(marginal)
        return d_gb * c_send

    rows: list[dict[str, Any]] = []
    for d_mb in delta_mb_per_s:
        d_gb = d_mb / 1000
        one = per_consumer_cores(d_gb)
        f_cpu = core_budget / one if one > 0 else float("inf")
        f_nic = nic_gbps / d_gb
        fanout = max(1, int(min(f_cpu, f_nic)))
        # levels: the sidecar serves min(F, relays of level 1); each level multiplies by F.
        # A node that cannot serve two consumers at this rate (F = 1) never reaches them all:
        # no tree does, so the row says so instead of looping (bounded: F >= 2 doubles reach).
        if fanout < 2 and predictors > 1:
            rows.append(
                {
                    "delta_mb_per_s_per_rank": d_mb,
                    "fanout_per_node": fanout,
                    "limited_by": "cpu" if f_cpu < f_nic else "nic",
                    "relay_levels": None,
                    "relays": [],
                    "relays_total": None,
                    "note": "one node cannot serve two consumers at this delta rate",
                }
            )
            continue
        levels, reach = 0, fanout
        while reach < predictors:
            levels += 1
            reach *= fanout
        # the narrowest tree: the last level serves every predictor, each level above it
        # serves the one below, the sidecar serves level 1
        widths: list[int] = []
        need = predictors
        for _ in range(levels):
            need = -(-need // fanout)
            widths.insert(0, need)
        per_level = [
            {"level": lv, "relays_per_rank": w, "relays": w * ranks}
            for lv, w in enumerate(widths, start=1)
        ]
        p99 = None
        if hop is not None and 0 in fresh:
            p99 = fresh[0] + levels * hop
        rows.append(
            {
                "delta_mb_per_s_per_rank": d_mb,
                "fanout_per_node": fanout,
                "limited_by": "cpu" if f_cpu < f_nic else "nic",
                "relay_levels": levels,
                "relays": per_level,
                "bytes_per_s_per_link": d_mb * 1e6,
                "node_out_bytes_per_s": min(fanout, predictors) * d_mb * 1e6,
                "predictor_in_bytes_per_s": ranks * d_mb * 1e6,
                "relay_mirror_cores": d_gb * c_mirror if c_mirror is not None else None,
                # every predictor-rank stream costs its serving node per_consumer_cores
                "serving_cores_per_consumer": one,
                "serving_cores_total": predictors * ranks * one,
                "relays_total": sum(x["relays"] for x in per_level),
                "relay_idle_cores_total": (
                    idle_relay * sum(x["relays"] for x in per_level)
                    if idle_relay is not None
                    else None
                ),
                "freshness_p99_s_at_predictor_tier": p99,
            }
        )
    return {
        "predictors": predictors,
        "ranks": ranks,
        "core_budget_per_node": core_budget,
        "nic_gb_per_s": nic_gbps,
        "c_send_cpu_s_per_gb": c_send,
        "cost_model": "pulls_per_s x fixed + D x marginal" if use_split else "D x c_send",
        "pulls_per_s": pulls_per_s if use_split else None,
        "fixed_cpu_s_per_pull": fixed,
        "marginal_cpu_s_per_gb": marginal,
        "fleet_consumers": fleet_top,
        "fleet_serving_cpu_s_per_gb": max(fleet_send) if fleet_send else None,
        "c_mirror_cpu_s_per_gb": c_mirror,
        "relay_idle_cores": idle_relay,
        "idle_cores_by_level": idle,
        "freshness_p99_s_by_level": fresh,
        "per_hop_p99_s": hop,
        "rows": rows,
    }
