"""A recording proxy between hsq's worker and SGLang: the expert choices of every prefill.

hsq's worker sends `/generate` with `max_new_tokens: 0` and reads only `prompt_tokens` and
`cached_tokens`; it has no reason to ask for routing. The MoE equality check needs the
experts SGLang chose in the very forward whose states were dumped (a re-run alone may
route differently), so the live test puts this proxy at the URL the worker is given. It
adds `return_routed_experts: true` (the server runs with --enable-return-routed-experts)
and asks for one new token (SGLang returns routing for positions [0, seqlen - 1): with 0
new tokens the last prompt token would be missing), keeps `meta_info.routed_experts`
(base64 int32 [T, layers, k]) by rid, and answers with the rest.

Failures look to the worker as they would without the proxy: SGLang unreachable -> 503
(hsq: server unavailable, not the sample's fault); a connection that breaks mid-request
-> the proxy drops the worker's connection without an answer (hsq: mid-request failure).
"""

from __future__ import annotations

import base64
import json
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import numpy as np

from hsq.dump.format import fingerprint


@dataclass(frozen=True)
class Routed:
    rid: str
    fingerprint: str
    experts: np.ndarray
    """int32 [prompt tokens, layers, k]."""


class RoutingProxy:
    def __init__(
        self, upstream: str, *, num_layers: int, top_k: int, one_more_token: bool = True
    ) -> None:
        self.upstream = upstream.rstrip("/")
        self.one_more_token = one_more_token
        """False for a prefill-only server (hsq's reference server, in CPU tests)."""
        self.num_layers, self.top_k = num_layers, top_k
        self.by_rid: dict[str, Routed] = {}
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._client = httpx.Client(timeout=httpx.Timeout(600.0, connect=5.0))
        self._http = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._http.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._http.server_address[1]}"
        self._thread = threading.Thread(target=self._http.serve_forever, daemon=True)

    def __enter__(self) -> RoutingProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._http.shutdown()
        self._http.server_close()
        self._client.close()

    def for_input(self, input_ids: list[int]) -> list[Routed]:
        """Every recorded routing of this input (one per answered attempt)."""
        fp = fingerprint(input_ids)
        with self._lock:
            return [r for r in self.by_rid.values() if r.fingerprint == fp]

    def _record(self, body: dict[str, Any], answer: dict[str, Any]) -> None:
        info = answer.get("meta_info") or {}
        raw = info.pop("routed_experts", None)
        rid, ids = str(body.get("rid")), body.get("input_ids") or []
        if raw is None:
            self.errors.append(f"{rid}: no routed_experts in the answer")
            return
        flat = np.frombuffer(base64.b64decode(raw), dtype=np.int32)
        per_row = self.num_layers * self.top_k
        if flat.size != len(ids) * per_row:
            self.errors.append(f"{rid}: {flat.size} expert ids for {len(ids)} tokens")
            return
        routed = Routed(rid, fingerprint(ids), flat.reshape(len(ids), self.num_layers, -1))
        with self._lock:
            self.by_rid[rid] = routed

    def _relay(self, body: dict[str, Any], r: httpx.Response) -> tuple[int, bytes]:
        """The answer without its routing (recorded); a 502 when it cannot be read: the
        sample dies with the reason, never retried unseen."""
        try:
            answer = r.json()
            self._record(body, answer)
        except Exception as exc:
            self.errors.append(f"{body.get('rid')}: {type(exc).__name__}: {exc}")
            return 502, json.dumps({"error": f"proxy: {exc!r}"}).encode()
        return 200, json.dumps(answer).encode()

    def _rewrite(self, body: dict[str, Any]) -> dict[str, Any]:
        sent = dict(body, return_routed_experts=True)
        params = dict(sent.get("sampling_params") or {})
        if self.one_more_token:
            params["max_new_tokens"] = max(1, int(params.get("max_new_tokens") or 0))
        sent["sampling_params"] = params
        return sent

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _answer(self, status: int, data: bytes, ctype: str = "application/json") -> None:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _forward(self, method: str, body: bytes | None) -> httpx.Response | None:
                try:
                    # FastAPI reads a body without its content type as bytes (400)
                    headers = {"Content-Type": "application/json"} if body is not None else {}
                    return proxy._client.request(
                        method, proxy.upstream + self.path, content=body, headers=headers
                    )
                except (httpx.ConnectError, httpx.ConnectTimeout):
                    self._answer(503, b'{"error": "upstream unreachable"}')
                except httpx.HTTPError:
                    self.close_connection = True  # no answer: a mid-request failure
                return None

            def do_GET(self) -> None:
                r = self._forward("GET", None)
                if r is not None:
                    self._answer(r.status_code, r.content, r.headers.get("content-type", ""))

            def do_POST(self) -> None:
                data = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.path != "/generate":
                    r = self._forward("POST", data)
                    if r is not None:
                        self._answer(r.status_code, r.content)
                    return
                body = json.loads(data)
                r = self._forward("POST", json.dumps(proxy._rewrite(body)).encode())
                if r is None:
                    return
                if r.status_code != 200:
                    self._answer(r.status_code, r.content)
                    return
                status, data = proxy._relay(body, r)
                self._answer(status, data)

        return Handler
