"""``meshtorch train --backend torch --nnodes 2`` across two "hosts" (network namespaces joined by a veth
pair, the fixture of test_network_interface.py: needs root and ``ip netns``, skipped elsewhere): the run
trains to the losses and the weights of a one-node run of the same mesh; nodes given different options,
or an ``--out`` that is not one directory for every node, are refused naming the flag. The checks that
need no second host run everywhere."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest

import meshtorch as mt
from meshtorch.cli import main as cli_main
from meshtorch.errors import ArgumentError, MeshError
from meshtorch.launcher.elastic import GLOO_IFNAME, NCCL_IFNAME, Nodes, check_in_at_exit_barrier
from meshtorch.recipes.lm.config import TrainConfig, check_nodes

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from net_harness import run_nodes, two_namespaces  # noqa: E402
from run_harness import assert_same_bits, checkpoint_tensors, tiny_train, write_corpus  # noqa: E402

pytestmark = pytest.mark.timeout(240)
SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
TINY = tiny_train(batch=8, sample_tokens=0, warmup=2, mesh="b:2", rules="batch:b", lr=0.01, tokenizer="bytes",
                  steps=4, log_every=1, checkpoint_every=2, no_memory_check=True)
NODES = ["--backend", "torch", "--device", "cpu", "--nnodes", "2", "--master-addr", "10.77.0.1"]


@pytest.fixture
def two_hosts():
    """Two network namespaces joined by a veth pair, 10.77.0.1 and 10.77.0.2 (:mod:`net_harness`)."""
    with two_namespaces() as hosts:
        yield hosts


def _nodes(hosts, per_node, port):
    """``meshtorch train`` on each host, with argv ``per_node[r]`` on node ``r``: (exit codes, stdouts,
    stderrs)."""
    cmds = [["ip", "netns", "exec", ns, sys.executable, "-m", "meshtorch", "train", *NODES, "--node-rank",
             str(rank), "--master-port", str(port), *per_node[rank]] for rank, ns in enumerate(hosts)]
    done = run_nodes(cmds, _env())
    return [n.code for n in done], [n.out for n in done], [n.err for n in done]


def _env():
    env = {k: v for k, v in os.environ.items() if k not in (GLOO_IFNAME, NCCL_IFNAME)}
    env.update(PYTHONPATH=SRC, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    return env


def _metrics(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_a_two_node_train_across_two_hosts_trains_as_a_one_node_run_of_the_same_mesh(two_hosts, tmp_path,
                                                                                      monkeypatch):
    (tmp_path / "data").mkdir()
    data = write_corpus(tmp_path / "data", 3)
    out = str(tmp_path / "two-nodes")
    args = [*TINY, "--rules", "batch:b; d_ff:b", "--data", data, "--out", out]
    codes, outs, errs = _nodes(two_hosts, [args, args], 29621)
    assert codes == [0, 0], "\n".join(e[-3000:] for e in errs)
    # each node's processor joined over its end of the veth pair; node 1 leaves the run's files to node 0
    for rank, ns in enumerate(two_hosts):
        assert f"{GLOO_IFNAME}=v{ns} (the interface that routes to 10.77.0.1" in errs[rank]
    assert "node 1: its processors are done" in outs[1] and "run directory:" in outs[0]
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert (summary["steps"], summary["mesh"]) == (4, "b:2")
    # the reference: the same mesh on one node (threads; on a 2-processor mesh the only cross-processor
    # arithmetic is sums of two addends, exact in either order, so the runs agree bitwise), each processor
    # on one CPU thread as each node's is (OMP_NUM_THREADS=1, which the threads backend keeps as the
    # others do; else each processor gets cores / processors; kernels split over more threads may round
    # otherwise)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    ref = str(tmp_path / "one-node")
    assert cli_main(["train", *TINY, "--rules", "batch:b; d_ff:b", "--data", data, "--out", ref]) == 0
    losses = [r["loss"] for r in _metrics(out) if "loss" in r]
    assert losses == [r["loss"] for r in _metrics(ref) if "loss" in r] and len(losses) == 4
    assert_same_bits(checkpoint_tensors(out), checkpoint_tensors(ref))
    # each processor wrote its slices into the one --out (d_ff:b splits the feed-forward weights: processor
    # 1 on node 1 holds, and writes, half of them)
    assert sorted(f for f in os.listdir(mt.checkpoint.latest(os.path.join(out, "checkpoint")))
                  if f.endswith(".safetensors")) == ["slices-00000.safetensors", "slices-00001.safetensors"]

# a sitecustomize that makes each torchrun worker of a node die of SIGABRT as its interpreter exits, after all
# its work: what gloo's "terminate called without an active exception" at exit did to a worker
ABORT_AT_EXIT = """
import atexit, os
if "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ:
    atexit.register(os.abort)
"""


def test_a_node_whose_worker_dies_at_exit_does_not_keep_the_other_node_waiting(two_hosts, tmp_path):
    """Node 1's worker dies at exit, once the run is done: node 1 fails naming it, and node 0, whose
    processors finished the run, exits at once instead of waiting 300 s in torchrun's exit barrier for node
    1's agent (which never checked in): the 180 s hang of this file's first test in one suite run."""
    (tmp_path / "data").mkdir()
    site = tmp_path / "abort-at-exit"
    site.mkdir()
    (site / "sitecustomize.py").write_text(ABORT_AT_EXIT)
    data = write_corpus(tmp_path / "data", 3)
    out = str(tmp_path / "run")
    args = [*TINY, "--steps", "2", "--checkpoint-every", "0", "--data", data, "--out", out]
    cmds = [["ip", "netns", "exec", ns, *([] if rank == 0 else ["env", f"PYTHONPATH={site}:{SRC}"]),
             sys.executable, "-m", "meshtorch", "train", *NODES, "--node-rank", str(rank), "--master-port",
             "29627", *args] for rank, ns in enumerate(two_hosts)]
    node0, node1 = run_nodes(cmds, _env(), timeout=150)
    assert node1.code == 2, node1.err[-3000:]
    assert "the run failed: processor 1 was killed by SIGABRT" in node1.err, node1.err[-3000:]
    assert node0.code == 0, node0.err[-3000:]
    assert "run directory:" in node0.out and "exit barrier" not in node0.err, node0.err[-3000:]
    assert json.load(open(os.path.join(out, "summary.json")))["steps"] == 2


def test_a_node_that_checks_in_releases_the_agent_waiting_in_torchruns_exit_barrier():
    """torch's own exit barrier, as node 0's agent waits in it once its workers are done (store_util.barrier
    on the rendezvous store under the run id, SimpleElasticAgent._exit_barrier's keys): released when node
    1, whose workers failed, checks in; and nothing to do for a run of one node."""
    import torch.distributed as dist
    from torch.distributed.elastic.agent.server.api import _TERMINAL_STATE_SYNC_ID
    from torch.distributed.elastic.utils import store as store_util

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    waited = []

    def node0_agent():
        store = dist.PrefixStore("none", dist.TCPStore("127.0.0.1", server.port, is_master=False))
        try:
            store_util.barrier(store, world_size=2, key_prefix=_TERMINAL_STATE_SYNC_ID, barrier_timeout=60)
            waited.append("released")
        except Exception as e:  # noqa: BLE001 - the test's answer
            waited.append(e)

    agent = threading.Thread(target=node0_agent)
    agent.start()
    node1 = Nodes(nnodes="2", node_rank=1, master_addr="127.0.0.1", master_port=str(server.port))
    assert check_in_at_exit_barrier(node1)
    agent.join(90)
    assert waited == ["released"]
    assert not check_in_at_exit_barrier(Nodes())


def test_nodes_given_different_options_are_refused_naming_the_flag(two_hosts, tmp_path):
    (tmp_path / "data").mkdir()
    data = write_corpus(tmp_path / "data", 1)
    out = str(tmp_path / "run")
    args = [*TINY, "--data", data, "--out", out]
    codes, _, errs = _nodes(two_hosts, [args, [*args, "--lr", "0.02"]], 29623)
    assert codes == [2, 2], "\n".join(e[-3000:] for e in errs)
    for err in errs:
        assert "the nodes of this run were given different options (--lr: 0.01 on node 0, 0.02 on node 1)" \
            in err, err[-3000:]
    assert not os.path.exists(os.path.join(out, "checkpoint"))


def test_an_out_that_is_not_one_directory_for_every_node_is_refused(two_hosts, tmp_path):
    """Node 1 sees another directory at --out's path (a tmpfs mounted over it in node 1's own mount
    namespace: what a local disk on a second host looks like)."""
    if subprocess.run(["which", "unshare"], capture_output=True).returncode:
        pytest.skip("needs unshare (util-linux)")
    (tmp_path / "data").mkdir()
    data = write_corpus(tmp_path / "data", 1)
    out = tmp_path / "run"
    out.mkdir()
    args = [*TINY, "--data", data, "--out", str(out)]
    cmds = []
    for rank, ns in enumerate(two_hosts):
        cmd = [sys.executable, "-m", "meshtorch", "train", *NODES, "--node-rank", str(rank), "--master-port",
               "29625", *args]
        if rank == 1:
            cmd = ["unshare", "-m", "sh", "-c", f'mount -t tmpfs none "{out}" && exec "$@"', "sh", *cmd]
        cmds.append(["ip", "netns", "exec", ns, *cmd])
    done = run_nodes(cmds, _env())
    errs = [n.err for n in done]
    if "mount" in errs[1] and done[1].code and "not one directory" not in errs[1]:
        pytest.skip(f"cannot mount a tmpfs in a mount namespace here: {errs[1][-300:]}")
    assert [n.code for n in done] == [2, 2], "\n".join(e[-3000:] for e in errs)
    for err in errs:
        assert f"--out {str(out)!r} is not one directory for the whole run: processor(s) 1 " in err, \
            err[-3000:]
    assert not os.path.exists(out / "checkpoint")


@pytest.mark.parametrize("options, error, words", [
    ({"nnodes": 2, "master_addr": "10.0.0.1", "out": "o"}, ArgumentError, "add --backend torch"),
    ({"backend": "torch", "nnodes": 2, "node_rank": 2, "master_addr": "10.0.0.1", "out": "o"}, ArgumentError,
     "--node-rank 2 is not a node of --nnodes 2: the nodes are numbered 0 to 1"),
    ({"backend": "torch", "mesh": "b:3", "nnodes": 2, "master_addr": "10.0.0.1", "out": "o"}, MeshError,
     "--mesh 'b:3' has 3 processors, which --nnodes 2 nodes cannot share equally"),
    ({"backend": "torch", "nnodes": 2, "out": "o"}, ArgumentError, "--nnodes 2 needs --master-addr"),
    ({"backend": "torch", "nnodes": 2, "master_addr": "10.0.0.1"}, ArgumentError, "--nnodes 2 needs --out"),
    ({"backend": "torch", "nnodes": 2, "master_addr": "10.0.0.1", "out": "o", "max_restarts": 1},
     ArgumentError, "--max-restarts 1 restarts the workers of one node"),
    ({"node_rank": 1}, ArgumentError, "--node-rank place this node in a run of several nodes: pass --nnodes"),
    ({"master_addr": "10.0.0.1"}, ArgumentError, "--master-addr place this node in a run of several nodes"),
])
def test_inconsistent_node_options_are_refused_naming_the_flag(options, error, words):
    with pytest.raises(error) as e:
        check_nodes(TrainConfig.of(**options))
    assert words in str(e.value)


@pytest.mark.parametrize("argv, words", [
    (["--nnodes", "0"], "--nnodes 0 is out of range: it must be >= 1"),
    (["--node-rank", "-1"], "--node-rank -1 is out of range: it must be >= 0"),
    (["--master-port", "70000"], "--master-port 70000 is out of range: it must be >= 1 and < 65536"),
])
def test_node_flags_out_of_range_are_refused_by_the_command_line(argv, words, capsys):
    assert cli_main(["train", *argv]) != 0
    assert words in capsys.readouterr().err


def test_a_one_node_train_is_unchanged_by_the_node_options_defaults():
    cfg = TrainConfig.of(backend="torch")
    check_nodes(cfg)
    par = cfg.parallelism
    assert (par.nnodes, par.node_rank, par.master_addr, par.master_port) == (1, 0, None, 29500)
