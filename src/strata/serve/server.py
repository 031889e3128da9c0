"""`serve`: run the app under uvicorn until SIGTERM or Ctrl-C, and `Server`, uvicorn's server
with strata's shutdown.

On SIGTERM (or the first Ctrl-C) the server stops taking connections, refuses the requests
still waiting in the queue (503), lets the one computing finish and its response reach the
client, then closes the engine and returns: the process exits with status 0, not by the signal
(uvicorn's own server re-raises it). A second Ctrl-C exits at once. If the model fails to
load, the server stops and `serve` raises the loader's error.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType

import uvicorn

from strata.serve.app import create_app
from strata.serve.options import LOG_LEVELS, ServedModel, ServeOptions
from strata.serve.worker import EngineWorker

__all__ = ["Server", "configure_logging", "make_server", "serve"]

log = logging.getLogger("strata.serve")


class Server(uvicorn.Server):
    """uvicorn's server: strata's shutdown (see the module's docstring), and the line that
    says where it listens (the port chosen, for `--port 0`)."""

    def __init__(self, config: uvicorn.Config, worker: EngineWorker) -> None:
        super().__init__(config)
        self.worker = worker
        self.port: int | None = None  # the port listened on, once started

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not uvicorn's: it records the signal to raise it again after the shutdown, which
        # would end the process by the signal instead of a clean exit. The waiting requests
        # are refused from another thread: this handler interrupts the event loop's thread,
        # which may be inside the queue's lock (queueing a request) at this very moment.
        threading.Thread(target=self.worker.refuse_waiting, name="strata-refuse").start()
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        else:
            self.should_exit = True

    async def startup(self, sockets: list | None = None) -> None:
        await super().startup(sockets)
        if self.servers and self.servers[0].sockets:
            self.port = self.servers[0].sockets[0].getsockname()[1]
            log.info("listening on http://%s:%d (the model %s)", self.config.host, self.port,
                     "loads now" if self.worker.state == "loading" else self.worker.state)


def make_server(load: Callable[[], ServedModel], options: ServeOptions, *,
                log_level: str = "info") -> Server:
    """The server of `create_app(load, options)`, not yet running (`run()` or `serve()` on an
    event loop). It stops by itself if the model fails to load."""
    holder: list[Server] = []

    def stop_on_failure(_err: BaseException) -> None:
        holder[0].should_exit = True

    app = create_app(load, options, on_load_failed=stop_on_failure)
    config = uvicorn.Config(app, host=options.host, port=options.port, log_config=None,
                            log_level=log_level, access_log=False, lifespan="on")
    holder.append(Server(config, app.state.worker))
    return holder[0]


def configure_logging(log_level: str) -> None:
    """strata's lines on stderr at `log_level` (info: one per request); uvicorn's only from
    warning up (its start and stop lines say what strata's say), but at debug."""
    if log_level not in LOG_LEVELS:
        raise ValueError(f"--log-level must be one of {', '.join(LOG_LEVELS)}, got "
                         f"{log_level!r}")
    level = getattr(logging, log_level.upper())
    formatter = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name, least in (("strata.serve", level), ("uvicorn", max(level, logging.WARNING)
                                                  if level > logging.DEBUG else level)):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(formatter)
        handler.setLevel(least)
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.setLevel(level)
        logger.propagate = False


def serve(load: Callable[[], ServedModel], options: ServeOptions, *,
          log_level: str = "info") -> None:
    """Serve until SIGTERM or Ctrl-C (see the module's docstring). Raises what `load` raised
    if the model could not be loaded."""
    configure_logging(log_level)
    server = make_server(load, options, log_level=log_level)
    server.run()
    if server.worker.error is not None:
        raise server.worker.error
    log.info("stopped")
