"""`python -m mm3 download`: fetch a published GGUF set from Hugging Face with `huggingface_hub`.

The repository is listed once (each file's size and SHA-256, and the commit every file is fetched
from); a set the folder has no room for is refused before any fetch; a file already in the shared
Hugging Face cache is hard-linked (else copied). Otherwise `huggingface_hub`'s HTTP client writes
`<name>.part`, which a stopped run keeps and the next resumes (a Range request), and which is checked
for size and SHA-256 before the rename. Not `hf_hub_download(local_dir=...)`: recent versions delete
their temporary file on any failure, so a stopped download would start over, and check no SHA-256.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import sys
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .. import __version__
from ..errors import Cancelled, MM3Error
from ..formats.published import PART, SETS, published_name

REPO = "Serveurperso/MiniMax-Music3-GGUF"

CHUNK = 1 << 20  # block size for hashing and copying local files (the transfer's is huggingface_hub's)
LIBRARY = "comfyui-mm3-gguf"  # named in the User-Agent
BY_HAND = "or copy the GGUF files into the models folder by hand"


class DownloadError(MM3Error, RuntimeError):
    """A file that could not be fetched or verified (offline, missing, checksum); nothing is left
    under the final name."""

    exit_code = 2


@dataclass(frozen=True)
class RemoteFile:
    name: str
    size: int
    sha256: str | None


def file_names(set_name: str) -> list[str]:
    if set_name not in SETS:
        raise DownloadError(f"unknown set {set_name!r} (expected one of {', '.join(SETS)})")
    return [published_name(c, t) for c, t in SETS[set_name].items()]


def _hub():
    """huggingface_hub, imported when a download starts (the engine and the inventory need it not)."""
    try:
        import huggingface_hub
        import huggingface_hub.constants
        import huggingface_hub.errors
        import huggingface_hub.file_download
        import huggingface_hub.utils
    except ImportError:
        raise DownloadError(f"downloading needs huggingface_hub (pip install -r requirements.txt), {BY_HAND}") from None
    return huggingface_hub


# Base classes of the transport errors of the HTTP clients huggingface_hub has used (httpx, httpx2,
# requests); matched by name, as which one is installed depends on its version.
_TRANSPORT = {"TransportError", "ConnectionError", "Timeout", "ChunkedEncodingError"}


def _is_network_error(e: BaseException) -> bool:
    if isinstance(e, (ConnectionError, TimeoutError, socket.gaierror)):
        return True
    return any(c.__name__ in _TRANSPORT and c.__module__.split(".")[0] in ("httpx", "httpx2", "requests", "urllib3")
               for c in type(e).__mro__)


def _reason(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _status(e: BaseException) -> int | None:
    response = getattr(e, "response", None)
    return getattr(response, "status_code", None)


def _hub_error(e: Exception, endpoint: str, what: str) -> DownloadError | None:
    """The one-line DownloadError for a failed Hub call, or None for an error that is not the
    network's or the Hub's (a bug: raised as it is)."""
    hub = _hub()
    host = urllib.parse.urlsplit(endpoint).netloc or endpoint
    if isinstance(e, hub.errors.OfflineModeIsEnabled):
        return DownloadError(f"Hugging Face offline mode is on (HF_HUB_OFFLINE): unset it to download, {BY_HAND}")
    if isinstance(e, hub.errors.HfHubHTTPError):
        status = _status(e)
        if status in (401, 403):
            return DownloadError(f"{host} refused {what} (HTTP {status}): it needs a token with access; set HF_TOKEN, "
                                 "log in with `hf auth login` or pass --token")
        if status == 404:
            return DownloadError(f"{host} has no {what} (HTTP 404)")
        return DownloadError(f"{host} answered HTTP {status} for {what} ({_reason(e)}); try again later, {BY_HAND}")
    if _is_network_error(e):
        return DownloadError(f"cannot reach {host} ({_reason(e)}); check the connection, {BY_HAND}")
    return None


def list_remote(repo: str, revision: str, *, endpoint: str, token=None) -> tuple[str, dict[str, RemoteFile]]:
    """The commit `revision` names and the repository's files there, with their sizes and SHA-256
    (from their LFS pointers)."""
    hub = _hub()
    api = hub.HfApi(endpoint=endpoint, token=token, library_name=LIBRARY, library_version=__version__)
    try:
        info = api.model_info(repo, revision=revision, files_metadata=True, timeout=30)
    except Exception as e:
        err = _hub_error(e, endpoint, f"{repo} at revision {revision!r}")
        if err is None:
            raise
        raise err from None
    files = {}
    for s in info.siblings or []:
        lfs = s.lfs  # BlobLfsInfo, a dict in every supported version
        size = (lfs["size"] if lfs else s.size) or 0
        files[s.rfilename] = RemoteFile(s.rfilename, int(size), lfs["sha256"] if lfs else None)
    return info.sha or revision, files


def _sha256_of(path: Path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h


class _Sink:
    """The `.part` file huggingface_hub's `http_get` writes into: hashes what is written, reports
    progress and polls `should_stop` after each chunk (a stop raises `Cancelled`; what was written
    stays in the `.part`)."""

    def __init__(self, f, path: Path, total: int, h, progress, should_stop):
        self.f, self.path, self.total, self.h = f, path, total, h
        self.hashed = f.tell()  # bytes of the file the hash covers
        self.progress, self.should_stop = progress, should_stop

    @property
    def name(self) -> str:  # old versions' optional hf_transfer path writes to the file by name
        return str(self.path)

    def write(self, block) -> int:
        n = self.f.write(block)
        self.h.update(block)
        self.hashed += len(block)
        done = self.f.tell()
        if self.progress:
            self.progress(self.path.name[:-len(PART)], done, self.total)
        if self.should_stop is not None and self.should_stop():
            raise Cancelled(f"download of {self.path.name[:-len(PART)]} stopped at {done} of {self.total} bytes; "
                            "the partial file is kept and resumes next time")
        return n

    def tell(self) -> int:
        return self.f.tell()

    def seek(self, *args) -> int:
        return self.f.seek(*args)

    def truncate(self, size=None) -> int:
        """The transfer restarted from an earlier offset (a server that ignored the Range)."""
        end = self.f.truncate(size)
        self.f.flush()
        self.h, self.hashed = _sha256_of(self.path), end
        return end

    def flush(self):
        self.f.flush()


def fetch_file(url: str, remote: RemoteFile, dest: Path, *, headers: dict | None = None,
               progress: Callable[[str, int, int], None] | None = None,
               should_stop: Callable[[], bool] | None = None) -> Path:
    """Download `url` to `dest`, resuming `dest.part`; verify size and SHA-256; rename.
    `should_stop()` is polled after each chunk: True stops with `Cancelled`, keeping the .part."""
    http_get = _hub().file_download.http_get
    errors = _hub().errors
    part = dest.with_name(dest.name + PART)
    have = part.stat().st_size if part.exists() else 0
    if have > remote.size:
        part.unlink()
        have = 0
    h = _sha256_of(part) if have else hashlib.sha256()
    reason = ""
    if have < remote.size:
        with open(part, "r+b" if have else "wb") as f:
            f.seek(have)
            sink = _Sink(f, part, remote.size, h, progress, should_stop)
            if progress:
                progress(dest.name, have, remote.size)
            try:
                http_get(url, sink, resume_size=have, headers=headers, expected_size=remote.size,
                         displayed_filename=dest.name)
            except Cancelled:
                raise
            except Exception as e:  # a dropped transfer: what arrived stays in .part for the next run
                if isinstance(e, errors.HfHubHTTPError):
                    reason = f"HTTP {_status(e)}"
                    if _status(e) in (401, 403):
                        reason += ": it needs a token with access; set HF_TOKEN or pass --token"
                elif _is_network_error(e) or isinstance(e, OSError):
                    reason = _reason(e)
                else:
                    raise
            h = sink.h
            hashed = sink.hashed
        have = part.stat().st_size
        if hashed != have:  # something wrote to the file by name: hash what is there
            h = _sha256_of(part)
    if have != remote.size:
        why = f" ({reason})" if reason else ""
        if have > remote.size:
            part.unlink()
            raise DownloadError(f"{dest.name}: got {have} bytes, expected {remote.size}{why}; the partial file was "
                                "removed, run again")
        raise DownloadError(f"{dest.name}: got {have} bytes, expected {remote.size}{why}; run again to resume")
    if remote.sha256 and h.hexdigest() != remote.sha256:
        part.unlink()
        raise DownloadError(f"{dest.name}: SHA-256 {h.hexdigest()} does not match the published "
                            f"{remote.sha256}; the partial file was removed, run again")
    os.replace(part, dest)
    return dest


def _in_cache(repo: str, name: str, commit: str, remote: RemoteFile, cache_dir) -> Path | None:
    """The file in the shared Hugging Face cache at `commit`, when it is there with the published
    size (`cache_dir` None: the default cache; False: never look)."""
    if cache_dir is False:
        return None
    try:
        found = _hub().try_to_load_from_cache(repo, name, cache_dir=cache_dir, revision=commit)
    except Exception:  # an unreadable cache is no reason to stop: download instead
        return None
    if not isinstance(found, str):
        return None
    blob = Path(os.path.realpath(found))
    try:
        return blob if blob.stat().st_size == remote.size else None
    except OSError:
        return None


def _same_device(a: Path, b: Path) -> bool:
    try:
        return os.stat(a).st_dev == os.stat(b).st_dev
    except OSError:
        return False


def take_from_cache(blob: Path, remote: RemoteFile, dest: Path, *, progress=None, should_stop=None) -> bool:
    """Put the cached `blob` under `dest` (a hard link, else a copy through `dest.part`); False when
    its SHA-256 is not the published one. A blob named by its SHA-256 (the cache's layout) is taken
    as it is; another (a cache without symlinks) is hashed first."""
    if remote.sha256 and blob.name != remote.sha256 and _sha256_of(blob).hexdigest() != remote.sha256:
        return False
    part = dest.with_name(dest.name + PART)
    part.unlink(missing_ok=True)
    try:
        os.link(blob, part)
    except OSError:  # another file system, or one without hard links
        try:
            with open(blob, "rb") as src, open(part, "wb") as f:
                sink = _Sink(f, part, remote.size, hashlib.sha256(), progress, should_stop)
                while block := src.read(CHUNK):
                    sink.write(block)
        except OSError as e:
            raise DownloadError(f"{dest.name}: copying it from the Hugging Face cache failed ({e}); run again") from None
    os.replace(part, dest)
    return True


def download_set(set_name: str, folder, *, endpoint: str | None = None, repo: str = REPO, revision: str = "main",
                 token: str | bool | None = None, cache_dir=None, progress=None, log=print,
                 should_stop=None, replace: tuple[str, ...] = ()) -> list[Path]:
    """Fetch the files of `set_name` into `folder` (see the module docstring); their paths.

    `endpoint`: the Hub or a mirror (default: $HF_ENDPOINT, else huggingface_hub's). `token`: a
    Hugging Face token (None: $HF_TOKEN or a stored login; False: none). `cache_dir`: the shared
    Hugging Face cache to take files from (None: the default; False: do not look). `progress(name,
    done, total)` reports bytes; `should_stop()` True stops with `Cancelled`, keeping the .part.
    `replace`: names fetched again even when a file of the published size has them (one that
    cannot be used: `mm3.files.inventory` says which)."""
    names = file_names(set_name)
    hub = _hub()
    endpoint = (endpoint or os.environ.get("HF_ENDPOINT") or hub.constants.ENDPOINT).rstrip("/")
    offline = getattr(hub, "is_offline_mode", None)
    if offline() if callable(offline) else hub.constants.HF_HUB_OFFLINE:
        raise _hub_error(hub.errors.OfflineModeIsEnabled(), endpoint, repo)
    commit, remote = list_remote(repo, revision, endpoint=endpoint, token=token)
    missing = [n for n in names if n not in remote]
    if missing:
        ggufs = sorted(n for n in remote if n.endswith(".gguf"))
        raise DownloadError(f"{repo} has no {', '.join(missing)} (it has: {', '.join(ggufs) or 'no GGUF files'})")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    todo, cached = [], {}
    for n in names:
        dest = folder / n
        if dest.exists() and dest.stat().st_size == remote[n].size and n not in replace:
            log(f"{n}: already present")
            continue
        if dest.exists() and n in replace:
            log(f"{n}: present but unusable, fetching it again")
        todo.append(n)
        if (blob := _in_cache(repo, n, commit, remote[n], cache_dir)) is not None:
            cached[n] = blob

    def needs(n):
        if n in cached and _same_device(cached[n], folder):
            return 0
        part = folder / (n + PART)
        return remote[n].size - (part.stat().st_size if part.exists() and n not in cached else 0)

    need = sum(needs(n) for n in todo)
    free = shutil.disk_usage(folder).free
    if need > free:
        raise DownloadError(f"{folder} has {free / 2**30:.1f} GiB free, the set needs {need / 2**30:.1f} GiB more")
    headers = hub.utils.build_hf_headers(token=token, library_name=LIBRARY, library_version=__version__)
    out = []
    for n in names:
        if n in todo:
            if should_stop is not None and should_stop():
                raise Cancelled(f"download of the {set_name} set stopped before {n}; "
                                "the partial files are kept and resume next time")
            dest = folder / n
            if n in cached and take_from_cache(cached[n], remote[n], dest, progress=progress, should_stop=should_stop):
                log(f"{n}: taken from the Hugging Face cache")
            else:
                url = hub.hf_hub_url(repo, n, revision=commit, endpoint=endpoint)
                fetch_file(url, remote[n], dest, headers=headers, progress=progress, should_stop=should_stop)
                log(f"{n}: verified")
        out.append(folder / n)
    return out


def run(args) -> int:
    from ..files.inventory import scan

    paths = download_set(args.set, args.dir, endpoint=args.endpoint, revision=args.revision, token=args.token,
                         log=lambda m: print(m, file=sys.stderr),
                         replace=tuple(scan(args.dir).unusable_in_set(args.set)))
    for p in paths:
        print(p)
    return 0


def add_cli(sub):
    p = sub.add_parser("download", help="fetch a published GGUF set from Hugging Face")
    p.add_argument("--set", default="q8", choices=list(SETS),
                   help="light (~9 GB: LM Q5_K_M, DiT Q4_K_M), q8 (~13 GB) or native (~29 GB)")
    p.add_argument("--dir", default="models/mm3", help="target folder (default: models/mm3)")
    p.add_argument("--endpoint", default=None,
                   help="Hugging Face endpoint or mirror (default: $HF_ENDPOINT, else the Hub)")
    p.add_argument("--revision", default="main", help="branch, tag or commit (default: main)")
    p.add_argument("--token", default=None,
                   help="Hugging Face token (default: $HF_TOKEN, else the one `hf auth login` stored)")
    p.set_defaults(func=run)
