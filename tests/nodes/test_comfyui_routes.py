"""The pack's routes and its queue-time checks in a real ComfyUI (COMFYUI_PATH), with the tiny models.

Routes: a body past its route's limit is a 413 (with or without a Content-Length), a body that is
not a JSON object or a field of the wrong type a 400 with the reason and no traceback, the token
count refuses the control characters MM3 Prompt refuses, and the server keeps answering while
long texts are counted. Queue time: /prompt refuses a Repaint range that runs backwards, a duration
out of range or not a number, and a control character or megabytes in the lyrics, one message on
the input that holds the mistake, before any node runs; the caption and an AR Plan min_duration
past its duration are refused by the node when it runs, before it loads anything.
"""

from __future__ import annotations

import http.client
import json
import threading
import time

import pytest

from tests.helpers.comfy_server import executed_nodes
from tests.helpers.comfyui import needs_comfy, tiny_workflow

TOKENS_LIMIT = 256 * 1024  # nodes/routes.py TOKENS_BODY_LIMIT
SMALL_LIMIT = 4 * 1024  # nodes/routes.py SMALL_BODY_LIMIT


def raw(server, method: str, path: str, data: bytes | None = None, *, chunked: bool = False,
        timeout: float = 60) -> tuple[int, dict | bytes]:
    """(status, JSON or bytes) of one request with exactly `data` as its body; `chunked` sends it
    without a Content-Length."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=timeout)
    try:
        headers = {"Content-Type": "application/json"}
        if chunked:
            body = (data[i:i + 65536] for i in range(0, len(data), 65536))
            conn.request(method, path, body=body, headers=headers, encode_chunked=True)
        else:
            conn.request(method, path, body=data, headers=headers)
        r = conn.getresponse()
        raw_body = r.read()
        try:
            return r.status, json.loads(raw_body)
        except ValueError:
            return r.status, raw_body
    finally:
        conn.close()


def post_json(server, path: str, body) -> tuple[int, dict | bytes]:
    return raw(server, "POST", path, json.dumps(body).encode())


def lyrics_of(size: int) -> str:
    """Lyrics of about `size` bytes, in JSON too (a verse repeated, " ^ " breaking its lines): text the
    tokenizer works through slowly."""
    line = "1234567890 la la dee da ^ "
    return "[verse]\n" + line * (size // len(line))


@needs_comfy
def test_bodies_past_the_limit_are_refused_413(comfy):
    big = json.dumps({"lm_model": "auto", "caption": "synth", "lyrics": "la " * (TOKENS_LIMIT // 3 + 10)}).encode()
    assert len(big) > TOKENS_LIMIT
    for chunked in (False, True):  # a declared length is refused unread, an undeclared one once past the limit
        status, got = raw(comfy, "POST", "/mm3/tokens", big, chunked=chunked)
        assert status == 413 and f"over the {TOKENS_LIMIT} byte limit" in got["error"], (chunked, status, got)
    status, got = raw(comfy, "POST", "/mm3/download", json.dumps({"set": "q8", "pad": "x" * SMALL_LIMIT}).encode())
    assert status == 413 and f"over the {SMALL_LIMIT} byte limit" in got["error"], (status, got)
    assert comfy.get("/mm3/download")["state"] == "idle"
    # A body under the limit is still counted.
    status, got = post_json(comfy, "/mm3/tokens", {"lm_model": "auto", "caption": "synth",
                                                   "lyrics": lyrics_of(200_000)})
    assert status == 200 and got["tokens"] > 100_000 and got["over"], got


@needs_comfy
@pytest.mark.parametrize("path, data, reason", [
    ("/mm3/tokens", b"[1]", "the body must be a JSON object, got an array"),
    ("/mm3/tokens", b'"caption"', "the body must be a JSON object, got a string"),
    ("/mm3/tokens", b"{", "the body is not JSON"),
    ("/mm3/tokens", b"\xff\xfe{}", "the body is not JSON"),
    ("/mm3/tokens", b"[" * 100_000, "the body is not JSON"),
    ("/mm3/tokens", b'{"caption": 5, "lyrics": "la"}', "caption must be a string, got a number"),
    ("/mm3/tokens", b'{"lm_model": ["a.gguf"]}', "lm_model must be a string, got an array"),
    ("/mm3/tokens", b'{"caption": "dark\\u001b[31m synth", "lyrics": "la"}',
     "caption contains the control character U+001B at position 4 (line 1, column 5)"),
    ("/mm3/tokens", b'{"caption": "pop", "lyrics": "la\\ud800"}', "lyrics contains an unpaired surrogate U+D800"),
    ("/mm3/download", b'{"set": ["q8"]}', "set must be a string, got an array"),
    ("/mm3/download", b"[1]", "the body must be a JSON object, got an array"),
    ("/mm3/download", b'{"set": "nope"}', "unknown set 'nope'"),
], ids=["tokens-array", "tokens-string", "tokens-broken", "tokens-not-utf8", "tokens-deep", "caption-number",
        "lm-array", "caption-escape", "lyrics-surrogate", "download-set-array", "download-array", "download-unknown"])
def test_malformed_bodies_are_400_with_the_reason(comfy, path, data, reason):
    logged = comfy.log_path.stat().st_size
    status, got = raw(comfy, "POST", path, data)
    assert status == 400 and isinstance(got, dict) and reason in got["error"], (status, got)
    assert "\n" not in got["error"]
    with open(comfy.log_path, "rb") as log:
        log.seek(logged)
        assert b"Traceback" not in log.read()


@needs_comfy
def test_the_server_answers_while_long_texts_are_counted(comfy):
    """Counts of the longest allowed texts run off the event loop: a cheap request answers within
    about one count's time while eight are sent at once, and counts beyond the few that may wait are
    refused (503) rather than queued without end."""
    body = json.dumps({"lm_model": "auto", "caption": "synth", "lyrics": lyrics_of(TOKENS_LIMIT - 1000)}).encode()
    assert len(body) <= TOKENS_LIMIT
    raw(comfy, "POST", "/mm3/tokens", body)  # the tokenizer is built and cached
    t = time.monotonic()
    status, got = raw(comfy, "POST", "/mm3/tokens", body)
    one = time.monotonic() - t
    assert status == 200 and got["tokens"] > 100_000, (status, got)

    results = []

    def count():
        results.append(raw(comfy, "POST", "/mm3/tokens", body, timeout=120))

    threads = [threading.Thread(target=count) for _ in range(8)]
    for th in threads:
        th.start()
    waits = []
    while any(th.is_alive() for th in threads):
        t = time.monotonic()
        assert comfy.get("/mm3/download", timeout=60)["state"] == "idle"
        waits.append(time.monotonic() - t)
        time.sleep(0.01)
    for th in threads:
        th.join()
    # On the event loop, a request waits for every count queued before it (3.1 s here for 0.44 s
    # counts); off it, a few milliseconds, more only where the machine is loaded.
    assert len(waits) >= 3 and max(waits) < 2 * one, (f"one count {one:.3f} s", sorted(waits)[-5:])
    statuses = sorted(s for s, _ in results)
    assert set(statuses) <= {200, 503} and 200 in statuses and 503 in statuses, statuses
    busy = next(g for s, g in results if s == 503)
    assert "the token counter is busy" in busy["error"], busy


# -- queue time ---------------------------------------------------------------------------------
def refused(server, workflow: dict) -> dict:
    """/prompt's node errors for a workflow it must refuse."""
    status, got = post_json(server, "/prompt", {"prompt": workflow, "client_id": server.client_id})
    assert status == 400, (status, got)
    return got["node_errors"]


def node_of(workflow: dict, class_type: str) -> str:
    return next(k for k, v in workflow.items() if v["class_type"] == class_type)


def through(workflow: dict, node: str) -> dict:
    """`workflow` without the Save Song nodes that do not depend on `node` (ComfyUI queues the
    outputs a bad node does not feed and reports the rest; with none left it refuses the prompt)."""
    def feeds(k: str) -> bool:
        links = [v[0] for v in workflow[k]["inputs"].values() if isinstance(v, list)]
        return k == node or any(feeds(x) for x in links)

    return {k: v for k, v in workflow.items() if v["class_type"] != "MM3SaveSong" or feeds(k)}


def messages(errors: dict, node: str) -> str:
    return " | ".join(f"{e['message']}: {e['details']}" for e in errors[node]["errors"])


def with_values(comfy, workflow: str, node_class: str, values: dict) -> tuple[dict, str]:
    """A shipped workflow with `values` set on its `node_class` node, without the outputs that do
    not depend on it; and that node's id."""
    wf = tiny_workflow(comfy, workflow)
    node = node_of(wf, node_class)
    wf[node]["inputs"].update(values)
    return through(wf, node), node


@needs_comfy
@pytest.mark.parametrize("workflow, node_class, values, inputs, reason", [
    ("repaint_range", "MM3Repaint", {"start": 0.8, "end": 0.4}, ["start", "end"],
     "start (0.8 s) must be before end (0.4 s)"),
    ("repaint_range", "MM3Repaint", {"start": 0.5, "end": 0.5}, ["start", "end"],
     "start (0.5 s) must be before end (0.5 s)"),
    ("repaint_range", "MM3Repaint", {"start": -1.0}, ["start", "end"], "start must be between 0 and 360, got -1"),
    ("text_to_song", "MM3ARPlan", {"duration": 0.0}, ["duration"], "Value 0.0 smaller than min of 0.04: duration"),
    ("text_to_song", "MM3ARPlan", {"duration": "abc"}, ["duration"],
     "Failed to convert an input value to a FLOAT value: duration, abc"),
    ("text_to_song", "MM3ARPlan", {"min_duration": 400.0}, ["min_duration"], "bigger than max of 360.0: min_duration"),
    ("text_to_song", "MM3PromptAssemble", {"lyrics": "[verse]\nla\x00"}, ["lyrics"],
     "lyrics contains the control character U+0000"),
    ("text_to_song", "MM3PromptAssemble", {"lyrics": lyrics_of(10 * 1024 * 1024)}, ["lyrics"],
     "characters long; a prompt of at most 5000 tokens holds at most 640,000 characters"),
    ("generate_in_one_node", "MM3Generate", {"duration": 0.0}, ["duration"], "smaller than min of 0.04: duration"),
    ("generate_in_one_node", "MM3Generate", {"lyrics": "la\x1b"}, ["lyrics"],
     "lyrics contains the control character U+001B"),
], ids=["repaint-backwards", "repaint-empty", "repaint-negative", "plan-zero", "plan-text-for-a-number",
        "plan-min-duration-range", "prompt-nul", "prompt-10-mb", "generate-zero", "generate-escape"])
def test_bad_widget_values_are_refused_when_queued(comfy, workflow, node_class, values, inputs, reason):
    """Refused by /prompt before any node runs, one message per mistake on the input that holds it
    (MM3 Repaint's range is one relation of two inputs, shown on both); 10 MB of lyrics within a
    few seconds, without the tokenizer."""
    wf, node = with_values(comfy, workflow, node_class, values)
    before = comfy.get("/history")
    start = time.monotonic()
    errors = refused(comfy, wf)
    assert time.monotonic() - start < 10
    assert set(errors) == {node}, errors
    assert reason in messages(errors, node), errors
    assert [e["extra_info"]["input_name"] for e in errors[node]["errors"]] == inputs, errors
    assert all(e["type"] != "exception_during_validation" for e in errors[node]["errors"])
    queue = comfy.get("/queue")
    assert queue["queue_running"] == [] and queue["queue_pending"] == []
    assert comfy.get("/history") == before  # nothing ran


@needs_comfy
@pytest.mark.parametrize("workflow, node_class, values, reason", [
    ("text_to_song", "MM3PromptAssemble", {"caption": "dark\x1b[31m synth"},
     "MM3 Prompt: caption contains the control character U+001B at position 4"),
    ("text_to_song", "MM3ARPlan", {"duration": 1.0, "min_duration": 2.0},
     "min_duration must be between 0 and the duration 1 s, got 2"),
    ("generate_in_one_node", "MM3Generate", {"duration": 1.0, "min_duration": 2.0},
     "min_duration must be between 0 and the duration 1 s, got 2"),
    ("generate_in_one_node", "MM3Generate", {"caption": "a\x85b"},
     "MM3 Prompt: caption contains the control character U+0085"),
    ("natural_ending_takes", "MM3SamplingOptions", {"lm_penalty": "dry", "lm_penalty_strength": 0.5},
     "lm_penalty_strength for dry must be in [1, 2], got 0.5"),
], ids=["prompt-caption-escape", "plan-min-duration", "generate-min-duration", "generate-caption-c1",
        "options-dry-strength"])
def test_checks_of_the_caption_and_of_two_inputs_refuse_when_the_node_runs(comfy, workflow, node_class, values, reason):
    """The caption (ComfyUI would show a queue-time verdict on the lyrics too), min_duration
    against the duration and a penalty strength against its penalty are refused by the node
    itself, first thing when it runs: its error, and no node after it ran."""
    wf, node = with_values(comfy, workflow, node_class, values)
    ws = comfy.ws()
    try:
        events = ws.events(comfy.queue(wf), timeout=120)
    finally:
        ws.close()
    error = [e for e in events if e["type"] == "execution_error"]
    assert error and error[0]["data"]["node_id"] == node, events[-3:]
    assert reason in error[0]["data"]["exception_message"]
    assert executed_nodes(events)[-1] == node


@needs_comfy
def test_checks_pass_what_they_cannot_see(comfy):
    """Linked and unset inputs are not judged at queue time: a continuation (prior codes linked) may
    ask for a min_duration past its own duration, as the request allows, and an AR Plan without
    its optional inputs queues."""
    wf = tiny_workflow(comfy, "continue_song")
    plans = [k for k, v in wf.items() if v["class_type"] == "MM3ARPlan"]
    cont = next(k for k in plans if isinstance(wf[k]["inputs"].get("prior_codes"), list))
    first = next(k for k in plans if k != cont)
    wf[cont]["inputs"]["min_duration"] = wf[cont]["inputs"]["duration"] + 1
    for name in ("min_duration", "takes", "lm_temperature"):
        wf[first]["inputs"].pop(name, None)
    status, got = post_json(comfy, "/prompt", {"prompt": wf, "client_id": comfy.client_id})
    assert status == 200 and got["node_errors"] == {}, got
    post_json(comfy, "/interrupt", {})
    comfy.wait(got["prompt_id"], timeout=120)


@needs_comfy
def test_load_lora_without_a_lora_says_where_to_put_one(comfy):
    """With no LoRA of this model in models/loras, MM3 Load LoRA offers one choice that says so, and
    queueing it is refused on lora_name with the folder and what belongs there (not ComfyUI's bare
    "Required input is missing")."""
    options = comfy.get("/object_info/MM3LoadLoRA")["MM3LoadLoRA"]["input"]["required"]["lora_name"]
    assert options[0] == ["(no MiniMax Music 3 LoRA in models/loras)"] or options[1]["options"] == [
        "(no MiniMax Music 3 LoRA in models/loras)"], options
    wf = tiny_workflow(comfy, "text_to_song")
    plan = node_of(wf, "MM3ARPlan")
    wf["20"] = {"class_type": "MM3LoadLoRA", "inputs": {"model": wf[plan]["inputs"]["lm"],
                                                      "lora_name": "(no MiniMax Music 3 LoRA in models/loras)",
                                                      "strength": 1.0, "attn_qk": 1.0, "attn_vo": 1.0, "mlp": 1.0}}
    wf[plan]["inputs"]["lm"] = ["20", 0]
    errors = refused(comfy, wf)
    assert [e["extra_info"]["input_name"] for e in errors["20"]["errors"]] == ["lora_name"], errors
    text = messages(errors, "20")
    assert "no MiniMax Music 3 LoRA was found in models/loras (" in text
    assert str(comfy.base / "models" / "loras") in text
    assert "kohya" in text and "Required input is missing" not in text
