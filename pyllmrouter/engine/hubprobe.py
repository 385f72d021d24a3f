"""A hub model's bytes from its headers: llama-server's hub options, probed without the download.

    hub_options(args)  ──▶ llama.cpp's parser reads the command line (its preset keys):
                           -hf/-hfr/--hf-repo, -hff/--hf-file, -hft/--hf-token,
                           -hfd/-hfrd/--hf-repo-draft (with -md FILE: the draft's file),
                           --no-mmproj, -mm FILE
    standing(args)     ──▶ hubfiles: the files llama-server would take, their heads
                           (Range requests, cached), sparse stand-ins in a temporary folder
                       ──▶ (spec of the stand-ins, plan, reading); the folder removed after
    probe_hub(args)    ──▶ engine/probe.probe of that spec: the bytes per device and buffer
                           type of the downloaded files, to the byte

Runs where probes run (llama.cpp is loaded here, for its parser and the probe); nothing
goes to llama.cpp's cache: the arguments the probe gets name the stand-ins, not the hub.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping, Sequence

from pyllmrouter import hubfiles
from pyllmrouter.engine.probe import probe as probe_file
from pyllmrouter.memory import MemoryEstimate, ProbeError, cache_dir
from pyllmrouter.spec import ModelSpec

__all__ = ["HubOptions", "HubProbe", "hub_options", "standing", "probe_hub", "head_cache"]

# llama.cpp's preset keys of the hub options (the last of each option's names)
_HUB_KEYS = ("hf-repo", "hf-file", "hf-token", "hf-repo-draft")


@dataclass(frozen=True)
class HubOptions:
    repo: str  # org/repo[:quant]
    file: str = ""
    token: str | None = None
    draft_repo: str = ""
    draft_file: str = ""
    mmproj: bool = True  # the repository's projector too (not with --no-mmproj or -mm FILE)
    rest: tuple[tuple[str, str], ...] = ()  # every other option, as llama.cpp's preset keys
    args: tuple[str, ...] = ()  # the command line as given


@dataclass(frozen=True)
class HubProbe:
    estimate: MemoryEstimate
    plan: hubfiles.HubPlan
    reading: hubfiles.Reading
    seconds: float

    def to_dict(self) -> dict:
        return {"files": [{"name": f.name, "size": f.size, "oid": f.oid, "bytes_read": self.reading.heads[f].read,
                           "cached": self.reading.heads[f].cached} for f in self.plan.files],
                "bytes_read": self.reading.bytes_read, "size": self.reading.size, "seconds": self.seconds}


def _native():
    from pyllmrouter.engine.backend import native  # noqa: PLC0415 - loads llama.cpp

    return native()


def hub_options(args: Sequence[str], env: Mapping[str, str] = os.environ) -> HubOptions | None:
    """The hub options of a llama-server command line, as llama.cpp's parser reads them;
    None: no -hf (a local model)."""
    try:
        keys = dict(_native().args_to_preset(list(args)))
    except ValueError as e:
        raise ProbeError("(arguments)", str(e)) from None
    repo = keys.get("hf-repo") or env.get("LLAMA_ARG_HF_REPO", "")
    if not repo:
        return None
    draft = keys.get("hf-repo-draft", "")
    mmproj = keys.get("mmproj-auto", "1").lower() not in ("0", "false", "off", "no") and not keys.get("mmproj") \
        and not keys.get("mmproj-url")
    skip = set(_HUB_KEYS) | ({"model-draft"} if draft else set())
    return HubOptions(repo, keys.get("hf-file", ""), keys.get("hf-token") or env.get("HF_TOKEN") or None,
                      draft, keys.get("model-draft", "") if draft else "", mmproj,
                      tuple((k, v) for k, v in keys.items() if k not in skip), tuple(args))


def head_cache() -> Path:
    return cache_dir() / "hub" / "heads"


@contextlib.contextmanager
def standing(opts: HubOptions, *, use_cache: bool = True,
             listing: Mapping[str, list[hubfiles.HubFile]] | None = None
             ) -> Iterator[tuple[ModelSpec, hubfiles.HubPlan, hubfiles.Reading]]:
    """A spec over sparse stand-ins of the files ``opts`` name on the hub, while the
    ``with`` lasts (the stand-ins are removed after)."""
    base = hubfiles.endpoint()
    try:
        plan = hubfiles.plan(opts.repo, opts.file, token=opts.token, base=base, mmproj=opts.mmproj,
                             draft_repo=opts.draft_repo, draft_file=opts.draft_file, listing=listing)
        reading = hubfiles.read_heads(plan.files, opts.token, head_cache() if use_cache else None)
    except hubfiles.HubError as e:
        raise ProbeError(opts.repo, str(e)) from None
    root = cache_dir() / "hub"
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="stand-ins-", dir=root) as tmp:
        paths = hubfiles.stand_ins(plan.files, reading.heads, Path(tmp))
        keys = list(opts.rest)
        if plan.mmproj is not None:
            keys.append(("mmproj", str(paths[plan.mmproj])))
        if plan.draft:
            keys.append(("model-draft", str(paths[plan.draft[0]])))
        try:
            args = _native().preset_args(keys)
        except ValueError as e:
            raise ProbeError("(arguments)", str(e)) from None
        yield ModelSpec(str(paths[plan.model[0]]), tuple(args)), plan, reading


def _paths(spec: ModelSpec, plan: hubfiles.HubPlan) -> list[Path]:
    root = Path(spec.path).parents[len(Path(plan.model[0].path).parts)]
    return [root / f.repo.replace("/", "--") / f.path for f in plan.files]


def probe(spec: ModelSpec | str | None = None, *, use_cache: bool = True, refresh: bool = False,
          hub: str | Sequence[str] | None = None) -> MemoryEstimate:
    """``engine.probe.probe`` of a file (``spec``), or of a model on a hub (``hub``), as
    llama-server names it ("org/repo[:quant]", or its command line: ["-hf",
    "org/repo:Q4_K_M", "-c", "8192"]): the same bytes, from its files' headers (HTTP range
    requests), without the download; ``use_cache`` then keeps the headers read."""
    if hub is None:
        if spec is None:
            raise ProbeError("(arguments)", "no model: give a spec, a file or hub=")
        return probe_file(spec, use_cache=use_cache, refresh=refresh)
    opts = hub_options(["-hf", hub] if isinstance(hub, str) else list(hub))
    if opts is None:
        raise ProbeError("(arguments)", "no hub model in the arguments (-hf org/repo[:quant])")
    return probe_hub(opts, use_cache=use_cache).estimate


def probe_hub(opts: HubOptions, *, use_cache: bool = True) -> HubProbe:
    """The exact bytes of the hub model ``opts`` names, from its headers (see the module)."""
    t0 = time.perf_counter()
    with standing(opts, use_cache=use_cache) as (spec, plan, reading):
        try:
            est = probe_file(spec, use_cache=False)
        except ProbeError as e:  # said of the hub's file, not of its stand-in
            names = {str(p): f.name for f, p in zip(plan.files, _paths(spec, plan))}
            raise ProbeError(names.get(e.path, plan.model[0].name), e.reason) from None
    est = dataclasses.replace(est, spec=ModelSpec(plan.model[0].name, opts.args))  # the stand-ins are gone
    return HubProbe(est, plan, reading, time.perf_counter() - t0)


def main(argv: list[str]) -> int:
    """``python -m pyllmrouter.engine.hubprobe [--timeout S] ARG...``: probe_hub of that
    command line, one JSON line: {"per_device", "total", "bytes_read", "size", "files"} |
    {"error"} (the router's check of a pull, in a short-lived process with no device);
    ``--timeout``: seconds the hub may take to answer one request."""
    if argv[:1] == ["--timeout"]:
        hubfiles.TIMEOUT = float(argv[1])  # this short-lived process's own
        argv = argv[2:]
    try:
        opts = hub_options(argv)
        if opts is None:
            raise ProbeError("(arguments)", "no hub model (-hf org/repo[:quant])")
        hp = probe_hub(opts)
    except ProbeError as e:
        print(json.dumps({"error": str(e)}))
        return 1
    print(json.dumps({"per_device": hp.estimate.per_device(), "total": hp.estimate.total, **hp.to_dict()}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
