"""python -m sglang.launch_server --model-path ... : the OpenAI-compatible server.

Process model: this process runs the HTTP server and the TokenizerManager (tokenize, encode chats, detokenize);
the model and scheduler run in a spawned scheduler process, so a long forward never blocks the API.
The listening address is bound first, before anything is loaded, so a port in use fails in a second.
Multi-node (--nnodes N --node-rank R --dist-init-addr HOST:PORT): node 0 serves HTTP and runs the first ranks;
every other node runs its ranks headless and exits (code 1) when one of them ends.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import socket
import sys
import threading
from typing import Optional

from sglang.srt.arg_groups import cli
from sglang.srt.server_args import ServerArgs
from sglang.srt.utils.common import configure_logging

logger = logging.getLogger("sglang.launch_server")
# SIGTERM / SIGINT: running requests get this long to finish, then they are cancelled (aborted in the scheduler) and
# the server exits; without a bound, uvicorn waits for every running generation, however long.
GRACEFUL_SHUTDOWN_S = 5


def bind_listen_socket(host: str, port: int) -> socket.socket:
    """Bind (not yet listen) the server's address, so a port in use is reported before the model loads and
    nobody can take it meanwhile; connections are refused until uvicorn listens. Raises OSError naming it."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise OSError(f"--host {host}: cannot resolve it ({e})") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a TIME_WAIT port is free
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise OSError(f"cannot bind {host}:{port} ({e.strerror}): the port is already in use or not allowed; "
                      f"stop the process holding it or pick another --port") from None
    return sock


def launch_server(server_args: ServerArgs, sock: Optional[socket.socket] = None) -> None:
    """Serve until stopped; `sock` is the address bound by `bind_listen_socket` (bound here when None)."""
    import uvicorn

    from sglang.srt.arg_groups.deepseek_v4_hook import describe_parsers
    from sglang.srt.entrypoints.http_server import create_app
    from sglang.srt.managers.scheduler_process import start_scheduler
    from sglang.srt.managers.tokenizer_manager import TokenizerManager
    from sglang.srt.model_loader.model_path import resolve_model_path
    from sglang.srt.utils.hf_transformers_utils import load_tokenizer

    configure_logging(server_args.log_level)
    exit_on_sigterm()
    if sock is None:
        sock = bind_listen_socket(server_args.host, server_args.port)
    logger.info("DeepSeek-V4 defaults applied: %s", ", ".join(server_args.applied_defaults) or "none")
    logger.info("chat parsers: %s", describe_parsers(server_args))
    shown = {k: ("***" if k in ("api_key", "admin_api_key") and v else v)
             for k, v in dataclasses.asdict(server_args).items()}
    logger.info("server args: %s", shown)
    proc, ready, ports = start_scheduler(server_args)
    tokenizer = load_tokenizer(server_args.tokenizer_path or resolve_model_path(server_args.model_path))
    metrics = None
    if server_args.enable_metrics:
        from sglang.srt.metrics.collector import MetricsCollector

        metrics = MetricsCollector(server_args.served_model_name or server_args.model_path)
    tm = TokenizerManager(tokenizer, ready, ports.scheduler_input, ports.tokenizer_input, metrics,
                          ports.tokenizer_input_remote, channel_key=ports.channel_key,
                          watchdog_timeout=server_args.watchdog_timeout,
                          max_queued_requests=server_args.max_queued_requests)
    app = create_app(tm, server_args, metrics, scheduler_proc=proc)

    logger.info("serving %s on http://%s:%d", server_args.model_path, server_args.host, server_args.port)
    config = uvicorn.Config(app, host=server_args.host, port=server_args.port, log_level=server_args.log_level,
                            timeout_keep_alive=5, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
    server = app.state.uvicorn_server = uvicorn.Server(config)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # SIGINT (Ctrl-C), which uvicorn re-raises after its shutdown: no traceback
        raise SystemExit(128 + signal.SIGINT) from None
    finally:
        proc.kill()
        sock.close()
    if app.state.fatal_error:
        logger.error("server stopped: %s", app.state.fatal_error)
        sys.exit(1)


def exit_on_sigterm() -> None:
    """SIGTERM raises SystemExit(143), so `finally` blocks and atexit run: the scheduler process is stopped and its IPC
    socket dir removed. Without this a SIGTERM during loading killed the process outright, and after serving uvicorn
    (0.29+) re-raises the signal it caught once it has shut down, which met the default action the same way."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_exit)


def _raise_exit(signum, frame) -> None:
    raise SystemExit(128 + signum)


def run_headless(server_args: ServerArgs) -> None:
    """A node other than 0: start this node's ranks, then wait; when one ends (node 0 stopped, a rank failed), stop
    the others and exit 1."""
    import time

    from sglang.srt.managers.scheduler_process import start_scheduler

    configure_logging(server_args.log_level)
    exit_on_sigterm()
    ranks, _, _ = start_scheduler(server_args)
    logger.info("node %d of %d: ranks %d..%d ready; node 0 serves HTTP", server_args.node_rank, server_args.nnodes,
                ranks.first, ranks.first + len(ranks.procs) - 1)
    try:
        while ranks.is_alive():
            time.sleep(0.5)
    finally:
        ranks.kill()
    logger.error("node %d stopped: %s", server_args.node_rank, ranks.describe_exit())
    sys.exit(1)


def build_parser() -> argparse.ArgumentParser:
    """The server's command line (arg_groups/cli.py): flags in --help groups, errors of one line."""
    return cli.build_parser()


def resolve_or_exit(args: argparse.Namespace, sock: Optional[socket.socket] = None) -> ServerArgs:
    """ServerArgs from the parsed flags, validated and with the DeepSeek-V4 defaults; a bad value (or model path)
    ends the process with one line naming the flag and exit status 2."""
    from sglang.srt.arg_groups.deepseek_v4_hook import resolve_server_args

    try:
        return resolve_server_args(ServerArgs.from_cli_args(args))
    except (ValueError, OSError) as e:
        if sock is not None:
            sock.close()
        cli.fail(e)


def main(argv=None) -> None:
    exit_on_sigterm()  # from the start: a SIGTERM while the model is resolved or generated exits cleanly too
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)  # first: resolving may generate the built-in model (a progress bar)
    if args.node_rank > 0:  # headless: no HTTP address of its own
        run_headless(resolve_or_exit(args))
    try:
        sock = bind_listen_socket(args.host, args.port)
    except OSError as e:
        logger.error("%s", e)
        raise SystemExit(1) from None
    launch_server(resolve_or_exit(args, sock), sock)


if __name__ == "__main__":
    sys.exit(main())
