#!/usr/bin/env python3
"""A local stand-in for the Hugging Face hub, for scripts (server/tests/hub.rs has the test one).

Serves the files under ROOT/OWNER/NAME/... as the repo OWNER/NAME, with the two endpoints
`hearth pull` uses:
    GET /api/models/OWNER/NAME/revision/REV?blobs=true   the listing (sizes, SHA-256s)
    GET /OWNER/NAME/resolve/COMMIT/PATH                  the file, with HTTP ranges
The SHA-256 of each file is computed once at start (about 1 s per GB). Standard library
only; traffic stays on the address it binds (127.0.0.1 by default).

    scripts/hub-standin.py ROOT --port 18400
"""
import argparse
import hashlib
import json
import os
import re
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

COMMIT = "0" * 40
CHUNK = 1 << 20


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(16 * CHUNK)
            if not b:
                return h.hexdigest()
            h.update(b)


def scan(root):
    repos = {}
    for owner in sorted(os.listdir(root)):
        for name in sorted(os.listdir(os.path.join(root, owner))):
            base = os.path.join(root, owner, name)
            files = []
            for dirpath, _, names in os.walk(base):
                for n in sorted(names):
                    full = os.path.join(dirpath, n)
                    rel = os.path.relpath(full, base)
                    print(f"hub-standin: hashing {owner}/{name}/{rel}", file=sys.stderr, flush=True)
                    files.append({"path": rel, "full": full, "size": os.path.getsize(full), "sha256": sha256(full)})
            repos[f"{owner}/{name}"] = files
    return repos


def handler(repos):
    class Hub(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):
            print("hub-standin: " + fmt % args, file=sys.stderr, flush=True)

        def send_json(self, status, body):
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            path = self.path.split("?", 1)[0]
            m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/revision/[^/]+", path)
            if m:
                files = repos.get(m.group(1))
                if files is None:
                    return self.send_json(404, {"error": "Repository not found"})
                siblings = [{"rfilename": f["path"], "size": f["size"], "blobId": f["sha256"][:40],
                             "lfs": {"sha256": f["sha256"], "size": f["size"], "pointerSize": 130}} for f in files]
                return self.send_json(200, {"id": m.group(1), "sha": COMMIT, "siblings": siblings})
            m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/[^/]+/(.+)", path)
            f = m and next((f for f in repos.get(m.group(1), []) if f["path"] == m.group(2)), None)
            if not f:
                return self.send_json(404, {"error": "Entry not found"})
            size, start, end = f["size"], 0, f["size"]
            r = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
            if r:
                start = int(r.group(1))
                end = min(size, int(r.group(2)) + 1) if r.group(2) else size
                if start >= size:
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{size}")
                    self.send_header("Content-Length", "0")
                    return self.end_headers()
            self.send_response(206 if r else 200)
            if r:
                self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
            self.send_header("Content-Length", str(end - start))
            self.send_header("ETag", f'"{f["sha256"]}"')
            self.end_headers()
            with open(f["full"], "rb") as src:
                src.seek(start)
                left = end - start
                while left > 0:
                    b = src.read(min(CHUNK, left))
                    if not b:
                        break
                    self.wfile.write(b)
                    left -= len(b)

    return Hub


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("root")
    p.add_argument("--port", type=int, default=18400)
    p.add_argument("--bind", default="127.0.0.1")
    a = p.parse_args()
    repos = scan(a.root)
    server = ThreadingHTTPServer((a.bind, a.port), handler(repos))
    print(f"hub-standin: serving {', '.join(repos)} on http://{a.bind}:{a.port}", file=sys.stderr, flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
