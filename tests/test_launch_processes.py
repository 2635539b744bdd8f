"""Spawned processors on one node: a rendezvous that listens on no network interface, a processor
that leaves (exits, is killed, returns early) reported at once and by name, and launch flags
checked before anything starts.
"""

from __future__ import annotations

import ipaddress
import json
import math
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import meshtorch as mt
from meshtorch.cli import main as cli_main
from meshtorch.comm.base import check_timeout
from meshtorch.errors import ArgumentError, CommError, ProcessorError

# no test below may wait for the 300 s default collective timeout: a slow report fails here
pytestmark = pytest.mark.timeout(120)
SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")


def _address(hex_addr: str) -> str:
    """An address of /proc/net/tcp{,6} (32-bit words in host order, little-endian here) as text."""
    raw = bytes.fromhex(hex_addr)
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, raw)


def listening_addresses(launcher: int | None = None) -> list[str]:
    """The addresses on which this processor, its parent and its ``launcher`` listen for TCP."""
    inodes = set()
    for pid in {os.getpid(), os.getppid(), launcher or os.getppid()}:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:  # closed meanwhile
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # state LISTEN, owned by us
                    found.append(_address(fields[1].split(":")[0]))
    mt.current().comm.all_reduce(torch.zeros(1), "m")  # everyone has joined and listens by now
    return found


def _is_loopback(addr: str) -> bool:
    ip = ipaddress.ip_address(addr)
    return ip.is_loopback or bool(getattr(ip, "ipv4_mapped", None) and ip.ipv4_mapped.is_loopback)


def _sockets_and_interfaces(launcher: int) -> tuple[list[str], str | None, str | None]:
    return (listening_addresses(launcher), os.environ.get("GLOO_SOCKET_IFNAME"),
            os.environ.get("NCCL_SOCKET_IFNAME"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_local_launch_listens_on_loopback_only():
    per_processor = mt.launch(_sockets_and_interfaces, os.getpid(), mesh="m:2", backend="torch")
    for addrs, gloo_if, nccl_if in per_processor:
        assert addrs, "gloo listens for its peers, so some socket must be found"
        assert all(_is_loopback(a) for a in addrs), f"listening on {addrs}: reachable from the network"
        # NCCL (on GPUs) is pinned to the same interface, which this CPU run cannot observe by sockets
        assert gloo_if == os.environ.get("GLOO_SOCKET_IFNAME", "lo")
        assert nccl_if == os.environ.get("NCCL_SOCKET_IFNAME", "lo")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_torchrun_rendezvous_listens_only_on_the_master_addr(tmp_path):
    # --master-addr takes the torchrun path; its static rendezvous store is this launcher's. Port 0: the
    # launcher's store picks a free one and holds it from its bind on (it hung: torchrun was given 0)
    script = tmp_path / "prog.py"
    script.write_text(textwrap.dedent(f"""
        import json, os, sys
        import meshtorch as mt
        sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
        from test_launch_processes import listening_addresses
        with open(sys.argv[1] + f"/r{{mt.current().rank}}.json", "w") as f:
            json.dump([listening_addresses(), os.environ["MASTER_PORT"]], f)
    """))
    p = subprocess.run([sys.executable, "-m", "meshtorch", "launch", "--backend", "torch", "--mesh", "m:2",
                        "--master-addr", "127.0.0.1", "--master-port", "0", str(script), str(tmp_path)],
                       capture_output=True, text=True, timeout=100, env={**os.environ, "PYTHONPATH": SRC})
    assert p.returncode == 0, p.stderr[-3000:]
    ports = set()
    for r in range(2):
        addrs, port = json.loads((tmp_path / f"r{r}.json").read_text())
        assert addrs and all(_is_loopback(a) for a in addrs), f"listening on {addrs}"
        ports.add(port)
    assert len(ports) == 1 and int(ports.pop()) > 0


def test_master_port_0_is_refused_where_other_nodes_would_need_the_port(tmp_path, capsys):
    script = tmp_path / "never.py"
    script.write_text("raise SystemExit('must not run')\n")
    assert cli_main(["launch", "--backend", "torch", "--mesh", "m:2", "--nnodes", "2", "-n", "1",
                     "--master-addr", "127.0.0.1", "--master-port", "0", str(script)]) == 2
    assert "--master-port 0 lets this node pick a free port, which the other nodes of --nnodes 2 cannot " \
           "learn" in capsys.readouterr().err


def _what_a_processor_inherited(tag: str) -> tuple[int, str | None]:
    rank = mt.current().rank
    # one write per line: print() writes the text and its newline separately when Python runs
    # unbuffered (PYTHONUNBUFFERED, as CI sets it), so two processors' lines could interleave
    for stream, kind in ((sys.stdout, "out"), (sys.stderr, "err")):
        stream.write(f"{tag} {kind} {rank}\n")
        stream.flush()
    return os.getppid(), os.environ.get("MESHTORCH_TEST_MARK")


@pytest.mark.skipif("forkserver" not in multiprocessing.get_all_start_methods(), reason="spawns instead")
def test_processors_fork_from_one_server_with_the_launchs_environment_and_streams(tmp_path, monkeypatch):
    """Every launch forks its processors from the same fork server (torch imported once), yet a
    processor sees the environment and writes to the standard output and error that the launcher
    has at the launch, not those of the launch that started the server."""
    monkeypatch.delenv("MESHTORCH_TEST_MARK", raising=False)
    first = mt.launch(_what_a_processor_inherited, "first", mesh="m:2", backend="torch")
    monkeypatch.setenv("MESHTORCH_TEST_MARK", "set after the server started")
    out, err = tmp_path / "out", tmp_path / "err"
    saved = os.dup(1), os.dup(2)
    try:
        with open(out, "w") as o, open(err, "w") as e:
            os.dup2(o.fileno(), 1)
            os.dup2(e.fileno(), 2)
            second = mt.launch(_what_a_processor_inherited, "second", mesh="m:2", backend="torch")
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])
    server = first[0][0]
    assert server != os.getpid() and [p for p, _ in first + second] == [server] * 4
    assert [m for _, m in first] == [None, None]
    assert [m for _, m in second] == ["set after the server started"] * 2
    assert sorted(out.read_text().split("\n")) == ["", "second out 0", "second out 1"]
    assert sorted(line for line in err.read_text().split("\n") if line.startswith("second")) == \
        ["second err 0", "second err 1"]


def _intra_op_threads() -> int:
    return torch.get_num_threads()


@pytest.mark.parametrize("backend", ["torch", "threads"])
@pytest.mark.parametrize("chosen", [True, False])
def test_processors_keep_the_users_omp_num_threads_else_get_their_share(monkeypatch, chosen, backend):
    """A user's OMP_NUM_THREADS is a process's intra-op threads: each process's (for processes: set
    after the fork server started, the processors see it), as torchrun's workers keep it, and
    split among the processors that share one process (threads); unset, each gets its share of the
    cores. The threads launcher lowered a user's value to the share of the cores."""
    from meshtorch.launcher.world import threads_per_processor

    share = threads_per_processor(2)
    if chosen:  # not the share, whatever the cores
        monkeypatch.setenv("OMP_NUM_THREADS", str(2 * (share + 2)))
        want = 2 * (share + 2) if backend == "torch" else share + 2
    else:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        want = share
    before = torch.get_num_threads()
    assert mt.launch(_intra_op_threads, mesh="m:2", backend=backend) == [want] * 2
    assert torch.get_num_threads() == before  # the threads launcher's setting ends with the launch


# OMP_NUM_THREADS -> the threads a processor runs (None: its share of the cores): a value that is no
# positive number of threads is none chosen, for every launcher alike
OMP_VALUES = {None: None, "3": 3, "4,2": 4, "abc": None, "0": None, "\u00b2": None, "": None, "-1": None}


@pytest.mark.parametrize("value", list(OMP_VALUES))
def test_every_launcher_reads_omp_num_threads_the_same_way(monkeypatch, value):
    from meshtorch.launcher.elastic import thread_environment
    from meshtorch.launcher.world import threads_chosen, threads_for, threads_per_processor

    if value is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", value)
    want = OMP_VALUES[value] or threads_per_processor(2)
    assert threads_chosen() == OMP_VALUES[value] and threads_for(2) == want
    # torchrun's workers: a chosen value passes as it is, anything else is replaced by the share
    assert thread_environment(2) == ({} if OMP_VALUES[value] else {"OMP_NUM_THREADS": str(want)})
    # two processors sharing one process split its threads (the chosen ones, else the cores)
    sharing = max(1, (OMP_VALUES[value] or threads_per_processor(1)) // 2)
    assert mt.launch(_intra_op_threads, mesh="m:2", backend="threads") == [sharing] * 2


_FORK_SERVERS_IMPORTS = r"""
import multiprocessing, os, sys, threading
import torch

calls = []


def spy(owner, name):
    real = getattr(owner, name, None)
    if real is not None:
        def call(*args, **kwargs):
            calls.append(name)
            return real(*args, **kwargs)
        setattr(owner, name, call)


spy(torch.cuda, "_lazy_init")
spy(torch._C, "_cuda_init")
spy(torch._C, "_cuda_getDeviceCount")
import meshtorch.launcher.preload  # noqa: E402
import torch._dynamo  # noqa: E402,F401 - (preload imports it: said here, should it ever stop)
print(threading.active_count(), torch.cuda.is_initialized(), "calls", calls, flush=True)
if sys.argv[1] == "cuda":
    def child():
        os._exit(0 if torch.ones(3, device="cuda").sum().item() == 3.0 else 1)
    p = multiprocessing.get_context("fork").Process(target=child)
    p.start()
    p.join()
    print("child", p.exitcode, flush=True)
"""


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
def test_the_fork_servers_imports_start_no_thread_and_leave_cuda_alone(device):
    """What the fork server imports before forking processors (a forked process keeps only the
    forking thread, so a Python thread started there would be lost with any lock it held; CUDA
    initialised there would be unusable in the processors), Dynamo among them: none of torch's CUDA
    initialisers or device queries is called (spied in a fresh interpreter; a CPU build answers
    some queries without them, a CUDA build, with a GPU or not, calls each), and on a GPU a process
    forked after the imports computes on CUDA (run by gpu_check.sh's tests; passed on an H200 with
    torch 2.11, which is why the server preloads Dynamo on CUDA builds too)."""
    out = subprocess.run([sys.executable, "-c", _FORK_SERVERS_IMPORTS, device], capture_output=True,
                         text=True, timeout=100, env={**os.environ, "PYTHONPATH": SRC})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[:4] == ["1", "False", "calls", "[]"], out.stdout
    if device == "cuda":
        assert "child 0" in out.stdout, out.stdout + out.stderr[-2000:]


def _modules_a_first_optimizer_imports() -> list[str]:
    before = set(sys.modules)
    torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))])
    return sorted(set(sys.modules) - before)


def test_a_processor_makes_its_first_optimizer_without_importing_dynamo():
    """torch's optimizers import Dynamo at their first add_param_group (about a second of CPU in each
    processor that trains): the fork server has imported it for them."""
    assert mt.launch(_modules_a_first_optimizer_imports, mesh="b:2", backend="torch") == [[], []]


def sends_then_returns_before_it_is_received(n: int):
    comm = mt.current().comm
    if comm.rank == 0:
        comm.send(torch.arange(float(n)), "s", dst=1)
        return None  # never waits for the send: leaving the world must
    time.sleep(1.0)  # processor 0 has returned and is leaving the world by now
    return comm.recv("s", src=0).sum().item()


def test_recv_on_gloo_still_gets_what_a_processor_sent_before_it_returned():
    """Leaving the world waits for the sends still in flight; before, the peer's recv failed with
    "Connection closed by peer" (and gloo could abort the sender at exit)."""
    assert mt.launch(sends_then_returns_before_it_is_received, 1000, mesh="s:2", backend="torch",
                     timeout=60) == [None, 1000 * 999 / 2]


def drops_communicators() -> tuple[bool, bool, bool]:
    """Whether a dropped torch communicator (a second one over this world) is still alive: after the
    send it waited for, with a send it never waited for, and then after ``wait_all_sends``."""
    import gc
    import weakref

    from meshtorch.comm.torch import TorchCommunicator, wait_all_sends

    def dropped(wait: bool) -> weakref.ref:
        comm = TorchCommunicator("s:2")
        if comm.rank == 0:
            comm.send(torch.arange(4.0), "s", dst=1)
            if wait:
                comm.wait_sends()
        else:
            assert comm.recv("s", src=0).tolist() == [0.0, 1.0, 2.0, 3.0]
        return weakref.ref(comm)

    waited = dropped(wait=True)
    gc.collect()
    unwaited = dropped(wait=False)
    gc.collect()
    alive = (waited() is not None, unwaited() is not None)
    wait_all_sends()
    gc.collect()
    return (*alive, unwaited() is not None)


def test_a_dropped_communicator_is_collected_once_its_sends_are_delivered():
    """comm/torch.py's registries: every communicator is held weakly (for leave_groups), and one
    with a send in flight strongly until it is waited for (destroying its gloo groups under the
    send would abort the process). Processor 0 sends; processor 1's communicators never do."""
    assert mt.launch(drops_communicators, mesh="s:2", backend="torch", timeout=60) == [
        (False, True, False), (False, False, False)]


def leaves_the_world_after_collectives():
    """What of this processor's gloo groups outlives leaving the world; then a collective."""
    import gc
    import weakref

    from meshtorch.launcher.world import shutdown

    comm = mt.current().comm
    groups = [weakref.ref(comm.process_group(axes)) for axes in ("b", "m", ("b", "m"))]
    comm.all_gather(torch.ones(4), ("b", "m"), dim=0)
    shutdown()
    gc.collect()
    alive = sum(g() is not None for g in groups)
    try:
        comm.all_reduce(torch.ones(1), "b")
    except CommError as e:
        return alive, str(e)
    return alive, "no error"


def test_leaving_the_world_destroys_every_process_group_of_the_communicator():
    """Groups that lived on into the interpreter's exit aborted it now and then ("terminate called
    without an active exception"): a gloo worker thread freed a finished collective's tensors there."""
    for alive, err in mt.launch(leaves_the_world_after_collectives, mesh="b:2,m:2", backend="torch",
                                timeout=60):
        assert alive == 0
        assert "after this process left the torch.distributed world" in err


def exits_in_collective(how: str):
    """Processor 1 leaves while processor 0 waits for it in an all_reduce."""
    comm = mt.current().comm
    if comm.rank == 1:
        if how == "exit":
            os._exit(3)
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        return "returned early"
    return comm.all_reduce(torch.ones(1), "m").item()


@pytest.mark.parametrize("how, text", [("exit", "exited with code 3"), ("kill", "was killed by SIGKILL")])
def test_a_processor_that_exits_is_reported_at_once_with_its_exit(how, text):
    with pytest.raises(ProcessorError) as info:
        mt.launch(exits_in_collective, how, mesh="m:2", backend="torch", timeout=300)
    assert info.value.rank == 1 and info.value.coords == {"m": 1}
    assert str(info.value).startswith("processor 1 {'m': 1} raised ProcessExit: " + text)


def test_a_processor_that_returns_early_is_named_by_the_one_left_waiting():
    with pytest.raises(CommError) as info:
        mt.launch(exits_in_collective, "return", mesh="m:2", backend="torch", timeout=300)
    assert info.value.rank == 0
    assert "processors that had already returned from the program, leaving the others waiting: " \
           "1 {'m': 1}" in str(info.value)


def test_meshtorch_launch_reports_the_exit_of_a_processor(tmp_path):
    script = tmp_path / "prog.py"
    script.write_text(textwrap.dedent("""
        import os, torch, meshtorch as mt
        comm = mt.current().comm
        if comm.rank == 1:
            os._exit(3)
        comm.all_reduce(torch.ones(1), "m")
    """))
    p = subprocess.run([sys.executable, "-m", "meshtorch", "launch", "--backend", "torch", "--mesh", "m:2",
                        str(script)], capture_output=True, text=True, timeout=100,
                       env={**os.environ, "PYTHONPATH": SRC})
    assert p.returncode == 2
    assert "error: processor 1 {'m': 1} raised ProcessExit: exited with code 3" in p.stderr


def test_a_script_without_a_main_guard_is_told_to_add_one(tmp_path):
    script = tmp_path / "prog.py"
    script.write_text("import meshtorch as mt\nprint(mt.launch(abs, -3, mesh='m:2', backend='torch'))\n")
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=100,
                       env={**os.environ, "PYTHONPATH": SRC})
    assert p.returncode != 0
    assert 'call it under `if __name__ == "__main__":`' in p.stderr
    assert "AssertionError" not in p.stderr  # the failed start is reported, not masked


@pytest.mark.parametrize("flags, message", [
    (["--nnodes", "0"], "--nnodes '0': the number of nodes must be at least 1"),
    (["--nnodes=-2"], "--nnodes '-2' is not N or MIN:MAX"),
    (["--nnodes", "3:2"], "--nnodes '3:2': the number of nodes must be at least 1 (and MIN <= MAX"),
    (["--nnodes", "two"], "--nnodes 'two' is not N or MIN:MAX"),
    (["--timeout", "0"], "--timeout=0.0 must be a positive, finite number of seconds"),
    (["--timeout=-5"], "--timeout=-5.0 must be a positive, finite number of seconds"),
    (["--timeout", "nan"], "--timeout=nan must be a positive, finite number of seconds"),
    (["-n", "0"], "-n/--nproc-per-node 0: a node runs at least 1 processor"),
])
@pytest.mark.parametrize("backend", ["threads", "torch"])
def test_meshtorch_launch_rejects_bad_flags_before_starting(tmp_path, capsys, flags, message, backend):
    script = tmp_path / "never.py"
    script.write_text("raise SystemExit('must not run')\n")
    assert cli_main(["launch", "--backend", backend, "--mesh", "m:2", *flags, str(script)]) == 2
    assert f"meshtorch launch: error: {message}" in capsys.readouterr().err


@pytest.mark.parametrize("timeout", [0, -1.0, math.nan, math.inf, "soon"])
def test_torch_launch_rejects_bad_timeouts_before_spawning(timeout):
    with pytest.raises(ArgumentError, match="timeout=.* must be a positive, finite number of seconds"):
        mt.launch(abs, -3, mesh="m:2", backend="torch", timeout=timeout)


def test_init_distributed_names_a_bad_timeout_from_the_environment(monkeypatch):
    monkeypatch.setenv("MESHTORCH_TIMEOUT", "-1")
    with pytest.raises(ArgumentError, match="MESHTORCH_TIMEOUT='-1'"):
        mt.init_distributed("m:1")


@settings(max_examples=50, deadline=None)
@given(st.floats(allow_nan=True, allow_infinity=True))
def test_check_timeout_accepts_exactly_the_finite_positive_seconds(value):
    if 0 < value < math.inf:
        assert check_timeout(value) == value
    else:
        with pytest.raises(ArgumentError):
            check_timeout(value)


def test_node_rank_0_must_be_able_to_listen_on_the_master_addr(tmp_path, capsys):
    script = tmp_path / "never.py"
    script.write_text("raise SystemExit('must not run')\n")
    # 192.0.2.1 is reserved for documentation: no machine has it, so nobody can listen there
    assert cli_main(["launch", "--backend", "torch", "--mesh", "m:2", "--nnodes", "2", "-n", "1",
                     "--master-addr", "192.0.2.1", "--master-port", "29500", str(script)]) == 2
    assert "cannot listen on --master-addr '192.0.2.1' --master-port 29500" in capsys.readouterr().err
