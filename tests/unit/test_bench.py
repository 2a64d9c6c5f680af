"""`splitserve bench` against a fake OpenAI SSE server, plus the datasets on their own.

The fake server (asyncio `start_server`, minimal HTTP/1.1, one request per connection) streams
`deltas` text events with a small sleep between them, then a usage event and `data: [DONE]`;
every `reject_every`-th request gets 429 with `Retry-After` instead.
"""

from __future__ import annotations

import asyncio
import json
import itertools
import threading
from dataclasses import dataclass, field
from pathlib import Path

import pytest

pytest.importorskip("httpx")

from splitserve.bench.datasets import (  # noqa: E402
    BenchRequest, mooncake_requests, random_requests, shared_prefix_requests,
)
from splitserve.cli.main import main  # noqa: E402

DELTAS = 5
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@dataclass
class FakeServer:
    deltas: int = DELTAS
    sleep_s: float = 0.004
    reject_every: int = 4  # every 4th request: 429
    seen: int = 0
    bodies: list[dict] = field(default_factory=list)
    url: str = ""

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            headers = dict(line.split(": ", 1) for line in head.decode().split("\r\n")[1:] if ": " in line)
            length = int({k.lower(): v for k, v in headers.items()}.get("content-length", 0))
            body = json.loads(await reader.readexactly(length))
            self.seen += 1
            self.bodies.append(body)
            if self.seen % self.reject_every == 0:
                await self._reject(writer)
            else:
                await self._stream(writer, body)
        except ConnectionError:
            pass  # the client went away (a request cancelled at the end of a run)
        finally:
            writer.close()

    async def _reject(self, writer: asyncio.StreamWriter) -> None:
        payload = json.dumps({"error": {"message": "over capacity", "type": "rate_limit", "code": 429}}).encode()
        writer.write(b"HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/json\r\nRetry-After: 2\r\n"
                     b"Connection: close\r\nContent-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
        await writer.drain()

    async def _stream(self, writer: asyncio.StreamWriter, body: dict) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n")
        n = min(self.deltas, body["max_tokens"])
        for i in range(n):
            await asyncio.sleep(self.sleep_s)
            event = {"id": "x", "object": "text_completion", "choices": [{"index": 0, "text": f" t{i}",
                                                                         "finish_reason": None}]}
            writer.write(f"data: {json.dumps(event)}\n\n".encode())
            await writer.drain()
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n, "total_tokens": len(body["prompt"]) + n}
        writer.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())
        await writer.drain()


@pytest.fixture
def fake_server():
    server = FakeServer()
    loop = asyncio.new_event_loop()
    started, stop = threading.Event(), asyncio.Event()

    async def serve():
        srv = await asyncio.start_server(server.handle, "127.0.0.1", 0)
        server.url = f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}"
        started.set()
        async with srv:
            await stop.wait()
        handlers = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in handlers:
            t.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)

    thread = threading.Thread(target=lambda: loop.run_until_complete(serve()), daemon=True)
    thread.start()
    assert started.wait(5)
    yield server
    loop.call_soon_threadsafe(stop.set)
    thread.join(5)
    loop.close()


def _bench(server: FakeServer, out: Path, *load: str, extra: tuple[str, ...] = ()) -> dict:
    rc = main(["bench", "--url", server.url, "--model", "fake", "--dataset", "random", "--input-len", "8", "32",
               "--output-len", "16", "--num-requests", "20", "--ttft-slo-ms", "10000", "--tpot-slo-ms", "10000",
               "--out", str(out), "-q", *load, *extra])
    assert rc == 0
    return json.loads(out.read_text())


def _check_sane(doc: dict, n: int) -> None:
    s = doc["summary"]
    assert s["num_requests"] == n == len(doc["requests"])
    assert s["completed"] + s["rejected"] + s["errors"] == n
    assert s["rejected"] == n // 4 and s["errors"] == 0  # every 4th request is a 429
    assert s["status_counts"] == {"http_429": n // 4, "ok": n - n // 4}
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert set(s[key]) == {"count", "mean", "p50", "p90", "p99"}
        assert 0 < s[key]["p50"] <= s[key]["p90"] <= s[key]["p99"]
    assert s["ttft_ms"]["mean"] < s["e2e_ms"]["mean"]
    assert s["itl_ms"]["count"] == s["completed"] * (DELTAS - 1)
    assert s["total_output_tokens"] == s["completed"] * DELTAS
    assert 0 < s["goodput"] <= s["request_throughput"] + 1e-9
    assert s["output_token_throughput"] > s["request_throughput"] > 0
    for row in doc["requests"]:
        if row["status"] == "ok":
            assert 0 < row["ttft_ms"] < row["e2e_ms"] and row["output_tokens"] == DELTAS
        else:
            assert row["status"] == "http_429" and row["retry_after_s"] == 2.0


@pytest.mark.parametrize("load", [("--rate", "200"), ("--concurrency", "4")], ids=["open", "closed"])
def test_bench_against_fake_server(fake_server, tmp_path, load):
    out = tmp_path / "sub" / "bench.json"
    doc = _bench(fake_server, out, *load)
    _check_sane(doc, 20)
    assert out.with_suffix(".png").read_bytes()[:8] == PNG_MAGIC
    body = fake_server.bodies[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert all(isinstance(t, int) for t in body["prompt"]) and body["max_tokens"] == 16


def test_bench_duration_bound(fake_server, tmp_path):
    doc = _bench(fake_server, tmp_path / "b.json", "--concurrency", "2", extra=("--duration", "0.3"))
    s = doc["summary"]
    assert 0 < s["num_requests"] <= 20 and s["duration_s"] < 5


def test_bench_cancels_in_flight_after_drain_timeout(fake_server, tmp_path):
    fake_server.sleep_s = 0.2  # 5 deltas: 1 s per request, far past the bound below
    doc = _bench(fake_server, tmp_path / "c.json", "--concurrency", "2",
                 extra=("--duration", "0.3", "--drain-timeout", "0.2"))
    s = doc["summary"]
    assert s["duration_s"] < 1.0 and s["status_counts"].get("cancelled") == 2
    assert s["errors"] == 2 and s["completed"] == 0


def test_bench_survives_unreachable_server(tmp_path):
    out = tmp_path / "b.json"
    rc = main(["bench", "--url", "http://127.0.0.1:9", "--model", "m", "--concurrency", "2", "--num-requests", "3",
               "--out", str(out), "-q", "--no-plot"])
    assert rc == 0
    s = json.loads(out.read_text())["summary"]
    assert s["errors"] == 3 and s["completed"] == 0 and s["status_counts"] == {"error": 3}


@pytest.mark.parametrize("argv, message", [
    (["--rate", "1", "--concurrency", "2"], "not both"),
    ([], "needs a load"),
    (["--rate", "0"], "--rate must be > 0"),
    (["--dataset", "mooncake", "--rate", "1"], "needs --trace"),
    (["--dataset", "shared-prefix", "--concurrency", "1", "--output-len", "4", "8"], "not a range"),
])
def test_bench_bad_arguments(argv, message, capsys, tmp_path):
    assert main(["bench", "--model", "m", "--out", str(tmp_path / "x.json"), "-q", *argv]) == 1
    assert message in capsys.readouterr().err


def _tokens(r: BenchRequest) -> tuple[int, ...]:
    assert isinstance(r.prompt, tuple)
    return r.prompt


def test_random_dataset_ranges_and_seed():
    def take(seed: int) -> list[BenchRequest]:
        return list(itertools.islice(random_requests((5, 9), (2, 3), seed=seed, vocab_size=500), 50))

    a, b, c = take(1), take(1), take(2)
    assert a == b and a != c
    assert all(5 <= len(_tokens(r)) <= 9 and 2 <= r.output_len <= 3 for r in a)
    assert all(0 <= t < 500 for r in a for t in _tokens(r))
    with pytest.raises(ValueError, match="input_len"):
        next(random_requests((9, 5)))


def test_shared_prefix_shares_exactly_the_system_prompt():
    reqs = list(shared_prefix_requests(3, 4, system_len=20, question_len=6, output_len=5, seed=7, vocab_size=1000,
                                       shuffle=False))
    assert len(reqs) == 12 and all(len(_tokens(r)) == 26 and r.output_len == 5 for r in reqs)
    groups = [reqs[i * 4:(i + 1) * 4] for i in range(3)]
    for group in groups:
        systems = {_tokens(r)[:20] for r in group}
        assert len(systems) == 1  # one system prompt per group...
        assert len({_tokens(r)[20] for r in group}) == 4  # ...and the questions differ right after it
    assert len({_tokens(g[0])[0] for g in groups}) == 3  # groups differ from the first token
    assert reqs == list(shared_prefix_requests(3, 4, 20, 6, 5, seed=7, vocab_size=1000, shuffle=False))
    shuffled = list(shared_prefix_requests(3, 4, 20, 6, 5, seed=7, vocab_size=1000))
    assert sorted(shuffled, key=_tokens) == sorted(reqs, key=_tokens)


def _write_trace(path: Path) -> list[dict]:
    records = [
        {"timestamp": 1000, "input_length": 1200, "output_length": 10, "hash_ids": [0, 1, 2]},
        {"timestamp": 1500, "input_length": 1100, "output_length": 20, "hash_ids": [0, 1, 3]},
        {"timestamp": 3000, "input_length": 600, "output_length": 30, "hash_ids": [0, 4]},
        {"timestamp": 4000, "input_length": 300, "output_length": 40, "hash_ids": [5]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return records


def test_mooncake_prefixes_follow_hash_ids(tmp_path):
    trace = tmp_path / "trace.jsonl"
    records = _write_trace(trace)
    reqs = list(mooncake_requests(trace, time_scale=0.5, seed=3))
    assert [len(_tokens(r)) for r in reqs] == [r["input_length"] for r in records]
    assert [r.output_len for r in reqs] == [10, 20, 30, 40]
    assert [r.arrival_s for r in reqs] == [0.0, 0.25, 1.0, 1.5]
    blocks = [[_tokens(r)[i:i + 512] for i in range(0, len(_tokens(r)), 512)] for r in reqs]
    for a, b in [(0, 1), (0, 2), (1, 2), (0, 3)]:
        ha, hb = records[a]["hash_ids"], records[b]["hash_ids"]
        common = next((i for i, (x, y) in enumerate(zip(ha, hb)) if x != y), min(len(ha), len(hb)))
        assert blocks[a][:common] == blocks[b][:common]
        assert blocks[a][common][:50] != blocks[b][common][:50]
    assert list(mooncake_requests(trace, 0.5, seed=3)) == reqs
    assert list(mooncake_requests(trace, 0.5, seed=4)) != reqs
    assert len(list(mooncake_requests(trace, max_requests=2))) == 2


def test_mooncake_reads_the_shared_trace():
    path = Path(__file__).resolve().parents[3] / "shared" / "data" / "mooncake" / "conversation_trace.jsonl"
    if not path.is_file():
        pytest.skip(f"no trace at {path}")
    reqs = list(mooncake_requests(path, time_scale=1.0, max_requests=5, max_output_len=8))
    assert len(reqs) == 5 and all(1 <= r.output_len <= 8 for r in reqs)
    assert _tokens(reqs[0])[:512] == _tokens(reqs[1])[:512]  # both start with hash id 0


def test_mooncake_bad_trace(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        list(mooncake_requests(bad))
    with pytest.raises(ValueError, match="not found"):
        list(mooncake_requests(tmp_path / "missing.jsonl"))


def test_seeded_arrivals_are_poisson_like():
    from splitserve.bench.runner import LoadConfig, _arrival_offsets

    reqs = iter([BenchRequest((1,), 1)] * 2000)
    offsets = [t for t, _ in _arrival_offsets(reqs, LoadConfig(rate=100.0, seed=1))]
    assert offsets == sorted(offsets) and offsets[0] == 0.0
    assert 18 < offsets[-1] < 22  # 2000 arrivals at 100/s take about 20 s


def test_bench_replays_trace_timestamps(fake_server, tmp_path):
    trace = tmp_path / "trace.jsonl"
    _write_trace(trace)
    out = tmp_path / "m.json"
    assert main(["bench", "--url", fake_server.url, "--model", "fake", "--dataset", "mooncake", "--trace", str(trace),
                 "--time-scale", "0.1", "--max-output-len", "3", "--out", str(out), "-q"]) == 0
    doc = json.loads(out.read_text())
    assert doc["config"]["mode"] == "open loop, trace timestamps"
    starts = [row["start_s"] for row in doc["requests"]]
    for got, want in zip(starts, [0.0, 0.05, 0.2, 0.3]):
        assert want <= got < want + 0.05  # each request leaves at its scaled timestamp
    assert doc["summary"]["rejected"] == 1 and doc["summary"]["completed"] == 3
    assert [len(b["prompt"]) for b in fake_server.bodies] == [1200, 1100, 600, 300]


def test_bench_shared_prefix_all_at_once(fake_server, tmp_path):
    out = tmp_path / "s.json"
    assert main(["bench", "--url", fake_server.url, "--model", "fake", "--dataset", "shared-prefix", "--rate", "inf",
                 "--num-groups", "2", "--prompts-per-group", "4", "--system-prompt-len", "32", "--question-len", "4",
                 "--output-len", "8", "--out", str(out), "-q"]) == 0
    doc = json.loads(out.read_text())
    assert doc["config"]["load"]["rate"] == "inf" and doc["summary"]["num_requests"] == 8
    assert len({tuple(b["prompt"][:32]) for b in fake_server.bodies}) == 2
