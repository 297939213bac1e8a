"""`ds4-agent --serve`: the HTTP shim that lets Claude Code, Codex CLI, opencode, Pi and the official
SDKs use the in-process engine (OpenAI Chat / Completions / Responses, Anthropic Messages)."""
from .config import ServeConfig
from .shim import Shim

__all__ = ["ServeConfig", "Shim", "create_app", "ServerThread"]


def create_app(shim):
    from .app import create_app as _create
    return _create(shim)


class ServerThread:
    """A uvicorn server on a background thread (tests, embedding): `with ServerThread(shim) as url:`.
    Port 0 picks a free one."""

    def __init__(self, shim: Shim, host: str = "127.0.0.1", port: int = 0):
        import socket
        import threading

        from .server import _Listener, make_server
        self.shim = shim
        # proto given: asyncio sets TCP_NODELAY only on IPPROTO_TCP sockets (else every keep-alive
        # request stalls ~40 ms on Nagle + delayed ACK)
        self.sock = _Listener(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.url = f"http://{host}:{self.sock.getsockname()[1]}"
        # the same server as `ds4-agent --serve`: its limits and timeouts come from shim.cfg
        self.server = make_server(create_app(shim), shim.cfg, graceful_s=5)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True, name="ds4-http")

    def __enter__(self) -> str:
        import time
        self.shim.start()
        self.thread.start()
        while not self.server.started and self.thread.is_alive():
            time.sleep(0.01)
        return self.url

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()
        self.shim.stop()
