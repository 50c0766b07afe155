#!/usr/bin/env python3
"""torch_nccl_bench.py: the torch.distributed (NCCL) peer of nccl_bench's rows, on the same GPUs.

all_reduce (float32 SUM, in place), all_gather (all_gather_into_tensor) and broadcast (from rank 0)
with torch.distributed's NCCL backend, one process per GPU (spawned here, meeting at a TCP store on
a free loopback port), timed as nccl_bench times its rows: CUDA events on each rank's current
stream around --iters back-to-back calls after --warmup untimed ones; time = elapsed / iters, max
over the ranks. Sizes and bandwidths follow nccl_bench (all_gather's size is the gathered output;
busbw factors 2(n-1)/n, (n-1)/n, 1). Every element of every rank's last result is checked (rank r
sends r + 1) and the program exits 1 on any wrong one. One rank (--ranks 1, the default) is the
case of issue 13's table: torch's per-call cost beside consort's row and direct NCCL's.

Usage:
  python3 bench/torch_nccl_bench.py [--ranks 1] [--min-bytes 4] [--max-bytes 1M] [--factor 2]
      [--warmup 5] [--iters 20] [--ops all_reduce,all_gather,broadcast] [--timeout 300]
      [--json FILE]

--timeout bounds the whole run in seconds: ranks still running then are stopped and the program
exits 1 saying so (an NCCL call that never completes would otherwise hold it forever).

Needs torch with CUDA and NCCL (the GPU machine's python3 has torch 2.11). Without torch it says so
and exits 3; with torch but fewer GPUs than --ranks it prints `torch_nccl_bench: no GPU (...)` and
exits 0, as nccl_bench does without a GPU.

Expected output (shape; figures depend on the GPU):
  # torch_nccl_bench  torch=2.11.0 nccl=(2, 28, 9) ranks=1 warmup=5 iters=20
  # GPU:0 NVIDIA H100 80GB HBM3
  # all_reduce  type=float  redop=sum  root=-1  busbw factor 2(n-1)/n
  #       size        count      type   redop   root     path       time   algbw   busbw  #wrong
             4            1     float     sum     -1    torch      25.00    0.00    0.00       0
  # Out of bounds values : 0 OK
"""

import argparse
import json
import multiprocessing
import os
import queue
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_gloo_bench import OPS, free_port, parse_bytes, sizes_of  # noqa: E402

BUSBW = {"all_reduce": lambda n: 2.0 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
         "broadcast": lambda n: 1.0}
FACTOR_TEXT = {"all_reduce": "2(n-1)/n", "all_gather": "(n-1)/n", "broadcast": "1"}


def run_rank(rank, world, init_method, args, results):
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=init_method, rank=rank, world_size=world,
                            device_id=dev)
    stream = torch.cuda.current_stream(dev)
    mine = float(rank + 1)
    out = []
    for op in args.ops:
        for size in sizes_of(args):
            count = size // 4
            if op == "all_gather":
                per = max(1, count // world)
                count = per * world
                x = torch.full((per,), mine, dtype=torch.float32, device=dev)
                y = torch.empty(count, dtype=torch.float32, device=dev)
            else:
                x = torch.full((count,), mine, dtype=torch.float32, device=dev)

            def call():
                if op == "all_reduce":
                    dist.all_reduce(x, op=dist.ReduceOp.SUM)
                elif op == "all_gather":
                    dist.all_gather_into_tensor(y, x)
                else:
                    dist.broadcast(x, src=0)

            for _ in range(args.warmup):
                call()
            if op != "all_gather":
                x.fill_(mine)  # all_reduce and broadcast work in place: start the timed run anew
            torch.cuda.synchronize(dev)
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record(stream)
            # In place, all_reduce's values grow call by call (as the timing wants: no refill
            # inside the clock); the check below therefore uses one more call from fresh inputs.
            for _ in range(args.iters):
                call()
            end.record(stream)
            end.synchronize()
            time_us = start.elapsed_time(end) * 1e3 / args.iters
            # The check: one more call from fresh inputs, after the clock stopped.
            if op != "all_gather":
                x.fill_(mine)
            call()
            torch.cuda.synchronize(dev)
            if op == "all_reduce":
                wrong = int((x != float(world * (world + 1) // 2)).sum().item())
            elif op == "all_gather":
                expect = torch.arange(1, world + 1, dtype=torch.float32,
                                      device=dev).repeat_interleave(count // world)
                wrong = int((y != expect).sum().item())
            else:
                wrong = int((x != 1.0).sum().item())
            stats = torch.tensor([time_us, float(wrong)], dtype=torch.float64, device=dev)
            # max time over the ranks, wrong summed: two calls, both outside the clock.
            t = stats[:1].clone()
            w = stats[1:].clone()
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            dist.all_reduce(w, op=dist.ReduceOp.SUM)
            out.append({"op": op, "size": size, "count": count, "type": "float",
                        "redop": "sum" if op == "all_reduce" else "none",
                        "root": 0 if op == "broadcast" else -1, "path": "torch",
                        "time_us": t.item(), "wrong": int(w.item()), "iters": args.iters})
    if rank == 0:
        results.put({"torch": torch.__version__, "nccl": str(torch.cuda.nccl.version()),
                     "gpus": [torch.cuda.get_device_name(i) for i in range(world)],
                     "rows": out})
    dist.destroy_process_group()


def spawned(rank, world, init_method, args, results):
    try:
        run_rank(rank, world, init_method, args, results)
    except Exception as e:  # a clear line, then a failing exit status
        print(f"torch_nccl_bench: rank {rank}: {type(e).__name__}: {e}", file=sys.stderr,
              flush=True)
        sys.exit(1)


def print_table(doc, args, world):
    print(f"# torch_nccl_bench  torch={doc['torch']} nccl={doc['nccl']} ranks={world} "
          f"warmup={args.warmup} iters={args.iters}")
    for i, name in enumerate(doc["gpus"]):
        print(f"# GPU:{i} {name}")
    print("# time: CUDA events around the back-to-back calls on each rank's current stream, "
          "per call, max over the ranks (as nccl_bench); GB = 1e9 bytes")
    total_wrong = 0
    for op in args.ops:
        redop = "sum" if op == "all_reduce" else "none"
        root = 0 if op == "broadcast" else -1
        print(f"#\n# {op}  type=float  redop={redop}  root={root}  busbw factor {FACTOR_TEXT[op]}")
        print("#%11s %12s %9s %7s %6s %8s %10s %7s %7s %7s" % (
            "size", "count", "type", "redop", "root", "path", "time", "algbw", "busbw", "#wrong"))
        print("#%11s %12s %9s %7s %6s %8s %10s %7s %7s %7s" % (
            "(B)", "(elements)", "", "", "", "", "(us)", "(GB/s)", "(GB/s)", ""))
        for row in (r for r in doc["rows"] if r["op"] == op):
            algbw = row["size"] / (row["time_us"] * 1e3) if row["time_us"] > 0 else 0.0
            row["algbw"] = algbw
            row["busbw"] = algbw * BUSBW[op](world)
            total_wrong += row["wrong"]
            print(" %11d %12d %9s %7s %6d %8s %10.2f %7.2f %7.2f %7d" % (
                row["size"], row["count"], "float", redop, root, "torch", row["time_us"], algbw,
                row["busbw"], row["wrong"]))
    print(f"# Out of bounds values : {total_wrong} {'OK' if total_wrong == 0 else 'FAILED'}")
    return total_wrong


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=1, help="processes, one GPU each")
    p.add_argument("--min-bytes", type=parse_bytes, default=4)
    p.add_argument("--max-bytes", type=parse_bytes, default=1 << 20)
    p.add_argument("--factor", type=int, default=2)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--timeout", type=float, default=300,
                   help="seconds for the whole run; ranks still running then are stopped")
    p.add_argument("--json", default="")
    args = p.parse_args()
    args.ops = [o for o in args.ops.split(",") if o]
    bad = [o for o in args.ops if o not in OPS]
    if bad or not args.ops:
        p.error(f"--ops: unknown or empty {bad} (all_reduce, all_gather, broadcast)")
    if args.ranks < 1 or args.min_bytes < 4 or args.max_bytes < args.min_bytes or \
            args.factor < 2 or args.iters <= 0 or args.warmup < 0 or not args.timeout > 0:
        p.error("need --ranks >= 1, 4 <= --min-bytes <= --max-bytes, --factor >= 2, "
                "--warmup >= 0, --iters > 0, --timeout > 0")
    try:
        import torch
        import torch.distributed as dist
        if not dist.is_available():
            raise ImportError("torch.distributed is not available in this build")
    except ImportError as e:
        print(f"torch_nccl_bench: cannot use torch with {sys.executable}: {e}", file=sys.stderr)
        return 3
    seen = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if seen < args.ranks or not dist.is_nccl_available():
        why = "torch has no NCCL" if not dist.is_nccl_available() else \
            f"torch sees {seen} GPU(s), --ranks asks for {args.ranks}"
        print(f"torch_nccl_bench: no GPU ({why})")
        return 0
    init = f"tcp://127.0.0.1:{free_port()}"
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=spawned, args=(r, args.ranks, init, args, results))
             for r in range(args.ranks)]
    for proc in procs:
        proc.start()
    doc = None
    status = 0
    deadline = time.monotonic() + args.timeout
    while any(proc.is_alive() for proc in procs) or doc is None:
        try:
            doc = results.get(timeout=0.2)
        except queue.Empty:
            pass
        if any(proc.exitcode not in (None, 0) for proc in procs):
            status = 1
            break
        if doc is None and not any(proc.is_alive() for proc in procs):
            status = 1
            break
        if time.monotonic() > deadline:
            print(f"torch_nccl_bench: not done within --timeout {args.timeout:g} s; stopping the "
                  "ranks", file=sys.stderr)
            status = 1
            break
    for proc in procs:
        if status != 0 and proc.is_alive():
            proc.terminate()
        proc.join(10)
        if proc.is_alive():  # stuck where SIGTERM does not reach it (inside a CUDA call)
            proc.kill()
            proc.join()
    if doc is None:
        print("torch_nccl_bench: no results came back from rank 0 (see the lines above)",
              file=sys.stderr)
        return 1
    wrong = print_table(doc, args, args.ranks)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "torch_nccl_bench", "ranks": args.ranks, **doc}, f)
            f.write("\n")
    return 0 if wrong == 0 and status == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
