"""bench quality's measures on a tiny model: a mode against itself agrees fully with zero KL,
and a different mode is measured as different."""

from __future__ import annotations

from ngramspec import LLM, SamplingParams
from ngramspec.bench.quality_bench import compare, matching_prefix


def test_matching_prefix() -> None:
    assert matching_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert matching_prefix([1, 2], [1, 2, 3]) == 2
    assert matching_prefix([], [1]) == 0


def test_a_mode_against_itself_and_against_bfloat16(tiny_model_dirs) -> None:
    model = str(tiny_model_dirs["llama"])
    ref = LLM(model, dtype="float32", num_threads=2)
    prompts = [[5, 17, 42, 99, 7], [3, 3, 8, 1, 250, 14, 9]]
    same = compare(ref, LLM(model, dtype="float32", num_threads=2), prompts, max_tokens=12,
                   mode="same")
    assert same.positions == 24
    assert same.argmax_agreement == 1.0 and abs(same.mean_kl) < 1e-6
    assert same.mean_matching_prefix == 12
    bf16 = compare(ref, LLM(model, dtype="bfloat16", num_threads=2), prompts, max_tokens=12,
                   mode="bfloat16")
    assert bf16.mode == "bfloat16"
    assert bf16.mean_kl > 1e-7, "bfloat16 measured as identical to float32: the scorer is blind"


# A stand-in llama-server whose greedy continuation repeats the prompt's last token.
FAKE_LLAMA = r'''
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
class H(BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def _send(self, body):
        data = json.dumps(body).encode()
        self.send_response(200); self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data))); self.end_headers(); self.wfile.write(data)
    def do_GET(self):
        self._send({"status": "ok"} if self.path == "/health" else {"data": [{"id": "fake"}]})
    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert self.path == "/completion" and req["temperature"] == 0.0 and req["return_tokens"]
        self._send({"tokens": [req["prompt"][-1]] * req["n_predict"]})
HTTPServer(("127.0.0.1", port), H).serve_forever()
'''


def test_llama_server_agreement_is_measured_position_by_position(tiny_model_dirs, tmp_path) -> None:
    import sys

    from ngramspec.bench.quality_bench import compare_llama_server

    fake = tmp_path / "llama-server"
    fake.write_text(f"#!{sys.executable}\n{FAKE_LLAMA}")
    fake.chmod(0o755)
    ref = LLM(str(tiny_model_dirs["llama"]), dtype="float32", num_threads=2)
    prompts = [[5, 17, 42, 99, 7], [3, 3, 8, 1, 250, 14, 9]]
    r = compare_llama_server(fake, tmp_path / "m.gguf", 2, ref, prompts, max_tokens=10)
    outs = [o.token_ids for o in ref.generate(prompts, SamplingParams(temperature=0, max_tokens=10))]
    # the stand-in predicts each position's previous token
    hits = sum((p + o)[len(p) + i - 1] == o[i] for p, o in zip(prompts, outs) for i in range(len(o)))
    assert r.mode == "llama-server" and r.positions == 20 and r.mean_kl is None
    assert r.argmax_agreement == hits / 20
    repeats = [matching_prefix(o, [p[-1]] * len(o)) for p, o in zip(prompts, outs)]
    assert r.mean_matching_prefix == sum(repeats) / 2
