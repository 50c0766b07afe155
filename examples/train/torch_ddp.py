#!/usr/bin/env python3
"""The training demo's peer: the same MLP, data, initial weights and SGD as consort-train, trained
with torch.nn.parallel.DistributedDataParallel over gloo (Debian's python3-torch).

    /usr/bin/python3 examples/train/torch_ddp.py --nproc 2 --hidden 1024 --layers 3 \
        --global-batch 1024 --lr 0.05 --steps 30
    /usr/bin/python3 examples/train/torch_ddp.py --self-test

What is the same as consort-train (examples/train/mlp.cpp, trainer.cpp):
- the data: make_dataset ported operation for operation (splitmix64, the Irwin-Hall normal, the
  Taylor-series sine), so it gives the same bytes; --self-test checks the recorded fingerprint;
- the initial weights: one splitmix64 stream draws w1 .. w{L+1} row-major, He-uniform for the
  hidden layers and Glorot-uniform for the output layer, biases zero;
- a step: global batch s is rows [s*B, s*B + B) of the dataset (cycling; the last one may be
  partial), split over the ranks as consort splits it over workers of one replica each
  (split_batch_across_workers: parts of ceil(rows / world) rows in rank order); each rank's loss is its sum of
  cross-entropies times world / rows of the global batch, so DDP's average is the sum over the
  global batch divided by its rows, and plain SGD applies it;
- the reported loss and accuracy: one all-reduce of [loss sum, correct] per step (consort carries
  them in its last gradient bucket).

Each process uses --threads intra-op threads (1 by default, as each consort replica uses one).
The last line is `RESULT {json}` for bench/train_bench.
"""

import argparse
import json
import math
import os
import socket
import sys
import time

MASK = (1 << 64) - 1
PI = 3.14159265358979323846


class SplitMix64:
    def __init__(self, seed):
        self.state = seed & MASK

    def next(self):
        self.state = (self.state + 0x9E3779B97F4A7C15) & MASK
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
        return z ^ (z >> 31)

    def uniform(self):
        return float(self.next() >> 11) * 2.0**-53

    def uniform_limit(self, limit):
        return (2.0 * self.uniform() - 1.0) * limit

    def normal(self):
        total = self.uniform() + self.uniform() + self.uniform() + self.uniform()
        return (total - 2.0) * 1.7320508075688772


def portable_sin(x):
    x -= 2.0 * PI * math.floor(x / (2.0 * PI) + 0.5)
    if x > PI / 2:
        x = PI - x
    elif x < -PI / 2:
        x = -PI - x
    x2 = x * x
    term = x
    total = x
    for n in range(1, 12):
        term *= -x2 / float((2 * n) * (2 * n + 1))
        total += term
    return total


def portable_cos(x):
    return portable_sin(x + PI / 2)


def make_dataset(examples, features=16, classes=4, seed=42):
    """consort::train::make_dataset: x float32 [examples, features], y int32 [examples]."""
    import numpy as np

    rng = SplitMix64(seed)
    embed = [rng.uniform_limit(1.0) for _ in range(2 * features)]
    x = np.empty((examples, features), dtype=np.float32)
    y = np.empty((examples,), dtype=np.int32)
    for n in range(examples):
        label = rng.next() % classes
        t = rng.uniform()
        radius = 0.3 + t
        angle = 2.0 * PI * label / float(classes) + PI * t
        z0 = radius * portable_cos(angle) + 0.05 * rng.normal()
        z1 = radius * portable_sin(angle) + 0.05 * rng.normal()
        w0 = z0 + 0.25 * portable_sin(2.0 * z1)
        w1 = z1 + 0.25 * portable_sin(2.0 * z0)
        row = [embed[2 * f] * w0 + embed[2 * f + 1] * w1 + 0.1 * rng.normal() for f in range(features)]
        x[n, :] = np.array(row, dtype=np.float64).astype(np.float32)
        y[n] = label
    return x, y


def init_params(inputs, hidden, classes, layers, seed):
    """consort::train::init_params: [(w1, b1), ..., (w{L+1}, b{L+1})] as float32 numpy arrays."""
    import numpy as np

    rng = SplitMix64(seed)
    params = []
    for layer in range(1, layers + 2):
        fan_in = inputs if layer == 1 else hidden
        fan_out = hidden if layer <= layers else classes
        limit = math.sqrt(6.0 / fan_in) if layer <= layers else math.sqrt(6.0 / (fan_in + fan_out))
        values = [rng.uniform_limit(limit) for _ in range(fan_in * fan_out)]
        w = np.array(values, dtype=np.float64).astype(np.float32).reshape(fan_in, fan_out)
        params.append((w, np.zeros((fan_out,), dtype=np.float32)))
    return params


def fnv1a(data):
    h = 0xCBF29CE484222325
    for b in data:
        h ^= b
        h = (h * 0x100000001B3) & MASK
    return h


def self_test():
    x, y = make_dataset(4096)
    problems = []
    if fnv1a(x.tobytes()) != 0xD406965095E66BFD:
        problems.append("x fingerprint %#x != 0xd406965095e66bfd" % fnv1a(x.tobytes()))
    if fnv1a(y.tobytes()) != 0x0814CBBC6B1758E4:
        problems.append("y fingerprint %#x != 0x0814cbbc6b1758e4" % fnv1a(y.tobytes()))
    if y[0] != 1 or float(x[0, 0]) != float.fromhex("0x1.2fabe2p-2") or float(x[0, 1]) != float.fromhex("0x1.78f75ep-1"):
        problems.append("first values differ: y[0]=%d x[0,0]=%r x[0,1]=%r" % (y[0], x[0, 0], x[0, 1]))
    if problems:
        print("self-test FAILED: " + "; ".join(problems), file=sys.stderr)
        return 1
    print("self-test OK: make_dataset gives consort's bytes")
    return 0


def split_batch_across_workers(rows, n):
    """consort::split_batch_across_workers(rows, n): parts of ceil(rows / n) rows in order (TF's
    MultiWorkerMirroredStrategy rebatch), so a partial batch leaves the last ranks short or empty;
    one rank takes every row."""
    per = -(-rows // n)
    out = []
    left = rows
    for _ in range(n):
        take = min(per, left)
        out.append(take)
        left -= take
    return out


def worker(rank, world, port, args, queue):
    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % port, rank=rank, world_size=world)
    try:
        x_all, y_all = make_dataset(args.examples, seed=args.seed)
        x_all = torch.from_numpy(x_all)
        y_all = torch.from_numpy(y_all.astype(np.int64))
        classes = int(y_all.max().item()) + 1

        class Mlp(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.weights = torch.nn.ParameterList()
                self.biases = torch.nn.ParameterList()
                for w, b in init_params(x_all.shape[1], args.hidden, classes, args.layers, args.seed):
                    self.weights.append(torch.nn.Parameter(torch.from_numpy(w.copy())))
                    self.biases.append(torch.nn.Parameter(torch.from_numpy(b.copy())))

            def forward(self, h):
                last = len(self.weights) - 1
                for i, (w, b) in enumerate(zip(self.weights, self.biases)):
                    h = torch.addmm(b, h, w)
                    if i < last:
                        h = torch.relu(h)
                return h

        model = torch.nn.parallel.DistributedDataParallel(Mlp(), bucket_cap_mb=args.bucket_mb)
        opt = torch.optim.SGD(model.parameters(), lr=args.lr)
        batches = (args.examples + args.global_batch - 1) // args.global_batch
        totals = torch.zeros(2, dtype=torch.float64)
        seen = 0
        reached = False
        time_to_target = None
        loss = accuracy = float("nan")
        steps_done = 0
        dist.barrier()
        start = time.perf_counter()
        for step in range(args.steps):
            first = (step % batches) * args.global_batch
            rows = min(args.global_batch, args.examples - first)
            parts = split_batch_across_workers(rows, world)
            begin = first + sum(parts[:rank])
            x = x_all[begin : begin + parts[rank]]
            y = y_all[begin : begin + parts[rank]]
            logits = model(x)
            losses = F.cross_entropy(logits, y, reduction="none")
            loss_sum = losses.sum()
            opt.zero_grad(set_to_none=True)
            (loss_sum * (world / rows)).backward()
            opt.step()
            with torch.no_grad():
                correct = (logits.argmax(dim=1) == y).sum()
                totals[0] = float(loss_sum.item())
                totals[1] = float(correct.item())
            dist.all_reduce(totals)
            loss = totals[0].item() / rows
            accuracy = totals[1].item() / rows
            seen += rows
            steps_done = step + 1
            elapsed = time.perf_counter() - start
            if rank == 0 and args.log_every and (steps_done == 1 or steps_done % args.log_every == 0 or steps_done == args.steps):
                print("step %4d/%d  loss %.4f  accuracy %.3f  %.0f examples/s" % (steps_done, args.steps, loss, accuracy, seen / elapsed), flush=True)
            if args.target_loss is not None and loss <= args.target_loss:
                reached = True
                time_to_target = elapsed
                break
        elapsed = time.perf_counter() - start
        if rank == 0:
            queue.put(
                {
                    "impl": "torch_ddp",
                    "processes": world,
                    "steps": steps_done,
                    "examples_per_s": seen / elapsed,
                    "elapsed_s": elapsed,
                    "final_loss": loss,
                    "final_accuracy": accuracy,
                    "time_to_target_s": time_to_target,
                    "reached_target": reached,
                }
            )
    finally:
        dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def positive_int(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("expected an integer >= 1, got %s" % text)
    return value


def positive_float(text):
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError("expected a number > 0, got %s" % text)
    return value


def main():
    p = argparse.ArgumentParser(description="The training demo's MLP under torch DDP (gloo).")
    p.add_argument("--nproc", type=positive_int, default=1, help="processes (ranks)")
    p.add_argument("--steps", type=positive_int, default=600)
    p.add_argument("--global-batch", type=positive_int, default=512)
    p.add_argument("--lr", type=positive_float, default=0.1)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--examples", type=positive_int, default=4096)
    p.add_argument("--hidden", type=positive_int, default=512)
    p.add_argument("--layers", type=positive_int, default=2)
    p.add_argument("--bucket-mb", type=positive_float, default=25.0, help="DDP bucket_cap_mb")
    p.add_argument("--threads", type=positive_int, default=1, help="torch threads per process")
    p.add_argument("--target-loss", type=positive_float, default=None)
    p.add_argument("--log-every", type=int, default=50, help="0: quiet")
    p.add_argument("--self-test", action="store_true", help="check make_dataset's bytes and exit")
    args = p.parse_args()
    if args.self_test:
        return self_test()

    # Before any child imports torch: its BLAS (OpenBLAS, from Debian's libopenblas0 through the
    # libblas.so.3 alternative) and OpenMP read these once.
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(args.threads)
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, args.nproc, port, args, queue)) for r in range(args.nproc)]
    for proc in procs:
        proc.start()
    failed = []
    for r, proc in enumerate(procs):
        proc.join()
        if proc.exitcode != 0:
            failed.append("rank %d exited with %s" % (r, proc.exitcode))
    if failed:
        print("torch_ddp.py: " + "; ".join(failed), file=sys.stderr)
        return 1
    if queue.empty():
        print("torch_ddp.py: rank 0 reported no result", file=sys.stderr)
        return 1
    print("RESULT " + json.dumps(queue.get()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
