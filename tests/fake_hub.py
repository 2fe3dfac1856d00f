"""A Hugging Face hub on this machine: the HTTP endpoints huggingface_hub's snapshot download calls, serving folders.

Point a process at it with HF_ENDPOINT=hub.url: `repo_info` (/api/models/<id>[/revision/<rev>]), the recursive
tree listing (/api/models/<id>/tree/<rev>: size, git blob id, and an LFS sha256 for *.safetensors), and
/<id>/resolve/<rev>/<file> (HEAD and GET, with Range). Failures to inject, per file (key `<id>/<file>`):
`cut[key] = n` sends the first n bytes of the next GET and drops the connection; `broken.add(key)` answers its GETs
500 until removed. `gets` counts each key's GETs and `ranges` the Range headers seen, so a test can tell what was
downloaded again.
"""
from __future__ import annotations

import hashlib
import json
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse


class FakeHub:
    def __init__(self):
        self.repos: dict[str, tuple[str, dict[str, bytes]]] = {}  # id -> (commit, files)
        self.cut: dict[str, int] = {}
        self.broken: set[str] = set()
        self.gets: Counter = Counter()
        self.ranges: list[tuple[str, str]] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def add(self, repo_id: str, folder: Path, commit: str | None = None) -> str:
        files = {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
        commit = commit or hashlib.sha1(repo_id.encode() + b"".join(files.values())).hexdigest()
        self.repos[repo_id] = (commit, files)
        return commit

    def __enter__(self) -> "FakeHub":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    # ---------------------------------------------------------------------------------------- the endpoints
    def _find(self, parts: list[str]):
        """(repo id, commit, rest of the path) for `<org>/<name>/<verb>/<rev>/...`."""
        repo_id = "/".join(parts[:2])
        if repo_id not in self.repos or len(parts) < 4:
            return None
        commit, _ = self.repos[repo_id]
        rev = parts[3]
        if rev not in ("main", commit):
            return None
        return repo_id, commit, "/".join(parts[4:])

    @staticmethod
    def _lfs(name: str) -> bool:
        return name.endswith(".safetensors")

    def _tree(self, repo_id: str) -> list[dict]:
        _, files = self.repos[repo_id]
        out = []
        for name, data in files.items():
            blob = hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()
            entry = {"type": "file", "path": name, "size": len(data), "oid": blob}
            if self._lfs(name):
                entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
            out.append(entry)
        return out

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _json(self, value, status=200):
                body = json.dumps(value).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _missing(self):
                self.send_response(404)
                self.send_header("X-Error-Code", "RepoNotFound")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_HEAD(self):
                self.do_GET()

            def do_GET(self):
                parts = [unquote(p) for p in urlparse(self.path).path.strip("/").split("/")]
                if parts[:2] == ["api", "models"]:
                    if len(parts) == 4:  # the repository's info at main
                        parts += ["revision", "main"]
                    found = hub._find(parts[2:])
                    if found is None:
                        return self._missing()
                    repo_id, commit, _ = found
                    if parts[4] == "revision":
                        files = hub.repos[repo_id][1]
                        return self._json({"id": repo_id, "sha": commit, "siblings": [{"rfilename": f} for f in files]})
                    if parts[4] == "tree":
                        return self._json(hub._tree(repo_id))
                    return self._missing()
                found = hub._find(parts)
                if found is None or parts[2] != "resolve" or found[2] not in hub.repos[found[0]][1]:
                    return self._missing()
                repo_id, commit, name = found
                data = hub.repos[repo_id][1][name]
                key = f"{repo_id}/{name}"
                if key in hub.broken and self.command == "GET":  # a HEAD answered: the failure is mid-download
                    self.send_response(500)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                blob = hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()
                etag = hashlib.sha256(data).hexdigest() if hub._lfs(name) else blob
                start = 0
                rng = self.headers.get("Range")
                if self.command == "GET":
                    hub.gets[key] += 1
                    if rng:
                        hub.ranges.append((key, rng))
                        start = int(rng.split("=")[1].split("-")[0])
                self.send_response(206 if start else 200)
                self.send_header("X-Repo-Commit", commit)
                self.send_header("ETag", f'"{etag}"')
                if hub._lfs(name):
                    self.send_header("X-Linked-Etag", f'"{etag}"')
                    self.send_header("X-Linked-Size", str(len(data)))
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("Content-Length", str(len(data) - start))
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                self.end_headers()
                if self.command == "HEAD":
                    return
                cut = hub.cut.pop(key, None)
                if cut is not None:
                    self.wfile.write(data[start:start + cut])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.wfile.write(data[start:])

        return Handler
