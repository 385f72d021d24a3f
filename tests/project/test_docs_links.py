"""The docs hold together, and the README's commands run.

- Every relative link between README.md, CHANGELOG.md and docs/**/*.md resolves: the file
  is there, and a ``#anchor`` names a heading of it (as GitHub makes a heading's anchor).
- Every shell command in README.md's code blocks that can run offline runs, as a reader
  runs it, in a folder holding the files it names (tiny generated models in their place),
  and the tour's openai block runs against the server the tour starts.  Left out, each
  with its reason in ``why_skipped``: the set-up commands (CI runs them: ``.ci/run``), and
  whatever needs a Ray cluster, a GPU or the network.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from pyllmrouter.tools.loopback import free_port, wait_healthy

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.S | re.M)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")

# a command's first words -> why it is not run here
SKIPPED = {
    "scripts/setup.sh": "the set-up commands are what CI runs (.ci/run), on a fresh machine",
    "scripts/gpu_check.sh": "needs an NVIDIA GPU",
    "ray": "needs a Ray cluster: tests/cluster/ start one",
    ".venv/bin/pyllmrouter ray": "needs a Ray cluster: tests/cluster/ deploy on one",
    "pyllmrouter ray": "needs a Ray cluster: tests/cluster/ deploy on one",
}


def docs() -> list[Path]:
    return [REPO / "README.md", REPO / "CHANGELOG.md", *sorted((REPO / "docs").glob("**/*.md"))]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", path.read_text()).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            s = slug(m.group(1))
            n = seen.get(s, 0)
            seen[s] = n + 1
            out.add(s if n == 0 else f"{s}-{n}")
    return out


def broken_links(files: list[Path]) -> list[str]:
    """'FILE: TARGET (why)' for each relative link that does not resolve."""
    out = []
    for doc in files:
        for target in LINK.findall(FENCE.sub("", doc.read_text())):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:: not ours to check
                continue
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            where = f"{doc.relative_to(REPO) if doc.is_relative_to(REPO) else doc.name}: {target}"
            if not dest.exists():
                out.append(f"{where} (no such file)")
            elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
                out.append(f"{where} (no such heading)")
    return out


def test_every_link_between_the_docs_resolves():
    assert broken_links(docs()) == []


def test_the_link_check_can_fail(tmp_path):
    (tmp_path / "b.md").write_text("# Some `serve` options\n\ntext\n")
    (tmp_path / "a.md").write_text("[ok](b.md#some-serve-options) [gone](c.md) [bad](b.md#nothing) "
                                   "[web](https://example.com/x.md)\n```sh\n[in code](nowhere.md)\n```\n")
    found = broken_links([tmp_path / "a.md"])
    assert [f.rsplit(": ", 1)[1] for f in found] == ["c.md (no such file)", "b.md#nothing (no such heading)"]


def blocks(kind: str) -> list[str]:
    return [m.group(2) for m in re.finditer(r"^```(\w*)\n(.*?)^```", README.read_text(), re.S | re.M)
            if m.group(1) == kind]


def commands() -> list[str]:
    """Each command of README.md's sh blocks, comments dropped, continued lines joined."""
    out = []
    for block in blocks("sh"):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].strip()
            if line and not line.startswith("#"):
                out.append(line)
    return out


def why_skipped(cmd: str) -> str | None:
    words = cmd.split()
    if {"-hf", "-hfr", "--hf-repo", "-hfd"} & set(words):
        return "reads a model's headers from the Hugging Face hub: needs the network (tests/probe/ use a local hub)"
    return next((why for start, why in SKIPPED.items() if words[:len(start.split())] == start.split()), None)


def test_the_readme_has_commands_to_run_and_says_why_it_skips_the_others():
    cmds = commands()
    assert cmds[:2] == ["scripts/setup.sh && .venv/bin/pyllmrouter demo",
                        "scripts/setup.sh --test && .venv/bin/python -m pytest"]  # the first code block
    assert README.read_text().split("```")[1].startswith("sh\nscripts/setup.sh && ")
    run = [c for c in cmds if why_skipped(c) is None]
    assert any(" serve " in f" {c} " for c in run) and any(c.startswith("curl") for c in run)


@pytest.fixture
def workdir(tmp_path, tiny):
    """A folder holding what the README's commands name: the preset, its model files
    (tiny generated ones in their place), and .venv/bin (this interpreter's)."""
    (tmp_path / "models.ini").write_text(blocks("ini")[0])
    for cmd in [*commands(), *blocks("ini")[0].splitlines()]:
        for name in re.findall(r"[\w./-]+\.gguf", cmd):
            dest = tmp_path / name
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(tiny["tiny-bert"] if "bge" in name or "embed" in name else tiny["tiny-llama"], dest)
    (tmp_path / ".venv").mkdir()
    (tmp_path / ".venv" / "bin").symlink_to(Path(sys.executable).parent)
    return tmp_path


@pytest.mark.slow
def test_every_offline_command_of_the_readme_runs(workdir):
    port = str(free_port())
    cmds = [c.replace("8080", port) for c in commands() if why_skipped(c) is None]
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    server = None
    try:
        for cmd in cmds:
            if " serve " in f" {cmd} ":  # a server: started, awaited, then the rest runs against it
                server = subprocess.Popen(shlex.split(cmd), cwd=workdir, start_new_session=True,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                wait_healthy(f"http://127.0.0.1:{port}", server, timeout=120)
                continue
            done = subprocess.run(["bash", "-c", cmd], cwd=workdir, capture_output=True, text=True, timeout=300)
            assert done.returncode == 0, (cmd, done.stdout[-2000:], done.stderr[-2000:])
            assert '"error"' not in done.stdout, (cmd, done.stdout[-2000:])
        assert server is not None
        # the tour's openai block, against the same server
        tour = next(b for b in blocks("python") if "from openai import OpenAI" in b)
        done = subprocess.run([sys.executable, "-c", tour.replace("8080", port)], cwd=workdir,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models") as r:
            assert r.status == 200
    finally:
        if server is not None:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()
