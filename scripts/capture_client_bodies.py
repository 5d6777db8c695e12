"""Record what an OpenAI client really sends: a reverse proxy in front of `vtoken serve` that writes the first
request body of each (client, path) to a JSON file and passes everything through unchanged, streams included.
How the fixtures in tests/data/openai_clients/ were captured (GuideLLM, AIPerf), so that CI needs neither tool:

    python scripts/capture_client_bodies.py --upstream http://127.0.0.1:8000 --port 8001 --name guidellm \\
        --out tests/data/openai_clients
    guidellm run --backend kind=openai_http,target=http://127.0.0.1:8001 ...   # then Ctrl-C the proxy
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

SKIP = {"host", "content-length", "transfer-encoding", "connection"}


def app(upstream: str, name: str, out: Path) -> Starlette:
    client = httpx.AsyncClient(base_url=upstream, timeout=600)
    seen: set[str] = set()

    async def proxy(request: Request) -> Response:
        body = await request.body()
        path = request.url.path
        if request.method == "POST" and path not in seen and body:
            seen.add(path)
            stem = f"{name}_{path.strip('/').replace('/', '_')}"
            record = {"client": name, "path": path, "body": json.loads(body)}
            (out / f"{stem}.json").write_text(json.dumps(record, indent=2) + "\n")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in SKIP}
        req = client.build_request(request.method, path, params=request.query_params, headers=headers, content=body)
        resp = await client.send(req, stream=True)
        out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in SKIP}
        return StreamingResponse(resp.aiter_raw(), resp.status_code, out_headers, background=None)

    return Starlette(routes=[Route("/{path:path}", proxy, methods=["GET", "POST"])])


def main() -> None:
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--upstream", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--name", required=True, help="the client's name, the files' prefix")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    uvicorn.run(app(a.upstream, a.name, a.out), host="127.0.0.1", port=a.port, log_level="warning")


if __name__ == "__main__":
    main()
