"""Whether a Ray cluster listens at the address given to join it, asked over a plain socket before
`ray.init`: Ray's own connect retries an unreachable address for a minute or more, in native code that
a Ctrl-C does not reach. A TCP connect alone is not enough (a proxy or a firewall may accept any
connection), so the probe opens HTTP/2 as gRPC does and waits for the server's SETTINGS frame: the GCS
and the Ray Client server both speak gRPC."""

from __future__ import annotations

import socket

# where a cluster listens when its address names no port: the GCS, and the Ray Client server (ray://)
_GCS_PORT, _CLIENT_PORT = 6379, 10001
# HTTP/2's client connection preface, then an empty SETTINGS frame (RFC 9113, 3.4)
_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
_SETTINGS = 4  # the frame type a server's preface begins with


class ClusterUnreachableError(ConnectionError):
    """Nothing answers at the Ray cluster's address."""


def probe_cluster(address: str, timeout_s: float = 3.0) -> None:
    """Raises ClusterUnreachableError, within timeout_s, unless something accepts a TCP connection
    at the cluster's address ("auto": the cluster this node is part of)."""
    if address.startswith("ray://"):
        target, default_port = address.removeprefix("ray://"), _CLIENT_PORT
    else:
        from ray._private.services import canonicalize_bootstrap_address_or_die

        try:
            target, default_port = canonicalize_bootstrap_address_or_die(address), _GCS_PORT
        except Exception as e:  # noqa: BLE001 - Ray raises several kinds for an address it cannot read
            raise ClusterUnreachableError(f"no Ray cluster at --address {address}: {' '.join(str(e).split())}") from e
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit():
        host, port = target, str(default_port)
    host = host.strip("[]")  # an IPv6 address written [::1]:6379
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s) as conn:
            conn.sendall(_PREFACE)
            head = conn.recv(9)
        why = None if len(head) > 3 and head[3] == _SETTINGS else "it does not answer as a Ray cluster does"
    except OSError as e:
        why = "timed out" if isinstance(e, TimeoutError) else e.strerror or type(e).__name__
    if why is not None:
        raise ClusterUnreachableError(
            f"no Ray cluster answers at --address {address} ({host}:{port}: {why}); is `ray start --head` "
            "running there, and is the port open?"
        )
