"""Command line: ``pyllmrouter devices | probe | serve | demo``."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from typing import Sequence

from pyllmrouter.presets import PresetError
from pyllmrouter.remote import RemoteError, devices_table, get, ps_table
from pyllmrouter.memory import HOST, MemoryEstimate, ProbeError, cache_dir
from pyllmrouter.engine.probe import probe
from pyllmrouter.spec import ModelSpec, SpecError
from pyllmrouter.tables import MiB, mib, render

__all__ = ["main", "spec_from_args", "split_args"]


def _devices() -> list[dict]:
    from pyllmrouter.engine.backend import native  # noqa: PLC0415 - loads llama.cpp

    return native().devices()


# our own options of `probe` and `fit` (-> whether each takes a value); every other
# argument is llama-server's, parsed by llama.cpp's own parser
_PROBE_OPTIONS = {"--margin": True, "--json": False, "--no-cache": False, "--rpc": True}
_FIT_OPTIONS = {"--margin": True, "--json": False, "--rpc": True, "--budget": True, "--fit-devices": True,
                "--table": False, "--contexts": True, "--cache-types": True}
_LLAMA_HELP = ("every other argument is llama-server's, as llama-server takes it (llama.cpp's own parser: "
               "-c, -np, -kvu, -ctk/-ctv, -fa, -ngl, -ts, -ot, --n-cpu-moe, --swa-full, --ctx-checkpoints, "
               "--cache-ram, --mmproj, --model-draft/-md, --lora, --fit-ctx... with their aliases and "
               "LLAMA_ARG_* variables; nothing given: llama-server's defaults). A hub model, as llama-server "
               "takes it (-hf org/repo[:quant], -hff FILE, -hfd, -hft; MODEL_ENDPOINT or HF_ENDPOINT, "
               "HF_TOKEN), is measured from its files' headers, without the download")


def split_args(argv: Sequence[str], ours: dict[str, bool]) -> tuple[list[str], list[str]]:
    """(our options, llama-server's arguments) of a `probe` or `fit` command line; the
    model may come first (as a path) or as llama-server's -m."""
    mine: list[str] = []
    theirs: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        name = arg.split("=", 1)[0]
        if name in ours or arg in ("-h", "--help"):
            mine.append(arg)
            if ours.get(name) and "=" not in arg and i + 1 < len(argv):
                mine.append(argv[i + 1])
                i += 1
        else:
            theirs.append(arg)
        i += 1
    return mine, theirs


def spec_from_args(llama_args: Sequence[str]) -> ModelSpec:
    """A spec from a llama-server command line: the model first, or llama-server's own
    -m (or LLAMA_ARG_MODEL), which llama.cpp's parser finds."""
    args = list(llama_args)
    if args and not args[0].startswith("-"):
        return ModelSpec(args[0], tuple(args[1:]))
    from pyllmrouter.engine.backend import native  # noqa: PLC0415 - loads llama.cpp

    try:
        model = native().server_params(args)["model"]
    except ValueError as e:
        raise ProbeError("(arguments)", str(e)) from None
    if not model:
        raise ProbeError("(arguments)", "no model: give the GGUF file first, or -m FILE")
    return ModelSpec(model, tuple(args))


def add_rpc_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rpc", default=None, help="comma-separated rpc-servers (host:port) to attach as devices")


def estimate_table(est: MemoryEstimate, free: dict[str, int], margin: int) -> str:
    rows = []
    for d in est.devices:
        f = free.get(d.device)
        fits = "-" if f is None else ("yes" if d.total <= f - margin else "no")
        rows.append([d.device, mib(d.weights), mib(d.kv), mib(d.compute), mib(d.output), mib(d.cache),
                     mib(d.checkpoints), mib(d.projector), mib(d.draft), mib(d.lora), mib(d.total), mib(f), fits])
    head = ["device", "weights MiB", "KV MiB", "compute MiB", "output MiB", "prompt cache MiB", "checkpoints MiB",
            "projector MiB", "draft MiB", "LoRA MiB", "total MiB", "free MiB",
            f"fits (margin {margin // MiB} MiB)"]
    return render(head, rows)


def _free_by_pool(devices: list[dict]) -> dict[str, int]:
    free = {d["name"]: d["free"] for d in devices}
    cpu = next((d for d in devices if d["type"] == "cpu"), None)
    if cpu is not None:
        free[HOST] = cpu["free"]
    return free


def _remote(a: argparse.Namespace, path: str):
    return get(a.url, path, a.api_key)


def cmd_ps(a: argparse.Namespace) -> int:
    """A running server's models, as ``ollama ps`` lists them."""
    models = _remote(a, "/models")
    if a.json:
        print(json.dumps(models, indent=2))
        return 0
    headers, rows = ps_table(models, a.all)
    print(render(headers, rows) if rows else "no model loaded (--all lists every model)")
    return 0


def cmd_devices(a: argparse.Namespace) -> int:
    if a.url:
        devices = _remote(a, "/devices")
        print(json.dumps(devices, indent=2) if a.json else render(*devices_table(devices)))
        return 0
    _attach_rpc(a)
    devs = _devices()
    if a.json:
        print(json.dumps(devs, indent=2))
        return 0
    rows = [[d["index"], d["name"], d["type"], d["description"], mib(d["free"]), mib(d["total"])] for d in devs]
    print(render(["#", "name", "type", "description", "free MiB", "total MiB"], rows))
    return 0


def _attach_rpc(a: argparse.Namespace) -> None:
    if getattr(a, "rpc", None):
        from pyllmrouter.engine.backend import native  # noqa: PLC0415

        native().add_rpc_servers([e.strip() for e in a.rpc.split(",") if e.strip()])


def _hub(llama_args: Sequence[str]):
    """The hub options of the command line (llama.cpp's parser reads them); None: a local model."""
    if llama_args and not llama_args[0].startswith("-"):
        return None
    from pyllmrouter.engine.hubprobe import hub_options  # noqa: PLC0415 - loads llama.cpp

    return hub_options(llama_args)


def _hub_note(hp) -> str:
    r = hp.reading
    return (f"read from the hub: {r.bytes_read / 1024:.1f} KiB of {r.size / MiB:.1f} MiB "
            f"({len(r.heads)} file{'s' if len(r.heads) > 1 else ''}: "
            f"{', '.join(f.path + (' (cached)' if h.cached else '') for f, h in r.heads.items())}); "
            f"nothing downloaded")


def cmd_probe(a: argparse.Namespace) -> int:
    _attach_rpc(a)
    opts = _hub(a.llama_args)
    hp = None
    t0 = time.perf_counter()
    if opts is not None:
        from pyllmrouter.engine.hubprobe import probe_hub  # noqa: PLC0415

        hp = probe_hub(opts, use_cache=not a.no_cache)
        est, name = hp.estimate, hp.plan.model[0].name
    else:
        spec = spec_from_args(a.llama_args)
        est, name = probe(spec, use_cache=not a.no_cache), spec.path
    elapsed = time.perf_counter() - t0
    devs = _devices()
    margin = a.margin * MiB
    if a.json:
        out = est.to_dict()
        free = _free_by_pool(devs)
        out["free"] = {d.device: free.get(d.device) for d in est.devices}
        out["fits"] = {d.device: free.get(d.device) is not None and d.total <= free[d.device] - margin
                       for d in est.devices}
        out["probe_seconds"] = elapsed
        if hp is not None:  # the stand-ins are gone: the hub's names instead
            out["spec"] = {"hub": opts.repo, "args": list(a.llama_args)}
            out["hub"] = hp.to_dict()
        print(json.dumps(out, indent=2))
        return 0
    f, p = est.facts, est.params
    print(f"{name}: {f.architecture} '{f.name}', {f.n_layer} layers, {f.n_params / 1e6:.1f}M params, "
          f"n_ctx {est.n_ctx} (train {f.n_ctx_train}{', fit may shrink it' if p.get('ctx_auto') else ''}), "
          f"{est.n_seq_max} slots ({'unified' if p.get('kv_unified') else 'one'} KV), "
          f"K {p.get('type_k')} V {p.get('type_v')}, experts {f.n_expert}")
    print(estimate_table(est, _free_by_pool(devs), margin))
    print(f"total {mib(est.total)} MiB; probed in {elapsed * 1000:.2f} ms{' (cached)' if est.cached else ''}")
    if hp is not None:
        print(_hub_note(hp))
    return 0


def _grants(a: argparse.Namespace) -> tuple[dict[str, int], list[str] | None, list[str]]:
    """(grant per pool, the devices to fit onto, the pools) of fit's options."""
    from pyllmrouter.devices import parse_budgets  # noqa: PLC0415

    devs = _devices()
    margin = a.margin * MiB
    budgets = parse_budgets(a.budget) if a.budget else {}
    free = _free_by_pool(devs)
    names = [d.strip() for d in a.fit_devices.split(",")] if a.fit_devices else None
    pools = (names or [d["name"] for d in devs if d["type"] != "cpu"]) + [HOST]
    return {p: budgets.get(p, free.get(p, 0)) - margin for p in pools}, names, pools


def cmd_fit(a: argparse.Namespace) -> int:
    """Plan how a model fits the given budgets, per device; verified by a probe."""
    from pyllmrouter.engine.fit import FitError, fit_here  # noqa: PLC0415

    _attach_rpc(a)
    opts = _hub(a.llama_args)
    if a.table:
        if opts is None:
            raise ProbeError("(arguments)", "--table reads a hub repository's quants: give -hf org/repo")
        from pyllmrouter.engine.hubtable import cmd_table  # noqa: PLC0415

        return cmd_table(a, opts, *_grants(a))
    grants, names, pools = _grants(a)
    with _fit_spec(a, opts) as (spec, name, hub):
        t0 = time.perf_counter()
        try:
            plan = fit_here(spec, grants, names)
        except FitError as e:
            print(f"pyllmrouter: cannot fit {name}: {e}", file=sys.stderr)
            return 3
    seconds = time.perf_counter() - t0
    if a.json:
        out = {**plan.to_dict(), "seconds": seconds}
        if hub is not None:  # the stand-ins are gone: the hub's names instead
            out["spec"] = {**out["spec"], "path": None, "hub": opts.repo}
            out["hub"] = {"files": [f.name for f in hub[0].files], "bytes_read": hub[1].bytes_read,
                          "size": hub[1].size}
        print(json.dumps(out, indent=2))
        return 0
    s = plan.spec
    print(f"{name}: n_gpu_layers={'all' if s.n_gpu_layers is None else s.n_gpu_layers} "
          f"tensor_split={s.tensor_split} experts of the first {plan.experts_on_host} layers in host memory"
          f"{f', context {plan.n_ctx}' if plan.n_ctx else ''}"
          f"{''.join(f', the {p} in host memory' for p in plan.to_host)} ({plan.probes} probes, "
          f"{seconds * 1000:.0f} ms)")
    rows = [[p, plan.layers.get(p, "-") if p != HOST else "-", mib(plan.per_device.get(p, 0)), mib(grants[p]),
             mib(grants[p] - plan.per_device.get(p, 0))] for p in pools]
    print(render(["device", "layers", "bytes MiB", "grant MiB", "left MiB"], rows))
    return 0


@contextlib.contextmanager
def _fit_spec(a: argparse.Namespace, opts):
    """(spec, its name, (hub plan, reading) or None) while the ``with`` lasts: a hub model's
    spec names stand-ins of its files, removed after."""
    if opts is None:
        spec = spec_from_args(a.llama_args)
        yield spec, spec.path, None
        return
    from pyllmrouter.engine.hubprobe import standing  # noqa: PLC0415

    with standing(opts) as (spec, plan, reading):
        yield spec, plan.model[0].name, (plan, reading)


def cmd_demo(a: argparse.Namespace) -> int:
    """Offline tour: devices, exact estimates for generated models, then the router serving them."""
    from pyllmrouter.tools import tinymodels  # noqa: PLC0415

    models_dir = cache_dir() / "models"
    paths = tinymodels.write_tiny_set(models_dir)
    shape = models_dir / "shape-7b-q4_0.gguf"
    if not shape.exists():
        tinymodels.write_shape(shape, tinymodels.SHAPE_7B)
    print("Devices llama.cpp sees here:\n")
    cmd_devices(argparse.Namespace(json=False, rpc=None, url=None, api_key=None))
    specs = [ModelSpec(str(paths["tiny-llama"])), ModelSpec(str(paths["tiny-moe"]), ("-np", "4")),
             ModelSpec(str(paths["tiny-bert"]), ("--embedding", "-c", "512")),
             ModelSpec(str(shape), ("-c", "8192")), ModelSpec(str(shape), ("-c", "32768", "-ctk", "q8_0", "-ctv", "q8_0"))]
    rows = []
    for spec in specs:
        t0 = time.perf_counter()
        est = probe(spec, refresh=True)
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        probe(spec)
        warm = time.perf_counter() - t0
        d = est.devices[0]
        rows.append([est.facts.name, est.n_ctx, est.n_seq_max, est.params.get("type_k"), mib(d.weights), mib(d.kv),
                     mib(d.compute), mib(d.output), mib(est.total), f"{cold * 1000:.1f}", f"{warm * 1000:.3f}"])
    print("\nExact memory per model (no tensor data read; the 7B is a sparse file of its real layout):\n")
    print(render(["model", "n_ctx", "seqs", "kv type", "weights MiB", "KV MiB", "compute MiB", "output MiB",
                  "total MiB", "probe ms", "cached ms"], rows))
    print("\nThe router serving the tiny models over HTTP:\n")
    from pyllmrouter.tools.demo import run_demo  # noqa: PLC0415

    return run_demo(keep=a.keep)


def cmd_serve(a: argparse.Namespace) -> int:
    from pyllmrouter.server.run import serve  # noqa: PLC0415

    return serve(a)


def cmd_ray(a: argparse.Namespace) -> int:
    """Deploy on the Ray cluster at --address: every serve argument but --address goes to
    each node's replica as it is; host, port, API key and body limit are the ingress's."""
    from pyllmrouter.config import MiB  # noqa: PLC0415
    from pyllmrouter.ray.deploy import deploy  # noqa: PLC0415

    argv = list(a.argv)
    i = next((k for k, arg in enumerate(argv) if arg == "--address" or arg.startswith("--address=")), None)
    if i is not None:
        del argv[i:i + (1 if "=" in argv[i] else 2)]
    try:
        deploy(argv, address=a.address, host=a.host, port=a.port, api_key=a.api_key,
               max_body=int(a.max_body_mb * MiB))
    except RuntimeError as e:  # e.g. the port is taken, or no node is marked
        print(f"pyllmrouter: error: {e}", file=sys.stderr)
        return 1
    print(f"pyllmrouter serves the cluster at http://{a.host}:{a.port} (ray serve shutdown to stop)")
    return 0


def add_url_arguments(p: argparse.ArgumentParser, default: str | None) -> None:
    p.add_argument("--url", default=default, help="a running pyllmrouter serve" +
                   (f" (default {default})" if default else ""))
    p.add_argument("--api-key", default=os.environ.get("LLAMA_API_KEY"),
                   help="the server's API key (default: $LLAMA_API_KEY)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pyllmrouter", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("devices", help="list ggml devices with free/total memory (--url: a running server's)")
    p.add_argument("--json", action="store_true")
    add_rpc_argument(p)
    add_url_arguments(p, None)
    p.set_defaults(func=cmd_devices)
    p = sub.add_parser("ps", help="a running server's models: state, devices and bytes, requests, until")
    add_url_arguments(p, "http://127.0.0.1:8080")
    p.add_argument("--all", action="store_true", help="every listed model, not only those holding memory")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_ps)
    p = sub.add_parser("probe", help="exact memory a model needs, per device",
                       usage="pyllmrouter probe MODEL [llama-server arguments] [--margin MiB] [--json] "
                             "[--no-cache] [--rpc HOST:PORT,...]", epilog=_LLAMA_HELP)
    p.add_argument("--margin", type=int, default=1024, help="MiB kept free per device (default 1024)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--no-cache", action="store_true", help="probe again even if cached")
    add_rpc_argument(p)
    p.set_defaults(func=cmd_probe)
    p = sub.add_parser("fit", help="fit a model into per-device budgets (context, layers, tensor split, MoE experts)",
                       usage="pyllmrouter fit MODEL [llama-server arguments] [--budget DEV=SIZE,...] "
                             "[--margin MiB] [--fit-devices DEV,...] [--json] [--rpc HOST:PORT,...] "
                             "[--table [--contexts N,...] [--cache-types T,...]]",
                       epilog=_LLAMA_HELP)
    add_rpc_argument(p)
    p.add_argument("--fit-devices", default=None, help="devices to fit onto, fastest first (default: all)")
    p.add_argument("--budget", default=None, help="per-device budgets, e.g. RPC0=2GiB,RPC1=4GiB,CPU=16GiB")
    p.add_argument("--margin", type=int, default=1024, help="MiB kept free per device (default 1024)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--table", action="store_true",
                   help="a hub repository (-hf org/repo): every quant x context x KV cache type, "
                        "whether it fits (whole, with parts in host memory, or never)")
    p.add_argument("--contexts", default=None, help="the table's contexts, e.g. 4096,32768 (default: powers "
                                                    "of four from 1024 up to the trained context, and it)")
    p.add_argument("--cache-types", default=None, help="the table's KV cache types, e.g. f16,q8_0 (default: "
                                                       "the arguments')")
    p.set_defaults(func=cmd_fit)
    p = sub.add_parser("demo", help="offline tour on generated models")
    p.add_argument("--keep", type=float, default=60.0,
                   help="seconds the demo's server stays up for its page afterwards (default 60; 0: none)")
    p.set_defaults(func=cmd_demo)
    p = sub.add_parser("serve", help="OpenAI and llama-server router compatible HTTP server",
                       epilog="any other argument is llama-server's, laid over every model (as llama-server's "
                              "router gives its own command line to every model)")
    from pyllmrouter.server.run import add_serve_arguments  # noqa: PLC0415

    add_serve_arguments(p)
    p.set_defaults(func=cmd_serve)
    p = sub.add_parser("ray", help="deploy on a Ray cluster: one replica per node, one address "
                                   "(pip install pyllmrouter[ray])")
    add_serve_arguments(p)
    p.add_argument("--address", default="auto", help="the Ray cluster (default: auto, the local one)")
    p.set_defaults(func=cmd_ray)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    llama_args: list[str] = []
    ours = {"probe": _PROBE_OPTIONS, "fit": _FIT_OPTIONS}.get(argv[0] if argv else "")
    if ours is not None:  # llama-server's arguments go to llama.cpp's parser, ours to argparse
        mine, llama_args = split_args(argv[1:], ours)
        argv = [argv[0], *mine]
    parser = build_parser()
    if argv[:1] == ["serve"]:  # llama-server's arguments, laid over every model, as llama-server's router does
        args, llama_args = parser.parse_known_args(argv)
    else:
        args = parser.parse_args(argv)
    args.argv = argv[1:]  # after the command's name
    args.llama_args = llama_args
    try:
        return args.func(args)
    except (ProbeError, SpecError, PresetError, RemoteError) as e:
        print(f"pyllmrouter: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
