"""A ComfyUI-Distributed cluster on 127.0.0.1: a master and N workers, each its own ComfyUI process
(own port, own input/output/user folders, as on separate machines) with this pack and a copy of
ComfyUI-Distributed (COMFYUI_DISTRIBUTED_PATH) in its custom_nodes, and the same tiny GGUFs.

The master's copy holds the cluster's configuration (ComfyUI-Distributed reads gpu_config.json
from its own folder): every worker enabled, as a remote worker at 127.0.0.1:port. Each process
leads its own process group, which `stop` ends whole.

`python tests/helpers/distributed.py --workers 0 1 2 --songs 12` measures songs per hour through
`POST /distributed/queue` (songs_across_workers on the tiny model) for each worker count, and the
CPU time all servers spent per song: on one machine the servers share its cores, so the figure
shows what the distribution costs, not a speed-up.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the repository on the path, as pytest has it
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.helpers.comfy_server import ComfyServer, build_tiny_models

DISTRIBUTED_PATH = os.environ.get("COMFYUI_DISTRIBUTED_PATH")
DISTRIBUTED_DIR = "ComfyUI-Distributed"


def distributed_missing() -> str | None:
    """Why a cluster cannot start here (None: it can)."""
    if not os.environ.get("COMFYUI_PATH"):
        return "COMFYUI_PATH is not set (a ComfyUI checkout to run)"
    if not DISTRIBUTED_PATH:
        return "COMFYUI_DISTRIBUTED_PATH is not set (a ComfyUI-Distributed checkout to install on each server)"
    if not (Path(DISTRIBUTED_PATH) / "distributed.py").is_file():
        return f"COMFYUI_DISTRIBUTED_PATH={DISTRIBUTED_PATH} holds no ComfyUI-Distributed (no distributed.py)"
    return None


class DistributedServer(ComfyServer):
    """A ComfyServer with its own copy of ComfyUI-Distributed (whose configuration lives in its folder)."""

    def launch(self) -> "DistributedServer":
        nodes = self.base / "custom_nodes"
        nodes.mkdir(parents=True, exist_ok=True)
        shutil.copytree(DISTRIBUTED_PATH, nodes / DISTRIBUTED_DIR,
                        ignore=shutil.ignore_patterns(".git", "node_modules", "gpu_config.json", "__pycache__"))
        return super().launch()

    def write_config(self, workers: list["DistributedServer"]) -> None:
        """This server as the master of `workers` (all enabled), in its copy's gpu_config.json."""
        config = {"master": {"host": "127.0.0.1"},
                  "workers": [{"id": str(i + 1), "name": f"worker {i + 1}", "host": "127.0.0.1", "port": w.port,
                               "type": "remote", "enabled": True} for i, w in enumerate(workers)],
                  "settings": {"debug": True, "auto_launch_workers": False, "master_delegate_only": False}}
        (self.base / "custom_nodes" / DISTRIBUTED_DIR / "gpu_config.json").write_text(json.dumps(config, indent=2))


class Cluster:
    """A master and `workers` worker servers, started side by side and stopped together."""

    def __init__(self, workers: int, comfy_path: str | None = None, python: str | None = None,
                 env: dict | None = None):
        self.models = Path(tempfile.mkdtemp(prefix="mm3cluster_models_"))
        build_tiny_models(self.models)
        comfy_path = comfy_path or os.environ["COMFYUI_PATH"]
        python = python or os.environ.get("COMFYUI_PYTHON")
        self.master = DistributedServer(comfy_path, python, env=env, models=self.models, own_group=True)
        self.workers = [DistributedServer(comfy_path, python, env=env, models=self.models, own_group=True)
                        for _ in range(workers)]
        self.servers = [self.master, *self.workers]

    def start(self, timeout: float = 900.0) -> "Cluster":
        try:
            for s in self.servers:
                s.launch()
            self.master.write_config(self.workers)  # read when the master queues, so after the start is fine
            for s in self.servers:
                s.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        from mm3.formats.gguf import read_architecture

        files = {read_architecture(self.models / n): n for n in self.master.model_names}
        for s in self.servers:
            s.files = files
        return self

    def stop(self) -> None:
        import signal

        for s in self.servers:  # all asked to end first, so they end side by side
            if s.proc is not None:
                try:
                    os.killpg(s.proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for s in self.servers:
            s.stop()
        shutil.rmtree(self.models, ignore_errors=True)

    def alive(self) -> list[str]:
        """The servers of which some process still runs."""
        return [s.url for s in self.servers if s.group_alive()]

    def queue(self, workflow: dict, workers: list[str] | None = None, delegate: bool = False) -> dict:
        """POST /distributed/queue on the master (every configured worker unless `workers` names
        their ids; `delegate`: the master only collects); its answer (prompt_id, worker_count)."""
        ids = [str(i + 1) for i in range(len(self.workers))] if workers is None else workers
        return self.master.post("/distributed/queue", {"prompt": workflow, "client_id": self.master.client_id,
                                                       "enabled_worker_ids": ids, "delegate_master": delegate},
                                timeout=300)

    def wait(self, prompt_id: str, timeout: float) -> dict:
        """The master's history entry of `prompt_id` once it finished; a server slow to answer (the
        machine busy) is asked again, not given up on."""
        import socket
        import urllib.error

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                entry = self.master.get(f"/history/{prompt_id}", timeout=300).get(prompt_id)
            except (urllib.error.URLError, ConnectionError, socket.timeout):
                continue
            if entry is not None and (entry["status"].get("completed") or entry["status"].get("status_str") == "error"):
                return entry
            time.sleep(0.2)
        raise TimeoutError(f"prompt {prompt_id} did not finish within {timeout} s:\n{self.master.log_tail()}")

    def worker_histories(self) -> list[dict]:
        """Every prompt each worker ran (its /history), per worker."""
        return [w.get("/history") for w in self.workers]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used, its threads included (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def songs_per_hour(cluster: Cluster, songs: int, duration: float, steps: int, timeout: float = 1800) -> dict:
    """Queue songs_across_workers through the master until `songs` songs are made (each run: one
    song on every server) and time the runs end to end; the songs made, songs per hour, and the CPU
    time every server used per song (what the machine spent, whatever share of it the servers got)."""
    from tests.helpers.comfyui import tiny_workflow

    runs = -(-songs // len(cluster.servers))
    base = tiny_workflow(cluster.master, "songs_across_workers", duration=duration, steps=steps)
    cpu = sum(cpu_seconds(s.proc.pid) for s in cluster.servers)
    start = time.monotonic()
    made = 0
    for r in range(runs):
        wf = json.loads(json.dumps(base))
        wf["3"]["inputs"]["seed"] = 1000 + r * len(cluster.servers)  # new songs each run, not the cache
        answer = cluster.queue(wf)
        entry = cluster.wait(answer["prompt_id"], timeout=timeout)
        if entry["status"].get("status_str") != "success":
            raise RuntimeError(f"run {r} failed: {json.dumps(entry['status'])[:2000]}\n{cluster.master.log_tail()}")
        made += len(entry["outputs"]["12"]["audio"])
    elapsed = time.monotonic() - start
    cpu = sum(cpu_seconds(s.proc.pid) for s in cluster.servers) - cpu
    return {"servers": len(cluster.servers), "workers": len(cluster.workers), "songs": made, "seconds": elapsed,
            "songs_per_hour": made * 3600 / elapsed, "seconds_per_song": elapsed / made,
            "cpu_seconds_per_song": cpu / made, "load_average": os.getloadavg()[0]}


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description="Songs per hour of songs_across_workers on the tiny model, through "
                                            "ComfyUI-Distributed on 127.0.0.1, for each worker count (COMFYUI_PATH, "
                                            "COMFYUI_DISTRIBUTED_PATH, COMFYUI_PYTHON)")
    p.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2], help="worker counts to measure (master too)")
    p.add_argument("--songs", type=int, default=6, help="songs to make per measurement (at least one run)")
    p.add_argument("--duration", type=float, default=2.0, help="seconds of each song")
    p.add_argument("--steps", type=int, default=4, help="DiT steps")
    p.add_argument("--threads", type=int, help="CPU threads of each server (OMP_NUM_THREADS; default: torch's own)")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    why = distributed_missing()
    if why:
        raise SystemExit(why)
    results = []
    for n in args.workers:
        cluster = Cluster(n, env=None if args.threads is None else {"OMP_NUM_THREADS": str(args.threads)}).start()
        try:
            songs_per_hour(cluster, len(cluster.servers), args.duration, args.steps)  # warm: models loaded
            result = songs_per_hour(cluster, args.songs, args.duration, args.steps)
        finally:
            cluster.stop()
        results.append(result)
        print(f"master + {n} workers: {result['songs']} songs in {result['seconds']:.1f} s, "
              f"{result['songs_per_hour']:.0f} songs per hour ({result['seconds_per_song']:.2f} s a song), "
              f"{result['cpu_seconds_per_song']:.2f} CPU s a song over all servers (load average "
              f"{result['load_average']:.1f})", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
