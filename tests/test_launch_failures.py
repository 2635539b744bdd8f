"""A processor's exception reaches the launching caller as its own class *and* a ProcessorError,
on every backend; mt.replicator.launch_replicas inside a running program; the `meshtorch launch` defaults.
"""

from __future__ import annotations

import inspect
import pickle
import textwrap

import pytest
import torch

import meshtorch as mt
from meshtorch import errors
from meshtorch.cli import build_parser
from meshtorch.cli import main as cli_main
from meshtorch.errors import MeshError, MeshTorchError, ProcessorError, ShapeError

pytestmark = pytest.mark.timeout(240)

MESHTORCH_ERRORS = [c for _, c in inspect.getmembers(errors, inspect.isclass)
                    if issubclass(c, MeshTorchError) and c not in (MeshTorchError, ProcessorError)]


def shape_error_on_one() -> int:
    """Processor 1 raises a ShapeError, the others return (module level: the torch backend pickles it)."""
    if mt.current().rank == 1:
        raise ShapeError("tensor x has dim d:3 but the weight wants d:4; reshape x")
    return mt.current().rank


def key_error_on_one() -> int:
    if mt.current().rank == 1:
        raise KeyError("missing_weight")
    return 0


def replica_ids() -> list[int]:
    return mt.replicator.launch_replicas(lambda: mt.Replicator(device="cpu").replica_id)


def _raiser(exc: BaseException, rank: int = 1):
    def prog():
        if mt.current().rank == rank:
            raise exc
        return mt.current().rank
    return prog


def test_threads_shape_error_is_both_classes_with_coords_and_traceback():
    with pytest.raises(ShapeError) as info:
        mt.launch(shape_error_on_one, mesh="b:1,m:2")
    err = info.value
    assert isinstance(err, ProcessorError) and isinstance(err, MeshTorchError)
    assert err.rank == 1 and err.coords == {"b": 0, "m": 1}
    assert str(err) == ("processor 1 {'b': 0, 'm': 1} raised ShapeError: "
                        "tensor x has dim d:3 but the weight wants d:4; reshape x")
    cause = err.__cause__
    assert type(cause) is ShapeError and cause.args == err.args
    # the processor's own traceback: the frame that raised is in it
    frames = []
    tb = cause.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    assert frames[-1] == "shape_error_on_one"


@pytest.mark.parametrize("cls", MESHTORCH_ERRORS, ids=lambda c: c.__name__)
def test_threads_every_meshtorch_error_keeps_its_class(cls):
    message = rf"processor 2 \{{'b': 1, 'm': 0\}} raised {cls.__name__}: on purpose"
    with pytest.raises(cls, match=message) as info:
        mt.launch(_raiser(cls("on purpose"), rank=2), mesh="b:2,m:2")
    assert isinstance(info.value, ProcessorError)
    assert (info.value.rank, info.value.coords) == (2, {"b": 1, "m": 0})
    assert type(info.value.__cause__) is cls


def test_threads_plain_python_exceptions_keep_class_args_and_fields():
    with pytest.raises(KeyError) as info:
        mt.launch(_raiser(KeyError("w_in")), mesh="m:2")
    assert isinstance(info.value, ProcessorError) and info.value.args == ("w_in",)
    assert str(info.value) == "processor 1 {'m': 1} raised KeyError: 'w_in'"
    with pytest.raises(FileNotFoundError) as info:
        mt.launch(_raiser(FileNotFoundError(2, "No such file", "ckpt.safetensors")), mesh="m:2")
    assert info.value.errno == 2 and info.value.filename == "ckpt.safetensors"
    assert info.value.coords == {"m": 1}

    class Custom(Exception):
        def __init__(self, step: int):
            super().__init__(f"diverged at step {step}")
            self.step = step

    with pytest.raises(Custom) as info:
        mt.launch(_raiser(Custom(7)), mesh="m:2")
    assert info.value.step == 7 and isinstance(info.value, ProcessorError)
    assert str(info.value) == "processor 1 {'m': 1} raised Custom: diverged at step 7"


def test_non_exception_failures_are_plain_processor_errors():
    with pytest.raises(ProcessorError) as info:
        mt.launch(_raiser(SystemExit(3)), mesh="m:2")
    assert type(info.value) is ProcessorError and info.value.coords == {"m": 1}
    assert isinstance(info.value.__cause__, SystemExit)


def test_meta_backend_error_is_both_classes():
    def prog():
        raise ShapeError("no fit")

    with pytest.raises(ShapeError, match=r"processor 0 \{'b': 0\} \(meta backend\) raised ShapeError: no fit"
                       ) as info:
        mt.launch(prog, mesh="b:64", backend="meta")
    assert isinstance(info.value, ProcessorError) and info.value.rank == 0


def test_combined_error_pickles_and_nests():
    with pytest.raises(ShapeError) as info:
        mt.launch(shape_error_on_one, mesh="m:2")
    back = pickle.loads(pickle.dumps(info.value))
    assert type(back) is type(info.value) and isinstance(back, ShapeError)
    assert (back.rank, back.coords, str(back), back.args) == (
        1, {"m": 1}, str(info.value), info.value.args)

    def outer():
        return mt.launch(shape_error_on_one, mesh="m:2")

    with pytest.raises(ShapeError) as info:  # a launch inside a launch: the outer processor is named
        mt.launch(outer, mesh="b:1")
    assert info.value.coords == {"b": 0}
    assert str(info.value).startswith("processor 0 {'b': 0} raised ShapeError: processor 1 {'m': 1} raised")


@pytest.mark.parametrize("fn, cls, message", [
    (shape_error_on_one, ShapeError,
     "processor 1 {'m': 1} raised ShapeError: tensor x has dim d:3 but the weight wants d:4; reshape x"),
    (key_error_on_one, KeyError, "processor 1 {'m': 1} raised KeyError: 'missing_weight'"),
])
def test_torch_backend_error_is_both_classes_with_remote_traceback(fn, cls, message):
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    with pytest.raises(cls) as info:
        mt.launch(fn, mesh="m:2", backend="torch")
    err = info.value
    assert isinstance(err, ProcessorError) and (err.rank, err.coords) == (1, {"m": 1})
    assert str(err) == message
    assert type(err.__cause__) is cls
    remote = str(err.__cause__.__cause__)
    assert f"in {fn.__name__}" in remote and "test_launch_failures.py" in remote


def test_replicator_launch_inside_running_mesh_runs_each_processor_as_a_replica():
    # each processor is one replica, and each gets every replica's result, as from a fresh launch
    assert mt.launch(replica_ids, mesh="replica:2") == [[0, 1], [0, 1]]
    assert mt.launch(replica_ids, mesh="b:2,m:2") == [[0, 1, 2, 3]] * 4

    def twice():  # back-to-back gathers do not mix
        return [mt.replicator.launch_replicas(lambda k=k: (k, mt.current().rank)) for k in range(3)]

    assert mt.launch(twice, mesh="replica:3") == [[[(k, r) for r in range(3)] for k in range(3)]] * 3
    assert mt.launch(replica_ids, mesh="replica:2", backend="meta") == [[0]]


def test_replicator_launch_inside_running_mesh_rejects_another_replica_count():
    def prog():
        return mt.replicator.launch_replicas(lambda: 0, num_replicas=3)

    with pytest.raises(MeshError, match=r"num_replicas=3\) was called where 2 processors \(mesh "
                       r"'replica:2'\) already run the program, each as one replica; leave num_replicas out"
                       ) as info:
        mt.launch(prog, mesh="replica:2")
    assert isinstance(info.value, ProcessorError)
    same = mt.launch(lambda: mt.replicator.launch_replicas(lambda: 5, num_replicas=2), mesh="replica:2")
    assert same == [[5, 5]] * 2


def test_replicator_launch_inside_torch_backend_gathers_every_replica():
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    assert mt.launch(replica_ids, mesh="replica:2", backend="torch") == [[0, 1], [0, 1]]


def test_meshtorch_launch_defaults_to_threads_like_train_and_mt_launch(capsys):
    assert build_parser().parse_args(["launch", "--mesh", "b:2", "x.py"]).backend == "threads"
    assert inspect.signature(mt.launch).parameters["backend"].default == "threads"
    assert cli_main(["launch", "--help"]) == 0   # main returns the exit status, --help's included
    help_text = " ".join(capsys.readouterr().out.split())
    assert "threads (default, as for `meshtorch train` and mt.launch)" in help_text
    assert "torch: one process per processor over torch.distributed" in help_text


def test_meshtorch_launch_threads_runs_script_and_reports_errors(tmp_path, capsys):
    script = tmp_path / "prog.py"
    script.write_text(textwrap.dedent("""
        import sys
        import meshtorch as mt
        if mt.current().rank == 1 and sys.argv[1] == "fail":
            raise KeyError("boom")
        if sys.argv[1] == "exit":
            sys.exit(0)
    """))
    assert cli_main(["launch", "--mesh", "m:2", str(script), "exit"]) == 0
    assert cli_main(["launch", "--mesh", "m:2", str(script), "fail"]) == 2
    assert "meshtorch launch: error: processor 1 {'m': 1} raised KeyError: 'boom'" in capsys.readouterr().err
    assert cli_main(["launch", "--mesh", "m:2", "--nnodes", "2", "-n", "1", str(script), "ok"]) == 2
    assert "--nnodes starts processes on several nodes; add --backend torch" in capsys.readouterr().err
    assert cli_main(["launch", "--mesh", "m:2", "--rdzv-endpoint", "h:1", str(script), "ok"]) == 2
    assert "--rdzv-endpoint starts processes on several nodes; add --backend torch" in capsys.readouterr().err
