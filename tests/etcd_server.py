"""A real etcd for the tests: Debian's etcd-server, on loopback, in a data dir of its own.

``EtcdServer(tmp_path).start()`` runs ``etcd`` with client and peer URLs on
127.0.0.1 at ports the system just handed out (bound and let go: etcd's JSON
gateway dials its own listen address, so port 0 cannot be passed on), waits for
it to answer, and ``stop()`` / ``kill()`` / ``start()`` again on the same ports
and data dir (a restart keeps the keys).  With ``tls=True`` it serves https
with a throwaway CA and a client certificate it asks for (made here with
openssl); :meth:`enable_auth` turns on etcd's users.  Tests skip, saying why,
where etcd or the etcd extra (h11) is missing; .ci/run installs etcd-server.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

ETCD = shutil.which("etcd")
ETCDCTL = shutil.which("etcdctl")


def need_etcd() -> None:
    if ETCD is None or ETCDCTL is None:
        pytest.skip("etcd is not installed (Debian: apt-get install etcd-server etcd-client; "
                    ".ci/run installs it)")
    try:
        import h11  # noqa: F401
    except ImportError:
        pytest.skip("the etcd extra is not installed (pip install -e '.[etcd]': h11)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_certs(d: Path) -> dict[str, str]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, in ``d``."""
    d.mkdir(parents=True, exist_ok=True)

    def ossl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=d)

    ossl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj",
         "/CN=transferd-test-ca", "-keyout", "ca.key", "-out", "ca.pem")
    ext = d / "san.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                   "extendedKeyUsage=serverAuth,clientAuth\n")
    for name in ("server", "client"):
        # No CN on the client: with auth on, etcd refuses a gateway request whose client
        # certificate has one (it would not be the user); the user and password are.
        subj = "/CN=server" if name == "server" else "/O=transferd-client"
        ossl("req", "-newkey", "rsa:2048", "-nodes", "-subj", subj, "-keyout",
             f"{name}.key", "-out", f"{name}.csr")
        ossl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
             "-CAcreateserial", "-days", "2", "-extfile", str(ext), "-out", f"{name}.pem")
    for key in d.glob("*.key"):
        key.chmod(0o600)
    return {n: str(d / f) for n, f in (("ca", "ca.pem"), ("cert", "client.pem"),
                                       ("key", "client.key"), ("server_cert", "server.pem"),
                                       ("server_key", "server.key"))}


class EtcdServer:
    def __init__(self, root: Path, *, tls: bool = False) -> None:
        need_etcd()
        self.root = root
        self.data = root / "etcd-data"
        self.tls = tls
        self.certs = make_certs(root / "certs") if tls else {}
        self.client_port = free_port()
        self.peer_port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = root / "etcd.log"
        self.root_password = ""

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    @property
    def endpoint(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.client_port}"

    @property
    def url(self) -> str:
        """What discovery.url takes."""
        return f"{'etcds' if self.tls else 'etcd'}://127.0.0.1:{self.client_port}"

    def start(self, timeout: float = 20.0) -> EtcdServer:
        peer = f"http://127.0.0.1:{self.peer_port}"
        argv = [ETCD or "etcd", "--name", "t", "--data-dir", str(self.data),
                "--listen-client-urls", self.endpoint, "--advertise-client-urls", self.endpoint,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"t={peer}", "--log-level", "warn",
                "--logger", "zap"]
        if self.tls:
            c = self.certs
            argv += ["--cert-file", c["server_cert"], "--key-file", c["server_key"],
                     "--trusted-ca-file", c["ca"], "--client-cert-auth"]
        log = open(self.log, "ab")  # noqa: SIM115 - the child writes it; closed below
        try:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        finally:
            log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}:\n"
                                   f"{self.log.read_text()[-3000:]}")
            if self.healthy():
                return self
            time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"etcd not up within {timeout} s:\n{self.log.read_text()[-3000:]}")

    def _ssl(self) -> ssl.SSLContext | None:
        if not self.tls:
            return None
        ctx = ssl.create_default_context(cafile=self.certs["ca"])
        ctx.load_cert_chain(self.certs["cert"], self.certs["key"])
        return ctx

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.endpoint}/version", timeout=1,
                                        context=self._ssl()) as r:
                return b"etcdserver" in r.read()
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        self.proc = None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
        self.proc = None

    def ctl(self, *args: str, user: str = "") -> str:
        """etcdctl against this server; its stdout."""
        argv = [ETCDCTL or "etcdctl", f"--endpoints={self.endpoint}", "--command-timeout=5s"]
        if self.tls:
            c = self.certs
            argv += [f"--cacert={c['ca']}", f"--cert={c['cert']}", f"--key={c['key']}"]
        if user:
            argv.append(f"--user={user}")
        r = subprocess.run([*argv, *args], capture_output=True, text=True, timeout=20,
                           env={**os.environ, "ETCDCTL_API": "3"})
        if r.returncode != 0:
            raise RuntimeError(f"etcdctl {' '.join(args)}: {r.stderr.strip()}")
        return r.stdout

    def enable_auth(self, user: str, password: str, prefix: str = "/transferd/") -> None:
        """A root user, and ``user`` with read-write on ``prefix`` only; auth on."""
        self.root_password = "root-" + password
        self.ctl("user", "add", f"root:{self.root_password}")
        self.ctl("user", "grant-role", "root", "root")
        self.ctl("role", "add", "transferd")
        self.ctl("role", "grant-permission", "transferd", "--prefix=true", "readwrite", prefix)
        self.ctl("user", "add", f"{user}:{password}")
        self.ctl("user", "grant-role", user, "transferd")
        self.ctl("auth", "enable")

    def put(self, key: str, value: bytes) -> None:
        """Put ``key`` through the JSON gateway (a value too large for etcdctl's argv)."""
        import base64

        body = json.dumps({"key": base64.b64encode(key.encode()).decode(),
                           "value": base64.b64encode(value).decode()}).encode()
        req = urllib.request.Request(f"{self.endpoint}/v3/kv/put", data=body)
        with urllib.request.urlopen(req, timeout=20, context=self._ssl()) as r:
            reply = json.loads(r.read())
        if "header" not in reply:
            raise RuntimeError(f"put {key}: {reply}")

    def stored(self, prefix: str = "/transferd/") -> dict[str, str]:
        """Every key under ``prefix`` and its value (as root when auth is on)."""
        user = f"root:{self.root_password}" if self.root_password else ""
        out = self.ctl("get", "--prefix", prefix, "-w", "json", user=user)
        import base64

        kvs = json.loads(out).get("kvs") or []
        return {base64.b64decode(kv["key"]).decode(): base64.b64decode(kv.get("value", ""))
                .decode(errors="replace") for kv in kvs}

    def __enter__(self) -> EtcdServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.kill()
