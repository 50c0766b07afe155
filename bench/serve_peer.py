"""The peer of consort-serve in bench/serve_bench.sh: what a user would write instead. Python's
standard http.server (ThreadingHTTPServer, a thread per connection) answering the same API
(POST /v1/models/NAME:predict with {"instances": [...]} -> {"predictions": [...]}, softmax
probabilities) with a torch forward pass of the same checkpoint (docs/checkpoints.md's reader).

Usage: python3 serve_peer.py CHECKPOINT_FILE NAME   (prints "listening on HOST:PORT", port 0)
"""
import json
import struct
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import torch

DTYPES = {"F32": "<f4", "F64": "<f8", "I32": "<i4", "I64": "<i8"}


def load(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    header.pop("__metadata__", None)
    return {name: torch.from_numpy(np.frombuffer(
        data[e["data_offsets"][0]:e["data_offsets"][1]], dtype=DTYPES[e["dtype"]])
        .reshape(e["shape"]).copy()) for name, e in header.items()}


def main():
    params = load(sys.argv[1])
    name = sys.argv[2]
    layers = len([k for k in params if k.startswith("w")]) - 1
    inputs = params["w1"].shape[0]
    path = "/v1/models/%s:predict" % name

    def forward(x):
        h = x
        for l in range(1, layers + 2):
            h = h @ params["w%d" % l] + params["b%d" % l]
            if l <= layers:
                h = torch.relu(h)
        return torch.softmax(h, dim=1)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as wrk expects
        # The headers and the body go out in two writes: without this, Nagle's algorithm holds
        # the body until the client's delayed ACK (40 ms) on every request.
        disable_nagle_algorithm = True

        def log_message(self, *args):
            pass

        def answer(self, status, body):
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self.path != path:
                return self.answer(404, {"error": "no such path"})
            try:
                rows = json.loads(body)["instances"]
                x = torch.tensor(rows, dtype=torch.float32)
                if x.dim() != 2 or x.shape[1] != inputs:
                    raise ValueError("expected rows of %d features" % inputs)
            except Exception as e:
                return self.answer(400, {"error": str(e)})
            with torch.no_grad():
                probs = forward(x)
            self.answer(200, {"predictions": probs.tolist()})

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    print("listening on 127.0.0.1:%d" % server.server_address[1], flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
