"""A throwaway PostgreSQL cluster for tests and benchmarks: initdb + pg_ctl in a temp dir, on loopback.

    cluster = PostgresCluster.start_new()      # initdb, start; torn down at interpreter exit in any case
    dsn = cluster.dsn                          # postgresql://postgres@127.0.0.1:PORT/postgres
    dsn = cluster.create_database()            # a fresh, empty database (t_<random>), kept until close()
    cluster.stop(mode="immediate")             # like a crash: no shutdown checkpoint, clients cut off
    cluster.start()                            # the same data directory and port again
    cluster.close()                            # stop and delete the data directory (idempotent)
    standby = PostgresCluster.start_standby(cluster)   # a streaming replica of it, on its own port
    standby.promote()                          # the replica becomes a primary (after the primary died)

The server runs with fsync on and synchronous_commit on, trust authentication for 127.0.0.1 only,
and its Unix socket in the temp dir (never the system's /var/run/postgresql). PostgreSQL refuses to
run as root: when we are root it runs as the `postgres` OS user (which the Debian package creates)
through `runuser`, and the temp dir is handed to that user. The binaries are found on PATH or in
/usr/lib/postgresql/<version>/bin (the newest); benchmarks/setup_postgres.sh installs them.

Used by tests/conftest.py (fixtures `postgres_cluster` and `postgres_dsn`) and benchmarks/broker.py,
with this folder on sys.path. Only the standard library at import; psycopg is imported when needed.
"""

from __future__ import annotations

import atexit
import glob
import os
import pwd
import secrets
import shutil
import socket
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

SERVER_SETTINGS = {
    "listen_addresses": "'127.0.0.1'",
    "fsync": "on",
    "synchronous_commit": "on",
    "max_connections": "200",  # tests open a store, a fence checker and a migration at once
    "log_min_messages": "warning",
    # Sized as a server that takes a broker's ingest would be: no checkpoint (and its burst of page
    # writes and full-page images) in the middle of a benchmark run, WAL buffered between group commits.
    "shared_buffers": "'256MB'",
    "wal_buffers": "'32MB'",
    "max_wal_size": "'8GB'",
    "checkpoint_timeout": "'30min'",
    "wal_compression": "off",
    "wal_init_zero": "off",
    "wal_recycle": "on",
}


class PostgresMissing(RuntimeError):
    """initdb/pg_ctl are not installed (run benchmarks/setup_postgres.sh)."""


def find_bin_dir() -> Path:
    """The folder holding initdb and pg_ctl: PATH first, else the newest /usr/lib/postgresql/*/bin."""
    on_path = shutil.which("initdb")
    if on_path and shutil.which("pg_ctl"):
        return Path(os.path.realpath(on_path)).parent
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"), key=lambda p: int(Path(p).parts[-3]))
    if not found:
        raise PostgresMissing("PostgreSQL is not installed (no initdb/pg_ctl); run benchmarks/setup_postgres.sh")
    return Path(found[-1]).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class PostgresCluster:
    """One server process over one data directory in `root`; see the module docstring."""

    root: Path
    port: int
    bin_dir: Path
    user: str | None  # the OS user the server runs as when we are root; None: ourselves
    closed: bool = field(default=False, init=False)

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def log(self) -> Path:
        return self.root / "server.log"

    @property
    def dsn(self) -> str:
        return self.dsn_for("postgres")

    def dsn_for(self, dbname: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{dbname}"

    @classmethod
    def start_new(cls, *, attempts: int = 3) -> PostgresCluster:
        """initdb a new cluster in a temp dir and start it on a free port; the port is chosen before the
        server binds it, so a start that loses that race is retried on another port."""
        bin_dir = find_bin_dir()
        user = None
        if os.geteuid() == 0:
            user = "postgres"
            try:
                pwd.getpwnam(user)
            except KeyError:
                raise PostgresMissing("running as root and there is no `postgres` OS user to run the server as; "
                                      "run benchmarks/setup_postgres.sh") from None
        root = Path(tempfile.mkdtemp(prefix="deltamesh-pg-"))
        if user is not None:
            entry = pwd.getpwnam(user)
            os.chown(root, entry.pw_uid, entry.pw_gid)
        cluster = cls(root, 0, bin_dir, user)
        atexit.register(cluster.close)  # also after a failed test or an interrupted benchmark
        try:
            # --no-sync: the initial files need not reach the disk (a crash here leaves only a temp dir);
            # the server itself runs with fsync on.
            cluster._run("initdb", "-D", str(cluster.data), "-A", "trust", "-U", "postgres", "-E", "UTF8",
                         "--locale=C", "--no-sync")
            for attempt in range(attempts):
                cluster.port = free_port()
                settings = {**SERVER_SETTINGS, "port": str(cluster.port), "unix_socket_directories": f"'{root}'"}
                with open(cluster.data / "postgresql.auto.conf", "w") as conf:  # read last: overrides the defaults
                    conf.writelines(f"{k} = {v}\n" for k, v in settings.items())
                try:
                    cluster.start()
                    break
                except subprocess.CalledProcessError:
                    if attempt == attempts - 1:
                        raise
        except BaseException:
            cluster.close()
            raise
        return cluster

    def _run(self, program: str, *args: str, timeout: float = 120) -> None:
        cmd = [str(self.bin_dir / program), *args]
        if self.user is not None:
            cmd = ["runuser", "-u", self.user, "--", *cmd]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            tail = self.log.read_text()[-2000:] if self.log.exists() else ""
            raise subprocess.CalledProcessError(done.returncode, cmd, done.stdout, f"{done.stderr}\n{tail}")

    def start(self) -> None:
        """Start the server (again) and return once it accepts connections."""
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-w", "-t", "60", "start")

    def stop(self, mode: str = "fast") -> None:
        """Stop the server: "immediate" is a crash (recovery on the next start), "fast" a clean shutdown."""
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "-t", "60", "stop")

    @classmethod
    def start_standby(cls, primary: PostgresCluster, *, port: int | None = None) -> PostgresCluster:
        """A streaming standby of `primary`, started on `port` (default: a free one): a base backup of its
        data that follows its WAL (`pg_basebackup -R`), read-only until `promote`. With
        `synchronous_standby_names` set on the primary, its commits wait for this standby."""
        root = Path(tempfile.mkdtemp(prefix="deltamesh-pg-"))
        if primary.user is not None:
            entry = pwd.getpwnam(primary.user)
            os.chown(root, entry.pw_uid, entry.pw_gid)
        cluster = cls(root, port or free_port(), primary.bin_dir, primary.user)
        atexit.register(cluster.close)
        try:
            cluster._run("pg_basebackup", "-D", str(cluster.data), "-h", "127.0.0.1", "-p", str(primary.port),
                         "-U", "postgres", "-R", "-X", "stream", "--no-sync", "--checkpoint=fast")
            # The copied settings name the primary's port and socket folder; later lines win.
            with open(cluster.data / "postgresql.auto.conf", "a") as conf:
                conf.write(f"port = {cluster.port}\nunix_socket_directories = '{root}'\n")
            cluster.start()
        except BaseException:
            cluster.close()
            raise
        return cluster

    def promote(self) -> None:
        """Make this standby a primary that accepts writes (returns once it does)."""
        self._run("pg_ctl", "-D", str(self.data), "-w", "-t", "60", "promote")

    def set_setting(self, name: str, value: str) -> None:
        """ALTER SYSTEM SET `name` to `value` and reload, on the running server."""
        import psycopg

        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute(f"ALTER SYSTEM SET {name} = '{value}'")
            conn.execute("SELECT pg_reload_conf()")

    def running(self) -> bool:
        cmd = [str(self.bin_dir / "pg_ctl"), "-D", str(self.data), "status"]
        if self.user is not None:
            cmd = ["runuser", "-u", self.user, "--", *cmd]
        return subprocess.run(cmd, capture_output=True).returncode == 0

    def ensure_running(self) -> None:
        """Start the server if a test left it stopped."""
        if not self.running():
            self.start()

    def create_database(self, name: str | None = None) -> str:
        """Create an empty database (default name t_<random>) and return its DSN."""
        import psycopg

        name = name or f"t_{secrets.token_hex(6)}"
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.dsn_for(name)

    def close(self) -> None:
        """Stop the server at once and delete everything; safe to call twice."""
        if self.closed:
            return
        self.closed = True
        if (self.data / "postmaster.pid").exists():
            try:
                self.stop(mode="immediate")
            except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError):
                pass  # already down; the directory goes anyway
        shutil.rmtree(self.root, ignore_errors=True)
