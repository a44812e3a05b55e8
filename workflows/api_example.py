"""Run an MM3 workflow on a ComfyUI server from a script (standard library only).

Posts an API-format workflow to /prompt, waits for it on /history/{prompt_id}, then downloads
every file the workflow's output nodes wrote through /view (audio, the replay JSON beside each song,
codes files), and prints on stderr the warnings the nodes showed (a caption without the trained
format's headings, a model file other than the one that made a song). Common settings have flags;
the model files are picked by component (--lm, --depth, --cond, --dit, --vae: a file name in
models/mm3, or auto); any other input is set with --set NODE.INPUT=VALUE (VALUE is JSON, or a
plain string).

    python workflows/api_example.py --server http://127.0.0.1:8188 \
        --caption "Basic Attributes: bpm is 100. Dreamy synth-pop, female vocal." \
        --lyrics-file lyrics.txt --duration 90 --lm-seed 7 --seed 1 \
        --lm MiniMax-Music3-language_model-Q8_0.gguf --out songs/

Several --server options fan the workflow out, one copy per server (each GPU its own ComfyUI):
server i takes the next block of seeds (every literal AR Plan lm_seed + i * songs, so each plans
other songs; a workflow without one, such as a saved plan's, every sampler seed + i * variations),
and its files go to OUT/HOST_PORT/. --distributed instead queues once through a ComfyUI-Distributed
master (POST /distributed/queue, with every worker its configuration enables), for the workflows
that collect on the master (songs_across_workers, variations_across_workers; --codes FILE puts a
replay JSON into the latter's MM3 Audio Codes From Text).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
# flag -> (node class, input name)
FLAGS = {
    "caption": ("MM3PromptAssemble", "caption"), "lyrics": ("MM3PromptAssemble", "lyrics"),
    "duration": ("MM3ARPlan", "duration"), "lm_seed": ("MM3ARPlan", "lm_seed"), "songs": ("MM3ARPlan", "songs"),
    "seed": ("MM3FlowSampler", "seed"), "steps": ("MM3FlowSampler", "steps"),
    "variations": ("MM3FlowSampler", "variations"), "format": ("MM3SaveSong", "format"),
}
# model flag -> (the loader of that component, its input; the set loader's input for it)
MODEL_FLAGS = {
    "lm": ("MM3LoadLanguageModel", "lm_model"), "depth": ("MM3LoadDepthDecoder", "depth_model"),
    "cond": ("MM3LoadConditionEncoder", "cond_model"), "dit": ("MM3LoadDiT", "dit_model"),
    "vae": ("MM3LoadVocoder", "vae_model"),
}


def call(server: str, path: str, body: dict | None = None, timeout: float = 60):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(server.rstrip("/") + path, data=data,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        raw = r.read()
        return json.loads(raw) if r.headers.get_content_type() == "application/json" else raw


def download(server: str, item: dict, timeout: float = 300) -> bytes:
    """A file an output node wrote, through /view (raw bytes, whatever its type)."""
    query = urllib.parse.urlencode({k: item[k] for k in ("filename", "subfolder", "type")})
    with urllib.request.urlopen(f"{server.rstrip('/')}/view?{query}", timeout=timeout) as r:
        return r.read()


def set_input(workflow: dict, node_class: str, name: str, value) -> int:
    """Set `name` on every node of `node_class` that has it as a literal input, or wired from a
    ComfyUI-Distributed seed node (which then gets it: the master's seed); returns how many."""
    n = 0
    for node in workflow.values():
        if node["class_type"] != node_class or name not in node["inputs"]:
            continue
        source = node["inputs"][name]
        if not isinstance(source, list):
            node["inputs"][name] = value
            n += 1
        elif workflow.get(str(source[0]), {}).get("class_type") == "DistributedSeed":
            workflow[str(source[0])]["inputs"]["seed"] = value
            n += 1
    return n


def set_model(workflow: dict, flag: str, name: str) -> int:
    """Point every loader of the flag's component (its own loader, or the set loader) at `name`."""
    loader, set_input_name = MODEL_FLAGS[flag]
    return set_input(workflow, loader, "model_name", name) + set_input(workflow, "MM3LoadModelSet", set_input_name, name)


def refusal(text: str, workflow: dict) -> str:
    """The server's answer to a refused prompt, as lines a person reads (node, input, what is wrong)."""
    try:
        body = json.loads(text)
    except json.JSONDecodeError:
        return text.strip()[:2000]
    lines = [body.get("error", {}).get("message", "refused") if isinstance(body.get("error"), dict) else
             str(body.get("error", "refused"))]
    for node_id, node in (body.get("node_errors") or {}).items():
        cls = node.get("class_type") or workflow.get(node_id, {}).get("class_type", "?")
        for err in node.get("errors", []):
            detail = err.get("details") or err.get("message", "")
            lines.append(f"  node {node_id} ({cls}): {detail}")
    return "\n".join(lines)


def node_warnings(entry: dict, workflow: dict) -> list[str]:
    """The "warning: ..." lines of the text each node showed (its `text` output in /history)."""
    found = []
    for node_id, node_output in (entry.get("outputs") or {}).items():
        cls = workflow.get(node_id, {}).get("class_type", "?")
        for text in node_output.get("text", []):
            for line in str(text).splitlines():
                if line.startswith("warning: "):
                    found.append(f"warning: node {node_id} ({cls}): {line[len('warning: '):]}")
    return found


def enabled_workers(server: str) -> list[str]:
    """The ids of the workers a ComfyUI-Distributed master's configuration enables."""
    try:
        config = call(server, "/distributed/config")
    except urllib.error.HTTPError as e:
        raise SystemExit(f"{server} answers /distributed/config with {e.code}: is ComfyUI-Distributed installed there?")
    return [str(w["id"]) for w in config.get("workers", []) if w.get("enabled")]


def queue(server: str, workflow: dict, distributed: bool = False) -> str:
    """POST the workflow to /prompt, or with `distributed` to the master's /distributed/queue with
    every enabled worker; its prompt id on that server."""
    client_id = uuid.uuid4().hex
    try:
        if distributed:
            workers = enabled_workers(server)
            answer = call(server, "/distributed/queue", {"prompt": workflow, "client_id": client_id,
                                                        "enabled_worker_ids": workers})
            print(f"{server}: sent to {answer.get('worker_count', 0)} of {len(workers)} enabled workers",
                  file=sys.stderr)
            if answer.get("node_errors"):
                raise SystemExit("the master refused the workflow:\n" + refusal(json.dumps(answer), workflow))
        else:
            answer = call(server, "/prompt", {"prompt": workflow, "client_id": client_id})
    except urllib.error.HTTPError as e:
        raise SystemExit(f"{server} refused the workflow:\n" + refusal(e.read().decode(errors="replace"), workflow))
    except urllib.error.URLError as e:
        raise SystemExit(f"cannot reach the ComfyUI server at {server} ({e.reason}); is it running?")
    print(f"{server}: queued {answer['prompt_id']}", file=sys.stderr)
    return answer["prompt_id"]


def run(server: str, workflow: dict, out: Path, timeout: float, distributed: bool = False) -> list[Path]:
    return fetch_results(server, queue(server, workflow, distributed), workflow, out, timeout)


def fetch_results(server: str, prompt_id: str, workflow: dict, out: Path, timeout: float) -> list[Path]:
    """Wait for the prompt on /history, print the nodes' warnings, download what its output nodes wrote."""
    deadline = time.monotonic() + timeout
    while True:
        entry = call(server, f"/history/{prompt_id}").get(prompt_id)
        status = (entry or {}).get("status", {})
        if status.get("completed"):
            break
        if status.get("status_str") == "error":
            for kind, data in status.get("messages", []):
                if kind == "execution_error":
                    raise SystemExit(f"the workflow failed in node {data.get('node_id')} ({data.get('node_type')}): "
                                     f"{data.get('exception_message', '').strip()}")
                if kind == "execution_interrupted":
                    raise SystemExit(f"the workflow was interrupted in node {data.get('node_id')}")
            raise SystemExit("the workflow failed (see the server's log)")
        if time.monotonic() > deadline:
            raise SystemExit(f"no result after {timeout:.0f} s (prompt {prompt_id} is still queued or running)")
        time.sleep(1.0)
    for line in node_warnings(entry, workflow):
        print(line, file=sys.stderr)
    written = []
    out.mkdir(parents=True, exist_ok=True)
    for node_output in entry["outputs"].values():
        for item in node_output.get("codes", []):  # Save Audio Codes' replay JSON
            path = out / item["filename"]
            path.write_bytes(download(server, item))
            written.append(path)
        for item in node_output.get("audio", []):
            path = out / item["filename"]
            path.write_bytes(download(server, item))
            written.append(path)
            if path.suffix in (".wav", ".mp3"):  # Save Song writes the replay request beside the audio
                try:
                    data = download(server, {**item, "filename": path.stem + ".json"})
                except urllib.error.HTTPError:
                    continue  # audio from other nodes has none
                (out / (path.stem + ".json")).write_bytes(data)
                written.append(out / (path.stem + ".json"))
    return written


def spread_seeds(workflow: dict, index: int) -> dict:
    """The copy of the workflow for fan-out server `index`: the next block of seeds, so every server
    makes other songs (each literal AR Plan lm_seed + index * songs) or, without one (a saved
    plan's workflow), other variations (each literal sampler seed + index * variations)."""
    copy = json.loads(json.dumps(workflow))
    plans = [n["inputs"] for n in copy.values() if n["class_type"] == "MM3ARPlan"
             and isinstance(n["inputs"].get("lm_seed"), int)]
    samplers = [n["inputs"] for n in copy.values() if n["class_type"] in ("MM3FlowSampler", "MM3Repaint")
                and isinstance(n["inputs"].get("seed"), int)]
    if plans:
        for inputs in plans:
            inputs["lm_seed"] += index * int(inputs.get("songs", 1))
    elif samplers:
        for inputs in samplers:
            inputs["seed"] += index * int(inputs.get("variations", 1))
    else:
        raise SystemExit("several --server options need an AR Plan lm_seed or a sampler seed typed into the workflow "
                         "(not wired), to give each server other songs")
    return copy


def server_folder(server: str) -> str:
    """A folder name for one server's files: its host and port."""
    parts = urllib.parse.urlsplit(server if "//" in server else "http://" + server)
    return f"{parts.hostname}_{parts.port or (443 if parts.scheme == 'https' else 80)}"


def parse_value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--server", action="append", metavar="URL",
                   help="a ComfyUI server (default http://127.0.0.1:8188); repeat it to fan the workflow out")
    p.add_argument("--distributed", action="store_true",
                   help="queue through the ComfyUI-Distributed master at --server (POST /distributed/queue)")
    p.add_argument("--codes", metavar="FILE",
                   help="a replay JSON for MM3 Audio Codes From Text (variations_across_workers)")
    p.add_argument("--workflow", default=str(HERE / "api" / "text_to_song.json"), help="API-format workflow JSON")
    p.add_argument("--out", default="mm3_out", help="folder for the downloaded files")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds to wait for the result")
    p.add_argument("--lyrics-file", help="read the lyrics from this UTF-8 file")
    p.add_argument("--set", action="append", default=[], metavar="NODE.INPUT=VALUE",
                   help="set any literal input by node id, e.g. 3.lm_cfg=1.8")
    for flag in FLAGS:
        text = flag in ("caption", "lyrics", "format")
        p.add_argument("--" + flag.replace("_", "-"), dest=flag, type=str if text else parse_value)
    for flag in MODEL_FLAGS:
        p.add_argument("--" + flag, dest="model_" + flag, metavar="FILE",
                       help=f"the {flag} file in models/mm3 (or auto)")
    args = p.parse_args(argv)

    workflow = json.loads(Path(args.workflow).read_text(encoding="utf-8"))
    if args.lyrics_file:
        args.lyrics = Path(args.lyrics_file).read_text(encoding="utf-8")
    for flag, (node_class, name) in FLAGS.items():
        value = getattr(args, flag)
        if value is not None and not set_input(workflow, node_class, name, value):
            raise SystemExit(f"--{flag.replace('_', '-')}: no {node_class} node with a literal {name} in the workflow")
    for flag in MODEL_FLAGS:
        value = getattr(args, "model_" + flag)
        if value is not None and not set_model(workflow, flag, value):
            raise SystemExit(f"--{flag}: the workflow has no loader of that component with a literal file name")
    if args.codes and not set_input(workflow, "MM3AudioCodesFromText", "replay_json",
                                    Path(args.codes).read_text(encoding="utf-8")):
        raise SystemExit("--codes: the workflow has no MM3 Audio Codes From Text with a literal replay_json")
    for item in args.set:
        key, _, value = item.partition("=")
        node_id, _, name = key.partition(".")
        if node_id not in workflow or not name:
            raise SystemExit(f"--set {item}: expected NODE.INPUT=VALUE with a node id of the workflow")
        workflow[node_id]["inputs"][name] = parse_value(value)
    servers = args.server or ["http://127.0.0.1:8188"]
    if args.distributed and len(servers) > 1:
        raise SystemExit("--distributed takes one --server: the master (it sends the workflow to its workers)")
    if len(servers) == 1:
        for path in run(servers[0], workflow, Path(args.out), args.timeout, args.distributed):
            print(path)
        return 0
    folders = [server_folder(s) for s in servers]
    if len(set(folders)) < len(folders):
        raise SystemExit(f"--server: the same server twice ({', '.join(servers)})")
    copies = [spread_seeds(workflow, i) for i in range(len(servers))]
    queued = [queue(s, wf) for s, wf in zip(servers, copies)]  # all queued first: they run side by side
    for s, wf, prompt_id, folder in zip(servers, copies, queued, folders):
        for path in fetch_results(s, prompt_id, wf, Path(args.out) / folder, args.timeout):
            print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
