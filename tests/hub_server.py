"""An in-memory stand-in for the Hugging Face Hub, served over real HTTP on 127.0.0.1.

It exists so that `lmpress publish` (and reloading what it published) is tested against a real HTTP
server: the unmodified `huggingface_hub` client (2.4.0, on httpx2) builds its own requests, sends them
through its own connection pool, retries, follows its own error handling, and this server answers
them the way huggingface.co does. Nothing in `huggingface_hub` is mocked.

Implemented endpoints (model repos only; `{repo}` is `namespace/name`, `{rev}` a URL-quoted branch
name or commit oid; the name in brackets is the key to use in `LocalHub.fail`):

    GET  /api/whoami-v2                                   [whoami]         HfApi.whoami
    POST /api/repos/create                                [create_repo]    HfApi.create_repo
    POST /api/models/{repo}/branch/{branch}               [create_branch]  HfApi.create_branch
    POST /api/validate-yaml                               [validate_yaml]  create_commit, when README.md is added
    POST /api/models/{repo}/preupload/{rev}               [preupload]      create_commit: regular or LFS?
    POST /{repo}.git/info/lfs/objects/batch               [lfs_batch]      create_commit: LFS "basic" transfer
    PUT  /lfs-upload/{upload_id}                          [lfs_upload]     create_commit: the bytes of one LFS file
    POST /{repo}.git/info/lfs/objects/verify              [lfs_verify]     create_commit: after each LFS upload
    POST /api/models/{repo}/commit/{rev}                  [commit]         create_commit: the NDJSON commit
    GET  /api/models/{repo}[/revision/{rev}]              [download]       repo_info (snapshot_download)
    GET  /api/models/{repo}/tree/{rev}[/{path}]           [download]       list_repo_tree (snapshot_download)
    HEAD /{repo}/resolve/{rev}/{path}                     [download]       file metadata (hf_hub_download)
    GET  /{repo}/resolve/{rev}/{path}                     [download]       file content, Range supported

Where it knowingly differs from the real hub:
- Every endpoint needs `Authorization: Bearer <known token>`, downloads of public repos included.
  The LFS upload PUT is the exception: like a pre-signed S3 URL, its secret is in the URL the batch
  endpoint handed out, and the client sends no Authorization header with it.
- A new repo has no commit at all (the hub makes an "initial commit" with a .gitattributes), so
  `files()` and `commits()` show exactly what the client pushed.
- LFS files are served directly from /resolve (200 with X-Linked-Etag/X-Linked-Size) rather than by a
  redirect to a CDN; no Xet: the client must run with Xet disabled (see below).
- No pull requests (`create_pr`), no tags, no datasets/spaces, no .gitignore handling.

The client only takes the LFS path if Xet is off: set `HF_HUB_DISABLE_XET=1` in the environment of a
subprocess, or in-process `monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_XET", True)`
(`is_xet_available()` reads that constant at call time).

Every user is a member of the organisation `TEST_ORG`, so repos may be created under the user's own
name or under `TEST_ORG`; any other namespace is refused with 403.
"""

from __future__ import annotations

import base64
import fnmatch
import hashlib
import json
import re
import secrets
import socket
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable
from urllib.parse import parse_qs, unquote, urlsplit

DEFAULT_TOKENS = {"hf_lmpress_test_token": "tester"}
TEST_ORG = "lmpress-org"

# Like the hub: files of 10 MiB or more, binary files and these patterns (the hub's default
# .gitattributes) go through LFS; everything else is committed inline as a "regular" file.
LFS_SIZE_THRESHOLD = 10 * 1024 * 1024
LFS_PATTERNS = (
    "*.7z", "*.arrow", "*.bin", "*.bz2", "*.ckpt", "*.ftz", "*.gguf", "*.gz", "*.h5", "*.joblib",
    "*.lfs.*", "*.mlmodel", "*.model", "*.msgpack", "*.npy", "*.npz", "*.onnx", "*.ot", "*.parquet",
    "*.pb", "*.pickle", "*.pkl", "*.pt", "*.pth", "*.rar", "*.safetensors", "*.tar", "*.tflite",
    "*.tgz", "*.wasm", "*.xz", "*.zip", "*.zst", "*tfevents*",
)

_INVALID_CREDENTIALS = "Invalid credentials in Authorization header"
_COMMIT_OID = re.compile(r"[0-9a-f]{40}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_REPO_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}")


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.000Z")


def _git_blob_oid(data: bytes) -> str:
    """The git object id of a blob, which is what the hub calls a regular file's oid."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _is_binary(sample: bytes) -> bool:
    return b"\0" in sample


def _goes_to_lfs(path: str, size: int, sample: bytes) -> bool:
    """The hub's preupload decision. (Empty files the client always commits as regular.)"""
    name = path.rsplit("/", 1)[-1]
    return (
        size >= LFS_SIZE_THRESHOLD
        or _is_binary(sample)
        or any(fnmatch.fnmatchcase(name, pattern) for pattern in LFS_PATTERNS)
    )


class _Blob:
    """The content of one file in a commit, with the ids the hub reports for it."""

    __slots__ = ("data", "lfs", "sha256", "oid", "pointer_size")

    def __init__(self, data: bytes, lfs: bool):
        self.data = data
        self.lfs = lfs
        self.sha256 = hashlib.sha256(data).hexdigest()
        if lfs:  # git stores a pointer file; its blob id is the file's oid
            pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{self.sha256}\nsize {len(data)}\n"
            self.pointer_size = len(pointer)
            self.oid = _git_blob_oid(pointer.encode())
        else:
            self.pointer_size = 0
            self.oid = _git_blob_oid(data)

    def tree_entry(self, path: str) -> dict:
        entry: dict[str, Any] = {"type": "file", "oid": self.oid, "size": len(self.data), "path": path}
        if self.lfs:
            entry["lfs"] = {"oid": self.sha256, "size": len(self.data), "pointerSize": self.pointer_size}
        return entry


@dataclass
class _Commit:
    oid: str
    parent: str | None
    branch: str
    message: str
    description: str
    tree: dict[str, _Blob]  # the whole repo at this commit: path -> content
    paths: list[str]  # the paths this commit added, replaced or deleted
    date: str = field(default_factory=_now)


@dataclass
class _Repo:
    repo_id: str
    private: bool
    created: str = field(default_factory=_now)
    branches: dict[str, str | None] = field(default_factory=lambda: {"main": None})  # name -> head oid
    commits: dict[str, _Commit] = field(default_factory=dict)  # oid -> commit, oldest first
    lfs: dict[str, bytes] = field(default_factory=dict)  # sha256 -> uploaded LFS object


class _HubError(Exception):
    """An error answer: status, JSON {"error": message}, and X-Error-Code when the hub sends one
    (the client maps RepoNotFound, RevisionNotFound and EntryNotFound to its own exceptions)."""

    def __init__(self, status: int, message: str, code: str | None = None, headers: dict | None = None, **extra):
        super().__init__(message)
        self.status, self.message, self.code, self.headers = status, message, code, headers or {}
        self.extra = extra  # more fields of the JSON body


@dataclass
class _Request:
    method: str
    path: str  # raw path, without the query string
    query: dict[str, list[str]]
    headers: Any
    body: bytes
    match: dict[str, str]  # the route's named groups, URL-unquoted
    user: str | None = None
    token: str | None = None

    def json(self) -> Any:
        try:
            return json.loads(self.body or b"null")
        except ValueError:
            raise _HubError(400, "Request body is not valid JSON")

    def flag(self, name: str) -> bool:
        return self.query.get(name, [""])[0].lower() in ("1", "true")


# (status, headers, body); a dict or list body is sent as JSON.
_Answer = tuple[int, dict[str, str], Any]


class LocalHub:
    """An in-memory Hugging Face Hub on http://127.0.0.1:PORT, for tests. Use as a context manager.

    tokens:   token -> user name; every request must carry `Authorization: Bearer <token>` with one of them.
    url:      the endpoint to give the client (`HfApi(endpoint=hub.url, token=...)`, `HF_ENDPOINT`).
    fail:     endpoint name -> HTTP status to answer instead (e.g. 401, 500), or "hang": hold the request
              without answering until the hub is closed. Names: whoami, create_repo, create_branch,
              preupload, lfs_batch, lfs_upload, commit, download (repo info, tree, resolve), and also
              validate_yaml, lfs_verify. Mutate it at any time.
    requests: (method, path) of every request received, in order (path as sent, without query).
    """

    def __init__(self, tokens: dict[str, str] | None = None):
        self.tokens: dict[str, str] = dict(DEFAULT_TOKENS if tokens is None else tokens)
        self.fail: dict[str, int | str] = {}
        self.requests: list[tuple[str, str]] = []
        self._repos: dict[str, _Repo] = {}
        self._uploads: dict[str, tuple[str, str, int]] = {}  # upload id -> (repo_id, sha256, size)
        self._lock = threading.Lock()  # guards all the state above
        self._closing = threading.Event()  # releases "hang" handlers
        self._connections: set[socket.socket] = set()
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.hub = self
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True)

    # ----------------------------------------------------------------------------------- lifecycle

    def __enter__(self) -> "LocalHub":
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Stop serving. Returns promptly: hung handlers are released, open connections are cut."""
        self._closing.set()
        if self._thread.is_alive():
            self._server.shutdown()
        self._server.server_close()
        with self._lock:
            connections = list(self._connections)
        for connection in connections:  # idle keep-alive connections of the client's pool
            try:
                connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join(timeout=5)

    # --------------------------------------------------------------------------- what was pushed

    def files(self, repo_id: str, revision: str = "main") -> dict[str, bytes]:
        """The repo's files at the head of branch `revision` (or at a commit oid); {} before any commit.
        KeyError if there is no such repo or revision."""
        with self._lock:
            repo = self._existing(repo_id)
            try:
                oid = self._resolve(repo, revision)
            except _HubError:
                raise KeyError(f"{repo_id} has no branch or commit {revision!r}") from None
            return {path: blob.data for path, blob in self._tree(repo, oid).items()}

    def commits(self, repo_id: str) -> list[dict]:
        """Every commit of the repo, oldest first: {"revision" (branch), "message", "oid", "paths"}."""
        with self._lock:
            return [
                {"revision": c.branch, "message": c.message, "oid": c.oid, "paths": list(c.paths)}
                for c in self._existing(repo_id).commits.values()
            ]

    def repos(self) -> dict[str, dict]:
        """repo_id -> {"private": bool, "branches": [names]}."""
        with self._lock:
            return {
                repo_id: {"private": repo.private, "branches": sorted(repo.branches)}
                for repo_id, repo in self._repos.items()
            }

    # ------------------------------------------------------------------------------ shared helpers

    def _existing(self, repo_id: str) -> _Repo:
        if repo_id not in self._repos:
            raise KeyError(f"LocalHub has no repo {repo_id!r} (it has {sorted(self._repos)})")
        return self._repos[repo_id]

    def _namespaces(self, user: str) -> set[str]:
        return {user, TEST_ORG}

    def _repo(self, req: _Request, write: bool = False) -> _Repo:
        """The repo named in the URL, if this user may see it (and write to it, if `write`)."""
        repo_id = req.match["repo"]
        repo = self._repos.get(repo_id)
        namespace = repo_id.split("/")[0]
        allowed = namespace in self._namespaces(req.user or "")
        if repo is None or (repo.private and not allowed):
            raise _HubError(404, "Repository not found", "RepoNotFound")
        if write and not allowed:
            raise _HubError(403, f"You don't have the rights to write to {repo_id}")
        return repo

    def _resolve(self, repo: _Repo, revision: str) -> str | None:
        """Branch name or commit oid -> commit oid (None for a branch without commits)."""
        if revision in repo.branches:
            return repo.branches[revision]
        if _COMMIT_OID.fullmatch(revision) and revision in repo.commits:
            return revision
        raise _HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")

    def _branch(self, repo: _Repo, revision: str) -> str:
        """A revision that must be an existing branch (the write endpoints commit onto branches)."""
        if revision not in repo.branches:
            raise _HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")
        return revision

    def _tree(self, repo: _Repo, oid: str | None) -> dict[str, _Blob]:
        return {} if oid is None else repo.commits[oid].tree

    # ---------------------------------------------------------------------------------- endpoints

    def _whoami(self, req: _Request) -> _Answer:
        return 200, {}, {
            "type": "user",
            "id": hashlib.sha1(req.user.encode()).hexdigest()[:24],
            "name": req.user,
            "fullname": req.user,
            "email": f"{req.user}@example.com",
            "emailVerified": True,
            "canPay": False,
            "isPro": False,
            "periodEnd": None,
            "avatarUrl": "",
            "orgs": [{"type": "org", "name": TEST_ORG, "fullname": TEST_ORG, "roleInOrg": "write"}],
            "auth": {"type": "access_token", "accessToken": {"displayName": "test", "role": "write"}},
        }

    def _create_repo(self, req: _Request) -> _Answer:
        payload = req.json() or {}
        name, namespace = payload.get("name"), payload.get("organization") or req.user
        if payload.get("type", "model") not in (None, "model"):
            raise _HubError(400, "LocalHub only serves model repos")
        if not isinstance(name, str) or not _REPO_NAME.fullmatch(name) or ".." in name or "--" in name:
            raise _HubError(400, f"Invalid repo name: {name!r}")
        if namespace not in self._namespaces(req.user):
            raise _HubError(403, f'You don\'t have the rights to create a model under the namespace "{namespace}"')
        repo_id = f"{namespace}/{name}"
        url = f"{self.url}/{repo_id}"
        if repo_id in self._repos:  # HfApi.create_repo(exist_ok=True) accepts this, and reads "url"
            raise _HubError(409, "You already created this model repo", url=url)
        self._repos[repo_id] = _Repo(repo_id, private=payload.get("visibility") == "private")
        return 200, {}, {"url": url, "name": repo_id, "id": secrets.token_hex(12)}

    def _create_branch(self, req: _Request) -> _Answer:
        repo = self._repo(req, write=True)
        branch = req.match["rev"]
        if branch in repo.branches:  # HfApi.create_branch(exist_ok=True) ignores exactly this
            raise _HubError(409, "Reference already exists")
        if branch.startswith("refs/") or not branch or _COMMIT_OID.fullmatch(branch):
            raise _HubError(400, f"Invalid branch name: {branch}")
        start = (req.json() or {}).get("startingPoint") or "main"
        repo.branches[branch] = self._resolve(repo, start)
        return 200, {}, {}

    def _validate_yaml(self, req: _Request) -> _Answer:
        """Checks the README's YAML front matter parses to a mapping, as the hub's validator does first."""
        content = (req.json() or {}).get("content", "")
        match = re.match(r"---\s*\n(.*?)\n---\s*(\n|$)", content, re.S)
        if match:
            import yaml  # a project dependency; only needed when a README has metadata

            try:
                metadata = yaml.safe_load(match.group(1))
            except yaml.YAMLError as error:
                return 400, {}, {"errors": [{"message": f"Invalid YAML: {error}"}], "warnings": []}
            if metadata is not None and not isinstance(metadata, dict):
                return 400, {}, {"errors": [{"message": "YAML metadata must be a mapping"}], "warnings": []}
        return 200, {}, {"errors": [], "warnings": []}

    def _preupload(self, req: _Request) -> _Answer:
        repo = self._repo(req, write=True)
        if req.flag("create_pr"):
            raise _HubError(400, "LocalHub does not support pull requests")
        tree = self._tree(repo, repo.branches[self._branch(repo, req.match["rev"])])
        answers = []
        for item in (req.json() or {}).get("files", []):
            path, size = item["path"], int(item["size"])
            sample = base64.b64decode(item.get("sample", ""))
            answer = {"path": path, "uploadMode": "lfs" if _goes_to_lfs(path, size, sample) else "regular",
                      "shouldIgnore": False}
            if path in tree:  # lets the client drop unchanged files from the commit
                existing = tree[path]
                answer["oid"] = existing.sha256 if existing.lfs else existing.oid
            answers.append(answer)
        return 200, {}, {"files": answers}

    def _lfs_batch(self, req: _Request) -> _Answer:
        repo = self._repo(req, write=True)
        payload = req.json() or {}
        if payload.get("operation") != "upload":
            raise _HubError(400, "LocalHub only supports LFS uploads")
        if "basic" not in payload.get("transfers", ["basic"]):
            raise _HubError(400, "LocalHub only supports the basic LFS transfer")
        if payload.get("hash_algo", "sha256") != "sha256":
            raise _HubError(400, "Only sha256 is supported")
        ref = (payload.get("ref") or {}).get("name")
        if ref is not None:
            self._branch(repo, ref)
        objects = []
        for item in payload.get("objects", []):
            oid, size = item.get("oid"), item.get("size")
            answer: dict[str, Any] = {"oid": oid, "size": size}
            if not isinstance(oid, str) or not _SHA256.fullmatch(oid) or not isinstance(size, int) or size < 0:
                answer["error"] = {"code": 422, "message": "Invalid oid or size"}
            elif oid in repo.lfs:  # no "actions": the client skips the upload
                answer["authenticated"] = True
            else:
                upload_id = secrets.token_hex(16)  # the URL is the credential, like a pre-signed S3 URL
                self._uploads[upload_id] = (repo.repo_id, oid, size)
                answer["authenticated"] = True
                answer["actions"] = {
                    "upload": {"href": f"{self.url}/lfs-upload/{upload_id}", "expires_in": 3600},
                    "verify": {"href": f"{self.url}/{repo.repo_id}.git/info/lfs/objects/verify"},
                }
            objects.append(answer)
        headers = {"Content-Type": "application/vnd.git-lfs+json"}
        return 200, headers, {"transfer": "basic", "objects": objects, "hash_algo": "sha256"}

    def _lfs_upload(self, req: _Request) -> _Answer:
        """The PUT of one LFS object; refuses bytes whose size or sha256 differ from the batch request."""
        upload = self._uploads.get(req.match["upload_id"])
        if upload is None:
            raise _HubError(403, "Invalid or expired upload URL")
        repo_id, oid, size = upload
        if len(req.body) != size:
            raise _HubError(400, f"Size mismatch: expected {size} bytes, received {len(req.body)}")
        if hashlib.sha256(req.body).hexdigest() != oid:  # (hashed under the lock: fine for test sizes)
            raise _HubError(400, f"BadDigest: the content does not hash to sha256 {oid}")
        self._repos[repo_id].lfs[oid] = req.body
        del self._uploads[req.match["upload_id"]]
        return 200, {"ETag": f'"{hashlib.md5(req.body).hexdigest()}"'}, b""

    def _lfs_verify(self, req: _Request) -> _Answer:
        repo = self._repo(req, write=True)
        payload = req.json() or {}
        data = repo.lfs.get(payload.get("oid"))
        if data is None or len(data) != payload.get("size"):
            raise _HubError(404, f"LFS object {payload.get('oid')} was not uploaded")
        return 200, {}, {}

    def _commit(self, req: _Request) -> _Answer:
        """The NDJSON commit: validated in full before anything is stored, so it lands whole or not at all."""
        repo = self._repo(req, write=True)
        if req.flag("create_pr"):
            raise _HubError(400, "LocalHub does not support pull requests")
        branch = self._branch(repo, req.match["rev"])
        try:
            lines = [json.loads(line) for line in req.body.splitlines() if line.strip()]
        except ValueError:
            raise _HubError(400, "Commit payload is not valid NDJSON")
        if not lines or lines[0].get("key") != "header" or not lines[0]["value"].get("summary"):
            raise _HubError(400, "Commit payload must start with a header with a summary")
        header = lines[0]["value"]
        head = repo.branches[branch]
        parent = header.get("parentCommit")
        if parent is not None and not (head or "").startswith(parent):
            raise _HubError(412, "A commit has happened since. Please refresh and try again.")

        tree = dict(self._tree(repo, head))
        paths: list[str] = []
        for line in lines[1:]:
            key, value = line.get("key"), line.get("value") or {}
            path = value.get("path", "")
            if not path or path.startswith("/") or any(part in ("", ".", "..") for part in path.rstrip("/").split("/")):
                raise _HubError(400, f"Invalid path: {path!r}")
            if key == "file":
                if value.get("encoding") != "base64":
                    raise _HubError(400, f"Unsupported encoding for {path}")
                data = base64.b64decode(value.get("content", ""))
                if len(data) >= LFS_SIZE_THRESHOLD or _is_binary(data[:512]):
                    raise _HubError(400, f"Your push was rejected: {path} must be stored with LFS")
                tree[path] = _Blob(data, lfs=False)
            elif key == "lfsFile":
                oid = value.get("oid")
                if value.get("algo", "sha256") != "sha256" or oid not in repo.lfs:
                    raise _HubError(400, f"Your push was rejected: LFS object {oid} ({path}) was never uploaded")
                if value.get("size") is not None and value["size"] != len(repo.lfs[oid]):
                    raise _HubError(400, f"Size of {path} does not match its LFS object")
                tree[path] = _Blob(repo.lfs[oid], lfs=True)
            elif key == "deletedFile":
                if tree.pop(path, None) is None:
                    raise _HubError(404, f"A file with this name doesn't exist: {path}", "EntryNotFound")
            elif key == "deletedFolder":
                prefix = path.rstrip("/") + "/"
                doomed = [p for p in tree if p.startswith(prefix)]
                if not doomed:
                    raise _HubError(404, f"A folder with this name doesn't exist: {path}", "EntryNotFound")
                for p in doomed:
                    del tree[p]
            else:
                raise _HubError(400, f"Unknown commit operation: {key!r}")
            paths.append(path)

        seed = f"{head}\n{header['summary']}\n{time.time_ns()}\n{len(repo.commits)}\n" + "\n".join(paths)
        oid = hashlib.sha1(seed.encode()).hexdigest()
        repo.commits[oid] = _Commit(oid, head, branch, header["summary"], header.get("description", ""), tree, paths)
        repo.branches[branch] = oid
        return 200, {}, {
            "success": True,
            "commitOid": oid,
            "commitUrl": f"{self.url}/{repo.repo_id}/commit/{oid}",
            "hookOutput": "",
            "pullRequestUrl": None,
        }

    def _repo_info(self, req: _Request) -> _Answer:
        repo = self._repo(req)
        revision = req.match.get("rev")
        oid = self._resolve(repo, revision or "main")
        if oid is None and revision is not None:  # snapshot_download needs a sha: say why there is none
            raise _HubError(404, f"Revision {revision} has no commits yet", "RevisionNotFound")
        siblings = []
        for path, blob in sorted(self._tree(repo, oid).items()):
            sibling: dict[str, Any] = {"rfilename": path}
            if req.flag("blobs"):
                sibling.update(size=len(blob.data), blobId=blob.oid)
                if blob.lfs:
                    sibling["lfs"] = {"sha256": blob.sha256, "size": len(blob.data), "pointerSize": blob.pointer_size}
            siblings.append(sibling)
        namespace = repo.repo_id.split("/")[0]
        modified = repo.commits[oid].date if oid else repo.created
        return 200, {}, {
            "_id": hashlib.sha1(repo.repo_id.encode()).hexdigest()[:24],
            "id": repo.repo_id,
            "modelId": repo.repo_id,
            "author": namespace,
            "sha": oid,
            "private": repo.private,
            "disabled": False,
            "gated": False,
            "downloads": 0,
            "likes": 0,
            "tags": [],
            "createdAt": repo.created,
            "lastModified": modified,
            "siblings": siblings,
        }

    def _list_tree(self, req: _Request) -> _Answer:
        repo = self._repo(req)
        tree = self._tree(repo, self._resolve(repo, req.match["rev"]))
        root = (req.match.get("path") or "").strip("/")
        prefix = root + "/" if root else ""
        recursive = req.flag("recursive")
        entries: dict[str, dict] = {}
        for path, blob in tree.items():
            if not path.startswith(prefix):
                continue
            parts = path[len(prefix):].split("/")
            depth = len(parts) if recursive else 1
            for i in range(1, min(depth, len(parts) - 1) + 1):  # the folders on the way
                folder = prefix + "/".join(parts[:i])
                entries[folder] = {"type": "directory", "oid": hashlib.sha1(folder.encode()).hexdigest(),
                                   "size": 0, "path": folder}
            if recursive or len(parts) == 1:
                entries[path] = blob.tree_entry(path)
        if root and not entries:
            raise _HubError(404, f"{root} does not exist", "EntryNotFound")
        return 200, {}, [entries[path] for path in sorted(entries)]

    def _resolve_file(self, req: _Request) -> _Answer:
        """HEAD/GET of a file, with the headers file_download.py reads (ETag, X-Repo-Commit, sizes)."""
        repo = self._repo(req)
        oid = self._resolve(repo, req.match["rev"])
        path = req.match["path"]
        blob = self._tree(repo, oid).get(path)
        if blob is None:
            headers = {"X-Repo-Commit": oid} if oid else {}
            raise _HubError(404, f"Entry not found: {path}", "EntryNotFound", headers)
        headers = {
            "X-Repo-Commit": oid,
            "ETag": f'"{blob.oid}"',
            "Accept-Ranges": "bytes",
            "Content-Type": "application/octet-stream",
        }
        if blob.lfs:
            headers.update({"X-Linked-Etag": f'"{blob.sha256}"', "X-Linked-Size": str(len(blob.data))})
        data, status = blob.data, 200
        range_header = req.headers.get("Range")
        if range_header:
            match = re.fullmatch(r"\s*bytes=(\d*)-(\d*)\s*", range_header)
            total = len(data)
            if match and match.group(1):
                start = int(match.group(1))
                end = min(int(match.group(2)) if match.group(2) else total - 1, total - 1)
            elif match and match.group(2):  # suffix range: the last N bytes
                start, end = max(total - int(match.group(2)), 0), total - 1
            else:
                start, end = total, -1
            if start > end:
                raise _HubError(416, "Range not satisfiable", headers={"Content-Range": f"bytes */{total}"})
            data, status = data[start:end + 1], 206
            headers["Content-Range"] = f"bytes {start}-{end}/{total}"
        return status, headers, data


# A route: method, raw-path regex, endpoint name (for `fail`), handler, whether it needs a token.
# `[^/]+` segments are URL-unquoted after matching (the client quotes revisions with safe="").
_REPO = r"(?P<repo>[^/]+/[^/]+)"
_ROUTES: list[tuple[str, re.Pattern, str, Callable[[LocalHub, _Request], _Answer], bool]] = [
    (m, re.compile(p), name, fn, auth)
    for m, p, name, fn, auth in [
        ("GET", r"/api/whoami-v2", "whoami", LocalHub._whoami, True),
        ("POST", r"/api/repos/create", "create_repo", LocalHub._create_repo, True),
        ("POST", r"/api/validate-yaml", "validate_yaml", LocalHub._validate_yaml, True),
        ("POST", rf"/api/models/{_REPO}/branch/(?P<rev>[^/]+)", "create_branch", LocalHub._create_branch, True),
        ("POST", rf"/api/models/{_REPO}/preupload/(?P<rev>[^/]+)", "preupload", LocalHub._preupload, True),
        ("POST", rf"/{_REPO}\.git/info/lfs/objects/batch", "lfs_batch", LocalHub._lfs_batch, True),
        ("PUT", r"/lfs-upload/(?P<upload_id>[0-9a-f]+)", "lfs_upload", LocalHub._lfs_upload, False),
        ("POST", rf"/{_REPO}\.git/info/lfs/objects/verify", "lfs_verify", LocalHub._lfs_verify, True),
        ("POST", rf"/api/models/{_REPO}/commit/(?P<rev>[^/]+)", "commit", LocalHub._commit, True),
        ("GET", rf"/api/models/{_REPO}/tree/(?P<rev>[^/]+)(?:/(?P<path>.+))?", "download", LocalHub._list_tree, True),
        ("GET", rf"/api/models/{_REPO}(?:/revision/(?P<rev>[^/]+))?", "download", LocalHub._repo_info, True),
        ("HEAD", rf"/{_REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)", "download", LocalHub._resolve_file, True),
        ("GET", rf"/{_REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)", "download", LocalHub._resolve_file, True),
    ]
]


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False  # close() must not wait for handlers
    hub: LocalHub


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, like the hub; every answer has a Content-Length
    server: _Server

    def setup(self) -> None:
        super().setup()
        with self.server.hub._lock:
            self.server.hub._connections.add(self.connection)

    def finish(self) -> None:
        with self.server.hub._lock:
            self.server.hub._connections.discard(self.connection)
        try:
            super().finish()
        except OSError:
            pass

    def log_message(self, format: str, *args) -> None:  # keep pytest output clean
        pass

    do_GET = do_HEAD = do_POST = do_PUT = lambda self: self._dispatch()

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline().strip():  # trailers, then the blank line
                        pass
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()  # CRLF after each chunk
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _dispatch(self) -> None:
        hub = self.server.hub
        split = urlsplit(self.path)
        with hub._lock:
            hub.requests.append((self.command, split.path))
        body = self._read_body()  # always drained, so the keep-alive connection stays in sync
        for method, pattern, name, handler, needs_auth in _ROUTES:
            match = pattern.fullmatch(split.path)
            if method == self.command and match:
                break
        else:
            return self._answer(404, {}, {"error": f"LocalHub has no route for {self.command} {split.path}"})

        failure = hub.fail.get(name)
        if failure == "hang":
            hub._closing.wait()  # until close(); then drop the connection without answering
            self.close_connection = True
            return
        if failure is not None:
            return self._answer(int(failure), {}, {"error": f"LocalHub: simulated failure of {name}"})

        groups = {key: unquote(value) for key, value in match.groupdict().items() if value is not None}
        req = _Request(self.command, split.path, parse_qs(split.query), self.headers, body, groups)
        try:
            if needs_auth:
                scheme, _, token = self.headers.get("Authorization", "").partition(" ")
                if scheme.lower() != "bearer" or token not in hub.tokens:
                    raise _HubError(401, _INVALID_CREDENTIALS)
                req.token, req.user = token, hub.tokens[token]
            with hub._lock:  # one request at a time touches the state: commits are atomic
                status, headers, payload = handler(hub, req)
        except _HubError as error:
            headers = dict(error.headers)
            if error.code:
                headers["X-Error-Code"] = error.code
            headers["X-Error-Message"] = error.message.encode("ascii", "backslashreplace").decode()
            return self._answer(error.status, headers, {"error": error.message, **error.extra})
        except (KeyError, TypeError, ValueError, AttributeError) as error:  # a payload of the wrong shape
            return self._answer(400, {}, {"error": f"Malformed request: {error!r}"})
        self._answer(status, headers, payload)

    def _answer(self, status: int, headers: dict[str, str], payload: Any) -> None:
        if isinstance(payload, (dict, list)):
            payload = json.dumps(payload).encode()
            headers = {"Content-Type": "application/json; charset=utf-8", **headers}
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(payload)
