"""Workers started through torchrun's elastic agent (``torch.distributed.run``, run in this process):
``meshtorch launch --backend torch`` across nodes or with ``--max-restarts``, and ``meshtorch train
--backend torch --max-restarts``.

The agent starts ``nproc`` copies of a worker command on this node, watches them, and when one fails
(an exception, an exit, ``kill -9``) stops the others and starts them all again, up to
``max_restarts`` times; each worker reads how many restarts came before it from
:func:`restart_count`. On one node (no rendezvous option given) the rendezvous store listens on the
loopback interface only, on a free port, and gloo and NCCL connect over it, as for a local spawn.
Across nodes, where ``GLOO_SOCKET_IFNAME`` is not set it is set to the interface that routes to the
rendezvous host (:func:`socket_interface`), so that gloo does not advertise the address the host
name resolves to (often 127.0.0.1) to the other nodes.

Example:
    >>> from meshtorch.launcher.elastic import Nodes, restart_count
    >>> Nodes().multi_node, Nodes(nnodes="2").multi_node, restart_count()
    (False, True, 0)
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import ipaddress
import os
import signal
import socket
import sys
from collections.abc import Iterator
from typing import Any

from meshtorch.errors import ArgumentError

# torchrun's defaults for its static rendezvous
TORCHRUN_MASTER_ADDR, TORCHRUN_MASTER_PORT = "127.0.0.1", 29500
# joining a rendezvous waits for the slowest node; as RENDEZVOUS_MIN_S in launcher.world
_RENDEZVOUS_S = 120.0
# how long a node whose workers failed tries to reach the rendezvous store to check in at the exit barrier
_CHECK_IN_S = 5.0
# the variables that pick the network interface gloo's and NCCL's connections use
GLOO_IFNAME, NCCL_IFNAME = "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"
_SIOCGIFADDR = 0x8915  # Linux's ioctl for an interface's (first) IPv4 address


@dataclasses.dataclass(frozen=True)
class Nodes:
    """torchrun's node options: ``--nnodes`` (N or MIN:MAX), ``--node-rank`` and the rendezvous's.

    Example:
        >>> Nodes(nnodes="1:4").counts, Nodes(master_addr="10.0.0.1").multi_node
        ((1, 4), True)
    """

    nnodes: str = "1"
    node_rank: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_backend: str | None = None
    rdzv_id: str | None = None
    master_addr: str | None = None
    master_port: str | None = None

    FLAGS = ("node_rank", "rdzv_endpoint", "rdzv_backend", "rdzv_id", "master_addr", "master_port")

    @property
    def counts(self) -> tuple[int, int]:
        """``--nnodes`` as (min, max): ``"2"`` is (2, 2), ``"1:4"`` is (1, 4)."""
        lo, sep, hi = self.nnodes.partition(":")
        if not (lo.isdigit() and (hi.isdigit() if sep else True)):
            raise ArgumentError(f"--nnodes {self.nnodes!r} is not N or MIN:MAX (e.g. --nnodes 2 or "
                                "--nnodes 1:4)")
        counts = (int(lo), int(hi) if sep else int(lo))
        if counts[0] < 1 or counts[0] > counts[1]:
            raise ArgumentError(f"--nnodes {self.nnodes!r}: the number of nodes must be at least 1 (and "
                                "MIN <= MAX in MIN:MAX); pass e.g. --nnodes 1")
        return counts

    @property
    def given(self) -> list[str]:
        """The node options given, as flags."""
        return [f"--{f.replace('_', '-')}" for f in self.FLAGS if getattr(self, f) is not None]

    @property
    def multi_node(self) -> bool:
        """Whether the processes need torchrun's rendezvous (several nodes, or an endpoint given)."""
        return self.counts != (1, 1) or bool(self.given)

    def argv(self) -> list[str]:
        """These options as torchrun's flags."""
        out = ["--nnodes", self.nnodes]
        for f in self.FLAGS:
            if getattr(self, f) is not None:
                out += [f"--{f.replace('_', '-')}", str(getattr(self, f))]
        return out

    def rendezvous_host(self) -> str:
        """The host the nodes meet at: ``--rdzv-endpoint``'s, else ``--master-addr`` (torchrun's default)."""
        if self.rdzv_endpoint:
            host = self.rdzv_endpoint.rsplit(":", 1)[0] if self.rdzv_endpoint.count(":") == 1 or \
                self.rdzv_endpoint.startswith("[") else self.rdzv_endpoint
            return host.strip("[]")
        return self.master_addr or TORCHRUN_MASTER_ADDR


def restart_count() -> int:
    """How many times torchrun's agent restarted this worker's group before starting it (0: the first
    start, or a process that torchrun did not start).

    Example:
        >>> restart_count()
        0
    """
    text = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") if "TORCHELASTIC_RUN_ID" in os.environ else "0"
    return int(text) if text.isdigit() else 0


def check_max_restarts(n: Any, flag: str = "--max-restarts") -> int:
    """``n`` if it is a whole number >= 0, else an :class:`ArgumentError` naming ``flag``.

    Example:
        >>> check_max_restarts(3)
        3
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ArgumentError(f"{flag} {n!r} must be a whole number >= 0 (0: a failed worker ends the run)")
    return n


def interface_addresses() -> dict[str, list[str]]:
    """Every network interface of this machine with its addresses (IPv4 by ``SIOCGIFADDR``, IPv6 from
    ``/proc/net/if_inet6``; Linux only: elsewhere an empty dict)."""
    if not sys.platform.startswith("linux") or not hasattr(socket, "if_nameindex"):
        return {}
    import fcntl
    import struct

    out: dict[str, list[str]] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
            except OSError:  # no IPv4 address on it
                out.setdefault(name, [])
                continue
            out.setdefault(name, []).append(socket.inet_ntoa(packed[20:24]))
    with contextlib.suppress(OSError), open("/proc/net/if_inet6") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 6:
                out.setdefault(parts[5], []).append(str(ipaddress.IPv6Address(bytes.fromhex(parts[0]))))
    return out


def interface_holding(address: str, addresses: dict[str, list[str]]) -> str | None:
    """The interface in ``addresses`` (name -> its addresses) that holds ``address``, or None.

    Example:
        >>> interface_holding("10.0.0.2", {"lo": ["127.0.0.1"], "eth1": ["10.0.0.2"]})
        'eth1'
    """
    want = ipaddress.ip_address(address.split("%")[0])
    for name, addrs in addresses.items():
        if any(ipaddress.ip_address(a.split("%")[0]) == want for a in addrs):
            return name
    return None


def source_address(host: str, port: int = TORCHRUN_MASTER_PORT) -> str | None:
    """The address of this machine that the kernel's routes pick to reach ``host`` (a UDP socket's
    ``connect`` sends nothing), or None where ``host`` does not resolve or is unreachable."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, kind, proto) as s:
            s.connect(addr)
            return s.getsockname()[0]
    except OSError:
        return None


def socket_interface(host: str) -> str | None:
    """The name of this machine's network interface that routes to ``host`` (the one holding the
    source address of its route; ``host`` itself when it is one of this machine's addresses), or None
    where that cannot be told.

    Example:
        >>> socket_interface("127.0.0.1") in (None, "lo", "lo0")
        True
    """
    local = source_address(host)
    return None if local is None else interface_holding(local, interface_addresses())


def _bind_rendezvous_store(nodes: Nodes) -> tuple[Any, Nodes]:
    """On the node that hosts torchrun's static rendezvous (``--master-addr``/``--master-port``,
    node rank 0), open its store listening on that address only, not on every interface as
    torchrun would; torchrun's own store then shares this server (both are multi-tenant).
    On one node with no rendezvous option: on the loopback address and a free port; on one node
    with ``--master-port 0``: on a free port of that address (as torchrun's ``--standalone`` takes
    ``localhost:0``), which torchrun and the workers are given.
    Returns the store (keep it alive while torchrun runs; None where torchrun's rendezvous is not
    static or is hosted elsewhere) and the node options with that address and port."""
    import torch.distributed as dist

    if nodes.rdzv_backend not in (None, "static") or nodes.rdzv_endpoint is not None \
            or (nodes.node_rank or 0) != 0:
        return None, nodes
    local = not nodes.multi_node
    host = nodes.master_addr or TORCHRUN_MASTER_ADDR
    try:
        port = 0 if local else int(nodes.master_port or TORCHRUN_MASTER_PORT)
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (ValueError, OSError) as e:
        raise ArgumentError(f"--master-addr {host!r} --master-port {nodes.master_port!r}: not an address "
                            f"this node can listen on ({e}); pass this node's address and a free port") from e
    free = port == 0  # the kernel picks the port, which only this node learns
    if free and nodes.counts != (1, 1):
        raise ArgumentError(f"--master-port {nodes.master_port} lets this node pick a free port, which the "
                            f"other nodes of --nnodes {nodes.nnodes} cannot learn; pass a free port, the "
                            "same on every node")
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(socket.SOMAXCONN)
    except OSError as e:
        sock.close()
        raise ArgumentError(f"cannot listen on --master-addr {host!r} --master-port {port} ({e}); node rank "
                            "0 hosts the rendezvous: pass one of its own addresses and a free port") from e
    port = sock.getsockname()[1]
    if free:  # torchrun and its workers get the port this store holds (from the bind on: no race)
        nodes = dataclasses.replace(nodes, master_addr=host, master_port=str(port))
    # the store owns the socket from here on and closes it
    store = dist.TCPStore(host, port, None, True, datetime.timedelta(seconds=_RENDEZVOUS_S),
                          wait_for_workers=False, multi_tenant=True, master_listen_fd=sock.detach())
    return store, nodes


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """``os.environ`` with ``values`` set for the block (torchrun's workers inherit it), then as it was:
    this process (a test, a caller of ``main()``) must not keep them."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def thread_environment(nproc: int) -> dict[str, str]:
    """``OMP_NUM_THREADS`` for ``nproc`` workers on this node where the user did not choose a number
    of threads with it: each worker's :func:`meshtorch.launcher.world.threads_for`, as the
    processes launcher gives its processes theirs. torchrun would set 1 itself where it is unset and print a
    warning of six lines about it, and would pass a value that is no number of threads (``"0"``,
    ``"abc"``, ``""``) on to the workers; a value the user chose is left as it is (``4,2`` too), and
    one worker where it is unset keeps torch's default.

    Example:
        >>> import os
        >>> from meshtorch.launcher.world import threads_per_processor
        >>> before = os.environ.pop("OMP_NUM_THREADS", None)
        >>> thread_environment(2) == {"OMP_NUM_THREADS": str(threads_per_processor(2))}, thread_environment(1)
        (True, {})
        >>> os.environ["OMP_NUM_THREADS"] = "3"
        >>> thread_environment(2)
        {}
        >>> os.environ["OMP_NUM_THREADS"] = "abc"
        >>> thread_environment(2) == {"OMP_NUM_THREADS": str(threads_per_processor(2))}
        True
        >>> del os.environ["OMP_NUM_THREADS"]
        >>> os.environ.update({} if before is None else {"OMP_NUM_THREADS": before})
    """
    from meshtorch.launcher.world import threads_chosen, threads_for

    if threads_chosen() is not None or (nproc < 2 and "OMP_NUM_THREADS" not in os.environ):
        return {}
    return {"OMP_NUM_THREADS": str(threads_for(nproc))}


def network_environment(nodes: Nodes, say: str = "meshtorch launch") -> dict[str, str]:
    """The interface variables the workers get where the user set none: the loopback on one node;
    across nodes, ``GLOO_SOCKET_IFNAME`` = the interface that routes to the rendezvous host (said on
    stderr), so that gloo advertises an address the other nodes can reach."""
    if not nodes.multi_node:
        names = {n for _, n in socket.if_nameindex()} if hasattr(socket, "if_nameindex") else set()
        lo = next((n for n in ("lo", "lo0") if n in names), None)
        return {k: lo for k in (GLOO_IFNAME, NCCL_IFNAME) if lo and k not in os.environ}
    if GLOO_IFNAME in os.environ:
        return {}
    host = nodes.rendezvous_host()
    name = socket_interface(host)
    if name is None:
        print(f"{say}: could not tell which network interface routes to {host}; gloo will use the one "
              f"this host's name resolves to: set {GLOO_IFNAME} if the nodes cannot connect",
              file=sys.stderr, flush=True)
        return {}
    print(f"{say}: {GLOO_IFNAME}={name} (the interface that routes to {host}; set {GLOO_IFNAME} to "
          "choose another)", file=sys.stderr, flush=True)
    return {GLOO_IFNAME: name}


def check_in_at_exit_barrier(nodes: Nodes, timeout_s: float = _CHECK_IN_S) -> bool:
    """Check this node in at the exit barrier of torchrun's agents (static rendezvous across nodes), once
    its agent has given up on its workers. An agent whose workers finished waits there for every
    node's agent before it exits, up to 300 s (``exit_barrier_timeout``, which torchrun's command line
    does not set), then exits as if all went well; but an agent whose workers failed returns without
    checking in. So when a worker of node 1 died after the last collective (e.g. aborted at its
    interpreter's exit), node 0, whose processors were done, waited 300 s for it. Returns whether
    this node checked in (False: not a static rendezvous across nodes, or its store is gone).

    Example:
        >>> check_in_at_exit_barrier(Nodes())  # one node: no other agent waits for it
        False
    """
    import torch.distributed as dist

    lo, hi = nodes.counts
    if not nodes.multi_node or lo != hi or nodes.rdzv_backend not in (None, "static") \
            or nodes.rdzv_endpoint is not None:
        return False
    # the keys of torch.distributed.elastic's exit barrier (store_util.barrier's member count and last-member
    # flag under the agent's _TERMINAL_STATE_SYNC_ID, in the rendezvous store under the run id): torch's
    # own (private) names where it has them, else their values in torch 2.13, whose barrier
    # tests/test_train_nodes.py releases this way
    try:
        from torch.distributed.elastic.agent.server.api import _TERMINAL_STATE_SYNC_ID as prefix
    except ImportError:
        prefix = "torchelastic/agent/terminal_state"
    try:
        from torch.distributed.elastic.utils.store import _LAST_MEMBER_CHECKIN as last
        from torch.distributed.elastic.utils.store import _NUM_MEMBERS as count
    except ImportError:
        count, last = "/num_members", "/last_member"
    try:
        client = dist.TCPStore(nodes.master_addr or TORCHRUN_MASTER_ADDR,
                               int(nodes.master_port or TORCHRUN_MASTER_PORT), is_master=False,
                               timeout=datetime.timedelta(seconds=timeout_s))
        store = dist.PrefixStore(nodes.rdzv_id or "none", client)  # torchrun's run id by default
        if store.add(prefix + count, 1) == hi:
            store.set(prefix + last, "<val_ignored>")
    except (RuntimeError, ValueError):  # node 0, host of the store, has gone: nobody waits any more
        return False
    return True


def run_elastic(worker: list[str], nproc: int, env: dict[str, str], nodes: Nodes = Nodes(),
                max_restarts: int = 0, say: str = "meshtorch launch") -> None:
    """Run the command ``worker`` (argv) ``nproc`` times on this node through torchrun's elastic agent,
    with ``env`` added to the environment the workers inherit (and their share of the cores as
    ``OMP_NUM_THREADS`` where unset: :func:`thread_environment`); the group is started again from scratch
    up to ``max_restarts`` times when a worker fails. Raises torchrun's ``ChildFailedError`` when the
    workers failed for the last time; stopped by SIGINT, SIGTERM or SIGHUP, this process dies of it
    once the agent has stopped the workers (as the one-node launch does).

    Example:
        >>> import sys
        >>> run_elastic([sys.executable, "-c", "pass"], 2, {}, max_restarts=1)  # doctest: +SKIP
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    check_max_restarts(max_restarts)
    network = network_environment(nodes, say)
    store, nodes = _bind_rendezvous_store(nodes)
    argv = [*nodes.argv(), "--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts),
            "--no-python", *worker]
    try:
        with _environment({**thread_environment(nproc), **env, **network}):
            torchrun_main(argv)
    except ChildFailedError:
        check_in_at_exit_barrier(nodes)
        raise
    except SignalException as e:
        # torchrun's agent has stopped the workers; die of the signal, as the one-node launch does
        print(f"{say}: stopped by {signal.Signals(e.sigval).name}; the workers were stopped",
              file=sys.stderr, flush=True)
        signal.signal(e.sigval, signal.SIG_DFL)
        signal.raise_signal(e.sigval)
        raise
    finally:
        del store


def failure_text(e: Any) -> str:
    """One line for torchrun's ``ChildFailedError``: the first worker that failed and how (its
    exception's message where it recorded one, else its exit or signal)."""
    rank, failure = e.get_first_failure()
    how = failure.message if os.path.isfile(failure.error_file) else None
    if isinstance(how, dict):  # an error file's record: {"message": "Type: text", "extraInfo": ...}
        how = how.get("message")
    if not isinstance(how, str) or not how:
        return f"processor {rank} " + (f"was killed by {failure.signal_name()}" if failure.exitcode < 0
                                       else f"exited with code {failure.exitcode}")
    return f"processor {rank} raised {how}"
