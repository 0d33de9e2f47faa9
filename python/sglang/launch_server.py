"""python -m sglang.launch_server --model-path ... : the OpenAI-compatible server.

Process model: this process runs the HTTP server and the TokenizerManager (tokenize, encode chats, detokenize);
the model and scheduler run in a spawned scheduler process, so a long forward never blocks the API.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import multiprocessing as mp
import os
import sys
import tempfile

from sglang.srt.server_args import ServerArgs

logger = logging.getLogger("sglang.launch_server")


def start_scheduler(server_args: ServerArgs):
    """Spawn the scheduler process and wait until it has loaded the model; returns (process, ready, ports)."""
    from sglang.srt.managers.io_struct import SchedulerReady
    from sglang.srt.managers.scheduler_process import PortArgs, run_scheduler_process

    ipc_dir = tempfile.mkdtemp(prefix="sglang-ipc-")
    ports = PortArgs(scheduler_input=f"ipc://{os.path.join(ipc_dir, 'scheduler')}",
                     tokenizer_input=f"ipc://{os.path.join(ipc_dir, 'tokenizer')}")
    ctx = mp.get_context("spawn")
    reader, writer = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=run_scheduler_process, args=(server_args, ports, writer), daemon=True,
                       name="sglang-scheduler")
    proc.start()
    while not reader.poll(1.0):
        if not proc.is_alive():
            raise RuntimeError(f"the scheduler process exited during start-up (code {proc.exitcode})")
    ready = reader.recv()
    if not isinstance(ready, SchedulerReady):
        proc.join(timeout=5)
        raise RuntimeError(f"the scheduler process failed to start: {ready}")
    return proc, ready, ports


def launch_server(server_args: ServerArgs) -> None:
    import uvicorn

    from sglang.srt.entrypoints.engine import load_tokenizer
    from sglang.srt.entrypoints.http_server import create_app
    from sglang.srt.managers.tokenizer_manager import TokenizerManager
    from sglang.srt.model_loader.model_path import resolve_model_path

    logging.basicConfig(level=server_args.log_level.upper(),
                        format="[%(asctime)s] %(levelname)s %(name)s: %(message)s")
    logger.info("DeepSeek-V4 defaults applied: %s", ", ".join(server_args.applied_defaults) or "none")
    shown = {k: ("***" if k == "api_key" and v else v) for k, v in dataclasses.asdict(server_args).items()}
    logger.info("server args: %s", shown)
    proc, ready, ports = start_scheduler(server_args)
    tokenizer = load_tokenizer(server_args.tokenizer_path or resolve_model_path(server_args.model_path))
    metrics = None
    if server_args.enable_metrics:
        from sglang.srt.metrics.collector import MetricsCollector

        metrics = MetricsCollector(server_args.served_model_name or server_args.model_path)
    tm = TokenizerManager(tokenizer, ready, ports.scheduler_input, ports.tokenizer_input, metrics)
    app = create_app(tm, server_args, metrics, scheduler_proc=proc)

    logger.info("serving %s on http://%s:%d", server_args.model_path, server_args.host, server_args.port)
    try:
        uvicorn.run(app, host=server_args.host, port=server_args.port, log_level=server_args.log_level,
                    timeout_keep_alive=5)
    finally:
        proc.kill()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m sglang.launch_server",
                                     description="Serve a DeepSeek-V4 model over an OpenAI-compatible API.")
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(argv)
    try:
        server_args = ServerArgs.from_cli_args(args).resolve()
    except ValueError as e:
        parser.error(str(e))
    launch_server(server_args)


if __name__ == "__main__":
    sys.exit(main())
