"""Benchmark 1: training-step overhead of tracking (and publishing) touched rows.

The reference DLRM (:mod:`bench.dlrm`, ~0.5 s/step on 2 cores at the full size) trains in a
fresh spawned process per (variant, round); variants are interleaved round by round so that
background load hits them alike. Per run: warm-up steps, then the wall time of each measured
step (forward, backward, fused embedding update, dense step, plus whatever the variant does
at that step). The figure is the median step time of a variant over the baseline's, both
medians over rounds of per-run medians.

Variants:

* ``none``: no tracker.
* ``deltad_tracker``: :class:`deltad.publish.tracker.DeltaTracker`, drained every ``publish_every``.
* ``deltad``: tracker + :class:`deltad.publish.publisher.SegmentPublisher` publishing every step
  (what a 0.5 s freshness needs at 0.5 s/step), fsync on, spool on local disk.
* ``deltad_tmpfs``: ``deltad`` with the spool on tmpfs (``/dev/shm``), as a pod's
  ``medium: Memory`` emptyDir would be: same fsync calls, no disk behind them.
* ``deltad_every10``: the same as ``deltad``, publishing every 10 steps.
* ``torchrec_id_only``: TorchRec's ModelDeltaTracker, ID_ONLY with auto_compact, its ids read
  (``get_unique_ids``) every ``publish_every`` steps.
* ``torchrec_embedding``: TorchRec's tracker in EMBEDDING mode, ``get_unique`` likewise.
"""

from __future__ import annotations

import statistics
import time
import traceback
from pathlib import Path
from typing import Any

from bench.common import Children, Context, NotAvailable, med, medf, pyplot, save_figure, summarize

VARIANTS = (
    "none",
    "deltad_tracker",
    "deltad",
    "deltad_tmpfs",
    "deltad_every10",
    "torchrec_id_only",
    "torchrec_embedding",
)
PUBLISH_EVERY = 10
#: where the tmpfs variant puts its spool (needs ~2.5 GB free at the full size)
TMPFS = "/dev/shm"


def _attach(
    variant: str, dmp: Any, spool: Path, publish_every: int, publish_steps: int = 0
) -> tuple[Any, Any, Any, Any]:
    """Set up the variant; return (per-step hook(step), close(), publisher or None, deltad
    tracker or None)."""
    if variant == "none":
        return (lambda step: None), (lambda: None), None, None
    if variant == "deltad_tracker":
        from deltad.publish.tracker import DeltaTracker

        tracker = DeltaTracker(dmp)

        def drain(step: int) -> None:
            if step % publish_every == 0:
                tracker.drain()

        return drain, tracker.detach, None, tracker
    if variant in ("deltad", "deltad_tmpfs", "deltad_every10"):
        import shutil
        import tempfile

        from deltad.config import PublisherConfig
        from deltad.publish.publisher import SegmentPublisher

        every = publish_steps or (10 if variant == "deltad_every10" else 1)
        if variant == "deltad_tmpfs":
            spool = Path(tempfile.mkdtemp(prefix="deltad-bench-", dir=TMPFS))
        pub = SegmentPublisher(
            dmp, PublisherConfig(spool_dir=spool, model="bench", every_steps=every)
        )
        pub.start(0)
        state = {"last": 0}

        def publish(step: int) -> None:
            state["last"] = step
            pub.maybe_publish(step)

        def close() -> None:
            try:
                pub.close(state["last"])
            finally:
                if variant == "deltad_tmpfs":
                    shutil.rmtree(spool, ignore_errors=True)

        return publish, close, pub, pub.tracker
    from torchrec.distributed.model_tracker.types import DeltaTrackerConfig, TrackingMode

    mode = TrackingMode.ID_ONLY if variant == "torchrec_id_only" else TrackingMode.EMBEDDING
    # TorchRec 1.8 refuses EMBEDDING mode on an EBC (pooled lookups): track the EC only there.
    skip = ["ebc"] if mode == TrackingMode.EMBEDDING else []
    tr = dmp.init_torchrec_delta_tracker(
        DeltaTrackerConfig(
            tracking_mode=mode, auto_compact=mode == TrackingMode.ID_ONLY, fqns_to_skip=skip
        )
    )

    def read(step: int) -> None:
        if step % publish_every == 0:
            if mode == TrackingMode.ID_ONLY:
                tr.get_unique_ids()
            else:
                tr.get_unique()

    return read, (lambda: None), None, None


def worker_main(conn: Any, specs: list[dict[str, Any]]) -> None:
    """Spawned: per spec build the DLRM, attach the variant, time steps; send results back."""
    import logging
    import warnings

    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")
    try:
        conn.send(("ok", [_worker(spec) for spec in specs]))
    except Exception:
        conn.send(("error", traceback.format_exc(limit=12)))
    finally:
        conn.close()


def _worker(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    from bench.common import self_peak_rss
    from bench.dlrm import DlrmSize, build, train_step

    torch.set_num_threads(spec.get("threads", torch.get_num_threads()))
    size = DlrmSize(**spec["size"])
    dmp, dense, stream = build(size, seed=spec.get("seed", 0))
    warmup, steps = spec["warmup"], spec["steps"]
    batches = [stream.next_batch() for _ in range(warmup + steps)]
    rss_before = self_peak_rss()
    hook, close, pub, trk = _attach(
        spec["variant"],
        dmp,
        Path(spec["spool"]),
        spec["publish_every"],
        spec.get("publish_steps", 0),
    )
    times: list[float] = []
    cpu0 = wall0 = barrier0 = 0.0
    for i, b in enumerate(batches):
        if i == warmup:
            cpu0, wall0 = time.process_time(), time.perf_counter()
            barrier0 = pub.stats.barrier_wait_s if pub is not None else 0.0
        t0 = time.perf_counter()
        train_step(dmp, dense, b)
        hook(i + 1)
        dt = time.perf_counter() - t0
        if i >= warmup:
            times.append(dt)
    # Process CPU (all threads, incl. the publisher's writer) per measured step: much less
    # sensitive than wall time to other processes competing for the cores.
    cpu_per_step = (time.process_time() - cpu0) / max(steps, 1)
    wall_per_step = (time.perf_counter() - wall0) / max(steps, 1)
    t0 = time.perf_counter()
    close()
    close_s = time.perf_counter() - t0
    out: dict[str, Any] = {
        "step_s": times,
        "median_step_s": statistics.median(times),
        "cpu_per_step_s": cpu_per_step,
        "wall_per_step_s": wall_per_step,
        "close_s": close_s,
        "peak_rss_bytes": self_peak_rss(),
        "peak_rss_before_tracking_bytes": rss_before,
        "ids_per_step": int(batches[0].sparse.values().numel() + batches[0].seq.values().numel()),
    }
    if trk is not None:
        # Hooks in the forward (stash ids, fold them into the bitmaps) and drains outside a
        # publisher, per step over every step run (warm-up included); a publisher's drains
        # are part of its stall, counted there.
        st = trk.stats
        own_drain = 0.0 if pub is not None else st.drain_s
        out["tracker_s_per_step"] = (st.forward_s + own_drain) / max(1, warmup + steps)
        # Off the loop: the fold thread's CPU (CPU weights fold in the background).
        out["tracker_background_s_per_step"] = st.background_s / max(1, warmup + steps)
    if pub is not None:
        segs = [s for s in pub.stats.segments if s.kind.value == "delta"]
        out["segments"] = [
            {
                "rows": s.rows,
                "nbytes": s.nbytes,
                "stall_s": s.stall_s,
                "write_s": s.write_s,
                "write_cpu_s": s.write_cpu_s,
                "copy_s": s.copy_s,
                "copy_cpu_s": s.copy_cpu_s,
                "dense_bytes": s.dense_bytes,  # rank 0: the dense state taken with it
                "dense_s": s.dense_s,  # in the loop (part of stall_s): cloning it
            }
            for s in segs
        ]
        out["decide_s"] = pub.stats.decide_s
        # Backward passes waiting for a background copy (loop time): in all, and per measured
        # step (like step times, without the warm-up, whose first copy fills fresh buffers).
        out["barrier_wait_s"] = pub.stats.barrier_wait_s
        out["barrier_wait_s_per_step"] = (pub.stats.barrier_wait_s - barrier0) / max(1, steps)
        out["barrier_waits"] = pub.stats.barrier_waits
    return out


def paired_main(conn: Any, spec: dict[str, Any]) -> None:
    """Spawned: one model, alternating blocks without / with deltad (tracker + publisher).

    Each block replays the same batches; a ``deltad`` block attaches a fresh tracker and
    publisher (its base segment is written before the block is timed), publishes every step,
    then closes and detaches. Blocks of the two kinds seconds apart in one process see the
    same background load, which separate processes minutes apart do not.
    """
    import logging
    import warnings

    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")
    try:
        conn.send(("ok", _paired(spec)))
    except Exception:
        conn.send(("error", traceback.format_exc(limit=12)))
    finally:
        conn.close()


def _paired(spec: dict[str, Any]) -> dict[str, Any]:
    from bench.dlrm import DlrmSize, build, train_step

    size = DlrmSize(**spec["size"])
    dmp, dense, stream = build(size, seed=0)
    warmup, steps = spec["warmup"], spec["steps"]
    batches = [stream.next_batch() for _ in range(warmup + steps)]
    for b in batches[:warmup]:  # first-touch of everything before any block
        train_step(dmp, dense, b)
    blocks: list[dict[str, Any]] = []
    step = 0
    for r in range(spec["rounds"]):
        for kind in ("none", "deltad") if r % 2 == 0 else ("deltad", "none"):
            hook, close, pub, _ = _attach(
                "deltad" if kind == "deltad" else "none",
                dmp,
                Path(spec["spool"]) / f"r{r}",
                spec["publish_every"],
                1,
            )
            times = []
            cpu0 = time.process_time()
            for i, b in enumerate(batches):
                t0 = time.perf_counter()
                train_step(dmp, dense, b)
                step += 1
                hook(step)
                if i >= warmup:
                    times.append(time.perf_counter() - t0)
                if i == warmup - 1:
                    cpu0 = time.process_time()
            cpu = (time.process_time() - cpu0) / max(steps, 1)
            close()
            if pub is not None:
                pub.tracker.detach()
            blocks.append(
                {"round": r, "kind": kind, "median_step_s": statistics.median(times), "cpu_s": cpu}
            )
    return {"blocks": blocks}


def _run_spawned(children: Children, target: Any, arg: Any, what: str, timeout_s: float) -> Any:
    """Run ``target(conn, arg)`` in a fresh spawned process; its ("ok", result) or raise."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = children.process(target, child, arg)
    child.close()
    if not parent.poll(timeout_s):
        proc.terminate()
        raise TimeoutError(f"{what} took more than {timeout_s}s")
    status, res = parent.recv()
    proc.join(timeout=30)
    if status != "ok":
        raise RuntimeError(f"{what} failed:\n{res}")
    return res


def run_paired(
    children: Children, spec: dict[str, Any], timeout_s: float = 1800.0
) -> dict[str, Any]:
    """Run :func:`paired_main` in a fresh process."""
    return dict(_run_spawned(children, paired_main, spec, "paired tracking worker", timeout_s))


def run_worker(
    children: Children, specs: list[dict[str, Any]], timeout_s: float = 900.0
) -> list[dict[str, Any]]:
    """Run specs in one fresh spawned process and return their results."""
    names = [s["variant"] for s in specs]
    return list(_run_spawned(children, worker_main, specs, f"tracking worker {names}", timeout_s))


def _unavailable(variant: str) -> str | None:
    from bench.deltad_procs import module_unavailable

    if variant == "deltad_tmpfs":
        import shutil

        try:
            if shutil.disk_usage(TMPFS).free < 3 << 30:
                return f"{TMPFS} has less than 3 GB free"
        except OSError:
            return f"no tmpfs at {TMPFS}"
    if variant.startswith("deltad"):
        mods = ["deltad.publish.tracker"] + (
            ["deltad.publish.publisher"] if variant != "deltad_tracker" else []
        )
        return module_unavailable(*mods)
    if variant.startswith("torchrec"):
        return module_unavailable("torchrec.distributed.model_tracker.types")
    return None


def size_for(ctx: Context) -> dict[str, Any]:
    from dataclasses import asdict

    from bench.dlrm import DlrmSize

    full = DlrmSize(batch=16384, pooling=16, seq_len=32)
    return asdict(ctx.pick(full, DlrmSize.small(), DlrmSize.tiny()))


def run(ctx: Context) -> dict[str, Any]:
    """Every variant, ``ctx.repeats`` rounds, interleaved."""
    from bench.deltad_procs import module_unavailable

    why = module_unavailable("deltad.reference.trainer.model", "deltad.reference.trainer.data")
    if why:
        raise NotAvailable(f"the reference DLRM is missing: {why}")
    size = size_for(ctx)
    warmup, steps = ctx.pick((3, 12), (2, 6), (1, 3))
    variants = [v for v in VARIANTS if not _unavailable(v)]
    missing = {v: _unavailable(v) for v in VARIANTS if _unavailable(v)}
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    for r in range(ctx.repeats):
        # One process per run (clean peak RSS); the smoke test shares one for speed.
        groups = [variants] if ctx.tiny else [[v] for v in variants]
        for group in groups:
            ctx.status(f"tracking round {r + 1} {','.join(group)}")
            with ctx.tmpdir("track") as spool, Children() as kids:
                specs = [
                    {
                        "variant": v,
                        "size": size,
                        "warmup": warmup,
                        "steps": steps,
                        "spool": str(spool / v),
                        "publish_every": PUBLISH_EVERY,
                        "seed": r,
                    }
                    for v in group
                ]
                for v, res in zip(group, run_worker(kids, specs), strict=True):
                    runs[v].append(res)
    paired: dict[str, Any] | None = None
    if "deltad" in variants:
        ctx.status("tracking: paired blocks none/deltad in one process")
        with ctx.tmpdir("paired") as spool, Children() as kids:
            pres = run_paired(
                kids,
                {
                    "size": size,
                    "warmup": 2 if not ctx.tiny else 1,
                    "steps": steps,
                    "rounds": ctx.pick(2 * ctx.repeats, ctx.repeats, 1),
                    "spool": str(spool),
                    "publish_every": PUBLISH_EVERY,
                },
            )
        blocks = pres["blocks"]
        rounds = sorted({b["round"] for b in blocks})
        by = {(b["round"], b["kind"]): b for b in blocks}
        wall = [
            (by[(r, "deltad")]["median_step_s"] / by[(r, "none")]["median_step_s"] - 1) * 100
            for r in rounds
        ]
        cpu_ov = [(by[(r, "deltad")]["cpu_s"] / by[(r, "none")]["cpu_s"] - 1) * 100 for r in rounds]
        paired = {
            "blocks": blocks,
            "overhead_pct": summarize(wall),
            "cpu_overhead_pct": summarize(cpu_ov),
            "none_step_s": summarize([b["median_step_s"] for b in blocks if b["kind"] == "none"]),
            "deltad_step_s": summarize(
                [b["median_step_s"] for b in blocks if b["kind"] == "deltad"]
            ),
        }
    base = summarize([x["median_step_s"] for x in runs["none"]])
    base_cpu = summarize([x["cpu_per_step_s"] for x in runs["none"]])
    table: dict[str, Any] = {}
    for v in variants:
        s = summarize([x["median_step_s"] for x in runs[v]])
        # Overhead per round (same round = same seed and closest in time), then the median.
        per_round = [
            (a["median_step_s"] / b["median_step_s"] - 1.0) * 100.0
            for a, b in zip(runs[v], runs["none"], strict=True)
        ]
        cpu = summarize([x["cpu_per_step_s"] for x in runs[v]])
        table[v] = {
            "step_s": s,
            "overhead_pct": (medf(s) / medf(base) - 1.0) * 100.0 if med(base) else None,
            "cpu_per_step_s": cpu,
            "cpu_overhead_pct": (medf(cpu) / medf(base_cpu) - 1.0) * 100.0
            if med(base_cpu)
            else None,
            "overhead_pct_per_round": summarize(per_round),
            "peak_rss_bytes": max(x["peak_rss_bytes"] for x in runs[v]),
            "close_s": summarize([x["close_s"] for x in runs[v]]),
        }
        trk = [x["tracker_s_per_step"] for x in runs[v] if "tracker_s_per_step" in x]
        if trk and med(base):
            table[v]["tracker_s_per_step"] = summarize(trk)
            fold = [x.get("tracker_background_s_per_step", 0.0) for x in runs[v]]
            table[v]["accounted"] = {
                "tracker_pct": statistics.median(trk) / medf(base) * 100.0,
                "fold_cpu_pct": statistics.median(fold) / medf(base) * 100.0,
            }
        segs = [s for x in runs[v] for s in x.get("segments", [])]
        if segs:
            table[v]["stall_per_segment_s"] = summarize([s["stall_s"] for s in segs])
            table[v]["rows_per_segment"] = statistics.median([s["rows"] for s in segs])
            table[v]["bytes_per_segment"] = statistics.median([s["nbytes"] for s in segs])
            table[v]["writer_cpu_per_segment_s"] = summarize(
                [s.get("write_cpu_s", 0.0) for s in segs]
            )
            table[v]["copier_cpu_per_segment_s"] = summarize(
                [s.get("copy_cpu_s", 0.0) for s in segs]
            )
            barrier = summarize([x.get("barrier_wait_s_per_step", 0.0) for x in runs[v]])
            table[v]["barrier_wait_s_per_step"] = barrier
            # Accounted cost, robust to other load. On the loop: what publish() took (stall)
            # and what backward passes waited for a background copy. Off the loop: what the
            # copier and writer threads burned. Per step, as a share of the no-tracker step.
            per_step = 1.0 / PUBLISH_EVERY if v == "deltad_every10" else 1.0  # segments per step
            if med(base):
                stall = medf(table[v]["stall_per_segment_s"]) * per_step
                wcpu = medf(table[v]["writer_cpu_per_segment_s"]) * per_step
                ccpu = medf(table[v]["copier_cpu_per_segment_s"]) * per_step
                table[v].setdefault("accounted", {"tracker_pct": 0.0, "fold_cpu_pct": 0.0}).update(
                    stall_pct=stall / medf(base) * 100.0,
                    barrier_pct=medf(barrier) / medf(base) * 100.0,
                    copier_cpu_pct=ccpu / medf(base) * 100.0,
                    writer_cpu_pct=wcpu / medf(base) * 100.0,
                )
    result: dict[str, Any] = {
        "size": size,
        "warmup_steps": warmup,
        "measured_steps": steps,
        "publish_every_for_readers": PUBLISH_EVERY,
        "ids_per_step": runs["none"][0]["ids_per_step"],
        "variants": table,
        "paired": paired,
        "missing": missing,
        "runs": runs,
    }
    head = []
    for v in variants:
        if v == "none":
            head.append({"metric": "step time, no tracker", "value": med(base), "unit": "s"})
            continue
        ov = table[v]["overhead_pct"]
        cov = table[v]["cpu_overhead_pct"]
        # The target is for tracking + publishing; the tracker-only variant is informative.
        target = "<= 1.5%" if v in ("deltad", "deltad_tmpfs", "deltad_every10") else ""
        acc = table[v].get("accounted")
        if acc and "stall_pct" in acc:
            loop = acc["tracker_pct"] + acc["stall_pct"] + acc["barrier_pct"]
            head.append(
                {
                    "metric": (
                        f"accounted cost {v} on the training loop: tracker hooks "
                        f"{acc['tracker_pct']:.2f}% + publish stall {acc['stall_pct']:.2f}% + "
                        f"barrier waits {acc['barrier_pct']:.2f}% of a step "
                        f"({table[v]['bytes_per_segment'] / 1e6:.0f} MB/segment)"
                    ),
                    "value": loop,
                    "unit": "%",
                    "target": target,
                    "met": loop <= 1.5,
                }
            )
            head.append(
                {
                    "metric": (
                        f"accounted cost {v} off the loop: fold thread CPU "
                        f"{acc['fold_cpu_pct']:.1f}% + copier thread CPU "
                        f"{acc['copier_cpu_pct']:.1f}% + writer thread CPU "
                        f"{acc['writer_cpu_pct']:.1f}% of a step"
                    ),
                    "value": acc["fold_cpu_pct"] + acc["copier_cpu_pct"] + acc["writer_cpu_pct"],
                    "unit": "%",
                }
            )
        elif acc:
            head.append(
                {
                    "metric": (
                        f"accounted cost {v}: tracker hooks and drains on the loop, % of a step "
                        f"(fold thread CPU off the loop {acc['fold_cpu_pct']:.2f}%)"
                    ),
                    "value": acc["tracker_pct"],
                    "unit": "%",
                }
            )
        head.append(
            {
                "metric": f"step overhead {v} (wall; CPU-time overhead {cov:+.1f}%)",
                "value": ov,
                "unit": "%",
                "baseline": med(base),
                "baseline_unit": "s/step",
                "target": target,
                "met": (ov is not None and ov <= 1.5) if target else None,
            }
        )
    if paired is not None:
        ov = med(paired["overhead_pct"])
        head.insert(
            1,
            {
                "metric": (
                    "step overhead deltad, paired blocks in one process (publish every step; "
                    f"CPU-time {medf(paired['cpu_overhead_pct']):+.1f}%, "
                    f"spread {paired['overhead_pct']['min']:+.1f}..{paired['overhead_pct']['max']:+.1f}%)"
                ),
                "value": ov,
                "unit": "%",
                "baseline": med(paired["none_step_s"]),
                "baseline_unit": "s/step",
                "target": "<= 1.5%",
                "met": ov is not None and ov <= 1.5,
            },
        )
    result["headline"] = head
    if "deltad" not in variants:
        raise NotAvailable(f"deltad tracker/publisher: {missing.get('deltad')}", result)
    return result


def plot(result: dict[str, Any], out_dir: Path) -> list[Path]:
    """Bar chart of step time per variant (median, min-max whiskers)."""
    plt = pyplot()
    vs = result.get("variants", {})
    names = list(vs)
    meds = [medf(vs[n]["step_s"]) * 1000 for n in names]
    lo = [m - vs[n]["step_s"]["min"] * 1000 for m, n in zip(meds, names, strict=True)]
    hi = [vs[n]["step_s"]["max"] * 1000 - m for m, n in zip(meds, names, strict=True)]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar(names, meds, yerr=[lo, hi], capsize=4, color="tab:blue")
    for i, n in enumerate(names):
        ov = vs[n].get("overhead_pct")
        if ov is not None and n != "none":
            ax.text(i, meds[i], f"{ov:+.1f}%", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("step time (ms, median of rounds)")
    ax.set_title("training-step overhead of tracking")
    plt.setp(ax.get_xticklabels(), rotation=20, ha="right", fontsize=8)
    return save_figure(fig, out_dir, "tracking")
