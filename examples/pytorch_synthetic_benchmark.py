"""Horovod's synthetic benchmark with one extra argument, --compression SPEC.

    mpirun -np 2 python examples/pytorch_synthetic_benchmark.py --compression topk,k=0.01,ef=vanilla
    horovodrun --gloo -np 2 -H localhost:2 python examples/pytorch_synthetic_benchmark.py ...

Models are built in (torchvision is not part of the pinned stack): `mlp` is communication-heavy
(large dense layers, ~12M parameters), `convnet` a small CNN.
"""
import argparse
import json
import time

import horovod.torch as hvd
import numpy as np
import torch
import torch.nn.functional as F

import hvd_compress.torch as hvdc

parser = argparse.ArgumentParser(description="PyTorch synthetic benchmark with compression")
parser.add_argument("--model", default="mlp", choices=["mlp", "convnet"])
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--num-warmup-batches", type=int, default=3)
parser.add_argument("--num-batches-per-iter", type=int, default=5)
parser.add_argument("--num-iters", type=int, default=5)
parser.add_argument("--compression", default="none",
                    help="codec spec, e.g. 'fp16' or 'topk,k=0.01,ef=vanilla'")
parser.add_argument("--min-compress-bytes", type=int, default=65536)
parser.add_argument("--json-out", default=None, help="rank 0 writes its results here")
args = parser.parse_args()

hvd.init()
torch.manual_seed(42)
torch.set_num_threads(1)


def build(name):
    if name == "mlp":
        return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 2048),
                                   torch.nn.ReLU(), torch.nn.Linear(2048, 2048), torch.nn.ReLU(),
                                   torch.nn.Linear(2048, 1024), torch.nn.ReLU(),
                                   torch.nn.Linear(1024, 10))
    return torch.nn.Sequential(torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.ReLU(),
                               torch.nn.MaxPool2d(2), torch.nn.Conv2d(32, 64, 3, padding=1),
                               torch.nn.ReLU(), torch.nn.MaxPool2d(2), torch.nn.Flatten(),
                               torch.nn.Linear(64 * 8 * 8, 512), torch.nn.ReLU(),
                               torch.nn.Linear(512, 10))


model = build(args.model)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
optimizer = hvdc.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                      compression=args.compression,
                                      min_compress_bytes=args.min_compress_bytes)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)

data = torch.randn(args.batch_size, 3, 32, 32)
target = torch.randint(0, 10, (args.batch_size,))


def benchmark_step():
    optimizer.zero_grad()
    loss = F.cross_entropy(model(data), target)
    loss.backward()
    optimizer.step()
    return loss.item()


def log(s):
    if hvd.rank() == 0:
        print(s, flush=True)


n_params = sum(p.numel() for p in model.parameters())
log(f"Model: {args.model} ({n_params / 1e6:.1f}M parameters), batch {args.batch_size}, "
    f"ranks {hvd.size()}, compression {optimizer.compression_config}")
for _ in range(args.num_warmup_batches):
    benchmark_step()

step_ms = []
for i in range(args.num_iters):
    t0 = time.perf_counter()
    for _ in range(args.num_batches_per_iter):
        loss = benchmark_step()
    dt = time.perf_counter() - t0
    step_ms.append(1000 * dt / args.num_batches_per_iter)
    log(f"Iter #{i}: {args.batch_size * args.num_batches_per_iter / dt:.1f} img/sec per rank, "
        f"loss {loss:.4f}")

stats = optimizer.compression_stats
result = {"compression": str(optimizer.compression_config), "model": args.model,
          "ranks": hvd.size(), "ms_per_step": float(np.median(step_ms)),
          "raw_bytes_per_step": stats.last_step_raw, "sent_bytes_per_step": stats.last_step_sent,
          "ratio": stats.last_step_raw / max(1, stats.last_step_sent)}
log(f"Median {result['ms_per_step']:.1f} ms/step; gradient bytes per step {stats.last_step_raw:,}, "
    f"sent {stats.last_step_sent:,} ({result['ratio']:.1f}x less)")
if hvd.rank() == 0 and args.json_out:
    with open(args.json_out, "w") as f:
        json.dump(result, f)
