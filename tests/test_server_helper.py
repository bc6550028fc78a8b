"""tests/_server.py without vLLM: /metrics parsing on vLLM's exposition format, and VllmServer's start-up
wait, failure report and stop on stand-in server processes (its command replaced)."""

from __future__ import annotations

import sys
import textwrap

import pytest
from _server import ServerError, VllmServer, parse_metrics, per_label, spec_counters

# The shape of vLLM 0.32's /metrics for the spec-decode counters (two engines' label sets, _created samples).
METRICS = """\
# HELP vllm:spec_decode_num_drafts Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="tiny"} 100.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="tiny"} 1.7e+09
vllm:spec_decode_num_drafts_total{engine="1",model_name="tiny"} 20.0
# HELP vllm:spec_decode_num_draft_tokens Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="tiny"} 240.0
# HELP vllm:spec_decode_num_accepted_tokens Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="tiny"} 150.0
# HELP vllm:spec_decode_num_accepted_tokens_per_pos Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="tiny",position="1"} 60.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="tiny",position="0"} 90.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
"""


def test_parse_metrics_sums_label_sets():
    m = parse_metrics(METRICS)
    assert m["vllm:spec_decode_num_drafts_total"] == 120.0
    assert m["vllm:num_requests_running"] == 3.0
    assert spec_counters(m) == {"num_drafts": 120.0, "num_draft_tokens": 240.0, "num_accepted_tokens": 150.0}
    assert spec_counters({}) == {"num_drafts": 0.0, "num_draft_tokens": 0.0, "num_accepted_tokens": 0.0}
    by_pos = per_label(METRICS, "vllm:spec_decode_num_accepted_tokens_per_pos_total", "position")
    assert by_pos == {"0": 90.0, "1": 60.0}


# A stand-in for the API server: /health answers 200 after a delay, /metrics serves METRICS.
_STAND_IN = textwrap.dedent(
    """
    import sys, time
    from http.server import BaseHTTPRequestHandler, HTTPServer
    time.sleep(1.0)
    body = open(sys.argv[2]).read().encode()
    class H(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path in ("/health", "/metrics") else 404)
            self.end_headers()
            if self.path == "/metrics":
                self.wfile.write(body)
        def log_message(self, *a):
            print("request", self.path, flush=True)
    print("stand-in up", flush=True)
    HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
    """
)


def test_server_starts_serves_metrics_and_stops(tmp_path):
    metrics = tmp_path / "metrics.txt"
    metrics.write_text(METRICS)
    server = VllmServer("unused", log=tmp_path / "server.log", timeout=60)
    server.cmd = [sys.executable, "-c", _STAND_IN, str(server.port), str(metrics)]
    with server:
        assert server.healthy()
        assert server.metric("vllm:spec_decode_num_accepted_tokens_total") == 150.0
        assert server.metric("absent") == 0.0
        assert server.startup_s is not None and server.startup_s >= 1.0
        proc = server.proc
    assert proc.poll() is not None, "the server still runs after the context exited"
    assert "stand-in up" in server.log_text() and "request /metrics" in server.log_text()


def test_server_exiting_during_start_up_reports_its_log(tmp_path):
    server = VllmServer("unused", log=tmp_path / "server.log", timeout=60)
    server.cmd = [sys.executable, "-c", "import sys; print('no such model'); sys.exit(3)"]
    with pytest.raises(ServerError, match=r"exited with 3 during start-up:\n(.|\n)*no such model"):
        server.start()


def test_server_not_healthy_in_time_is_stopped(tmp_path):
    server = VllmServer("unused", log=tmp_path / "server.log", timeout=2)
    server.cmd = [sys.executable, "-c", "import time; print('loading', flush=True); time.sleep(600)"]
    with pytest.raises(ServerError, match=r"did not answer /health in 2 s:\n(.|\n)*loading"):
        server.start()
    assert server.proc.poll() is not None
