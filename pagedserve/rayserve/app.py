"""``pagedserve ray-serve``: the Ray Serve application, and its command line.

    pagedserve ray-serve [--address auto] [--num-replicas 3] [--router kv|round-robin]
                         [--model M] [--http-port 8000] [-- SERVE_ARGS...]

SERVE_ARGS go to each replica's ``pagedserve serve`` (e.g. --kv-cache-memory).
Each replica asks Ray for ``--replica-cpus`` CPUs, so Ray spreads them over
the cluster's nodes."""
from __future__ import annotations

import argparse
import sys
from typing import Any

ROUTERS = {"kv": "pagedserve.rayserve.router:KVAffinityRouter",
           "round-robin": "pagedserve.rayserve.router:RoundRobinRouter"}
DEFAULT_NAME = "SmolLM2-135M-Instruct"


def build_app(model: str | None, serve_args: list[str], num_replicas: int = 3, router: str = "kv",
              block_size: int = 16, replica_cpus: float = 1.0, served_name: str = DEFAULT_NAME,
              max_ongoing_requests: int = 64, stats_period_s: float = 0.5,
              env: dict[str, str] | None = None) -> Any:
    from ray.serve.config import RequestRouterConfig

    from pagedserve.rayserve.ingress import Ingress
    from pagedserve.rayserve.replica import PagedServeReplica

    if router not in ROUTERS:
        raise ValueError(f"--router: one of {', '.join(ROUTERS)}")
    cfg = RequestRouterConfig(request_router_class=ROUTERS[router], request_routing_stats_period_s=stats_period_s,
                              request_routing_stats_timeout_s=max(5.0, 4 * stats_period_s))
    replica = PagedServeReplica.options(
        num_replicas=num_replicas, max_ongoing_requests=max_ongoing_requests,
        ray_actor_options={"num_cpus": replica_cpus, "runtime_env": {"env_vars": dict(env or {})}},
        request_router_config=cfg,
        health_check_period_s=2, health_check_timeout_s=30, graceful_shutdown_timeout_s=30,
    ).bind(model, [*serve_args, "--block-size", str(block_size)])
    return Ingress.options(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=10_000).bind(
        replica, model, served_name, block_size)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    serve_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, serve_args = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(prog="pagedserve ray-serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--address", default="auto", help="the Ray cluster (auto: a running one, else a local one)")
    p.add_argument("--num-replicas", type=int, default=3)
    p.add_argument("--router", choices=list(ROUTERS), default="kv")
    p.add_argument("--model", default=None, help="none: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--served-model-name", default=DEFAULT_NAME)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--replica-cpus", type=float, default=1.0)
    p.add_argument("--http-host", default="127.0.0.1")
    p.add_argument("--http-port", type=int, default=8000)
    args = p.parse_args(argv)
    try:
        import ray
        from ray import serve
    except ImportError:
        print("pagedserve ray-serve: Ray Serve is not installed: pip install 'pagedserve[ray]'", file=sys.stderr)
        return 1
    ray.init(address=None if args.address == "local" else args.address, ignore_reinit_error=True)
    serve.start(http_options={"host": args.http_host, "port": args.http_port})
    app = build_app(args.model, serve_args, args.num_replicas, args.router, args.block_size, args.replica_cpus,
                    args.served_model_name)
    serve.run(app, name="pagedserve", route_prefix="/", blocking=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
