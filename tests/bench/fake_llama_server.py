"""A stand-in for llama.cpp's ``llama-server`` (tests only): the flags the bench passes, ``GET
/health`` and a streaming ``POST /completion`` that answers ``n_predict`` made-up tokens with the
timings fields llama.cpp sends. Every request body is appended to ``$FAKE_LLAMA_LOG`` (JSON lines,
with this process's pid and flags) so a test can check what the bench asked for."""

from __future__ import annotations

import argparse
import json
import os
from http.server import BaseHTTPRequestHandler, HTTPServer

p = argparse.ArgumentParser()
p.add_argument("-m", required=True)
p.add_argument("-md", default=None)
p.add_argument("--port", type=int, required=True)
p.add_argument("--host", default="127.0.0.1")
p.add_argument("--spec-draft-n-max", type=int, default=3)
args, _ = p.parse_known_args()


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):  # quiet
        pass

    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
        self.wfile.write(b'{"status": "ok"}')

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with open(os.environ["FAKE_LLAMA_LOG"], "a") as log:
            log.write(json.dumps({"pid": os.getpid(), "draft": args.md, "k": args.spec_draft_n_max, **body}) + "\n")
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        last = body["prompt"][-1]
        for i in range(body["n_predict"]):
            self.wfile.write(
                b"data: " + json.dumps({"tokens": [(last + i + 1) % 40], "stop": False}).encode() + b"\n\n"
            )
        timings = {"prompt_n": len(body["prompt"]), "prompt_ms": 2.5, "predicted_n": body["n_predict"]}
        if args.md:
            timings.update(draft_n=4, draft_n_accepted=3)
        self.wfile.write(b"data: " + json.dumps({"tokens": [], "stop": True, "timings": timings}).encode() + b"\n\n")


HTTPServer((args.host, args.port), Handler).serve_forever()
