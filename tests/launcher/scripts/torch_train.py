"""A Horovod PyTorch training script written as Horovod's examples are (no hvd_compress import):
the launcher tests run it as it is, through `python -m hvd_compress`, through HVD_COMPRESSION,
and edited by hand to use hvd_compress's optimizer."""
import argparse
import json
import sys

import numpy as np
import torch
import torch.nn.functional as F
import horovod.torch as hvd

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=5)
parser.add_argument("--fp16-allreduce", action="store_true")
parser.add_argument("--out", required=True, help="rank 0 writes the trained weights here (JSON)")
parser.add_argument("--exit-code", type=int, default=0)
args = parser.parse_args()
print("script started", flush=True)

hvd.init()
torch.manual_seed(42)
torch.set_num_threads(1)
model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05 * hvd.size(), momentum=0.0)
compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                     compression=compression)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)

rng = np.random.default_rng(1000 + hvd.rank())
data = torch.from_numpy(rng.standard_normal((32, 64), dtype=np.float32))
target = torch.from_numpy(rng.integers(0, 10, 32))
losses = []
for step in range(args.steps):
    optimizer.zero_grad()
    loss = F.cross_entropy(model(data), target)
    loss.backward()
    optimizer.step()
    losses.append(loss.item())

if hvd.rank() == 0:
    with open(args.out, "w") as f:
        json.dump({"argv": sys.argv, "name": __name__, "losses": losses,
                   "optimizer": type(optimizer).__module__ + "." + type(optimizer).__qualname__,
                   "hvd_compress_loaded": "hvd_compress" in sys.modules,
                   "weights": {k: v.double().flatten().tolist()
                               for k, v in model.state_dict().items()}}, f)
sys.exit(args.exit_code)
