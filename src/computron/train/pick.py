"""The planner's pick for each group of measured training layouts, against the fastest one measured.

What flows through: the bench's configurations fall into groups that train the same thing on the
same number of GPUs (model, global batch, sequence length, GPUs: :func:`group_key`). For each group
:func:`search_picks` runs the planner's search (``planner.search.search``, what ``plan search``
runs) for the best layout on one node of that many GPUs of this machine's type, from the group's
profile when there is one, within what the Trainer runs (:data:`RESTRICTIONS`); its best plan
becomes a ``plan launch`` ``Layout`` (``launch.layout_from_plan``) and that a bench ``Config``.
:func:`to_measure` lists the picks no configuration of their group runs (the bench measures them
too), and :func:`compare` turns the measured rows and the picks into, per group, the pick, its
measured time, the fastest measured layout and the ratio, and a summary: the worst ratio and
whether every pick is within ``TOLERANCE`` of its group's fastest. :func:`to_measure` and
:func:`compare` are pure (rows are dicts, picks hold ``Config``s): no torch, no planner.
"""

from __future__ import annotations

TOLERANCE = 0.05  # a pick within 5% of its group's fastest measured layout passes
VIRTUAL_STAGES = (1, 2)  # the interleaving the search tries (plan search --virtual-stages 1,2)
RESTRICTIONS = (
    "ZeRO 0, then 1: with dp > 1 the search takes plain data parallelism where it fits and ZeRO-1 where it does "
    "not (the Trainer's ZeRO-1, torch's, moves more than plain DDP; plan search's default ladder is 1, 2, 3)",
    "no sequence parallelism, context parallelism, fp8 or TP communication overlap (the Trainer runs none)",
    "tp dividing the heads, the key/value heads and the FFN (the Trainer keeps one tensor rank per K/V head)",
    f"virtual stages {', '.join(map(str, VIRTUAL_STAGES))} (plan search tries 1 unless told)",
)
LAYOUT = ("tp", "pp", "dp", "mbs", "v", "zero1", "recompute", "partition")


def group_key(row: dict) -> tuple:
    """(model, global batch, sequence length, GPUs): the configurations that train the same thing."""
    return row["model"], row["global_batch"], row["seq_len"], row["tp"] * row["pp"] * row["dp"]


def group_label(key: tuple) -> str:
    model, gb, seq, gpus = key
    return f"{model} gb={gb} s={seq} on {gpus} GPU" + "s" * (gpus > 1)


def layout_key(row: dict) -> tuple:
    """What a layout is within its group (a partition of None is the uniform one)."""
    return tuple(tuple(row[k]) if k == "partition" and row[k] is not None else row[k] for k in LAYOUT)


def to_measure(configs: list, picks: dict) -> list:
    """The picked ``Config``s (``picks``: group -> {"config", "predicted_s"} or {"error"}) that no
    configuration of their group runs, each once, in the groups' order."""
    have = {(group_key(c.as_row()), layout_key(c.as_row())) for c in configs}
    out = []
    for key, pick in picks.items():
        cfg = pick.get("config")
        if cfg is not None and (key, layout_key(cfg.as_row())) not in have:
            have.add((key, layout_key(cfg.as_row())))
            out.append(cfg)
    return out


def compare(rows: list[dict], picks: dict, failed: dict | None = None, tolerance: float = TOLERANCE) -> dict:
    """Per group of the measured ``rows`` (``LAYOUT`` fields, ``config``, ``measured_s``; ``added``
    when the bench ran it for the pick), its pick against its fastest row: ``ratio`` = the pick's
    measured time / the fastest's, ``within`` = ratio <= 1 + ``tolerance``. ``failed``: a pick's
    label -> why its measurement failed. A group whose pick has no measurement (no plan, not run,
    failed) is not within; the summary's ``all_within`` needs every group within."""
    failed = failed or {}
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(group_key(r), []).append(r)
    out = []
    for key, members in groups.items():
        fastest = min(members, key=lambda r: r["measured_s"])
        g = {"group": group_label(key), "model": key[0], "global_batch": key[1], "seq_len": key[2], "gpus": key[3],
             "measured": len(members), "fastest": fastest["config"], "fastest_s": fastest["measured_s"],
             "pick": None, "pick_s": None, "ratio": None, "within": False}
        pick = picks.get(key, {"error": "not searched"})
        if "error" in pick:
            g["note"] = pick["error"]
        else:
            cfg = pick["config"]
            g.update(pick=cfg.label, pick_layout=cfg.as_row(), pick_predicted_s=pick["predicted_s"])
            same = [r for r in members if layout_key(r) == layout_key(cfg.as_row())]
            if same:
                ratio = same[0]["measured_s"] / fastest["measured_s"]
                g.update(pick_s=same[0]["measured_s"], ratio=ratio, within=ratio <= 1 + tolerance,
                         pick_added=bool(same[0].get("added")))
            else:
                g["note"] = failed.get(cfg.label, "the pick was not measured")
        out.append(g)
    measured = [g for g in out if g["ratio"] is not None]
    worst = max(measured, key=lambda g: g["ratio"]) if measured else None
    return {"groups": out, "summary": {
        "groups": len(out), "tolerance": tolerance, "worst_ratio": None if worst is None else worst["ratio"],
        "worst_group": None if worst is None else worst["group"], "all_within": bool(out) and all(g["within"] for g in out),
        "restrictions": list(RESTRICTIONS)}}


# ---- the search (planner; torch-free) ----------------------------------------------------------

def trainer_tps(shape, gpus: int) -> tuple[int, ...]:
    """Tensor-parallel degrees on a node of ``gpus`` GPUs that the Trainer runs for ``shape`` (a
    planner ``TransformerShape``): dividing the GPUs, the heads, the key/value heads and the FFN."""
    return tuple(t for t in range(1, gpus + 1)
                 if gpus % t == 0 and shape.heads % t == 0 and shape.kv % t == 0 and shape.ffn % t == 0)


def search_pick(model: str, shape, gpus: int, gpu: str, cm) -> dict:
    """The search's best layout of ``shape`` (the preset ``model`` as the trainer runs it) on one
    node of ``gpus`` GPUs of type ``gpu`` under the cost model ``cm``: {"config": Config,
    "predicted_s": its iteration time}, or {"error": why there is none}."""
    from ..planner import report
    from ..planner.errors import PlannerError
    from ..planner.hardware import load_cluster
    from ..planner.search import SearchOptions, search
    from .accuracy import Config
    from .launch import LaunchError, layout_from_plan

    opts = SearchOptions(top=1, all_nodes=True, virtual_stages=VIRTUAL_STAGES, sequence_parallel=False, zero=(0, 1),
                         cp=(1,), tp=trainer_tps(shape, gpus))
    try:
        plans = search(shape, load_cluster(f"{gpu}:{gpus}x1"), opts, cm).plans
    except PlannerError as e:
        return {"error": f"the search failed: {e}"}
    if not plans:
        return {"error": f"the search found no feasible plan on {gpus} {gpu}"}
    r = plans[0]
    try:
        lay = layout_from_plan(shape.to_dict(), {**report.plan_row(r), "detail": r.to_dict()}, "the search's plan")
    except LaunchError as e:
        return {"error": str(e)}
    part = tuple(lay.chunk_partition()) if lay.pp > 1 else None
    cfg = Config(model, lay.mbs, lay.global_batch, lay.seq_len, lay.recompute, lay.tp, lay.pp, lay.dp,
                 lay.virtual_stages, lay.zero1, part).canonical(shape.layers)
    return {"config": cfg, "predicted_s": r.iteration_s}


def search_picks(configs: list, models: dict, gpu: str, profile_of, log=print, a=None) -> dict:
    """{group: :func:`search_pick`} for every group of ``configs``; ``models``: preset -> its engine
    ``ModelConfig``; ``profile_of(model, seq_len)``: the profile file to plan from (None: roofline);
    ``a``: the cost model's assumptions (default: ``accuracy.assumptions``)."""
    from .accuracy import cost_model, shape_of

    out: dict[tuple, dict] = {}
    for c in configs:
        key = group_key(c.as_row())
        if key in out:
            continue
        model, gb, seq, gpus = key
        shape = shape_of(models[model], seq, gb)
        out[key] = pick = search_pick(model, shape, gpus, gpu, cost_model(shape, gpu, profile_of(model, seq), a))
        got = f"{pick['config'].label} (predicted {pick['predicted_s']:.4f} s)" if "config" in pick else pick["error"]
        log(f"plan search pick for {group_label(key)}: {got}")
    return out


def print_report(pick: dict, out=print) -> None:
    s = pick["summary"]
    out("planner's pick against the fastest measured; the search kept to what the Trainer runs:")
    for x in s["restrictions"]:
        out(f"    {x}")
    for g in pick["groups"]:
        if g["ratio"] is None:
            out(f"  {g['group']}: pick {g['pick'] or '-'}: {g['note']}; fastest {g['fastest']} {g['fastest_s']:.4f} s")
            continue
        out(f"  {g['group']}: pick {g['pick']}{' (added)' * g['pick_added']} {g['pick_s']:.4f} s; fastest "
            f"{g['fastest']} {g['fastest_s']:.4f} s; ratio {g['ratio']:.3f} {'ok' if g['within'] else 'OVER'}")
    worst = "no pick measured" if s["worst_ratio"] is None else f"worst ratio {s['worst_ratio']:.3f} ({s['worst_group']})"
    out(f"  {worst}; every group within {s['tolerance']:.0%}: {'yes' if s['all_within'] else 'no'}")
