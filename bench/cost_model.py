"""A time model of one training step, fitted to bench/network.py's measured runs and extended
to 64, 256 and 1024 ranks. The extension is a model, not a measurement.

    python bench/cost_model.py        # docs/benchmarks/network.json and network_2x2*.json
    python bench/cost_model.py A.json B.json --out DIR

For row r (one spec in one results file) at shaped rate R, the model is

    t = t_compute(r) + m(r) * alpha + B / (eta(g) * R)

- B: the bytes the row sent across the shaped link per step, as measured (TCP/IP included);
- m(r): the message latencies the row pays per step. Horovod fuses the allreduces and the
  allgathers of a step, so each (kind, process set) counts once; alltoalls are not fused and
  count once per tensor. Ring allreduce 2(g-1), allgather and alltoall g-1, g the group's size;
- eta(g): the fraction of the shaped rate achieved, one per group g = (layout, strategy);
- t_compute(r): what the link does not explain (compute, encode and decode, ranks sharing
  cores), one per row.

m(r) is the same at every rate, so with an intercept per row alpha cannot be told apart from
t_compute; the script checks this by rank. It then fits alpha with an intercept shared by the
allgather and compressed-allreduce rows of one codec in one file: their message counts differ,
but so does their compute, so alpha is used only if its interval lies above zero.

The extension takes the file with the most ranks (the largest model among them), holds its
rows' t_compute as a floor, uses its layout's eta per strategy, and takes bytes per rank from
hvd_compress.collectives.wire_bytes on a flat network of one rank per link.
"""
import argparse
import glob
import json
import os
import sys
from dataclasses import replace
from functools import lru_cache

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import network  # noqa: E402
import results  # noqa: E402

from hvd_compress import collectives, parse_spec  # noqa: E402
from hvd_compress.launch import DEFAULT_MIN_COMPRESS_BYTES  # noqa: E402
from hvd_compress.powersgd import matrix_shape  # noqa: E402

RANKS = (64, 256, 1024)
EXTEND_RATES = ("1gbit", "10gbit")
# Rows of the extension: labels of bench/network.py's 2x2 layout, which force the strategy.
EXTEND = ("horovod, no compression", "horovod fp16", "onebit allgather",
          "onebit compressed allreduce", "minmax8 allgather", "minmax8 compressed allreduce",
          "topk 1% allgather", "topk 1% compressed allreduce")
TWO_LEVEL = collectives.TWO_LEVEL


def default_inputs():
    return [os.path.join(results.DEFAULT_OUT, "network.json")] + sorted(
        glob.glob(os.path.join(results.DEFAULT_OUT, "network_2x2*.json")))


@lru_cache(maxsize=None)
def shapes(params_m):
    """The shape of every parameter of bench/network.py's model, built on the meta device so
    that nothing is allocated."""
    import torch
    with torch.device("meta"):
        model, _ = network.make_model({"model": "mlp", "params_m": params_m, "rank": 0,
                                       "batch": 1}, seed=0)
    return tuple(tuple(p.shape) for p in model.parameters())


def how_of(label):
    """bench/network.py's labels start with the framework for Horovod's and DDP's own rows."""
    for how in ("horovod", "ddp"):
        if label.startswith(how):
            return how
    return "ours"


def tensor_plans(how, spec, params_m, per_node, nodes):
    """Per parameter: (strategy, group size, bytes per rank of the part that travels by it,
    the node's rank count under two-level or 0, rounds of the codec)."""
    n = per_node * nodes
    config = None if how == "horovod" else parse_spec(spec)
    out = []
    for shape in shapes(params_m):
        numel = int(np.prod(shape))
        compressed = (config is not None and config.codec != "none"
                      and numel * 4 >= DEFAULT_MIN_COMPRESS_BYTES
                      and len(shape) >= config.info.min_dim)
        if not compressed:  # Horovod's ring allreduce; its own fp16 halves the bytes
            itemsize = 2 if how == "horovod" and spec == "fp16" else 4
            out.append((collectives.ALLREDUCE, n, 2.0 * (n - 1) / n * numel * itemsize, 0, 1))
            continue
        if config.info.rounds == 2:  # PowerSGD: P and Q of the matrix, by two allreduces
            sent = 4 * config.param_dict["rank"] * sum(matrix_shape(shape))
            out.append((collectives.ALLREDUCE, n, 2.0 * (n - 1) / n * sent, 0, 2))
            continue
        local = per_node if config.hierarchical else 0
        g = nodes if local else n
        elements = numel
        if local:  # this rank's shard (local rank 0's)
            bounds = collectives.chunk_bounds(numel, local)
            elements = bounds[1] - bounds[0]
        job = collectives.Job(name="t", n=elements, itemsize=4,
                              config=replace(config, hierarchical=False), rank=0, world=g,
                              average=True, opname="t")
        collectives.choose(job)
        out.append((job.strategy, g, job.wire_bytes, local, 1))
    return out


def messages(plans):
    """Latency terms per step: fused kinds once per process set, alltoalls once per tensor."""
    fused, alltoalls = {}, 0
    for strategy, g, _, local, rounds in plans:
        if local:
            alltoalls += local - 1
            fused[("allgather", "local")] = local
        where = "cross" if local else "all"
        if strategy == collectives.ALLREDUCE:
            for i in range(rounds):
                fused[(f"allreduce {i}", where)] = g
        elif strategy == collectives.ALLGATHER:
            fused[("allgather", where)] = g
        elif strategy == collectives.COMPRESSED_ALLREDUCE:
            alltoalls += g - 1
            fused[("allgather", where)] = g
        elif strategy == collectives.HOMOMORPHIC:
            fused[("allreduce max", where)] = g
            fused[("allreduce 0", where)] = g
    return alltoalls + sum((2 if kind.startswith("allreduce") else 1) * (g - 1)
                           for (kind, _), g in fused.items())


def row_strategy(plans):
    """The strategy that carries most of the row's bytes."""
    strategy, _, _, local, _ = max(plans, key=lambda p: p[2])
    return TWO_LEVEL if local else strategy


def load(paths):
    """One point per measured (file, row, rate), DDP's rows and unknown rates left out."""
    points = []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        s = data["settings"]
        layout = s.get("layout", "1x2")
        per_node, nodes = (int(x) for x in layout.split("x"))
        for r in data["rows"]:
            how = how_of(r["row"])
            if how == "ddp" or r["rate"] not in network.RATES:
                continue
            try:
                plans = tensor_plans(how, r["spec"], s["params_m"], per_node, nodes)
            except ValueError as e:  # a spec this checkout does not know
                print(f"skipped {r['row']!r} ({r['spec']}): {e}")
                continue
            points.append({"file": os.path.basename(path), "layout": layout,
                           "per_node": per_node, "nodes": nodes, "params_m": s["params_m"],
                           "row": r["row"], "how": how, "spec": r["spec"], "rate": r["rate"],
                           "R": network.RATES[r["rate"]], "t": r["ms_per_step"] / 1e3,
                           "B": r["bytes_per_step"], "m": messages(plans),
                           "strategy": row_strategy(plans)})
    return points


# ---- the fit --------------------------------------------------------------------------------
def fit(points, intercept_of, eta_of, with_alpha):
    """Least squares of t on an intercept per intercept_of(point), 1/eta per eta_of(point)
    (times B·8/R) and, with_alpha, alpha (times m). Standard errors from the residuals."""
    ikeys = list(dict.fromkeys(intercept_of(p) for p in points))
    ekeys = list(dict.fromkeys(eta_of(p) for p in points))
    cols = len(ikeys) + len(ekeys) + with_alpha
    A = np.zeros((len(points), cols))
    y = np.array([p["t"] for p in points])
    for i, p in enumerate(points):
        A[i, ikeys.index(intercept_of(p))] = 1.0
        A[i, len(ikeys) + ekeys.index(eta_of(p))] = p["B"] * 8 / p["R"]
        if with_alpha:
            A[i, -1] = p["m"]
    x, _, rank, _ = np.linalg.lstsq(A, y, rcond=None)
    fitted = A @ x
    dof = len(points) - rank
    s2 = float(np.sum((y - fitted) ** 2)) / dof if dof > 0 else float("nan")
    se = np.sqrt(np.maximum(np.diag(s2 * np.linalg.pinv(A.T @ A)), 0.0))
    return {"rank": int(rank), "full_rank": bool(rank == cols), "dof": int(dof),
            "c": dict(zip(ikeys, x[:len(ikeys)])),
            "inv_eta": {k: (x[len(ikeys) + j], se[len(ikeys) + j]) for j, k in enumerate(ekeys)},
            "alpha": (x[-1], se[-1]) if with_alpha else None,
            "fitted": fitted, "rms": float(np.sqrt(np.mean((y - fitted) ** 2)))}


def per_row(p):
    return (p["file"], p["row"])


def per_codec(p):
    """Allgather and compressed-allreduce rows of one codec share an intercept."""
    if p["strategy"] not in (collectives.ALLGATHER, collectives.COMPRESSED_ALLREDUCE):
        return per_row(p)
    spec = ",".join(t for t in p["spec"].split(",") if not t.startswith("collective="))
    return (p["file"], "codec " + spec)


def per_group(p):
    return (p["layout"], p["strategy"])


def eta_interval(inv, se):
    """eta and its interval from 1/eta +- 2 standard errors (no upper end where that
    interval reaches zero)."""
    lo, hi = inv - 2 * se, inv + 2 * se
    return 1 / inv, 1 / hi, (1 / lo if lo > 0 else None)


def analyse(points):
    main = fit(points, per_row, per_group, False)
    with_alpha = fit(points, per_row, per_group, True)
    pooled = fit(points, per_codec, per_group, True)
    one_eta = fit(points, per_row, lambda p: "all", False)
    a, se = pooled["alpha"]
    identified = pooled["full_rank"] and a - 2 * se > 0
    return {"main": main, "alpha_per_row_identifiable": with_alpha["full_rank"],
            "alpha": a if identified else None, "alpha_fit": (a, se), "one_eta": one_eta}


# ---- the extension --------------------------------------------------------------------------
def extend(points, fits):
    """Modelled ms/step at RANKS, one rank per link: (source file, table rows)."""
    top = max(points, key=lambda p: (p["per_node"] * p["nodes"], p["params_m"]))
    source = [p for p in points if p["file"] == top["file"]]
    main, alpha = fits["main"], fits["alpha"]
    rows = []
    for label in EXTEND:
        spec = next((s for lab, _, s in network.ROWS_2X2 if lab == label), None)
        measured = next((p for p in source if p["row"] == label and p["spec"] == spec), None)
        c = None
        if measured:  # the row's intercept holds its own latency terms where alpha is known
            c = main["c"][per_row(measured)] - (alpha * measured["m"] if alpha else 0.0)
        for n in RANKS:
            plans = tensor_plans(how_of(label), spec, top["params_m"], 1, n)
            strategy = row_strategy(plans)
            inv = main["inv_eta"].get((top["layout"], strategy))
            wire = sum(b for _, _, b, _, _ in plans)
            m = messages(plans)
            for rate in EXTEND_RATES:
                link = wire * 8 / network.RATES[rate] * inv[0] if inv else None
                total = (c + link + (alpha * m if alpha is not None else 0.0)
                         if c is not None and link is not None else None)
                rows.append({"row": label, "strategy": strategy, "ranks": n, "rate": rate,
                             "mb_per_rank": wire / 1e6, "messages": m,
                             "t_compute_ms": ms(c), "link_ms": ms(link),
                             "latency_ms": ms(alpha * m) if alpha is not None else None,
                             "model_ms": ms(total)})
    return top, rows


def ms(seconds):
    return None if seconds is None else round(seconds * 1e3, 1)


def show(x):
    return "n/a" if x is None else f"{x:.0f}"


# ---- the report -----------------------------------------------------------------------------
def report(points, fits, top, rows, out_dir, paths):
    main, one = fits["main"], fits["one_eta"]
    print("Effective bandwidth: eta = achieved / shaped rate, per layout and strategy "
          "(interval: 1/eta +- 2 standard errors)")
    lines = []
    for key, (inv, se) in main["inv_eta"].items():
        group = [i for i, p in enumerate(points) if per_group(p) == key]
        res = [abs(points[i]["t"] - main["fitted"][i]) * 1e3 for i in group]
        eta, lo, hi = eta_interval(inv, se)
        lines.append([key[0], key[1], len({per_row(points[i]) for i in group}), len(group),
                      f"{eta:.2f}", f"{lo:.2f}-" + (f"{hi:.2f}" if hi else "any"),
                      f"{np.sqrt(np.mean(np.square(res))):.0f}", f"{max(res):.0f}"])
    print(results.markdown(["layout", "strategy", "rows", "points", "eta", "interval",
                            "rms residual ms", "worst ms"], lines))
    inv, se = one["inv_eta"]["all"]
    print(f"One eta for every row instead: {1 / inv:.2f}, rms residual {one['rms'] * 1e3:.0f} ms "
          f"(per group: {main['rms'] * 1e3:.0f} ms), {main['dof']} degrees of freedom left.")

    a, se = fits["alpha_fit"]
    print("\nLatency per message, alpha:")
    if not fits["alpha_per_row_identifiable"]:
        print("- with an intercept per row: not identifiable (m is the same at every rate, so "
              "m*alpha is part of the row's constant)")
    print(f"- with an intercept per codec shared by its allgather and compressed-allreduce rows: "
          f"{a * 1e3:.2f} +- {2 * se * 1e3:.2f} ms")
    if fits["alpha"] is None:
        print("  NOT IDENTIFIED: the interval reaches zero or below. Those rows differ in compute "
              "as well as in messages. The times below leave m*alpha out: add it for your alpha.")

    rates = [r for r in network.RATES if any(p["rate"] == r for p in points)]
    by = {(per_row(p), p["rate"]): (p, main["fitted"][i]) for i, p in enumerate(points)}
    keys = list(dict.fromkeys(per_row(p) for p in points))
    print("\nMeasured / fitted ms per step, and t_compute (what the link does not explain):")
    res_lines, residuals = [], []
    for key in keys:
        cells = []
        for rate in rates:
            got = by.get((key, rate))
            cells.append(f"{got[0]['t'] * 1e3:.0f} / {got[1] * 1e3:.0f}" if got else "")
            if got:
                residuals.append({"file": key[0], "row": key[1], "rate": rate,
                                  "measured_ms": ms(got[0]["t"]), "fitted_ms": ms(got[1])})
        p = next(p for p in points if per_row(p) == key)
        res_lines.append([key[0], key[1], p["strategy"], p["m"], f"{main['c'][key] * 1e3:.0f}"]
                         + cells)
    print(results.markdown(["file", "row", "strategy", "m", "t_compute ms"] + rates, res_lines))

    latency = "+ m*alpha " if fits["alpha"] is not None else ""
    print(f"\nModel, not measurement: ms/step = t_compute (measured at "
          f"{top['per_node'] * top['nodes']} ranks, {top['params_m']:g}M parameters, "
          f"{top['file']}) + bytes per rank / (eta * rate) {latency}at "
          f"{', '.join(map(str, RANKS))} ranks, one rank per link")
    by_row = {}
    for r in rows:
        by_row.setdefault((r["row"], r["strategy"]), {})[(r["ranks"], r["rate"])] = r
    header = (["row", "strategy", "t_compute ms"]
              + [f"{rate} {n}" for rate in EXTEND_RATES for n in RANKS]
              + [f"MB/rank {n}" for n in RANKS] + [f"messages {n}" for n in RANKS])
    lines = [[label, strategy, show(cells[(RANKS[0], EXTEND_RATES[0])]["t_compute_ms"])]
             + [show(cells[(n, rate)]["model_ms"]) for rate in EXTEND_RATES for n in RANKS]
             + [f"{cells[(n, EXTEND_RATES[0])]['mb_per_rank']:.2f}" for n in RANKS]
             + [cells[(n, EXTEND_RATES[0])]["messages"] for n in RANKS]
             for (label, strategy), cells in by_row.items()]
    print(results.markdown(header, lines))

    settings = {
        "inputs": [os.path.basename(p) for p in paths],
        "model": "t = t_compute(row) + m*alpha + B/(eta_group*rate); t_compute per (file, "
                 "row), eta per (layout, strategy), B measured across the link",
        "eta": {f"{k[0]} {k[1]}": {"eta": eta_interval(*v)[0], "low": eta_interval(*v)[1],
                                  "high": eta_interval(*v)[2]}
                for k, v in main["inv_eta"].items()},
        "eta_one_for_all": 1 / one["inv_eta"]["all"][0],
        "rms_residual_ms": main["rms"] * 1e3, "rms_residual_one_eta_ms": one["rms"] * 1e3,
        "alpha_identifiable_per_row": fits["alpha_per_row_identifiable"],
        "alpha_pooled_ms": a * 1e3, "alpha_pooled_2se_ms": 2 * se * 1e3,
        "alpha_ms": None if fits["alpha"] is None else fits["alpha"] * 1e3,
        "t_compute_ms": {f"{k[0]}: {k[1]}": v * 1e3 for k, v in main["c"].items()},
        "residuals": residuals,
        "extension": {"source": top["file"], "params_m": top["params_m"], "ranks": list(RANKS),
                      "rates": list(EXTEND_RATES), "network": "one rank per link, flat"},
    }
    results.write(out_dir, "cost_model", settings, rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("inputs", nargs="*", help="bench/network.py results (JSON); default: "
                    "docs/benchmarks/network.json and network_2x2*.json")
    ap.add_argument("--out", default=results.DEFAULT_OUT)
    args = ap.parse_args()
    paths = args.inputs or default_inputs()
    points = load(paths)
    fits = analyse(points)
    top, rows = extend(points, fits)
    report(points, fits, top, rows, args.out, paths)


if __name__ == "__main__":
    main()
