"""Every command the project writes down for users parses as written.

Commands are collected from the READMEs and docs/ (fenced shell blocks and inline code), the
workflow files' notes, and the docstrings and messages of the Python sources. Each is run up to argument parsing
(the program's own parser, stopped right after it parsed): an unknown subcommand, flag or choice,
or a stray positional argument fails the test. Full commands (shell blocks, workflow notes) must
parse completely; a synopsis in running text (`python -m mm3 info FILE...`) may leave out
required arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import inspect
import io
import json
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ["README.md", "workflows/README.md", *sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("docs/*.md")),
           *sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("workflows/*.json")),
           *sorted(str(p.relative_to(ROOT)) for d in ("mm3", "nodes", "workflows", "tests")
                   for p in (ROOT / d).rglob("*.py") if p.name != Path(__file__).name)]
PROGRAM = re.compile(r"python3? (?:-m [\w.]+|[\w./-]+\.py)")


class Parsed(Exception):
    """Raised in place of running a program once its parser has accepted the arguments."""


def _fenced_commands(text: str) -> list[str]:
    """Commands of ```bash blocks: continuation lines joined, quoted newlines kept."""
    out = []
    for block in re.findall(r"```(?:bash|sh|shell)\n(.*?)```", text, re.S):
        pending = ""
        for line in block.splitlines():
            pending = f"{pending}\n{line}" if pending else line
            if pending.endswith("\\"):
                pending = pending[:-1]
                continue
            try:
                shlex.split(pending, comments=True)
            except ValueError:  # an open quote: the command goes on
                continue
            if PROGRAM.search(pending):
                out.append(pending[PROGRAM.search(pending).start():])
            pending = ""
    return out


def _inline_commands(text: str) -> list[str]:
    """`python ...` in running text, over lines that end with a backslash, up to a backtick or a
    closing parenthesis outside quotes (or the end of the line)."""
    out = []
    for m in PROGRAM.finditer(text):
        lines = text[m.start():].split("\n")
        cmd = lines.pop(0)
        while cmd.rstrip().endswith("\\") and lines:
            cmd = cmd.rstrip()[:-1] + " " + lines.pop(0).strip()
        try:
            tokens = shlex.split(cmd)
        except ValueError:  # quotes of the surrounding text (a Python string, an apostrophe)
            tokens = shlex.split(re.split(r"[`)\"]", cmd)[0])
        words = []
        for t in tokens:
            cut = re.search(r"[`)]", t)
            if cut:
                words += [t[:cut.start()]] if cut.start() else []
                break
            words.append(t)
        out.append(shlex.join(words))
    return out


def collect() -> list[tuple[str, str, bool]]:
    """(where, command, full): `full` commands must parse completely."""
    found = []
    for rel in SOURCES:
        text = (ROOT / rel).read_text(encoding="utf-8")
        fenced = _fenced_commands(text) if rel.endswith(".md") else []
        found += [(rel, c, True) for c in fenced]
        if rel.endswith(".md"):
            text = re.sub(r"```.*?```", "", text, flags=re.S)
        if rel.endswith(".json"):  # the notes shown in the editor are full commands
            strings = [s for s in _json_strings(json.loads(text))]
            found += [(rel, c, True) for s in strings for c in _inline_commands(s)]
            continue
        found += [(rel, c, False) for c in _inline_commands(text)]
    return found


def _json_strings(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _json_strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _json_strings(v)


def _alternatives(argv: list[str]) -> list[list[str]]:
    """A synopsis as commands: `[--x Y]` kept, `a|b|c` -> a, `FILE...` -> FILE, and words joined by
    a lone `|` (`generate | plan | render`) as one command each."""
    argv = [a.replace("[", "").replace("]", "") for a in argv]
    argv = [a[:-3] if a.endswith("...") and len(a) > 3 else a for a in argv if a not in ("", "...")]
    if "|" in argv:
        i = argv.index("|")
        head = argv[:i - 1]
        words = [argv[i - 1]] + [argv[j] for j in range(i + 1, len(argv), 2)]
        return [head + [w] for w in words]
    return [[a.split("|")[0] if "|" in a and not a.startswith("http") else a for a in argv]]


def _main_of(program: str):
    """The `main(argv)` (or parser) that a `python -m X` / `python path.py` command runs."""
    if program.startswith("-m "):
        name = program[3:]
        if name == "mm3":
            from mm3.commands.main import build_parser
            return lambda argv: build_parser().parse_args(argv)
        module = importlib.import_module(name)
        return _argv_main(module)
    path = ROOT / program
    assert path.is_file(), f"{program} does not exist"
    spec = importlib.util.spec_from_file_location(f"doc_cmd_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return _argv_main(module)


def _argv_main(module):
    """`module.main` when it takes an argument list (and parses it with argparse), else None."""
    main = getattr(module, "main", None)
    if main is None:
        return None
    params = list(inspect.signature(main).parameters)
    return main if params[:1] in (["argv"], ["args"]) else None


def parse_error(command: str, full: bool) -> str | None:
    """None if `command` parses (for a synopsis, missing required arguments are allowed)."""
    words = shlex.split(command, comments=True)
    program = " ".join(words[1:3]) if words[1] == "-m" else words[1]
    if program in ("-m pytest", "-m pip", "-m venv"):
        return None
    main = _main_of(program)
    if main is None:
        return f"{program} has no main(argv) with an argument parser to check the command against"
    args = words[3:] if words[1] == "-m" else words[2:]
    for argv in ([args] if full else _alternatives(args)):
        err = io.StringIO()
        with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stderr(err):
            real = argparse.ArgumentParser.parse_args

            def stop(self, args=None, namespace=None):
                raise Parsed(real(self, args, namespace))

            mp.setattr(argparse.ArgumentParser, "parse_args", stop)
            try:
                main(argv)
            except Parsed:
                continue
            except SystemExit:
                message = err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else "exit"
                if not full and "the following arguments are required" in message:
                    continue
                return f"{' '.join(argv)}: {message}"
        return f"{' '.join(argv)}: the program ran past its argument parser"
    return None


COMMANDS = collect()


def test_commands_were_found():
    """The collector sees the documented commands (a regex that matched nothing would pass)."""
    text = {c for _, c, _ in COMMANDS}
    assert any(c.startswith("python -m mm3 generate") for c in text)
    assert any(c.startswith("python -m mm3 download") for c in text)
    assert any(c.startswith("python workflows/api_example.py") for c in text)
    assert len(COMMANDS) > 20


@pytest.mark.parametrize("where,command,full", COMMANDS, ids=[f"{w}:{c[:60]}" for w, c, _ in COMMANDS])
def test_documented_command_parses(where, command, full):
    problem = parse_error(command, full)
    assert problem is None, f"{where}: `{command}` does not parse: {problem}"


@pytest.mark.parametrize("command,full", [
    ("python -m mm3 download q8 ComfyUI/models/mm3", True),
    ("python -m mm3 generate --models m --out x.wav --no-such-flag", True),
    ("python -m mm3 frobnicate", False),
    ("python -m mm3 generate --models m", True),
    ("python tests/helpers/comfy_lowvram_check.py COMFYUI_PATH", True),  # a required argument left out
    ("python -m mm3.files.registry", True),  # a module without a command line
])
def test_bad_commands_are_caught(command, full):
    assert parse_error(command, full) is not None


def _api_example():
    spec = importlib.util.spec_from_file_location("doc_api_example", ROOT / "workflows" / "api_example.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_api_example_shows_the_nodes_warnings():
    """The warning MM3 Prompt shows for a caption without the format's headings reaches the
    script's user, naming the node; other text stays out."""
    from mm3.song.captions import caption_warning

    warning = caption_warning("Dreamy synth-pop, female vocal, 100 BPM")
    workflow = {"2": {"class_type": "MM3PromptAssemble"}, "3": {"class_type": "MM3ARPlan"}}
    entry = {"outputs": {"2": {"text": [f"12 / 5000 prompt tokens\nwarning: {warning}\n\ncaption (cleaned):\nx"]},
                         "3": {"text": ["250 frames"]}, "8": {"audio": [{"filename": "a.mp3"}]}}}
    assert _api_example().node_warnings(entry, workflow) == [f"warning: node 2 (MM3PromptAssemble): {warning}"]


def test_documented_example_captions_have_the_format_headings():
    """The captions the READMEs and the script's help pass with --caption draw no format warning."""
    from mm3.song.captions import caption_warning

    captions = [shlex.split(c)[shlex.split(c).index("--caption") + 1] for _, c, _ in COMMANDS if "--caption" in c]
    assert captions
    for caption in captions:
        assert caption_warning(caption) is None, caption


def test_workflows_readme_lists_every_workflow_and_its_loaders_are_auto():
    """workflows/README.md has one table row per shipped workflow, and its word that every loader
    is `auto` holds for every API file."""
    text = (ROOT / "workflows" / "README.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| `(\w+)` \|", text, re.M)
    shipped = sorted(p.stem for p in (ROOT / "workflows" / "api").glob("*.json"))
    assert sorted(rows) == shipped and len(shipped) == 10
    assert "Every loader is set to `auto`" in text
    for name in shipped:
        workflow = json.loads((ROOT / "workflows" / "api" / f"{name}.json").read_text(encoding="utf-8"))
        models = {k: v for node in workflow.values() if node["class_type"].startswith("MM3Load")
                  and node["class_type"] != "MM3LoadAudioCodes" for k, v in node["inputs"].items() if "model" in k}
        assert models and set(models.values()) == {"auto"}, (name, models)


def test_ci_runs_the_readmes_test_commands(tmp_path):
    """The README's test lines install the test requirements and torchaudio, then run pytest; CI
    (`.ci/run`, from the pack's folder) runs those same lines. Run with a `python` that records its
    arguments."""
    import os
    import subprocess

    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index("## Run the tests"):]
    section = section[:section.index("\n## ", 3)]
    lines = re.findall(r"```bash\n(.*?)```", section, re.S)[0].splitlines()
    assert all(line.startswith("python ") for line in lines), lines
    log = tmp_path / "calls"
    shim = tmp_path / "bin" / "python"
    shim.parent.mkdir()
    shim.write_text(f'#!/bin/sh\necho "$@" >> {log}\n')
    shim.chmod(0o755)
    env = dict(os.environ, PATH=f"{shim.parent}{os.pathsep}{os.environ['PATH']}")
    done = subprocess.run(["bash", str(ROOT / ".ci" / "run")], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert log.read_text().splitlines() == [line.removeprefix("python ") for line in lines]
    assert "-r requirements-test.txt" in lines[0] and "--no-deps torchaudio==" in lines[1]
    assert lines[-1] == "python -m pytest"
