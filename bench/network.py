"""Compression on a real slow link: two ranks in two network namespaces joined by a veth pair
that tc shapes to 100 Mbit/s, 1 Gbit/s and 10 Gbit/s, training a communication-heavy MLP.

    sudo python bench/network.py            # 25M parameters, 3 timed steps per row and rate
    sudo python bench/network.py --quick    # 6M parameters, 2 timed steps: about two minutes
    sudo python bench/network.py --layout 2x2   # 4 ranks: two "nodes" of two ranks each
    sudo python bench/network.py --model resnet50 --bucket-mb 4   # models.py's ResNet-50
    sudo python bench/network.py --model keras-resnet50 --bucket-mb 4   # the TF/Keras frontend
    sudo python bench/network.py --rounds 3   # every row three times, in alternating order
    sudo python bench/network.py --cycle-time-ms 5   # Horovod's cycle time, for every Horovod row
    sudo python bench/network.py --paired     # each of our rows' steps beside the baseline's

With --layout 2x2 each namespace is a node running two ranks (Horovod's local and cross ranks
set as horovodrun would on two hosts): ranks of one node talk over its loopback, unshaped, and
only traffic between the nodes crosses the shaped veth. Its rows compare Horovod with the
codecs over allgather, the compressed allreduce and the two-level strategy (hierarchical=true);
bytes per step are then those node 0 sent across the link.

Rows: uncompressed Horovod (the baseline), Horovod's own fp16, PyTorch DDP over Gloo with its
fp16_compress_hook and powerSGD_hook (the same rank as our powersgd row), and our codecs through
hvd_compress.torch.DistributedOptimizer. With --model keras-resnet50 the same rows train
Keras' ResNet-50 through horovod.tensorflow.keras and hvd_compress.tensorflow.keras instead,
without the DDP rows (they are torch's). Columns per rate: median ms/step of rank 0, speedup over
uncompressed Horovod at that rate, the CPU time rank 0's process spent per timed step (all its
threads; its main thread's in parentheses: when both ranks share the machine's cores, a row
whose CPU time is about its step time lost on the CPU, not on the link), and bytes rank 0 sent
per step as counted by its veth (/proc/net/dev: payload plus TCP/IP headers). With --rounds N
the table runs N times, the rows in reverse order every other time, so that a machine drifting during the run weighs on every
row alike; a row then shows its median ms/step, the median of the speedups each round measured
against its own baseline, and the lowest and highest of them. Within a round the baseline runs
first, after every BASE_EVERY rows and last, and each Horovod row's speedup is against the mean
of the baseline's runs on either side of it: on a shared VM the baseline alone moved by 15%
between rounds, and one run of it set every speedup of its round. DDP's rows, a job of their
own, are measured against the median of the round's baseline runs. With --paired, each of our
rows trains a second copy of the model through uncompressed Horovod in the same job, a step of
one then a step of the other (which goes first alternates; in Keras' warm-up the baseline's,
as keras_worker says why; an even --steps puts each first equally often), and its speedup is
against the median of those baseline steps: on a
VM whose speed moved by 10-30% from one minute to the next, two runs of a minute apart differed
by more than compression gains at 10 Gbit/s. --paired also adds the row SELF_PAIR: uncompressed
Horovod paired the same way with a copy of itself, whose speedup is what the harness measures
for identical work. Horovod runs over Gloo (no MPI launcher can cross
the namespaces); the ranks get the same rendezvous that horovodrun would give them.

Needs root (namespaces, tc). The namespaces are deleted on exit, on failure and on Ctrl-C, and
ones left by a run that was killed outright are removed by the next run.
"""
import argparse
import gc
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import results  # noqa: E402
from hvd_compress import autotune  # noqa: E402

RATES = {"100mbit": 100e6, "1gbit": 1e9, "10gbit": 10e9}
NS_PREFIX = "hvdc-bench-"
SUBNET = "10.231.77"
DDP_PORT = 29531
POWERSGD_RANK = 4
# (label, how, spec): how = horovod (its own DistributedOptimizer), ours, or ddp (hook name).
ROWS = [("horovod, no compression", "horovod", "none"),
        ("horovod fp16", "horovod", "fp16"),
        ("ddp fp16_compress_hook", "ddp", "fp16"),
        (f"ddp powerSGD_hook rank={POWERSGD_RANK}", "ddp", "powersgd"),
        ("fp16", "ours", "fp16"),
        ("bf16", "ours", "bf16"),
        ("onebit", "ours", "onebit,ef=vanilla"),
        ("efsignsgd", "ours", "efsignsgd"),
        ("topk 1%", "ours", "topk,k=0.01,ef=vanilla"),
        ("randomk 1%", "ours", "randomk,k=0.01"),
        ("minmax8", "ours", "minmax8"),
        ("dithering", "ours", "dithering,ef=vanilla"),
        ("qsgd", "ours", "qsgd"),
        ("terngrad", "ours", "terngrad"),
        ("natural", "ours", "natural"),
        ("threshold (~1% at step 0)", "ours", "threshold,ef=vanilla"),
        ("dgc 0.1%", "ours", "dgc,k=0.001"),
        (f"powersgd rank={POWERSGD_RANK}", "ours", f"powersgd,rank={POWERSGD_RANK},start_iter=2")]
# Two nodes of two ranks: where the bytes between nodes come from.
ROWS_2X2 = [("horovod, no compression", "horovod", "none"),
            ("horovod fp16", "horovod", "fp16")] + [
    (f"{label} {how}", "ours", f"{spec},{suffix}")
    for label, spec in (("onebit", "onebit,ef=vanilla"), ("minmax8", "minmax8"),
                        ("topk 1%", "topk,k=0.01,ef=vanilla"), ("efsignsgd", "efsignsgd"),
                        ("dithering", "dithering,ef=vanilla"))
    for how, suffix in (("allgather", "collective=allgather"),
                        ("compressed allreduce", "collective=allreduce"),
                        ("two-level", "hierarchical=true"),
                        ("two-level fp16", "hierarchical=fp16"))]
LAYOUTS = {"1x2": (1, ROWS), "2x2": (2, ROWS_2X2)}  # ranks per node, rows
BASE_EVERY = 4  # rows between two runs of the baseline in a round
# With --paired, uncompressed Horovod beside a copy of itself: the spread that identical work
# shows in the paired harness, against which our rows' speedups near 1.0x can be read.
SELF_PAIR = "horovod beside a copy of itself"


# ---- the namespaces -------------------------------------------------------------------------
def sh(*cmd, check=True):
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


class LinkPair:
    """Namespaces A and B, a veth pair between them (A: SUBNET.1, B: SUBNET.2)."""

    def __init__(self):
        tag = str(os.getpid())
        self.ns = [f"{NS_PREFIX}{tag}-a", f"{NS_PREFIX}{tag}-b"]
        self.dev = [f"hvb{tag}a"[-15:], f"hvb{tag}b"[-15:]]
        self.addr = [f"{SUBNET}.1", f"{SUBNET}.2"]

    def __enter__(self):
        remove_stale()
        try:
            for ns in self.ns:
                sh("ip", "netns", "add", ns)
            sh("ip", "link", "add", self.dev[0], "type", "veth", "peer", "name", self.dev[1])
            for ns, dev, addr in zip(self.ns, self.dev, self.addr):
                sh("ip", "link", "set", dev, "netns", ns)
                sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                sh("ip", "-n", ns, "link", "set", dev, "up")
                sh("ip", "-n", ns, "link", "set", "lo", "up")
                # Horovod 0.28.1 opens its per-process-set Gloo context on the address of this
                # machine's hostname, not on HOROVOD_GLOO_IFACE: `ip netns exec` mounts this
                # file over /etc/hosts, so inside each namespace the hostname is its veth.
                os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
                with open(f"/etc/netns/{ns}/hosts", "w") as f:
                    f.write(f"127.0.0.1 localhost\n{addr} {socket.gethostname()}\n")
        except BaseException:
            self.__exit__()
            raise
        return self

    def shape(self, rate_bps):
        # tbf needs a bucket of at least rate/HZ; 4 ms of traffic, never under 256 kbit.
        burst = max(32 * 1024, int(rate_bps / 8 * 0.004))
        for ns, dev in zip(self.ns, self.dev):
            sh("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
               "rate", f"{int(rate_bps)}bit", "burst", str(burst), "latency", "50ms")

    def __exit__(self, *exc):
        for ns in self.ns:
            delete_namespace(ns)


def delete_namespace(ns):
    sh("ip", "netns", "del", ns, check=False)  # takes its end of the veth pair with it
    shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)


def remove_stale():
    """Namespaces of runs whose process is gone (killed before their cleanup could run)."""
    listing = sh("ip", "netns", "list", check=False).stdout.split()
    for name in listing:
        if name.startswith(NS_PREFIX):
            pid = name[len(NS_PREFIX):].split("-")[0]
            if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                delete_namespace(name)


def refuse_unless_able():
    if os.geteuid() != 0:
        sys.exit("bench/network.py needs root: it creates two network namespaces and shapes the "
                 "veth pair between them with tc. Run it as root (e.g. `sudo make bench`).")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            sys.exit(f"bench/network.py needs `{tool}` (Debian package iproute2)")
    probe = f"{NS_PREFIX}probe-{os.getpid()}"
    made = sh("ip", "netns", "add", probe, check=False)
    sh("ip", "netns", "del", probe, check=False)
    if made.returncode != 0:
        sys.exit("bench/network.py cannot create network namespaces here (`ip netns add`: "
                 f"{made.stderr.strip()}); it needs CAP_SYS_ADMIN and CAP_NET_ADMIN")


# ---- launching ranks ------------------------------------------------------------------------
def launch(link, node, env, args):
    cmd = ["ip", "netns", "exec", link.ns[node], sys.executable, os.path.abspath(__file__)] + args
    return subprocess.Popen(cmd, env={**os.environ, **env}, stdin=subprocess.DEVNULL)


def run_pair(procs, timeout):
    try:
        deadline = time.monotonic() + timeout
        for p in procs:
            p.wait(timeout=max(1, deadline - time.monotonic()))
        bad = [p.returncode for p in procs if p.returncode != 0]
        if bad:
            raise RuntimeError(f"a rank exited with status {bad[0]}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def run_horovod(link, rows, opts, out, timeout, per_node=1):
    """One Horovod job per rate runs every Horovod and hvd_compress row, with per_node ranks in
    each of the two namespaces."""
    rdv = subprocess.Popen(["ip", "netns", "exec", link.ns[0], sys.executable,
                            os.path.abspath(__file__), "--rendezvous", "--per-node",
                            str(per_node)],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = rdv.stdout.readline().strip()
        if not port.isdigit():
            raise RuntimeError("the rendezvous server did not start")
        procs = []
        size = 2 * per_node
        for r in range(size):
            node, local = divmod(r, per_node)
            env = {"HOROVOD_GLOO_RENDEZVOUS_ADDR": link.addr[0],
                   "HOROVOD_GLOO_RENDEZVOUS_PORT": port, "HOROVOD_CONTROLLER": "gloo",
                   "HOROVOD_CPU_OPERATIONS": "gloo", "HOROVOD_GLOO_IFACE": link.dev[node],
                   "HOROVOD_HOSTNAME": f"hvdc-{node}", "HOROVOD_RANK": str(r),
                   "HOROVOD_SIZE": str(size), "HOROVOD_LOCAL_RANK": str(local),
                   "HOROVOD_LOCAL_SIZE": str(per_node), "HOROVOD_CROSS_RANK": str(node),
                   "HOROVOD_CROSS_SIZE": "2",
                   # the two-level rows register their node process sets at run time
                   "HOROVOD_DYNAMIC_PROCESS_SETS": "1"}
            procs.append(launch(link, node, env, ["--worker", "horovod", "--iface",
                                                  link.dev[node], "--rows", json.dumps(rows),
                                                  "--opts", json.dumps(opts), "--result", out]))
        run_pair(procs, timeout)
    finally:
        rdv.stdin.close()
        try:
            rdv.wait(timeout=30)
        except subprocess.TimeoutExpired:
            rdv.kill()
            rdv.wait()


def run_ddp(link, rows, opts, out, timeout):
    procs = [launch(link, r, {"GLOO_SOCKET_IFNAME": link.dev[r]},
                    ["--worker", "ddp", "--iface", link.dev[r], "--rank", str(r),
                     "--master", link.addr[0], "--rows", json.dumps(rows), "--opts",
                     json.dumps(opts), "--result", out]) for r in range(2)]
    run_pair(procs, timeout)


def rendezvous_server(per_node):
    from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
    from horovod.runner.http.http_server import RendezvousServer
    server = RendezvousServer()
    port = server.start()
    server.init(get_host_assignments(parse_hosts(f"hvdc-0:{per_node},hvdc-1:{per_node}"),
                                     2 * per_node))
    print(port, flush=True)
    sys.stdin.read()  # until the parent closes our stdin
    server.stop()


# ---- inside a rank --------------------------------------------------------------------------
def tx_bytes(iface):
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == iface:
                return int(rest.split()[8])
    raise RuntimeError(f"no interface {iface} in /proc/net/dev")


# Models a user trains (bench/models.py), with inputs small enough for a CPU step: the
# gradients, which are what crosses the link, do not depend on the image or sequence size.
MODELS = {"mlp": "MLP of --params-m million parameters, mostly two large dense layers",
          "resnet50": "ResNet-50 (torchvision's 161 tensors, 25.6M parameters), 3x32x32 images",
          "transformer": "BERT-base-sized encoder (150 tensors, 108.9M parameters), 16 tokens",
          "keras-resnet50": "tf.keras.applications.ResNet50 (214 trainable tensors, 25.6M "
                            "parameters), 32x32x3 images, through the TensorFlow frontend"}
KERAS_MODELS = ("keras-resnet50",)


def make_model(opts, seed):
    """The model and this rank's batch (inputs, labels), the same for every row and worker."""
    import torch
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(1 + seed + opts["rank"])
    batch = opts["batch"]
    if opts["model"] == "resnet50":
        import models
        return models.resnet50(), (torch.randn(batch, 3, 32, 32, generator=g),
                                   torch.randint(0, 1000, (batch,), generator=g))
    if opts["model"] == "transformer":
        import models
        return models.bert_encoder(), (torch.randint(0, 30522, (batch, 16), generator=g),
                                       torch.randint(0, 2, (batch,), generator=g))
    width = int((opts["params_m"] * 1e6 / 2.5) ** 0.5) // 64 * 64  # width/2 -> width x2 -> 10
    model = torch.nn.Sequential(torch.nn.Linear(width // 2, width), torch.nn.ReLU(),
                                torch.nn.Linear(width, width), torch.nn.ReLU(),
                                torch.nn.Linear(width, width), torch.nn.ReLU(),
                                torch.nn.Linear(width, 10))
    return model, (torch.randn(batch, width // 2, generator=g),
                   torch.randint(0, 10, (batch,), generator=g))


def torch_step(model, opt, batch):
    import torch.nn.functional as F
    x, y = batch

    def step():
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return step


def time_steps(step, opts, iface, sync, base=None, alternate_warmup=True):
    """The median step time, the bytes sent per step, and the CPU the process (every thread:
    the framework's, Horovod's or DDP's, ours) and its main thread spent per step. Ranks that
    share a machine's cores show here whether a row lost on the wire or on the CPU. With `base`
    (the baseline's step: --paired), time_paired."""
    if base is not None:
        return time_paired(step, base, opts, iface, sync, alternate_warmup)
    times = []
    for i in range(opts["warmup"] + opts["steps"]):
        if i == opts["warmup"]:
            sync()
            sent = tx_bytes(iface)
            cpu, main = time.process_time(), time.thread_time()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    cpu, main = time.process_time() - cpu, time.thread_time() - main
    sync()
    sent = tx_bytes(iface) - sent
    timed = times[opts["warmup"]:]
    return {"ms_per_step": 1e3 * statistics.median(timed),
            "bytes_per_step": sent // opts["steps"],
            "cpu_ms_per_step": 1e3 * cpu / opts["steps"],
            "main_cpu_ms_per_step": 1e3 * main / opts["steps"]}


def time_paired(step, base, opts, iface, sync, alternate_warmup=True):
    """time_steps with a step of `base` beside each of `step`'s, the first of the two
    alternating (alternate_warmup=False: `base` first in every warm-up step). The timed steps
    always alternate: Keras' ResNet-50 through Horovod's optimizer, paired with itself at 10
    Gbit/s, took 4-5% longer a step second than first (308 vs 295 ms, 327 vs 310), and a row
    always second lost that much. CPU is `step`'s alone, read around each of its steps;
    paired_base_ms is the median of the baseline's steps. Bytes are read around the timed steps
    that `step` takes first in their pair, each of which follows one of its own: a step returns
    with the tail of what it sent still queued at the veth, and behind a baseline step that
    tail is the baseline's (a 0.3M-parameter MLP's `step` at 1 Gbit/s read 290,420 bytes a step
    of which 44,000-63,000 were its own). A step of `step` cannot return before the other ranks have
    finished the baseline step before it, so by then the baseline's tail has left; its own tail
    it leaves to the window after it, as it took in the one before."""
    times, base_times = [], []
    sent = cpu = main = counted = 0
    for i in range(opts["warmup"] + opts["steps"]):
        if i == opts["warmup"]:
            sync()
        timed = i >= opts["warmup"]
        base_first = i % 2 or (i < opts["warmup"] and not alternate_warmup)
        for which in ((base, step) if base_first else (step, base)):
            ours, read = which is step and timed, which is step and timed and not base_first
            if ours:
                cpu, main = cpu - time.process_time(), main - time.thread_time()
            if read:
                sent -= tx_bytes(iface)
            t0 = time.perf_counter()
            which()
            (times if which is step else base_times).append(time.perf_counter() - t0)
            if read:
                sent, counted = sent + tx_bytes(iface), counted + 1
            if ours:
                cpu, main = cpu + time.process_time(), main + time.thread_time()
    sync()
    return {"ms_per_step": 1e3 * statistics.median(times[opts["warmup"]:]),
            "bytes_per_step": sent // counted,
            "cpu_ms_per_step": 1e3 * cpu / opts["steps"],
            "main_cpu_ms_per_step": 1e3 * main / opts["steps"],
            "paired_base_ms": 1e3 * statistics.median(base_times[opts["warmup"]:]),
            "steps_ms": [1e3 * t for t in times[opts["warmup"]:]],
            "base_steps_ms": [1e3 * t for t in base_times[opts["warmup"]:]]}


def horovod_worker(args):
    import warnings

    import horovod.torch as hvd
    import torch
    import torch.nn.functional as F

    import hvd_compress.torch as hvdc
    warnings.simplefilter("ignore")  # dgc's note that it replaces the optimizer's momentum
    torch.set_num_threads(1)
    hvd.init()
    opts = json.loads(args.opts)
    rows = json.loads(args.rows)
    out = []
    for label, how, spec in rows:
        model, batch = make_model({**opts, "rank": hvd.rank()}, seed=0)
        sgd = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        if spec.startswith("threshold"):
            model.zero_grad()
            F.cross_entropy(model(batch[0]), batch[1]).backward()
            g = torch.cat([p.grad.abs().flatten() for p in model.parameters()])
            model.zero_grad()
            spec += f",threshold={step0_quantile(g.numpy(), torch.tensor, hvd):.4g}"
        if how == "horovod":
            comp = hvd.Compression.fp16 if spec == "fp16" else hvd.Compression.none
            opt = hvd.DistributedOptimizer(sgd, model.named_parameters(), compression=comp)
        else:
            opt = hvdc.DistributedOptimizer(sgd, model.named_parameters(), compression=spec,
                                            bucket_mb=opts["bucket_mb"])
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        base = base_model = base_opt = None
        if opts.get("paired") and (how == "ours" or label == SELF_PAIR):
            base_model, base_batch = make_model({**opts, "rank": hvd.rank()}, seed=0)
            base_opt = hvd.DistributedOptimizer(
                torch.optim.SGD(base_model.parameters(), lr=0.01, momentum=0.9),
                base_model.named_parameters())
            hvd.broadcast_parameters(base_model.state_dict(), root_rank=0)
            base = torch_step(base_model, base_opt, base_batch)
        r = time_steps(torch_step(model, opt, batch), opts, args.iface,
                       lambda: hvd.allreduce(torch.zeros(1), name="sync"), base)
        if how == "ours" and opts.get("autotune"):
            r["autotune"] = opt.compression_report()["autotune"]
        out.append(shown(hvd.rank(), label, spec, r))
        # Horovod's hooks tie the parameters and the optimizer in a cycle: without a collection
        # each row's model, gradients and state stay (the 109M-parameter encoder was killed for
        # memory at the sixth row).
        del model, sgd, opt, base, base_model, base_opt
        gc.collect()
    if hvd.rank() == 0:
        with open(args.result, "w") as f:
            json.dump(out, f)


def step0_quantile(g, tensor, hvd):
    """|g| above which about 1% of step 0's gradient g (|g| of every parameter, flat, in numpy)
    lies, averaged over ranks: what a user tuning `threshold` for a 1% density would pick.
    tensor and hvd: the frontend's tensor constructor and Horovod module."""
    import numpy as np
    k = int(0.99 * g[::7].size)
    q = np.partition(g[::7], k - 1)[k - 1:k]  # the k-th smallest
    return float(hvd.allreduce(tensor(q), name="threshold_q")[0])


def shown(rank, label, spec, r):
    """The row's result, printed by rank 0 as it comes."""
    if rank == 0:
        print(f"  {label:32s} {r['ms_per_step']:10.1f} ms/step {r['bytes_per_step']:14,d} B/step"
              f" {r['cpu_ms_per_step']:8.0f} CPU ms/step", flush=True)
    return {"row": label, "spec": spec, **r}


def keras_worker(args):
    """horovod_worker's rows on a Keras model: Horovod's and our Keras DistributedOptimizer."""
    import warnings
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"  # read when TensorFlow loads

    import horovod.tensorflow as hvd
    import horovod.tensorflow.keras as hvd_keras
    import tensorflow as tf

    import hvd_compress.tensorflow.keras as hvdk
    warnings.simplefilter("ignore")  # as horovod_worker's
    tf.get_logger().setLevel("ERROR")
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    hvd.init()
    opts = json.loads(args.opts)
    out = []
    for label, how, spec in json.loads(args.rows):
        model, loss = keras_model(tf, hvd, opts)
        if spec.startswith("threshold"):
            with tf.GradientTape() as tape:
                value = loss()
            g = tf.concat([tf.reshape(tf.abs(d), [-1])
                           for d in tape.gradient(value, model.trainable_variables)], 0)
            spec += f",threshold={step0_quantile(g.numpy(), tf.constant, hvd):.4g}"
        sgd = tf.keras.optimizers.SGD(0.01, momentum=0.9)
        if how == "horovod":
            comp = hvd.Compression.fp16 if spec == "fp16" else hvd.Compression.none
            opt = hvd_keras.DistributedOptimizer(sgd, compression=comp)
        else:
            opt = hvdk.DistributedOptimizer(sgd, compression=spec, bucket_mb=opts["bucket_mb"])
        base = None
        if opts.get("paired") and (how == "ours" or label == SELF_PAIR):
            base_model, base_loss = keras_model(tf, hvd, opts)
            base = keras_step(tf, base_model, base_loss, hvd_keras.DistributedOptimizer(
                tf.keras.optimizers.SGD(0.01, momentum=0.9)))
        step = keras_step(tf, model, loss, opt)
        # The first warm-up step traces each function. The baseline's step goes first in
        # every warm-up step, where the probe runs: a traced step's autotune probe times it
        # from the end of our previous step (tensorflow/autotune.py), and in turns every other
        # window held two baseline steps, in step with the probe's arms: uncompressed windows
        # measured 840-1110 ms a rank, compressed ones 300-480, and every row kept compression.
        r = time_steps(step, opts, args.iface, lambda: hvd.allreduce(tf.zeros(1), name="sync"),
                       base, alternate_warmup=False)
        if how == "ours" and opts.get("autotune"):
            r["autotune"] = opt._hvdc_reducer.compression_report()["autotune"]
        out.append(shown(hvd.rank(), label, spec, r))
        del model, loss, sgd, opt, step, base
        tf.keras.backend.clear_session()
        gc.collect()
    if hvd.rank() == 0:
        with open(args.result, "w") as f:
            json.dump(out, f)


def keras_model(tf, hvd, opts):
    """Keras' ResNet-50 with every rank's starting weights, and the loss of this rank's batch."""
    tf.keras.utils.set_random_seed(0)
    model = tf.keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3), classes=1000)
    gen = tf.random.Generator.from_seed(1 + hvd.rank())
    x = gen.normal([opts["batch"], 32, 32, 3])
    y = gen.uniform([opts["batch"]], 0, 1000, dtype=tf.int64)
    hvd.broadcast_variables(model.variables, root_rank=0)

    def loss():
        return tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(
            y, model(x, training=True)))
    return model, loss


def keras_step(tf, model, loss, opt):
    """One training step, a tf.function for each trace our optimizer asks for
    (compression_next_trace), as AutotuneCallback keeps them for fit."""
    def traced():
        @tf.function
        def step():
            with tf.GradientTape() as tape:
                value = loss()
            opt.apply_gradients(opt.compute_gradients(value, model.trainable_variables,
                                                      tape=tape))
        return step
    functions = {}

    def step():
        trace = opt.compression_next_trace() if hasattr(opt, "compression_next_trace") else None
        if trace not in functions:
            functions[trace] = traced()
        functions[trace]()
    return step


def ddp_worker(args):
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{args.master}:{DDP_PORT}",
                            rank=args.rank, world_size=2)
    opts = json.loads(args.opts)
    out = []
    for label, _, spec in json.loads(args.rows):
        model, batch = make_model({**opts, "rank": args.rank}, seed=0)
        if spec == "fp16":
            ddp = torch.nn.parallel.DistributedDataParallel(model)
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        else:
            # The hook issues its second allreduce from a future's callback; with several
            # buckets those interleave differently on the two ranks and Gloo aborts on a size
            # mismatch (seen with torch 2.13), so PowerSGD gets one bucket for all gradients.
            ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1024)
            state = powerSGD_hook.PowerSGDState(process_group=None,
                                                matrix_approximation_rank=POWERSGD_RANK,
                                                start_powerSGD_iter=2)
            ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        sgd = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
        r = time_steps(torch_step(ddp, sgd, batch), opts, args.iface, dist.barrier)
        out.append(shown(args.rank, label, spec, r))
    if args.rank == 0:
        with open(args.result, "w") as f:
            json.dump(out, f)
    # A rank sometimes aborted here after its work was done ("terminate called without an
    # active exception", torch 2.13, twice in some twenty runs on a shaped link). Likely causes:
    # the peer tearing Gloo down while a hook's allreduce is still in flight, or torch's C++
    # destructors at interpreter exit. So both ranks meet first, then leave without finalization.
    del ddp, sgd, model
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ---- the report -----------------------------------------------------------------------------
def bracketed(rows):
    """The Horovod rows of a round in the order they ran, with the baseline (rows[0]) first,
    after every BASE_EVERY of the others and last."""
    base, rest = rows[0], rows[1:]
    out = [base]
    for i in range(0, len(rest), BASE_EVERY):
        out += rest[i:i + BASE_EVERY] + [base]
    return out


def against_bracket(results, base):
    """results (one round's, in the order they ran) with each row's base_ms: the mean of the
    baseline's runs just before and just after it (the baseline's own runs: themselves)."""
    at = [i for i, r in enumerate(results) if r["row"] == base]
    for i, r in enumerate(results):
        near = [results[j]["ms_per_step"] for j in (max((j for j in at if j <= i), default=None),
                                                    min((j for j in at if j >= i), default=None))
                if j is not None]
        r["base_ms"] = r.get("paired_base_ms", statistics.fmean(near))
    return results


def collapse(rows, base):
    """One row per rate and row over the rounds: the median ms/step and bytes/step, and the
    median, lowest and highest of the speedups each round measured against its base_ms (the
    baseline's runs around it)."""
    runs: dict[tuple, list] = {}
    tuned = any("autotune" in r for r in rows)
    for r in rows:  # in the first round's order
        runs.setdefault((r["rate"], r["row"]), []).append(r)
    out = []
    for (rate, label), rs in runs.items():
        speedups = [r["base_ms"] / r["ms_per_step"] for r in rs]
        out.append({"rate": rate, "row": label, "spec": rs[0]["spec"],
                    "ms_per_step": statistics.median(r["ms_per_step"] for r in rs),
                    "bytes_per_step": int(statistics.median(r["bytes_per_step"] for r in rs)),
                    **{k: statistics.median(r[k] for r in rs)
                       for k in ("cpu_ms_per_step", "main_cpu_ms_per_step")},
                    "speedup": statistics.median(speedups), "speedup_low": min(speedups),
                    "speedup_high": max(speedups), "rounds": len({r["round"] for r in rs})})
        if tuned:  # the arm each round's probe kept, and its medians; None: not ours
            out[-1]["autotune"] = [r["autotune"] for r in rs] if "autotune" in rs[0] else None
            out[-1]["autotune_kept"] = ([a["compress"] for a in out[-1]["autotune"]]
                                        if out[-1]["autotune"] else None)
        # the baseline beside it (--paired), which its speedups are against; else None
        out[-1]["paired_base_ms"] = (statistics.median(r["paired_base_ms"] for r in rs)
                                     if "paired_base_ms" in rs[0] else None)
        if "steps_ms" in rs[0]:  # each round's timed steps, ours and the baseline's beside it
            out[-1]["steps_ms"] = [r["steps_ms"] for r in rs]
            out[-1]["base_steps_ms"] = [r["base_steps_ms"] for r in rs]
    return out


def kept(r):
    """Which arm autotune kept for the row, in each round ("-": not ours)."""
    arms = r.get("autotune_kept")
    return "/".join("compressed" if a else "uncompressed" for a in arms) if arms else "-"


def report(rows, rates, settings, out_dir, table=ROWS, name="network"):
    by = {(r["rate"], r["row"]): r for r in rows}
    labels = [label for label, _, _ in table if any(r["row"] == label for r in rows)]
    spread = settings.get("rounds", 1) > 1
    tuned = bool(settings.get("autotune"))
    cols = ("ms/step", "speedup") + (("speedup range",) if spread else ()) + (
        "cpu ms/step (main thread)", "bytes/step") + (("autotune kept",) if tuned else ())
    header = ["row"] + [f"{rate} {c}" for rate in rates for c in cols]

    def cells(r):
        return [f"{r['ms_per_step']:.1f}", f"{r['speedup']:.2f}x"] + (
            [f"{r['speedup_low']:.2f}-{r['speedup_high']:.2f}x"] if spread else []) + [
            f"{r['cpu_ms_per_step']:.0f} ({r['main_cpu_ms_per_step']:.0f})",
            f"{r['bytes_per_step']:,}"] + ([kept(r)] if tuned else [])
    lines = [[label] + [x for rate in rates for x in cells(by[(rate, label)])]
             for label in labels]
    print(results.markdown(header, lines))
    results.write(out_dir, name, settings, rows, json_only=("steps_ms", "base_steps_ms"))
    plt = results.pyplot()
    fig, ax = plt.subplots(figsize=(11, 5))
    width = 0.8 / len(rates)
    for i, rate in enumerate(rates):
        ax.bar([j + i * width for j in range(len(labels))],
               [by[(rate, label)]["speedup"] for label in labels], width, label=rate)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([j + width * (len(rates) - 1) / 2 for j in range(len(labels))])
    ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("speedup over uncompressed Horovod (ms/step)")
    ax.set_title(f"{settings['layout']}: {settings['ranks']} ranks, {settings['model']} "
                 f"({settings['params_m']:.1f}M parameters), veth shaped by tc")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, f"{name}.png"), dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="6M parameters, 2 timed steps")
    ap.add_argument("--params-m", type=float, default=None, help="MLP size, millions")
    ap.add_argument("--model", choices=list(MODELS), default="mlp",
                    help="; ".join(f"{k}: {v}" for k, v in MODELS.items()))
    ap.add_argument("--batch", type=int, default=None,
                    help="per rank (default: 32 for the MLP, 4 for the ResNet-50s, 2 for the "
                         "encoder)")
    ap.add_argument("--bucket-mb", type=float, default=0, help="our optimizer's bucket_mb")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per row and rate")
    ap.add_argument("--rounds", type=int, default=1,
                    help="times the table runs per rate, in alternating order (1)")
    ap.add_argument("--rates", default=",".join(RATES), help="comma-separated: " + ", ".join(RATES))
    ap.add_argument("--out", default=results.DEFAULT_OUT)
    ap.add_argument("--layout", choices=list(LAYOUTS), default="1x2",
                    help="ranks per namespace x namespaces: 1x2 (default) or 2x2")
    ap.add_argument("--select", default=None,
                    help="comma-separated words: only the rows whose label contains one of "
                         "them (with the Horovod rows for reference), e.g. two-level,fp16")
    ap.add_argument("--cycle-time-ms", type=float, default=None,
                    help="HOROVOD_CYCLE_TIME for every Horovod and hvd_compress row, the "
                         "baseline included (default: the environment's, else Horovod's 1 ms)")
    ap.add_argument("--paired", action="store_true",
                    help="each of our rows against a baseline trained beside it, step by step")
    ap.add_argument("--autotune", type=int, default=0,
                    help="autotune=K in each of our rows' specs (hvd_compress.autotune), its "
                         "probe inside the warm-up steps")
    ap.add_argument("--rendezvous", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--per-node", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--worker", choices=["horovod", "ddp"], help=argparse.SUPPRESS)
    for hidden in ("--iface", "--rows", "--opts", "--result", "--master"):
        ap.add_argument(hidden, help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rendezvous:
        return rendezvous_server(args.per_node)
    if args.worker == "horovod":
        keras = json.loads(args.opts)["model"] in KERAS_MODELS
        return (keras_worker if keras else horovod_worker)(args)
    if args.worker == "ddp":
        return ddp_worker(args)

    rates = args.rates.split(",")
    unknown = [r for r in rates if r not in RATES]
    if unknown:
        sys.exit(f"unknown rate(s) {unknown}; valid: {', '.join(RATES)}")
    if args.rounds < 1:
        sys.exit(f"--rounds must be 1 or more, got {args.rounds}")
    cycle = (args.cycle_time_ms if args.cycle_time_ms is not None
             else os.environ.get("HOROVOD_CYCLE_TIME", "1"))
    try:
        cycle_ms = float(cycle)
    except ValueError:
        cycle_ms = float("nan")
    if not cycle_ms > 0:
        sys.exit(f"--cycle-time-ms must be above 0 (HOROVOD_CYCLE_TIME where it is not given), "
                 f"got {cycle!r}")
    os.environ["HOROVOD_CYCLE_TIME"] = f"{cycle_ms:g}"  # launch() passes it on
    if args.autotune < 0:
        sys.exit(f"--autotune must be a number of probe steps per arm >= 0, got {args.autotune}")
    params_m = {"resnet50": 25.557032, "transformer": 108.9, "keras-resnet50": 25.583592}.get(
        args.model, args.params_m or (6.0 if args.quick else 25.0))
    opts = {"model": args.model, "params_m": params_m, "bucket_mb": args.bucket_mb,
            "steps": args.steps or (2 if args.quick else 3), "paired": args.paired,
            "warmup": 3 + (autotune.WARMUP + 2 * args.autotune if args.autotune else 0),
            "autotune": args.autotune,
            "batch": args.batch or {"mlp": 32, "resnet50": 4, "transformer": 2,
                                    "keras-resnet50": 4}[args.model]}
    if args.paired and opts["warmup"] % 2 and opts["steps"] < 2:
        sys.exit(f"--paired reads our rows' bytes in the timed steps where ours goes first (see "
                 f"time_paired), which after {opts['warmup']} warm-up steps needs --steps 2 or "
                 f"more, got {opts['steps']}")
    refuse_unless_able()
    # Ctrl-C or a kill reaches the finally blocks, so the namespaces always go.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    per_node, table = LAYOUTS[args.layout]
    if args.select:
        words = args.select.split(",")
        table = [r for r in table if r[1] == "horovod" or any(w in r[0] for w in words)]
    keras = args.model in KERAS_MODELS
    if keras:
        table = [r for r in table if r[1] != "ddp"]  # DDP hooks are torch's
    if args.paired:
        table = table[:2] + [(SELF_PAIR, "horovod", "none")] + table[2:]
    if args.autotune:
        table = [(label, how, f"{spec},autotune={args.autotune}" if how == "ours" else spec)
                 for label, how, spec in table]
    rows = []
    with LinkPair() as link, tempfile.TemporaryDirectory() as tmp:
        for rate in rates:
            print(f"{rate}: tc tbf on both ends of the veth pair", flush=True)
            link.shape(RATES[rate])
            # no row sends more than 32-bit gradients (a 100M-parameter model takes 35 s a step
            # at 100 Mbit/s), plus start-up (a Keras row builds and traces its step, some 40 s
            # on 2 cores): only a hang outlives this
            steps_s = (opts["warmup"] + opts["steps"]) * per_node * opts["params_m"] * 32e6 \
                / RATES[rate]

            def timeout(rows):  # --paired: each of our rows builds and steps two models
                return 600 + len(rows) * (steps_s + 60) * (2 if args.paired else 1)
            for k in range(args.rounds):
                order = 1 if k % 2 == 0 else -1
                hv = [r for r in table if r[1] != "ddp"]
                hv = bracketed(hv[:1] + hv[1:][::order])
                # A process keeps some of every Keras model, optimizer and traced step it built
                # after clear_session() (ResNet-50 through Horovod's optimizer: 0.2 GB a row,
                # through ours 0.7 GB): with --paired each row builds two, and the 2-core
                # machine's 23 GB ran out at the fourteenth row. Then each row is a job.
                jobs = [[r] for r in hv] if keras and args.paired else [hv]
                ran = []
                for i, job in enumerate(jobs):
                    path = os.path.join(tmp, f"h{i}.json")
                    run_horovod(link, job, opts, path, timeout(job), per_node)
                    with open(path) as f:
                        ran += json.load(f)
                ran = against_bracket(ran, table[0][0])
                # in the table's order (the baseline's runs first), as every round lists them
                place = {label: i for i, (label, _, _) in enumerate(table)}
                ran.sort(key=lambda r: place[r["row"]])
                ddp = [r for r in table if r[1] == "ddp"][::order]
                if ddp:
                    run_ddp(link, ddp, opts, os.path.join(tmp, "d.json"), timeout(ddp))
                    base_ms = statistics.median(r["ms_per_step"] for r in ran
                                                if r["row"] == table[0][0])
                    with open(os.path.join(tmp, "d.json")) as f:
                        ran += [{**r, "base_ms": base_ms} for r in json.load(f)[::order]]
                rows += [{"rate": rate, "round": k, **r} for r in ran]
    rows = collapse(rows, table[0][0])
    settings = {**opts, "rates": rates, "ranks": 2 * per_node, "layout": args.layout,
                "rounds": args.rounds, "horovod_cycle_time_ms": cycle_ms,
                "threads_per_rank": 1,
                "network": "veth pair between two namespaces, tc tbf on both ends"}
    name = "network" if args.layout == "1x2" else f"network_{args.layout}"
    if args.model != "mlp":
        name += f"_{args.model}"
    if args.bucket_mb:
        name += f"_buckets{args.bucket_mb:g}mb"
    if cycle_ms != 1:
        name += f"_cycle{cycle_ms:g}ms"
    if args.paired:
        name += "_paired"
    if args.autotune:
        name += f"_autotune{args.autotune}"
    report(rows, rates, settings, args.out, table, name)


if __name__ == "__main__":
    main()
