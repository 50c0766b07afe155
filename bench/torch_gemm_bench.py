#!/usr/bin/env python3
"""torch_gemm_bench.py: cuBLAS (through torch) on the shapes of bench/gemm_bench, timed the same way.

For each hidden width H and the batch B, three float32 GEMMs of one step of the training demo:
forward  relu(A [B, H] @ W [H, H] + bias), grad_w  A^T @ delta ([H, B] x [B, H]) and grad_x
delta @ W^T. TF32 is off (torch.backends.cuda.matmul.allow_tf32 = False, torch's default), so
cuBLAS does float32 arithmetic, as our kernels do. The time is CUDA events around --iters
back-to-back calls after 3 warm-up calls; GFLOP/s is 2 M N K / time. Rows print as gemm_bench's do,
so the two tables line up.

Usage:
  python3 bench/torch_gemm_bench.py [--batch 512] [--hidden 512,1024,4096] [--iters 50] [--json FILE]

Without torch it says so and exits 3; without a GPU it says so and exits 0.
"""

import argparse
import json
import sys


def positive_list(text):
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return values


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=lambda t: positive_list(t)[0], default=512)
    parser.add_argument("--hidden", type=positive_list, default=[512, 1024, 4096])
    parser.add_argument("--iters", type=lambda t: positive_list(t)[0], default=50)
    parser.add_argument("--json")
    args = parser.parse_args()
    try:
        import torch
    except ImportError as e:
        print(f"torch_gemm_bench: torch is not installed ({e})", file=sys.stderr)
        return 3
    if not torch.cuda.is_available():
        print("# torch_gemm_bench: no GPU visible; nothing to measure")
        return 0
    torch.backends.cuda.matmul.allow_tf32 = False
    device = torch.device("cuda:0")
    gen = torch.Generator(device=device).manual_seed(12345)
    print(f"# torch_gemm_bench: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
          f"batch {args.batch}, {args.iters} iterations per shape (cuBLAS, TF32 off)")
    print(f"# {'gemm':<8} {'M':>6} {'N':>6} {'K':>6} {'time (us)':>12} {'GFLOP/s':>10}")
    rows = []
    b = args.batch
    for h in args.hidden:
        def rand(*shape):
            return torch.rand(*shape, device=device, generator=gen) - 0.5
        a, w, bias, delta = rand(b, h), rand(h, h), rand(h), rand(b, h)
        cases = [
            ("forward", b, h, h, lambda: torch.relu(torch.addmm(bias, a, w))),
            ("grad_w", h, h, b, lambda: a.t() @ delta),
            ("grad_x", b, h, h, lambda: delta @ w.t()),
        ]
        for name, m, n, k, fn in cases:
            for _ in range(3):
                fn()
            begin = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            begin.record()
            for _ in range(args.iters):
                fn()
            end.record()
            end.synchronize()
            us = begin.elapsed_time(end) * 1e3 / args.iters
            gflops = 2.0 * m * n * k / (us * 1e3)
            print(f"  {name:<8} {m:>6} {n:>6} {k:>6} {us:>12.1f} {gflops:>10.0f}")
            rows.append({"gemm": name, "m": m, "n": n, "k": k, "us": us, "gflops": gflops})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
