"""bench/tensors.py end to end on tiny sizes: both layouts of every selected row, the table,
and the files. No timing is asserted."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_tensors_quick(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "tensors.py"),
                           "--elements-m", "0.05", "--tensors", "12", "--steps", "1",
                           "--select", "horovod,onebit,topk,powersgd", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(tmp_path / "tensors.json") as f:
        rows = json.load(f)["rows"]
    labels = ["horovod, no compression", "horovod fp16", "onebit", "topk 1%", "powersgd rank=4"]
    assert [(r["row"], r["tensors"]) for r in rows] == [(label, t) for label in labels for t in (1, 12)]
    assert all(r["ms_per_step"] > 0 and r["many_over_one"] > 0 for r in rows)
    assert "many / 1" in proc.stdout
    with open(tmp_path / "tensors.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
