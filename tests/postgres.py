"""A throwaway PostgreSQL cluster for the tests marked ``postgres``.

``initdb`` in a fresh temp folder, ``pg_ctl start`` listening on a unix socket in that folder only
(no TCP port, so parallel runs never collide), trust auth, durability off (a test cluster). Run as
the ``postgres`` system user when the tests run as root (the server refuses root). ``stop()``
shuts it down and removes the folder. The binaries are found on PATH or in the distribution's
``/usr/lib/postgresql/<version>/bin``.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path

REQUIRE_ENV = "SPECTUNE_REQUIRE_POSTGRES"  # set by .ci/run: a missing server fails instead of skipping


def find_binary(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    versions = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"),
                      key=lambda p: int(Path(p).parts[-3]) if Path(p).parts[-3].isdigit() else 0)
    return versions[-1] if versions else None


def missing() -> str | None:
    """Why a cluster cannot start here, or None."""
    for name in ("initdb", "pg_ctl"):
        if find_binary(name) is None:
            return f"PostgreSQL binaries not found ({name}; apt-get install postgresql)"
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return 'psycopg not installed (pip install "spectune[postgres]")'
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root without a 'postgres' user to run the server as"
    return None


class Cluster:
    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="spectune-pg-"))
        self.data, self.sock = self.root / "data", self.root / "sock"
        self.sock.mkdir()
        self.user = None
        if os.geteuid() == 0:
            self.user = "postgres"
            pw = pwd.getpwnam("postgres")
            for p in (self.root, self.sock):
                os.chown(p, pw.pw_uid, pw.pw_gid)

    def _run(self, *args: str) -> None:
        subprocess.run(list(args), check=True, capture_output=True, user=self.user, cwd=self.root, timeout=120)

    def start(self) -> None:
        self._run(find_binary("initdb") or "initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust",
                  "--no-sync", "-E", "UTF8")
        opts = (f"-c listen_addresses='' -c unix_socket_directories='{self.sock}' -c fsync=off "
                f"-c synchronous_commit=off -c full_page_writes=off -c max_connections=200")
        self._run(find_binary("pg_ctl") or "pg_ctl", "-D", str(self.data), "-l", str(self.root / "log"),
                  "-o", opts, "-w", "-t", "60", "start")

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@/{database}?host={self.sock}"

    def create_database(self) -> str:
        import psycopg

        name = f"t_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(host=str(self.sock), user="postgres", dbname="postgres", autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self._run(find_binary("pg_ctl") or "pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(self.root, ignore_errors=True)
