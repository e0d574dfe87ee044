"""A loopback stand-in for the few Hugging Face Hub endpoints an upload uses, recording what the client sent.

It answers `create_repo` (`POST /api/repos/create`), the model card metadata check (`POST /api/validate-yaml`,
recorded), the preupload check (`POST /api/models/{repo}/preupload/{rev}`,
every file declared a regular git blob so its bytes travel inside the commit) and the commit itself
(`POST /api/models/{repo}/commit/{rev}`, an NDJSON stream). Anything else is answered 404 and recorded, so a test
sees an unexpected call. The real `huggingface_hub` client runs unchanged against it via `HF_ENDPOINT`.
"""

import base64
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse

PREUPLOAD = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/preupload/(?P<revision>[^/]+)$")
COMMIT = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/commit/(?P<revision>[^/]+)$")


class StandInHub(ThreadingHTTPServer):
    """Serves on 127.0.0.1 from a background thread; `files[repo][path]` holds the committed bytes."""

    def __init__(self):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.requests: list[tuple[str, str]] = []
        self.created: list[dict] = []
        self.commits: list[dict] = []
        self.files: dict[str, dict[str, bytes]] = {}
        self.tokens: set[str] = set()
        self.validated_cards: list[str] = []
        self._thread = threading.Thread(target=self.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_port}"

    def __enter__(self) -> "StandInHub":
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()
        self.server_close()


class _Handler(BaseHTTPRequestHandler):
    server: StandInHub

    def log_message(self, format, *args):  # keep the test output clean
        pass

    def _reply(self, status: int, payload: dict) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self.server.requests.append(("GET", self.path))
        self._reply(404, {"error": f"not served by the stand-in: GET {self.path}"})

    def do_POST(self) -> None:
        path = urlparse(self.path).path
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.server.requests.append(("POST", path))
        self.server.tokens.add(self.headers.get("Authorization", ""))
        if path == "/api/repos/create":
            payload = json.loads(body)
            self.server.created.append(payload)
            repo_id = f"{payload.get('organization') or 'stand-in-user'}/{payload['name']}"
            self.server.files.setdefault(repo_id, {})
            return self._reply(200, {"url": f"{self.server.endpoint}/{repo_id}", "name": repo_id})
        if path == "/api/validate-yaml":
            self.server.validated_cards.append(json.loads(body)["content"])
            return self._reply(200, {"errors": [], "warnings": []})
        if PREUPLOAD.match(path):
            files = json.loads(body)["files"]
            answer = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False, "oid": None} for f in files]
            return self._reply(200, {"files": answer, "commitOid": "0" * 40})
        if match := COMMIT.match(path):
            lines = [json.loads(line) for line in body.splitlines() if line.strip()]
            repo = match["repo"]
            self.server.commits.append({"repo": repo, "header": lines[0]["value"], "files": []})
            for line in lines[1:]:
                if line["key"] != "file":
                    return self._reply(400, {"error": f"stand-in only takes regular files, got {line['key']}"})
                content = base64.b64decode(line["value"]["content"])
                self.server.files.setdefault(repo, {})[line["value"]["path"]] = content
                self.server.commits[-1]["files"].append(line["value"]["path"])
            oid = f"{len(self.server.commits):040x}"
            commit_url = f"{self.server.endpoint}/{repo}/commit/{oid}"
            return self._reply(200, {"commitUrl": commit_url, "commitOid": oid, "pullRequestUrl": None})
        self._reply(404, {"error": f"not served by the stand-in: POST {path}"})
