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
                           "--select", "horovod,onebit,topk,powersgd", "--bucket-mb", "0.02",
                           "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(tmp_path / "tensors.json") as f:
        rows = json.load(f)["rows"]
    labels = ["horovod, no compression", "horovod fp16", "onebit", "topk 1%", "powersgd rank=4"]
    # Horovod's rows have no buckets of ours
    want = [(label, t, b) for label in labels for t, b in ((1, 0), (12, 0), (12, 0.02))
            if not (b and label.startswith("horovod"))]
    assert [(r["row"], r["tensors"], r["bucket_mb"]) for r in rows] == want
    assert all(r["ms_per_step"] > 0 and r["many_over_one"] > 0 for r in rows)
    assert "many / 1" in proc.stdout and "bucketed / 1" in proc.stdout
    with open(tmp_path / "tensors.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_models_have_the_tensors_of_the_real_ones():
    """ResNet-50 as torchvision has it (161 tensors, 25,557,032 parameters, same names in the
    same order at the ends); the encoder is BERT-base-sized. Each runs forward and backward."""
    import torch
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import models
    resnet = models.resnet50()
    names = [n for n, _ in resnet.named_parameters()]
    assert len(names) == 161 and sum(p.numel() for p in resnet.parameters()) == 25_557_032
    assert names[:4] == ["conv1.weight", "bn1.weight", "bn1.bias", "layer1.0.conv1.weight"]
    assert "layer1.0.downsample.0.weight" in names and names[-2:] == ["fc.weight", "fc.bias"]
    resnet(torch.randn(2, 3, 32, 32)).sum().backward()
    bert = models.bert_encoder()
    assert len(list(bert.parameters())) == 150
    assert 105e6 < sum(p.numel() for p in bert.parameters()) < 112e6
    bert(torch.randint(0, 30522, (2, 8))).sum().backward()
    assert all(p.grad is not None for p in bert.parameters())


def test_tensors_on_a_models_gradients(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "tensors.py"),
                           "--model", "resnet50", "--steps", "1", "--select", "horovod,onebit",
                           "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(tmp_path / "tensors_resnet50.json") as f:
        data = json.load(f)
    assert data["settings"]["elements"] == 25_557_032
    assert sorted({r["tensors"] for r in data["rows"]}) == [1, 161]


def test_tensors_granularity_reaches_the_bucketed_rows(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "tensors.py"),
                           "--elements-m", "0.05", "--tensors", "12", "--steps", "1",
                           "--select", "fp16,onebit", "--bucket-mb", "0.02", "--granularity",
                           "tensor", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(tmp_path / "tensors_granularity_tensor.json") as f:
        rows = json.load(f)["rows"]
    ran = {(r["row"], r["bucket_mb"]): r["ran"] for r in rows if r["how"] == "ours"}
    assert ran[("onebit", 0.02)] == "onebit,ef=vanilla,granularity=tensor"
    assert ran[("onebit", 0)] == "onebit,ef=vanilla"  # without buckets: nothing to choose
    assert ran[("fp16", 0.02)] == "fp16"  # a linear codec: the same either way
