"""Who may talk to the buffer: loopback by default, CURVE (pyzmq's auth) for anything else.

A key directory made by `generate_keys` (CLI: `slime-async keys OUT_DIR`) holds

    server.key, server.key_secret              the buffer server's key pair
    clients/client.key, clients/client.key_secret   the key pair that senders and trainers use

The server accepts exactly the public keys in `clients/` (add more `*.key` files there to admit
more clients); a client needs `server.key` and `clients/client.key_secret`.
"""

from __future__ import annotations

import ipaddress
import shutil
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator


class InsecureEndpointError(ValueError):
    """A non-loopback endpoint without CURVE keys; the message names the endpoint and the fix."""


def is_loopback(endpoint: str) -> bool:
    """True for ipc:// and inproc:// endpoints and for tcp:// on 127.0.0.0/8, ::1 or localhost."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep:
        raise ValueError(f"endpoint {endpoint!r}: expected scheme://address, e.g. tcp://127.0.0.1:5555")
    if scheme in ("ipc", "inproc"):
        return True
    if scheme != "tcp":
        return False
    host = rest.rpartition(":")[0] if ":" in rest else rest
    host = host.split(";")[-1].strip("[]")  # `tcp://src;dst:port` connects from src to dst
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # an interface name, a host name or `*`: not provably loopback


@dataclass(frozen=True)
class CurveKeys:
    """Paths of a key directory made by `generate_keys`."""

    dir: Path

    @property
    def server_public(self) -> Path:
        return self.dir / "server.key"

    @property
    def server_secret(self) -> Path:
        return self.dir / "server.key_secret"

    @property
    def clients_dir(self) -> Path:
        return self.dir / "clients"

    @property
    def client_secret(self) -> Path:
        return self.clients_dir / "client.key_secret"

    def check(self) -> None:
        for path in (self.server_public, self.server_secret, self.client_secret):
            if not path.is_file():
                raise FileNotFoundError(
                    f"{path}: missing CURVE key file; make the directory with `slime-async keys {self.dir}`"
                )


def generate_keys(out_dir: str | Path, overwrite: bool = False) -> CurveKeys:
    """Write a server key pair and a client key pair under `out_dir` (see the module docstring)."""
    keys = CurveKeys(Path(out_dir))
    if keys.dir.exists() and any(keys.dir.iterdir()):
        if not overwrite:
            raise FileExistsError(f"{keys.dir}: exists and is not empty; choose another directory or pass --force")
        shutil.rmtree(keys.dir)
    keys.clients_dir.mkdir(parents=True, exist_ok=True)
    zmq.auth.create_certificates(keys.dir, "server")
    zmq.auth.create_certificates(keys.clients_dir, "client")
    keys.server_secret.chmod(0o600)
    keys.client_secret.chmod(0o600)
    return keys


def secure_server(socket: zmq.Socket, endpoint: str, curve_dir: str | Path | None) -> ThreadAuthenticator | None:
    """Make `socket` a CURVE server when keys are given; refuse a non-loopback endpoint without them.

    Returns the authenticator thread (stop it when the socket closes) or None on loopback without keys.
    """
    if curve_dir is None:
        if not is_loopback(endpoint):
            raise InsecureEndpointError(
                f"buffer.endpoint={endpoint!r} is not loopback and buffer.curve_dir is not set: "
                "make keys with `slime-async keys DIR` and set buffer.curve_dir=DIR, or bind to 127.0.0.1"
            )
        return None
    keys = CurveKeys(Path(curve_dir))
    keys.check()
    auth = ThreadAuthenticator(socket.context)
    auth.start()
    auth.configure_curve(domain="*", location=str(keys.clients_dir))
    public, secret = zmq.auth.load_certificate(keys.server_secret)
    socket.curve_secretkey = secret
    socket.curve_publickey = public
    socket.curve_server = True
    return auth


def secure_client(socket: zmq.Socket, endpoint: str, curve_dir: str | Path | None) -> None:
    """Give `socket` the client keys when set; refuse a non-loopback endpoint without them."""
    if curve_dir is None:
        if not is_loopback(endpoint):
            raise InsecureEndpointError(
                f"endpoint {endpoint!r} is not loopback and no CURVE key directory was given: "
                "pass the directory made by `slime-async keys DIR` (buffer.curve_dir)"
            )
        return
    keys = CurveKeys(Path(curve_dir))
    keys.check()
    server_public, _ = zmq.auth.load_certificate(keys.server_public)
    public, secret = zmq.auth.load_certificate(keys.client_secret)
    socket.curve_serverkey = server_public
    socket.curve_publickey = public
    socket.curve_secretkey = secret
