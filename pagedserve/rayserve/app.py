"""``pagedserve ray-serve``: the Ray Serve application, and its command line.

    pagedserve ray-serve [--address auto] [--num-replicas 3] [--router kv|round-robin]
                         [--model M] [--http-port 8000] [-- SERVE_ARGS...]

SERVE_ARGS go to each replica's ``pagedserve serve`` (e.g. --kv-cache-memory,
--api-key, --served-model-name): the ingress forwards every request to a
replica's own server, so they act as on a single engine. Each replica asks
Ray for ``--replica-cpus`` CPUs, so Ray spreads them over the cluster's nodes.
Ctrl-C or SIGTERM deletes the application (each replica stops its engine and
removes its folder), then disconnects from Ray (a local cluster it started
stops)."""
from __future__ import annotations

import argparse
import signal
import sys
import time
from typing import Any

ROUTERS = {"kv": "pagedserve.rayserve.router:KVAffinityRouter",
           "round-robin": "pagedserve.rayserve.router:RoundRobinRouter"}
APP_NAME = "pagedserve"


def build_app(model: str | None, serve_args: list[str], num_replicas: int = 3, router: str = "kv",
              block_size: int = 16, replica_cpus: float = 1.0, max_ongoing_requests: int = 64,
              stats_period_s: float = 0.5, env: dict[str, str] | None = None, trace: str | None = None) -> Any:
    """``trace``: a file the router appends each routing decision to (benchmarks/ray_multiturn.py)."""
    from ray.serve.config import RequestRouterConfig

    from pagedserve.rayserve.ingress import Ingress
    from pagedserve.rayserve.replica import PagedServeReplica

    if router not in ROUTERS:
        raise ValueError(f"--router: one of {', '.join(ROUTERS)}")
    cfg = RequestRouterConfig(request_router_class=ROUTERS[router], request_routing_stats_period_s=stats_period_s,
                              request_routing_stats_timeout_s=max(5.0, 4 * stats_period_s),
                              request_router_kwargs={"stats_period_s": stats_period_s, "trace": trace})
    replica = PagedServeReplica.options(
        num_replicas=num_replicas, max_ongoing_requests=max_ongoing_requests,
        ray_actor_options={"num_cpus": replica_cpus, "runtime_env": {"env_vars": dict(env or {})}},
        request_router_config=cfg,
        health_check_period_s=2, health_check_timeout_s=30, graceful_shutdown_timeout_s=30,
    ).bind(model, [*serve_args, "--block-size", str(block_size)])
    return Ingress.options(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=10_000).bind(
        replica, model, block_size, stats_period_s)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagedserve ray-serve", usage="%(prog)s [options] [-- SERVE_ARGS ...]",
                                description=__doc__.split("\n\n", 2)[2],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="-- SERVE_ARGS: everything after a lone -- goes to each replica's "
                                       "`pagedserve serve` (see `pagedserve serve --help`).")
    p.add_argument("--address", default="auto",
                   help="the Ray cluster: auto (a running one, else a new local one), local (a new local one, "
                        "stopped on exit), HOST:PORT or ray://HOST:PORT")
    p.add_argument("--num-replicas", type=int, default=3)
    p.add_argument("--router", choices=list(ROUTERS), default="kv")
    p.add_argument("--model", default=None, help="none: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--replica-cpus", type=float, default=1.0)
    p.add_argument("--stats-period", type=float, default=0.5, help="seconds between the replicas' routing stats")
    p.add_argument("--http-host", default="127.0.0.1")
    p.add_argument("--http-port", type=int, default=8000)
    return p


def _connect(address: str) -> None:
    import ray

    if address == "auto":
        try:
            ray.init(address="auto", logging_level="WARNING")
            return
        except ConnectionError:
            address = "local"
    ray.init(address=address, logging_level="WARNING")  # "local": always a new local instance


def _stop_on_signal(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # SIGTERM as Ctrl-C: the finally below shuts down


def shutdown() -> None:
    """Deletes the application (Serve runs each replica's __del__: its engine stops, its folder goes), then
    Serve itself if nothing else runs on it, then disconnects (a local cluster this process started stops)."""
    import ray
    from ray import serve

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the engines' shutdown
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        if ray.is_initialized():
            serve.delete(APP_NAME)
            if not serve.status().applications:
                serve.shutdown()
    finally:
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    serve_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, serve_args = argv[:i], argv[i + 1:]
    args = _parser().parse_args(argv)
    try:
        from ray import serve
    except ImportError:
        print("pagedserve ray-serve: Ray Serve is not installed: pip install 'pagedserve[ray]'", file=sys.stderr)
        return 1
    signal.signal(signal.SIGTERM, _stop_on_signal)
    url = f"http://{args.http_host}:{args.http_port}"
    try:
        _connect(args.address)
        signal.signal(signal.SIGTERM, _stop_on_signal)  # again: ray.init puts its own (a stack dump, abort)
        serve.start(http_options={"host": args.http_host, "port": args.http_port})
        app = build_app(args.model, serve_args, args.num_replicas, args.router, args.block_size, args.replica_cpus,
                        stats_period_s=args.stats_period)
        serve.run(app, name=APP_NAME, route_prefix="/")
        print(f"pagedserve ray-serve: serving at {url}/v1 ({args.num_replicas} replicas, router {args.router}); "
              "Ctrl-C or SIGTERM stops the application and its engines", file=sys.stderr, flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("pagedserve ray-serve: stopping the application and its engines", file=sys.stderr, flush=True)
    except Exception as e:  # noqa: BLE001 - a deploy that failed: still clean up, then say why
        print(f"pagedserve ray-serve: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        shutdown()
        return 1
    shutdown()
    print("pagedserve ray-serve: stopped", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
