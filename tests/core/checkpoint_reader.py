"""Reads a consort checkpoint with numpy alone (the reader of docs/checkpoints.md) and prints each
tensor as `name dtype shape values...`, values as Python's repr of each element as a float or int,
so that tests/core/checkpoint_test.cpp can compare them with what it wrote.

Usage: python3 checkpoint_reader.py FILE
"""
import json
import struct
import sys

import numpy as np

DTYPES = {"F32": "<f4", "F64": "<f8", "F16": "<f2", "BF16": "<u2", "I32": "<i4",
          "I64": "<i8", "U8": "u1", "BOOL": "?"}


def load(path):
    """The ten-line reader: {name: numpy array} and the metadata."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    meta = header.pop("__metadata__", {})
    out = {}
    for name, e in header.items():
        begin, end = e["data_offsets"]
        a = np.frombuffer(data[begin:end], dtype=DTYPES[e["dtype"]]).reshape(e["shape"])
        if e["dtype"] == "BF16":  # numpy has no bfloat16: widen to float32
            a = (a.astype(np.uint32) << 16).view(np.float32)
        out[name] = a
    return out, meta


def main():
    tensors, meta = load(sys.argv[1])
    print("step", meta["consort.step"])
    for name, a in sorted(tensors.items()):
        values = " ".join(repr(float(v)) if a.dtype.kind == "f" else repr(int(v))
                          for v in a.reshape(-1))
        print(name, a.dtype.name, list(a.shape), values)


if __name__ == "__main__":
    main()
