"""A stand-in for llama.cpp's llama-server, run as its binary by the bench tests.

/health and /v1/models answer as llama-server does. /v1/completions answers greedy-like text that
depends on the prompt, changed by `--spec-type ngram-simple` (a speculative mode that is not
lossless), one token long unless `ignore_eos` asks for max_tokens, streamed as one chunk a token when asked; /completion (llama-server's own endpoint) repeats the prompt's last token.
"""

import json
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer


class Handler(BaseHTTPRequestHandler):
    simple = False

    def log_message(self, *args):
        pass

    def _send(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._send({"status": "ok"} if self.path == "/health" else {"data": [{"id": "fake"}]})

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert req["temperature"] == 0.0
        if self.path == "/completion":
            assert req["return_tokens"]
            self._send({"tokens": [req["prompt"][-1]] * req["n_predict"]})
            return
        assert req["model"] == "fake"
        text = "x" * (sum(req["prompt"]) % 7) + ("!" if self.simple else "")
        tokens = req["max_tokens"] if req["ignore_eos"] else 1  # an early end of text otherwise
        if req.get("stream"):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for _ in range(tokens):
                self.wfile.write(b"data: " + json.dumps({"choices": [{"text": "x"}]}).encode() + b"\n\n")
            self.wfile.write(b"data: [DONE]\n\n")
            return
        self._send({"choices": [{"text": text}], "usage": {"completion_tokens": tokens}})


if __name__ == "__main__":
    args = sys.argv[1:]
    Handler.simple = "ngram-simple" in args
    HTTPServer(("127.0.0.1", int(args[args.index("--port") + 1])), Handler).serve_forever()
