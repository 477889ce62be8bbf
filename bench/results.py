"""Where the benchmark scripts put their results: NAME.json (everything, with the settings),
NAME.csv (the rows) and NAME.png, under one output folder (docs/benchmarks by default)."""
import argparse
import csv
import json
import os

DEFAULT_OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                           "benchmarks")


def write(out_dir, name, settings, rows, json_only=()):
    """rows: a list of flat dicts. The CSV's columns are the first row's keys but json_only
    (lists: each step's times), which a later row may add."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump({"settings": settings, "rows": rows}, f, indent=1)
    with open(os.path.join(out_dir, f"{name}.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[k for k in rows[0] if k not in json_only],
                           extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)


def pyplot():
    """matplotlib without a display."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def markdown(header, lines):
    """A table that reads in a terminal and pastes into Markdown."""
    cells = [list(header)] + [[str(c) for c in line] for line in lines]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    fmt = lambda row: "| " + " | ".join(c.rjust(w) for c, w in zip(row, widths)) + " |"  # noqa
    return "\n".join([fmt(cells[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
                     + [fmt(r) for r in cells[1:]])


def worker_arguments(ap, *hidden):
    """The arguments a driver passes to the ranks it launches (its own script with --worker):
    kept out of --help."""
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for name in hidden:
        ap.add_argument(name, help=argparse.SUPPRESS)


def with_setting(spec, key, value):
    """`spec` with `key=value` added, or None where the spec refuses it (the codec cannot
    travel that way, or the setting means nothing to it)."""
    import hvd_compress
    try:
        hvd_compress.parse_spec(f"{spec},{key}={value}")
    except ValueError:
        return None
    return f"{spec},{key}={value}"
