"""`make demo`: a 2-rank training run per spec (uncompressed, then two codecs) and a table of
what compression saved. Ranks are launched with mpirun, as a Horovod user would."""
import json
import os
import subprocess
import sys
import tempfile

SPECS = ["none", "fp16", "topk,k=0.01,ef=vanilla", "efsignsgd"]
HERE = os.path.dirname(os.path.abspath(__file__))


def run(spec, out):
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", "-x", "PATH",
           sys.executable, os.path.join(HERE, "pytorch_synthetic_benchmark.py"),
           "--compression", spec, "--json-out", out]
    print("$", " ".join(cmd[:6]), "... --compression", spec, flush=True)
    subprocess.run(cmd, check=True, timeout=600)
    with open(out) as f:
        return json.load(f)


def main():
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, spec in enumerate(SPECS):
            rows.append(run(spec, os.path.join(tmp, f"{i}.json")))
    base = rows[0]
    print()
    print(f"2 ranks, {base['model']} model, loopback network (compression pays most on slow links)")
    print(f"{'compression':44s} {'ms/step':>8s} {'bytes sent/step':>16s} {'ratio':>7s}")
    for r in rows:
        print(f"{r['compression']:44s} {r['ms_per_step']:8.1f} {r['sent_bytes_per_step']:16,d} "
              f"{r['raw_bytes_per_step'] / max(1, r['sent_bytes_per_step']):6.1f}x")


if __name__ == "__main__":
    main()
