"""``GLOO_SOCKET_IFNAME`` picked for a multi-node launch: the interface that routes to the rendezvous host.

Without it gloo advertises the address the host name resolves to (often 127.0.0.1), and the other node's
connections are refused. The last test runs two "hosts" (network namespaces joined by a veth pair, which
needs root and ``ip netns``; skipped where the box allows neither) and a two-node launch across them.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap

import pytest

from meshtorch.launcher import elastic
from meshtorch.launcher.elastic import (
    GLOO_IFNAME,
    Nodes,
    interface_addresses,
    interface_holding,
    network_environment,
    socket_interface,
)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from net_harness import run_nodes, two_namespaces  # noqa: E402

pytestmark = pytest.mark.timeout(150)
SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
LINUX = sys.platform.startswith("linux")


def test_the_interface_holding_an_address_is_found_by_value_for_ipv4_and_ipv6():
    table = {"lo": ["127.0.0.1", "::1"], "eth0": ["192.0.2.2", "fd00::2"], "veth1": ["10.1.0.2"], "ifb0": []}
    assert interface_holding("10.1.0.2", table) == "veth1"
    assert interface_holding("fd00:0::2", table) == "eth0"  # the same IPv6 address, spelt otherwise
    assert interface_holding("fe80::1%eth0", {"eth0": ["fe80::1"]}) == "eth0"  # a link-local's zone
    assert interface_holding("10.9.9.9", table) is None


@pytest.mark.skipif(not LINUX, reason="reads this machine's interfaces (Linux)")
def test_the_interface_that_routes_to_an_address_of_this_machine_is_the_one_that_holds_it():
    addrs = interface_addresses()
    assert "127.0.0.1" in addrs.get("lo", [])
    assert socket_interface("127.0.0.1") == "lo"
    for name, ips in addrs.items():
        for ip in ips:
            if "." in ip and not ip.startswith("127."):
                assert socket_interface(ip) == name  # node rank 0's own --master-addr
    assert socket_interface("host.invalid") is None  # does not resolve: nothing is picked


@pytest.mark.skipif(not LINUX, reason="reads this machine's interfaces (Linux)")
def test_a_multi_node_launch_sets_gloo_socket_ifname_only_where_it_is_unset(monkeypatch, capsys):
    monkeypatch.delenv(GLOO_IFNAME, raising=False)
    assert network_environment(Nodes(nnodes="2", master_addr="127.0.0.1")) == {GLOO_IFNAME: "lo"}
    assert "GLOO_SOCKET_IFNAME=lo (the interface that routes to 127.0.0.1" in capsys.readouterr().err
    # a c10d rendezvous endpoint is the host to route to
    assert network_environment(Nodes(nnodes="2", rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:29400")) == \
        {GLOO_IFNAME: "lo"}
    assert network_environment(Nodes(nnodes="2", master_addr="host.invalid")) == {}
    assert "could not tell which network interface routes to host.invalid" in capsys.readouterr().err
    monkeypatch.setenv(GLOO_IFNAME, "eth7")
    assert network_environment(Nodes(nnodes="2", master_addr="127.0.0.1")) == {}  # the user's choice wins
    # one node: the loopback, for gloo and NCCL alike, unless set
    monkeypatch.delenv(GLOO_IFNAME)
    monkeypatch.delenv(elastic.NCCL_IFNAME, raising=False)
    assert network_environment(Nodes()) == {GLOO_IFNAME: "lo", elastic.NCCL_IFNAME: "lo"}


def test_the_rendezvous_host_is_read_from_the_endpoint_or_the_master_address():
    assert Nodes(rdzv_endpoint="10.0.0.1:29400").rendezvous_host() == "10.0.0.1"
    assert Nodes(rdzv_endpoint="[fd00::1]:29400").rendezvous_host() == "fd00::1"
    assert Nodes(rdzv_endpoint="node0").rendezvous_host() == "node0"
    assert Nodes(master_addr="10.0.0.7").rendezvous_host() == "10.0.0.7"
    assert Nodes().rendezvous_host() == "127.0.0.1"  # torchrun's default


@pytest.fixture
def two_hosts():
    """Two network namespaces joined by a veth pair, 10.77.0.1 and 10.77.0.2 (:mod:`net_harness`)."""
    with two_namespaces() as hosts:
        yield hosts


SCRIPT = textwrap.dedent("""
    import json, os, sys, torch
    import meshtorch as mt
    ctx = mt.current()
    total = ctx.comm.all_reduce(torch.tensor([1.0 + ctx.rank]), ("m",), "sum").item()
    with open(os.path.join(sys.argv[1], f"n{ctx.rank}.json"), "w") as f:
        json.dump({"total": total, "ifname": os.environ.get("GLOO_SOCKET_IFNAME")}, f)
""")


def test_a_two_node_launch_across_two_hosts_picks_the_interface_that_reaches_the_master(two_hosts, tmp_path):
    script = tmp_path / "prog.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in (GLOO_IFNAME, elastic.NCCL_IFNAME)}
    env.update(PYTHONPATH=SRC, PYTHONUNBUFFERED="1")
    cmds = [["ip", "netns", "exec", ns, sys.executable, "-m", "meshtorch", "launch", "--backend", "torch",
             "--nnodes", "2", "--node-rank", str(rank), "-n", "1", "--master-addr", "10.77.0.1",
             "--master-port", "29611", "--mesh", "m:2", str(script), str(tmp_path)]
            for rank, ns in enumerate(two_hosts)]
    done = run_nodes(cmds, env, timeout=100)
    errs = [n.err for n in done]
    assert [n.code for n in done] == [0, 0], "\n".join(e[-2000:] for e in errs)
    for rank, ns in enumerate(two_hosts):
        rec = json.loads((tmp_path / f"n{rank}.json").read_text())
        assert rec == {"total": 3.0, "ifname": f"v{ns}"}  # each node's end of the veth pair
        assert f"GLOO_SOCKET_IFNAME=v{ns} (the interface that routes to 10.77.0.1" in errs[rank]
