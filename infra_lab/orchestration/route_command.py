"""`infra-lab route`: the router over OpenAI-compatible workers (orchestration.router), or, given
--prefill and --decode workers, the front of a disaggregated deployment (orchestration.pd_router).
Binds its socket first, so that connections wait in the backlog, then announces its address."""
from __future__ import annotations

import asyncio
import socket

from infra_lab.orchestration import launch
from infra_lab.orchestration.pd_router import create_pd_app
from infra_lab.orchestration.router import RouterSettings, create_app, policy_from_args
from infra_lab.orchestration.tenants import Tenants


def main(args) -> int:
    """`infra-lab route`: serve until SIGINT or SIGTERM."""
    import uvicorn

    if bool(args.worker) == bool(args.prefill or args.decode) or bool(args.prefill) != bool(args.decode):
        print("infra-lab route: give --worker URL..., or --prefill URL... and --decode URL... (disaggregated)")
        return 2
    try:
        tenants = Tenants.load(args.tenants) if args.tenants else Tenants()
        settings = RouterSettings(worker_slots=args.worker_slots, health_interval_s=args.health_interval,
                                  admin_key=args.admin_key)
        sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((args.host, args.port))
    except (OSError, ValueError) as exc:
        print(f"infra-lab route: {exc}")
        return 2
    sock.listen(2048)  # connections wait in the backlog from here, so announcing early is safe
    host, port = sock.getsockname()[:2]
    try:
        if args.prefill:
            app = create_pd_app(args.prefill, args.decode, settings, on_started=lambda: launch.announce(host, port))
        else:
            app = create_app(args.worker, policy_from_args(args), tenants, settings,
                             on_started=lambda: launch.announce(host, port))
    except ValueError as exc:
        print(f"infra-lab route: {exc}")
        return 2
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=30)
    asyncio.run(uvicorn.Server(config).serve(sockets=[sock]))
    return 0
