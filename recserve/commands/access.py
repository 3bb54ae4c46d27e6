"""``recserve access``: the Envoy proxy in front of one tritonserver per variant (see recserve.access)."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from recserve.commands.serving import add_log_arguments, log_environment
from recserve.core.spec.parse import load_spec


def _access(args: argparse.Namespace) -> int:
    from recserve.access import AccessError, AccessLayer, behind_proxy, observe, run_foreground
    from recserve.build.repository import is_built

    spec = load_spec(args.spec)
    if not log_environment(args):  # every variant's servers log there, each record with its variant
        return 2
    if not is_built(spec, args.repository):
        message = f"{args.repository} is not built from this spec; run 'recserve build'"
        print(f"error: {message}", file=sys.stderr)
        return 2
    repositories = {"stable": args.repository}
    if args.canary is not None:  # may come from another spec version; it must serve the same model
        if not (args.canary / spec.name / "config.pbtxt").is_file():
            print(f"error: the canary {args.canary} serves no model {spec.name!r}", file=sys.stderr)
            return 2
        repositories["canary"] = args.canary

    def announce(layer: AccessLayer) -> None:
        servers = ", ".join(
            f"{name} (pid {s.process.pid if s.process else '-'}, gRPC {s.ports.grpc})"
            for name, replicas in layer.servers.items()
            for s in replicas
        )
        proxy = layer.proxy.pid if layer.proxy is not None else "-"
        watch = observe.write(layer.workdir, spec, *layer.scrape_targets())
        print(
            f"access layer up: gRPC {layer.grpc_url}, HTTP {layer.http_url}, "
            f"admin 127.0.0.1:{layer.ports.admin} (envoy pid {proxy}); variants: {servers}; "
            f"config {layer.workdir / 'envoy.json'}; to watch it: {', '.join(map(str, watch))}",
            file=sys.stderr,
        )

    with tempfile.TemporaryDirectory(prefix="recserve-access-") as scratch:
        workdir = args.workdir or Path(scratch)
        try:
            served, config_name = behind_proxy(
                repositories, spec.access.queue_policy, spec.serving.queue_policies, workdir
            )
            return run_foreground(
                AccessLayer(spec.access, served, workdir, config_name=config_name), announce
            )
        except AccessError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Add ``access`` to ``recserve``'s sub-command parser."""
    access = sub.add_parser(
        "access",
        help="Envoy in front of the stable (and canary) tritonservers, from the spec's [access]",
    )
    access.add_argument("--repository", type=Path, default=None, help="the stable variant's repository")
    access.add_argument(
        "--canary",
        type=Path,
        default=None,
        help="the canary variant's repository: the new version to roll out (none: stable only)",
    )
    access.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="keep the Envoy config, the logs and a canary's decision here (default: a temp folder)",
    )
    add_log_arguments(access)
    access.set_defaults(func=_access)
    canary = sub.add_parser(
        "canary",
        help="roll the canary variant out through a running 'access --workdir' (shadow, then the spec's "
        "[access.canary] steps), rolling it back when it misbehaves",
    )
    canary.add_argument("--workdir", type=Path, required=True, help="the running access layer's --workdir")
    canary.add_argument("--new", action="store_true", help="start over: forget the decision saved there")
    canary.set_defaults(func=_canary)
    watch = sub.add_parser(
        "observe", help="write a Prometheus scrape config and a Grafana dashboard for a running stack"
    )
    watch.add_argument(
        "--output", type=Path, required=True, help="folder for prometheus.yml and the dashboard"
    )
    watch.add_argument(
        "--triton", nargs="+", default=["127.0.0.1:8002"], help="host:port of each tritonserver's metrics"
    )
    watch.add_argument(
        "--envoy", nargs="*", default=None, help="host:port of Envoy's admin (default: the spec's [access])"
    )
    watch.add_argument(
        "--loop", nargs="*", default=[], help="host:port of recserve join's and learn's --metrics-port"
    )
    watch.set_defaults(func=_observe)
    k8s = sub.add_parser(
        "k8s", help="write Kubernetes manifests of the stack (variants, proxy, Redis Cluster)"
    )
    k8s.add_argument("--output", type=Path, required=True, help="folder for recserve-<model>.yaml")
    k8s.add_argument("--image", required=True, help="an image with recserve installed and the spec")
    k8s.add_argument("--namespace", default="default")
    k8s.set_defaults(func=_kubernetes)


def _canary(args: argparse.Namespace) -> int:
    import signal
    import threading

    from recserve.access import AccessError
    from recserve.access.canary import controller as canary

    spec = load_spec(args.spec)
    if spec.access.canary.shadow_fraction > 0 and spec.access.shadow_variant != "canary":
        variant = spec.access.shadow_variant
        message = f"[access] shadow_variant is {variant!r}: the canary's shadow stage needs 'canary'"
        print(f"error: {message}", file=sys.stderr)
        return 2
    stop = threading.Event()
    previous = {
        s: signal.signal(s, lambda signum, frame: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        stack = canary.Stack.load(args.workdir / canary.STACK_FILE)
        ensembles = [spec.name, *([spec.candidates_model] if spec.candidates_model else [])]
        controller = canary.CanaryController(ensembles, spec.access.canary, stack, args.workdir)
        server = controller.serve_metrics()
        try:
            state = controller.run(stop, new=args.new)
        finally:
            server.shutdown()
    except AccessError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    detail = f": {state.reason}" if state.reason else ""
    print(f"canary {state.status} at stage {canary.stages(spec.access.canary)[state.stage].name}{detail}")
    return {canary.PROMOTED: 0, canary.ROLLED_BACK: 1}.get(state.status, 3)


def _kubernetes(args: argparse.Namespace) -> int:
    from recserve.access import kubernetes

    print(kubernetes.write(args.output, load_spec(args.spec), args.image, args.namespace, args.spec))
    return 0


def _observe(args: argparse.Namespace) -> int:
    from recserve.access import observe

    spec = load_spec(args.spec)
    envoy = [f"127.0.0.1:{spec.access.admin_port}"] if args.envoy is None else args.envoy
    for path in observe.write(args.output, spec, args.triton, envoy, args.loop):
        print(path)
    return 0
