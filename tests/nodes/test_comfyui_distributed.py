"""The pack under ComfyUI-Distributed: a master and two workers on 127.0.0.1, each a ComfyUI process
with its own folders (tests/helpers/distributed.py), driven through the master's
`POST /distributed/queue` as a script or the editor drives it.

Each collected song must be the song one server makes for the same request, byte for byte (float
WAV), with its replay request; nothing of the cluster may be left running afterwards. Skipped,
saying why, without COMFYUI_PATH and COMFYUI_DISTRIBUTED_PATH (a ComfyUI-Distributed checkout).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from tests.helpers.comfy_workflows import api_from_ui, schema_problems
from tests.helpers.comfyui import API_DIR, audio_entries, read_wav, run, tiny_workflow
from tests.helpers.distributed import Cluster, distributed_missing

ROOT = Path(__file__).resolve().parents[2]
WHY = distributed_missing()
pytestmark = [pytest.mark.comfyui, pytest.mark.slow, pytest.mark.skipif(WHY is not None, reason=WHY or "")]
DISTRIBUTED_WORKFLOWS = ["songs_across_workers", "variations_across_workers"]
RUN_TIMEOUT = 900  # three ComfyUI processes share the test machine's cores


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(workers=2).start()
    try:
        yield c
    finally:
        c.stop()
        assert c.alive() == [], "cluster processes left running"


def distributed_run(cluster, workflow, delegate: bool = False) -> dict:
    """Queue through the master's /distributed/queue; the master's history entry once it finished."""
    answer = cluster.queue(workflow, delegate=delegate)
    assert answer["worker_count"] == 2 and not answer.get("node_errors"), answer
    entry = cluster.wait(answer["prompt_id"], timeout=RUN_TIMEOUT)
    assert entry["status"]["status_str"] == "success", (json.dumps(entry["status"])[:3000], cluster.master.log_tail())
    return entry


def worker_entries(cluster, prompt_count: int) -> list[dict]:
    """Each worker's history entries, newest last; each worker ran `prompt_count` prompts, all successfully."""
    found = []
    for w, history in zip(cluster.workers, cluster.worker_histories()):
        entries = sorted(history.values(), key=lambda e: e["prompt"][0])
        assert len(entries) == prompt_count, (w.url, len(entries), w.log_tail())
        assert all(e["status"]["status_str"] == "success" for e in entries), (w.url, w.log_tail())
        found.append(entries)
    return found


def saved(server, entry, node: str) -> list[tuple[bytes, dict]]:
    """(audio bytes, replay request) of each file a Save Song node wrote."""
    return [(server.view(f), json.loads(server.view({**f, "filename": f["filename"].rsplit(".", 1)[0] + ".json"})))
            for f in audio_entries(entry, node)]


def test_distributed_workflows_convert_to_the_api_ones(cluster):
    """The editor files of the two workflows queue exactly their API files (the master knows both packs' nodes)."""
    info = cluster.master.get("/object_info")
    for name in DISTRIBUTED_WORKFLOWS:
        ui = json.loads((ROOT / "workflows" / f"{name}.json").read_text())
        assert schema_problems(ui) == [], name
        api = json.loads((API_DIR / f"{name}.json").read_text())
        assert api_from_ui(ui, info) == {k: {"class_type": v["class_type"], "inputs": v["inputs"]}
                                         for k, v in api.items()}, name


def test_a_plan_is_asked_for_before_anything_runs(cluster):
    """variations_across_workers as shipped holds no plan: queueing it is refused, saying what to
    paste; a text that is not a replay JSON with codes is refused in its own words."""
    import urllib.error

    wf = json.loads((API_DIR / "variations_across_workers.json").read_text())
    for text, words in (("", "replay_json is empty; paste the text of a replay JSON"),
                        ('{"caption": "x", "lyrics": "y"}', "holds no audio_codes"),
                        ("{", "MM3 Audio Codes From Text: Malformed JSON")):
        wf["2"]["inputs"]["replay_json"] = text
        with pytest.raises(urllib.error.HTTPError) as refused:
            cluster.master.post("/prompt", {"prompt": wf})
        assert words in refused.value.read().decode(), text


def test_songs_across_workers(cluster):
    """Master and workers each plan and render their own song (lm_seed 50, 51, 52 from Distributed
    Seed); the master saves all three with their replay requests, each equal to the song the master
    alone makes for that lm_seed."""
    master = cluster.master
    wf = tiny_workflow(master, "songs_across_workers", fmt="wav32", **{"3": {"seed": 50}})
    entry = distributed_run(cluster, wf)
    songs = saved(master, entry, "12")
    assert [r["lm_seed"] for _, r in songs] == [50, 51, 52]
    assert [len(e) for e in worker_entries(cluster, 1)] == [1, 1]
    for data, replay in songs:
        alone, _ = run(master, tiny_workflow(master, "text_to_song", fmt="wav32",
                                             **{"3": {"lm_seed": replay["lm_seed"]}, "8": {"filename_prefix": "alone"}}),
                       timeout=RUN_TIMEOUT)
        ((want, want_replay),) = saved(master, alone, "8")
        assert read_wav(data)[:3] == (2, 44100, 32)
        assert data == want, replay["lm_seed"]
        assert replay == want_replay


def test_songs_across_workers_with_the_master_only_collecting(cluster):
    """Delegate mode: the master runs only the collector and what follows it, so the songs are the
    workers' two (lm_seed 61, 62), each with its replay request."""
    master = cluster.master
    before = [len(h) for h in cluster.worker_histories()]
    entry = distributed_run(cluster, tiny_workflow(master, "songs_across_workers", fmt="wav32",
                                                   **{"3": {"seed": 60}}), delegate=True)
    songs = saved(master, entry, "12")
    assert [r["lm_seed"] for _, r in songs] == [61, 62]
    assert "4" not in entry["prompt"][2]  # the master was sent no plan to make
    assert [len(e) for e in worker_entries(cluster, before[0] + 1)] == [before[0] + 1] * 2
    assert songs[0][0] != songs[1][0]


def test_variations_across_workers(cluster):
    """The master plans once (AR only, Save Audio Codes); the plan's JSON travels in the workflow's
    text to every server, which checks its own LM and depth files against the fingerprints it
    records (the text names a depth fingerprint no server has: each one warns) and renders one
    variation (seed 300, 301, 302). Each equals the variation the master alone renders from its plan."""
    master = cluster.master
    planner = {k: v for k, v in tiny_workflow(master, "variations_from_one_plan").items() if k in "12678"}
    planner["7"]["inputs"]["lm_seed"] = 606
    planner["8"]["inputs"]["filename_prefix"] = "mm3/cluster_plan"
    plan_entry, _ = run(master, planner, timeout=RUN_TIMEOUT)
    plan_text = master.view(plan_entry["outputs"]["8"]["codes"][0]).decode()
    plan = json.loads(plan_text)
    tampered = {**plan, "model_fingerprints": {**plan["model_fingerprints"], "depth_model": "1-" + "0" * 16}}
    wf = tiny_workflow(master, "variations_across_workers", fmt="wav32",
                       **{"2": {"replay_json": json.dumps(tampered)}, "4": {"seed": 300}})
    before = [len(h) for h in cluster.worker_histories()]
    entry = distributed_run(cluster, wf)
    variations = saved(master, entry, "11")
    assert [r["seed"] for _, r in variations] == [300, 301, 302]
    assert all(r["audio_codes"] == plan["audio_codes"] and r["lm_seed"] == 606 for _, r in variations)
    for w, entries in zip(cluster.workers, worker_entries(cluster, before[0] + 1)):
        text = "\n".join(entries[-1]["outputs"]["2"]["text"])
        assert "warning: depth_model" in text and "is not the file that made this song" in text, (w.url, text)
    for data, replay in variations:
        single = copy.deepcopy(tiny_workflow(master, "variations_from_one_plan", fmt="wav32"))
        single["7"]["inputs"]["lm_seed"] = 606
        single["10"]["inputs"].update(seed=replay["seed"], variations=1)
        alone, _ = run(master, single, timeout=RUN_TIMEOUT)
        ((want, _),) = saved(master, alone, "13")
        assert data == want, replay["seed"]


def api_example(*args: str) -> str:
    """workflows/api_example.py with these arguments; its stderr (it must succeed)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, str(ROOT / "workflows" / "api_example.py"), *args, "--timeout",
                          str(RUN_TIMEOUT)], capture_output=True, text=True, timeout=RUN_TIMEOUT + 60)
    assert out.returncode == 0, out.stderr
    return out.stderr


def test_api_example_fans_out_over_several_servers(cluster, tmp_path):
    """Three --server options, no ComfyUI-Distributed involved: each server plans its own song
    (lm_seed 70, 71, 72), its files land in its own folder, and the second server's song is the
    one the master alone makes for lm_seed 71."""
    master = cluster.master
    path = tmp_path / "wf.json"
    path.write_text(json.dumps(tiny_workflow(master, "text_to_song", fmt="wav32")))
    servers = [a for s in cluster.servers for a in ("--server", s.url)]
    api_example(*servers, "--workflow", str(path), "--lm-seed", "70", "--out", str(tmp_path / "out"))
    folders = [tmp_path / "out" / f"127.0.0.1_{s.port}" for s in cluster.servers]
    replays = [json.loads(next(f.glob("*.json")).read_text()) for f in folders]
    assert [r["lm_seed"] for r in replays] == [70, 71, 72]
    alone, _ = run(master, tiny_workflow(master, "text_to_song", fmt="wav32", **{"3": {"lm_seed": 71}}),
                   timeout=RUN_TIMEOUT)
    ((want, _),) = saved(master, alone, "8")
    assert next(folders[1].glob("*.wav")).read_bytes() == want


def test_api_example_queues_through_the_master(cluster, tmp_path):
    """--distributed sends the workflow once, to the master, which sends it to its enabled workers:
    --lm-seed sets the Distributed Seed wired into AR Plan; --codes puts a plan into
    variations_across_workers. The collected songs are downloaded from the master."""
    master = cluster.master
    songs = tmp_path / "songs.json"
    songs.write_text(json.dumps(tiny_workflow(master, "songs_across_workers", fmt="wav16")))
    log = api_example("--server", master.url, "--distributed", "--workflow", str(songs), "--lm-seed", "80",
                      "--out", str(tmp_path / "songs"))
    assert "sent to 2 of 2 enabled workers" in log, log
    replays = sorted(json.loads(p.read_text())["lm_seed"] for p in (tmp_path / "songs").glob("*.json"))
    assert replays == [80, 81, 82] and len(list((tmp_path / "songs").glob("*.wav"))) == 3
    plan = sorted((tmp_path / "songs").glob("*.json"))[0]  # a song's replay JSON is a plan too
    variations = tmp_path / "variations.json"
    variations.write_text(json.dumps(tiny_workflow(master, "variations_across_workers", fmt="wav16")))
    api_example("--server", master.url, "--distributed", "--workflow", str(variations), "--codes", str(plan),
                "--seed", "500", "--out", str(tmp_path / "variations"))
    got = [json.loads(p.read_text()) for p in sorted((tmp_path / "variations").glob("*.json"))]
    assert sorted(r["seed"] for r in got) == [500, 501, 502]
    assert {r["audio_codes"] for r in got} == {json.loads(plan.read_text())["audio_codes"]}
