"""``hetconv worker``: serve convolutions to a master."""

from __future__ import annotations

import argparse

from hetconv.argtypes import number_at_least, parse_address, positive_int

from .common import HelpFormatter


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "worker",
        help="serve convolutions to a master",
        description=(
            "Serve convolutions over gRPC until Ctrl-C or SIGTERM. Prints the device, a probe "
            "figure and the address it serves on. A master uses it with "
            "`hetconv train --worker HOST:PORT`."
        ),
        formatter_class=HelpFormatter,
    )
    p.add_argument(
        "--listen",
        default="0.0.0.0:50051",
        metavar="HOST:PORT",
        help="address to serve on; port 0 picks a free one",
    )
    p.add_argument(
        "--sum-port",
        type=number_at_least(int, 0),
        default=0,
        metavar="PORT",
        help="TCP port, on --listen's host, where the other workers of a ring (--split images "
        "--exchange ring) write their parts of its sums; open it beside --listen's in a "
        "firewall (default 0: a free one, said at start; a peer that cannot reach it puts "
        "its parts through --listen's port instead, more slowly)",
    )
    p.add_argument(
        "--backend",
        default="auto",
        help="cpu, onednn, opencl, cuda, or auto (the fastest GPU present, by a probe against "
        "the CPU engine, else the CPU engine: onednn where its library loads, else cpu)",
    )
    p.add_argument(
        "--device",
        type=int,
        metavar="N",
        help="device number within the backend (see `hetconv devices`); default: its best",
    )
    _add_limits(p)
    _add_running(p)
    _add_security(p)
    p.set_defaults(func=run)


def _add_limits(p: argparse.ArgumentParser) -> None:
    """What one call, and all of them at once, may use of the device and the memory."""
    p.add_argument(
        "--memory-limit",
        type=positive_int,
        metavar="MIB",
        help="device memory one call may use; larger calls run in chunks of images "
        "(default: what the device reports)",
    )
    p.add_argument(
        "--max-request-mib",
        type=positive_int,
        metavar="MIB",
        help="refuse convolution requests larger than this (default: the smaller of 2048 and "
        "half the memory available at start)",
    )
    p.add_argument(
        "--sessions",
        type=positive_int,
        default=4,
        metavar="N",
        help="masters it serves at once: it keeps the forward inputs of N sessions "
        "for their backward passes; with more masters they evict each other's and every "
        "backward pass fails (FAILED_PRECONDITION, naming eviction)",
    )
    p.add_argument(
        "--memory-mib",
        type=positive_int,
        metavar="MIB",
        help="memory budget for everything calls hold: requests in flight and their answers, "
        "saved forward states (each session keeps at most MIB / --sessions) and device scratch; "
        "a call that does not fit is refused (RESOURCE_EXHAUSTED) before anything is allocated "
        "(default: half the memory available at start)",
    )
    p.add_argument(
        "--max-calls",
        type=positive_int,
        metavar="N",
        help="convolution calls in flight at once (default 16); one more is refused at once "
        "(RESOURCE_EXHAUSTED) and health says NOT_SERVING while all are taken; as many calls "
        "that only wait for another worker's part may wait besides; health checks and "
        "Describe are answered beside them",
    )
    p.add_argument(
        "--idle-timeout",
        type=number_at_least(float, 0),
        metavar="S",
        help="end a call whose client sends nothing, or reads nothing of its answer, for S "
        "seconds (DEADLINE_EXCEEDED; default 10; 0: never)",
    )


def _add_running(p: argparse.ArgumentParser) -> None:
    """Threads, advertising, reports and how the worker starts and stops."""
    p.add_argument(
        "--threads",
        type=positive_int,
        metavar="N",
        help="BLAS/OpenMP threads for the convolutions (default: one per core, which leaves "
        "nothing to a laptop's owner)",
    )
    p.add_argument(
        "--no-advertise",
        action="store_true",
        help="do not advertise on the LAN by DNS-SD/mDNS (it does whenever it listens beyond "
        "loopback, so that `hetconv train --discover` finds it)",
    )
    p.add_argument(
        "--report-every",
        type=number_at_least(float, 0),
        default=30.0,
        metavar="S",
        help="print one line of what was served (requests, MB in and out, masters) every S "
        "seconds in which anything was; 0: never",
    )
    p.add_argument(
        "--no-startup-probe", action="store_true", help="skip the probe printed at start"
    )
    p.add_argument(
        "--exit-on-stdin-close",
        action="store_true",
        help="also stop when standard input closes (end of file): a launcher that pipes it "
        "takes its workers down with it, even when killed (hetconv train's local workers)",
    )


def _add_security(p: argparse.ArgumentParser) -> None:
    security = p.add_argument_group(
        "security",
        "Without a token, anyone who can reach --listen may use this worker (it warns unless "
        "it listens on loopback only).",
    )
    security.add_argument(
        "--token",
        metavar="TOKEN",
        help="refuse (UNAUTHENTICATED) every call, health checks included, that lacks this "
        "shared secret (default: $HETCONV_TOKEN; the flag wins; the variable stays out of `ps`)",
    )
    security.add_argument(
        "--tls-cert",
        metavar="PEM",
        help="serve TLS with this certificate (chain); masters then need --tls-ca",
    )
    security.add_argument("--tls-key", metavar="PEM", help="the private key of --tls-cert")


def run(args: argparse.Namespace) -> int:
    from hetconv.backends import get_backend
    from hetconv.security import resolve_token
    from hetconv.worker.auth import WorkerSecurity
    from hetconv.worker.main import exit_within, limit_threads, run_worker
    from hetconv.worker.service import WorkerConfig

    parse_address(args.listen, "--listen")
    if args.memory_mib and args.max_request_mib and args.max_request_mib > args.memory_mib:
        raise ValueError(
            f"--max-request-mib {args.max_request_mib} is more than --memory-mib "
            f"{args.memory_mib}: no request that large could ever be served"
        )
    # Before the backend (whose auto choice probes): a bad token or PEM file fails at once.
    security = WorkerSecurity.from_files(resolve_token(args.token), args.tls_cert, args.tls_key)
    # None: run_worker picks the limit from the memory available and says so.
    limit = args.max_request_mib
    config = WorkerConfig(max_request_bytes=limit << 20) if limit else None
    memory = args.memory_limit << 20 if args.memory_limit else None
    print(limit_threads(args.threads), flush=True)  # before the backend: auto probes
    backend = get_backend(args.backend, device=args.device, memory_limit=memory)
    status = run_worker(
        args.listen,
        backend,
        config,
        startup_probe=not args.no_startup_probe,
        security=security,
        sessions=args.sessions,
        exit_on_stdin_close=args.exit_on_stdin_close,
        memory_bytes=args.memory_mib << 20 if args.memory_mib else None,
        idle_timeout=args.idle_timeout,
        max_calls=args.max_calls,
        advertise=not args.no_advertise,
        report_every=args.report_every,
        sum_port=args.sum_port,
    )
    exit_within(status)  # a thread still waiting (a device job, a silent peer) holds no exit
    return status
