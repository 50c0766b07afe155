#!/usr/bin/env python3
"""torch_gloo_bench.py: the peer of strategy_collective_bench and collective_tcp_bench.

all_reduce (float32 SUM), all_gather (into a list) and broadcast (from rank 0) with
torch.distributed's gloo backend between worker processes on this host, timed and printed the way
the consort benchmarks print them (nccl-tests columns, gloo's p50/p99), so that
bench/user_path.sh can put the three side by side (issue 12).

Usage:
  python3 bench/torch_gloo_bench.py --workers 2 [--min-bytes 4] [--max-bytes 64M] [--factor 4]
      [--warmup 3] [--iters 20] [--large-bytes 16M] [--large-iters 0]
      [--ops all_reduce,all_gather,broadcast] [--json FILE]
  tools/consort-launch -n 2 -- python3 bench/torch_gloo_bench.py [options]

Without the launcher the script starts --workers processes itself (multiprocessing, spawn) and
they meet at a TCP store on a free loopback port. Under tools/consort-launch (CONSORT_LAUNCH_RANK
and CONSORT_LAUNCH_SIZE set) every process is one rank and the store listens on worker 0's
TF_CONFIG address. Each rank keeps torch to one intra-op thread (torch.set_num_threads(1)).

Per iteration, as in collective_tcp_bench: the input is refilled (untimed; all_reduce and
broadcast work in place), a barrier (an all_reduce of one float), then the timed call. Time is
rank 0's. Every element of every result is checked on every rank after the clock stopped; the
wrong counts are summed over the ranks and the program exits 1 on any. An all_gather row of S
bytes gathers max(1, S/4/N) floats from each of the N ranks. Only rank 0 prints.

Needs torch (Debian: apt-get install python3-torch, then /usr/bin/python3); without it the
script says so and exits 3.

Expected output (figures made up; bench/README.md has measured ones):
  # torch_gloo_bench  torch=1.13.0a0 backend=gloo ranks=2 threads=1 warmup=3 iters=20 ...
  # all_reduce
  #        size        count   type  redop       time   algbw   busbw  #wrong        p50        p99
             4            1  float    sum     150.00    0.00    0.00       0      140.0      300.0
  # Out of bounds values : 0 OK
"""

import argparse
import datetime
import json
import math
import multiprocessing
import os
import platform
import socket
import sys
import time

OPS = ("all_reduce", "all_gather", "broadcast")


def parse_bytes(text):
    """A byte count with an optional binary suffix: 4, 64K, 64M, 1G (as the consort benches)."""
    scale = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip()
    mult = 1
    if t and t[-1].lower() in scale:
        mult = scale[t[-1].lower()]
        t = t[:-1]
    if not t.isdigit():
        raise argparse.ArgumentTypeError(f"expects a byte count such as 4, 64K or 64M, got '{text}'")
    return int(t) * mult


def percentile(sorted_values, p):
    """Nearest-rank percentile, as bench/common.hpp."""
    if not sorted_values:
        return 0.0
    rank = math.ceil(p / 100.0 * len(sorted_values))
    return sorted_values[min(max(rank, 1), len(sorted_values)) - 1]


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def sizes_of(args):
    out = []
    b = args.min_bytes
    while b <= args.max_bytes:
        out.append(b)
        b *= args.factor
    return out


def run_rank(rank, world, init_method, args):
    """One rank's whole run; returns its exit status."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.timeout))
    one = torch.zeros(1, dtype=torch.float32)

    def barrier():
        dist.all_reduce(one)

    barrier()
    out = sys.stdout
    if rank == 0:
        print(f"# torch_gloo_bench  torch={torch.__version__} backend=gloo ranks={world} "
              f"threads={torch.get_num_threads()} warmup={args.warmup} iters={args.iters} "
              f"large_bytes={args.large_bytes} large_iters={args.large_iters or args.iters}",
              file=out)
        print(f"# machine: nproc={os.cpu_count()} cpu={cpu_model()}", file=out)
        print("# time: per iteration on rank 0 after a barrier (an all_reduce of one float); "
              "all_gather size = the result (max(1, count/N) floats per rank); GB = 1e9 bytes",
              file=out)
        print("#", file=out, flush=True)

    rows = []
    total_wrong = 0
    for op in args.ops:
        if rank == 0:
            print(f"# {op}", file=out)
            print("#%12s %12s %6s %6s %10s %7s %7s %7s %10s %10s" % (
                "size", "count", "type", "redop", "time", "algbw", "busbw", "#wrong", "p50",
                "p99"), file=out)
            print("#%12s %12s %6s %6s %10s %7s %7s %7s %10s %10s" % (
                "(B)", "(elements)", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(us)"),
                file=out, flush=True)
        for size in sizes_of(args):
            count = size // 4
            iters = args.large_iters if (size >= args.large_bytes and args.large_iters > 0) \
                else args.iters
            mine = float(rank + 1)
            if op == "all_gather":
                per = max(1, count // world)
                x = torch.full((per,), mine, dtype=torch.float32)
                outs = [torch.empty(per, dtype=torch.float32) for _ in range(world)]
            else:
                x = torch.empty(count, dtype=torch.float32)
            samples = []
            wrong = 0
            for it in range(args.warmup + iters):
                if op != "all_gather":
                    x.fill_(mine)
                barrier()
                t0 = time.perf_counter_ns()
                if op == "all_reduce":
                    dist.all_reduce(x, op=dist.ReduceOp.SUM)
                elif op == "all_gather":
                    dist.all_gather(outs, x)
                else:
                    dist.broadcast(x, src=0)
                t1 = time.perf_counter_ns()
                if it >= args.warmup:
                    samples.append((t1 - t0) / 1e3)
                # The check, after the clock stopped.
                if op == "all_reduce":
                    wrong += int((x != float(world * (world + 1) // 2)).sum().item())
                elif op == "all_gather":
                    for j, o in enumerate(outs):
                        wrong += int((o != float(j + 1)).sum().item())
                else:
                    wrong += int((x != 1.0).sum().item())
            w = torch.tensor([float(wrong)], dtype=torch.float64)
            dist.all_reduce(w)
            row_wrong = int(w.item())
            total_wrong += row_wrong
            s = sorted(samples)
            avg = sum(s) / len(s)
            algbw = size / (avg * 1e3) if avg > 0 else 0.0
            factor = {"all_reduce": 2.0 * (world - 1) / world,
                      "all_gather": (world - 1) / world, "broadcast": 1.0}[op]
            redop = "sum" if op == "all_reduce" else "none"
            row = {"op": op, "size": size, "count": count, "iters": iters, "type": "float",
                   "redop": redop, "time_us": avg, "algbw": algbw, "busbw": algbw * factor,
                   "wrong": row_wrong, "p50_us": percentile(s, 50), "p99_us": percentile(s, 99),
                   "samples_us": [round(v, 3) for v in samples]}
            rows.append(row)
            if rank == 0:
                print(" %12d %12d %6s %6s %10.2f %7.2f %7.2f %7d %10.1f %10.1f" % (
                    size, count, "float", redop, avg, algbw, algbw * factor, row_wrong,
                    row["p50_us"], row["p99_us"]), file=out, flush=True)
    if rank == 0:
        print(f"# Out of bounds values : {total_wrong} {'OK' if total_wrong == 0 else 'FAILED'}",
              file=out, flush=True)
        if args.json:
            doc = {"benchmark": "torch_gloo_bench",
                   "config": {"backend": "gloo", "torch": torch.__version__, "ranks": world,
                              "threads": torch.get_num_threads(), "warmup": args.warmup,
                              "iters": args.iters, "large_bytes": args.large_bytes,
                              "large_iters": args.large_iters or args.iters},
                   "machine": {"nproc": os.cpu_count(), "cpu": cpu_model()},
                   "results": rows, "out_of_bounds": total_wrong}
            with open(args.json, "w") as f:
                json.dump(doc, f)
                f.write("\n")
    barrier()
    dist.destroy_process_group()
    return 0 if total_wrong == 0 else 1


def spawned_rank(rank, world, init_method, args):
    sys.exit(run_rank(rank, world, init_method, args))


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher_rendezvous():
    """tcp:// address of worker 0 from TF_CONFIG (set by tools/consort-launch)."""
    cfg = json.loads(os.environ["TF_CONFIG"])
    cluster = cfg["cluster"]
    first = (cluster.get("chief") or cluster["worker"])[0]
    return "tcp://" + first


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=2,
                   help="processes to start (ignored under tools/consort-launch)")
    p.add_argument("--min-bytes", type=parse_bytes, default=4)
    p.add_argument("--max-bytes", type=parse_bytes, default=64 << 20)
    p.add_argument("--factor", type=int, default=4)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--large-bytes", type=parse_bytes, default=16 << 20,
                   help="sizes from this one on run --large-iters iterations")
    p.add_argument("--large-iters", type=int, default=0, help="0: --iters")
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--timeout", type=int, default=300, help="gloo's timeout in seconds")
    p.add_argument("--json", default="", help="rank 0 writes the results (with every sample)")
    args = p.parse_args()
    args.ops = [o for o in args.ops.split(",") if o]
    bad = [o for o in args.ops if o not in OPS]
    if bad or not args.ops:
        p.error(f"--ops: unknown or empty {bad} (all_reduce, all_gather, broadcast)")
    if args.min_bytes < 4 or args.max_bytes < args.min_bytes or args.factor < 2 or \
            args.iters <= 0 or args.warmup < 0:
        p.error("need 4 <= --min-bytes <= --max-bytes, --factor >= 2, --warmup >= 0, --iters > 0")
    try:
        import torch  # noqa: F401
        import torch.distributed as dist
        if not dist.is_available() or not dist.is_gloo_available():
            raise ImportError("torch.distributed with gloo is not available in this build")
    except ImportError as e:
        print(f"torch_gloo_bench: cannot use torch with {sys.executable}: {e}", file=sys.stderr)
        return 3

    if "CONSORT_LAUNCH_RANK" in os.environ:
        return run_rank(int(os.environ["CONSORT_LAUNCH_RANK"]),
                        int(os.environ["CONSORT_LAUNCH_SIZE"]), launcher_rendezvous(), args)
    init = f"tcp://127.0.0.1:{free_port()}"
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=spawned_rank, args=(r, args.workers, init, args))
             for r in range(args.workers)]
    for proc in procs:
        proc.start()
    # When one rank fails the others would wait for it until gloo's timeout: stop them.
    status = 0
    while any(proc.is_alive() for proc in procs):
        for proc in procs:
            proc.join(0.2)
            if proc.exitcode not in (None, 0) and status == 0:
                status = proc.exitcode if proc.exitcode > 0 else 1
                for other in procs:
                    if other.is_alive():
                        other.terminate()
    for proc in procs:
        proc.join()
        if proc.exitcode != 0 and status == 0:
            status = proc.exitcode if proc.exitcode > 0 else 1
    return status


if __name__ == "__main__":
    sys.exit(main())
