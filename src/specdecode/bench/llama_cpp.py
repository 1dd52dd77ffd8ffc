"""llama.cpp in the same ``specdecode bench`` run (``--llama-server PATH``): its plain decoding and
its own draft-model speculation on the same GGUF files, fed the same prompt token ids.

Each is a ``llama-server`` (one slot, ``--threads`` as ours, AMX as built) started once on a free
loopback port and asked one streaming ``POST /completion`` per prompt, interleaved with our cells:
``cache_prompt`` as our prefix cache (on: a prompt reuses the common start of the one before;
off: every prompt is prefilled), greedy as temperature 0, sampling
with every other sampler disabled (top-k 0, top-p 1, min-p 0: llama.cpp's default min-p is 0.05),
the prompt's seed. Timings are taken on this side (TTFT is the first streamed token's arrival);
llama.cpp's own counters give prefill time and draft acceptance. An optional bench dependency:
never needed by tests beyond a stand-in server.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from specdecode.bench.report import reference_stats
from specdecode.errors import InputError

BINARY = "llama-server"
DEFAULT_K = 4  # llama.cpp's draft length when the run measures no fixed k
START_TIMEOUT_S = 300.0  # loading a 1.5B GGUF and warming up takes ~10 s; a cold disk more


def find_binary(path: str) -> Path:
    """``path`` itself, or the ``llama-server`` in the folder ``path``; InputError otherwise."""
    p = Path(path).expanduser()
    p = p / BINARY if p.is_dir() else p
    if not (p.is_file() and os.access(p, os.X_OK)):
        raise InputError(f"--llama-server: no executable llama-server at {path}")
    return p


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LlamaServer:
    """One ``llama-server`` process over ``model`` (and ``draft``, drafting up to ``k`` tokens)."""

    def __init__(
        self,
        binary: Path,
        model: Path,
        threads: int,
        context: int,
        log: Path,
        draft: Path | None = None,
        k: int = DEFAULT_K,
        cache_prompt: bool = False,
    ) -> None:
        self.port = _free_port()
        self.cache_prompt = cache_prompt
        cmd = [str(binary), "-m", str(model), "-t", str(threads), "-c", str(context), "-np", "1"]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port)]
        if draft is not None:
            cmd += ["-md", str(draft), "-td", str(threads), "--spec-type", "draft-simple", "--spec-draft-n-max", str(k)]
        self.command = cmd
        env = {
            **os.environ,
            "LD_LIBRARY_PATH": os.pathsep.join([str(binary.parent), os.environ.get("LD_LIBRARY_PATH", "")]),
        }
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise InputError(f"llama-server exited ({self.proc.returncode}) while loading: {self._log_tail()}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        self.close()
        raise InputError(f"llama-server did not answer /health in {START_TIMEOUT_S:.0f} s: {self._log_tail()}")

    def _log_tail(self) -> str:
        try:
            lines = [ln for ln in self.log.read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            return "(no log)"
        return " | ".join(lines[-3:]) or "(empty log)"

    def peak_rss_mb(self) -> float:
        """The server process's peak resident memory (VmHWM), in MiB; 0 where unreadable."""
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
        except OSError:
            pass
        return 0.0

    def generate(
        self, ids: list[int], max_new_tokens: int, temperature: float, seed: int, top_p: float = 1.0
    ) -> tuple[list[int], dict[str, Any]]:
        """One completion of prompt ``ids``: (new token ids, a stats record like the engine's)."""
        body = {
            "prompt": list(ids),
            "n_predict": max_new_tokens,
            "temperature": temperature,
            "top_k": 0 if temperature > 0 else 1,
            "top_p": top_p,
            "min_p": 0.0,
            "typical_p": 1.0,
            "repeat_penalty": 1.0,
            "seed": seed % (1 << 31),
            "cache_prompt": self.cache_prompt,
            "stream": True,
            "return_tokens": True,
        }
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        start = time.perf_counter()
        conn.request("POST", "/completion", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise InputError(f"llama-server answered {resp.status}: {resp.read()[:200]!r}")
        tokens: list[int] = []
        first, timings = None, {}
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            chunk = json.loads(line[5:])
            if chunk.get("tokens"):
                first = first if first is not None else time.perf_counter()
                tokens.extend(int(t) for t in chunk["tokens"])
            if chunk.get("stop"):
                timings = chunk.get("timings") or {}
                break
        total = time.perf_counter() - start
        conn.close()
        return tokens, self._stats(len(ids), tokens, total, (first or start + total) - start, timings)

    def _stats(self, prompt: int, tokens: list[int], total: float, ttft: float, timings: dict) -> dict[str, Any]:
        drafted, accepted = int(timings.get("draft_n", 0)), int(timings.get("draft_n_accepted", 0))
        prefill = float(timings.get("prompt_ms", 0.0)) / 1000
        rss = self.peak_rss_mb()
        return reference_stats(
            "llama.cpp", "llama.cpp", prompt, len(tokens), total, ttft, rss, drafted, accepted, prefill
        )

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
