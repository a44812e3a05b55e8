"""`python -m mm3 download`: fetch a published GGUF set from Hugging Face.

Resumes partial files (`<name>.part` + an HTTP Range request), checks each file's size and
SHA-256 against the repository listing, and only then renames it into place, so a file with the
final name is always complete. Standard library only (urllib), so it runs in any ComfyUI install.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import shutil
import sys
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..errors import Cancelled, MM3Error

REPO = "Serveurperso/MiniMax-Music3-GGUF"
DEFAULT_ENDPOINT = "https://huggingface.co"

# The published sets: the type of each component file.
SETS = {
    "native": {"language_model": "BF16", "rvq_depth_decoder": "BF16", "condition_encoder": "F32",
               "transformer": "F32", "vocoder": "F32"},
    "q8": {"language_model": "Q8_0", "rvq_depth_decoder": "Q8_0", "condition_encoder": "F32",
           "transformer": "Q8_0", "vocoder": "F32"},
    "light": {"language_model": "Q5_K_M", "rvq_depth_decoder": "Q8_0", "condition_encoder": "F32",
              "transformer": "Q4_K_M", "vocoder": "F32"},
}
CHUNK = 1 << 20


class DownloadError(MM3Error, RuntimeError):
    """A file that could not be fetched or verified (offline, missing, checksum); nothing is left
    under the final name."""

    exit_code = 2


@dataclass(frozen=True)
class RemoteFile:
    name: str
    size: int
    sha256: str | None


def published_name(component: str, file_type: str) -> str:
    """The published file name of a component (its diffusers folder name) in a file type."""
    return f"MiniMax-Music3-{component}-{file_type}.gguf"


def file_names(set_name: str) -> list[str]:
    if set_name not in SETS:
        raise DownloadError(f"unknown set {set_name!r} (expected one of {', '.join(SETS)})")
    return [published_name(c, t) for c, t in SETS[set_name].items()]


def _open(url: str, headers=None, timeout: float = 30.0):
    req = urllib.request.Request(url, headers={"User-Agent": "mm3-download", **(headers or {})})
    token = os.environ.get("HF_TOKEN")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        return urllib.request.urlopen(req, timeout=timeout)
    except urllib.error.HTTPError as e:
        raise DownloadError(f"{url}: HTTP {e.code} {e.reason}") from None
    except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
        reason = getattr(e, "reason", e)
        host = urllib.parse.urlsplit(url).netloc
        raise DownloadError(f"cannot reach {host} ({reason}); check the connection, or copy the "
                            f"GGUF files into the models folder by hand") from None


def list_remote(endpoint: str, repo: str, revision: str) -> dict[str, RemoteFile]:
    """Files of the repository with their sizes and SHA-256 (from its LFS pointers)."""
    url = f"{endpoint}/api/models/{repo}/tree/{urllib.parse.quote(revision, safe='')}"
    with _open(url) as r:
        try:
            entries = json.load(r)
        except json.JSONDecodeError as e:
            raise DownloadError(f"{url}: unexpected answer ({e})") from None
    out = {}
    for e in entries:
        if e.get("type") != "file":
            continue
        lfs = e.get("lfs") or {}
        out[e["path"]] = RemoteFile(e["path"], int(lfs.get("size", e.get("size", 0))), lfs.get("oid"))
    return out


def _sha256_of(path: Path, h=None):
    h = h or hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h


def fetch_file(url: str, remote: RemoteFile, dest: Path,
               progress: Callable[[str, int, int], None] | None = None,
               should_stop: Callable[[], bool] | None = None) -> Path:
    """Download `url` to `dest`, resuming `dest.part`; verify size and SHA-256; rename.
    `should_stop()` is polled between blocks: True stops with `Cancelled`, keeping the .part."""
    part = dest.with_name(dest.name + ".part")
    have = part.stat().st_size if part.exists() else 0
    if have > remote.size:
        part.unlink()
        have = 0
    h = hashlib.sha256()
    if have:
        _sha256_of(part, h)
    if have < remote.size:
        with _open(url, {"Range": f"bytes={have}-"} if have else None) as r:
            if have and r.status != 206:  # the server ignored the range: start over
                have, h = 0, hashlib.sha256()
            with open(part, "ab" if have else "wb") as f:
                try:
                    while block := r.read(CHUNK):
                        f.write(block)
                        h.update(block)
                        have += len(block)
                        if progress:
                            progress(dest.name, have, remote.size)
                        if should_stop is not None and should_stop():
                            raise Cancelled(f"download of {dest.name} stopped at {have} of {remote.size} bytes; "
                                            "the partial file is kept and resumes next time")
                except (http.client.IncompleteRead, ConnectionError, TimeoutError, OSError):
                    pass  # a dropped transfer: what arrived stays in .part for the next run
    if have != remote.size:
        raise DownloadError(f"{dest.name}: got {have} bytes, expected {remote.size}; run again to resume")
    if remote.sha256 and h.hexdigest() != remote.sha256:
        part.unlink()
        raise DownloadError(f"{dest.name}: SHA-256 {h.hexdigest()} does not match the published "
                            f"{remote.sha256}; the partial file was removed, run again")
    os.replace(part, dest)
    return dest


def download_set(set_name: str, folder, *, endpoint: str | None = None, repo: str = REPO,
                 revision: str = "main", progress=None, log=print, should_stop=None) -> list[Path]:
    endpoint = (endpoint or os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")
    names = file_names(set_name)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    remote = list_remote(endpoint, repo, revision)
    missing = [n for n in names if n not in remote]
    if missing:
        ggufs = sorted(n for n in remote if n.endswith(".gguf"))
        raise DownloadError(f"{repo} has no {', '.join(missing)} (it has: {', '.join(ggufs) or 'no GGUF files'})")
    todo = []
    for n in names:
        dest = folder / n
        if dest.exists() and dest.stat().st_size == remote[n].size:
            log(f"{n}: already present")
            continue
        todo.append(n)
    need = sum(remote[n].size - ((folder / (n + ".part")).stat().st_size
                                 if (folder / (n + ".part")).exists() else 0) for n in todo)
    free = shutil.disk_usage(folder).free
    if need > free:
        raise DownloadError(f"{folder} has {free / 2**30:.1f} GiB free, the set needs {need / 2**30:.1f} GiB more")
    out = []
    for n in names:
        if n in todo:
            url = f"{endpoint}/{repo}/resolve/{urllib.parse.quote(revision, safe='')}/{urllib.parse.quote(n)}"
            fetch_file(url, remote[n], folder / n, progress, should_stop)
            log(f"{n}: verified")
        out.append(folder / n)
    return out


def run(args) -> int:
    from tqdm import tqdm

    bars = {}

    def progress(name, done, total):
        bar = bars.get(name)
        if bar is None:
            bar = bars[name] = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=name[-40:],
                                    file=sys.stderr)
        bar.update(done - bar.n)
        if done >= total:
            bar.close()

    paths = download_set(args.set, args.dir, endpoint=args.endpoint, revision=args.revision,
                         progress=progress, log=lambda m: print(m, file=sys.stderr))
    for p in paths:
        print(p)
    return 0


def add_cli(sub):
    p = sub.add_parser("download", help="fetch a published GGUF set from Hugging Face")
    p.add_argument("--set", default="q8", choices=list(SETS),
                   help="light (~9 GB: LM Q5_K_M, DiT Q4_K_M), q8 (~13 GB) or native (~29 GB)")
    p.add_argument("--dir", default="models/mm3", help="target folder (default: models/mm3)")
    p.add_argument("--endpoint", default=None, help="Hugging Face endpoint (default: $HF_ENDPOINT or the hub)")
    p.add_argument("--revision", default="main")
    p.set_defaults(func=run)
