"""The meta backend counts exactly what processor 0 of a real run counts."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import meshtorch as mt
from mesh_harness import meshes, rules_for

DIMS = ["batch", "d_model", "d_ff", "vocab"]


def _step():
    b, d, f, v = mt.Dim("batch", 8), mt.Dim("d_model", 8), mt.Dim("d_ff", 16), mt.Dim("vocab", 8)
    table = mt.random.normal([v, d], seed=0, requires_grad=True)
    w1 = mt.random.normal([d, f], seed=1, requires_grad=True)
    w2 = mt.random.normal([f, v], seed=2, requires_grad=True)
    ids = mt.cast(mt.random.uniform([b], 0, 8, seed=3) * 0.999, torch.int64)
    x = mt.layer_norm(mt.embedding(table, ids, "vocab"), "d_model")
    logits = mt.einsum("batch d_ff, d_ff vocab -> batch vocab",
                       mt.gelu(mt.einsum("batch d_model, d_model d_ff -> batch d_ff", x, w1)), w2)
    loss = mt.reduce_mean(mt.cross_entropy(logits, ids, "vocab"))
    loss.backward()
    return mt.comm_stats().as_dict(), str(w2.grad.local.device)


@given(data=st.data())
@settings(max_examples=10, deadline=None)
def test_meta_counts_equal_processor_0_of_threads_run(data):
    mesh = data.draw(meshes())
    rules = data.draw(rules_for(mesh, DIMS))
    real, device = mt.launch(_step, mesh=mesh, rules=rules)[0]
    (meta, meta_device), = mt.launch(_step, mesh=mesh, rules=rules, backend="meta")
    assert device == "cpu" and meta_device == "meta"
    assert meta == real


def test_meta_plans_a_512_processor_mesh_without_storage():
    def step():
        w = mt.random.normal("d_model:4096,d_ff:65536", seed=0, requires_grad=True)  # 1 GiB whole
        x = mt.random.normal("batch:4096,d_model:4096", seed=1)
        mt.reduce_sum(mt.einsum("batch d_model, d_model d_ff -> batch d_ff", x, w)).backward()
        s = mt.comm_stats()
        return s.bytes(axis="b"), s.bytes(axis="m"), s.bytes(axis=("b", "m"))

    (b_bytes, m_bytes, both), = mt.launch(step, mesh="b:16,m:32", rules="batch:b; d_ff:m", backend="meta")
    assert b_bytes == 4096 * 65536 // 32 * 4  # w's gradient slice summed over b
    assert m_bytes == 0
    assert both == 4  # the loss's partial sums over batch and d_ff: one all_reduce over the sub-mesh


def test_meta_errors_name_the_processor():
    with pytest.raises(mt.errors.ProcessorError, match="meta backend"):
        mt.launch(lambda: mt.ones("a:3") + mt.ones("a:4"), mesh="x:2", rules="a:x", backend="meta")


@pytest.mark.parametrize("device_mode", ["torch's", "fallback"])
@pytest.mark.parametrize("autocast", [False, True])
def test_torch_optimizers_make_their_host_counters_on_the_host_as_in_a_run(monkeypatch, autocast,
                                                                          device_mode):
    # torch's optimizers make their host counters with torch.tensor(0.0) (NAdam its mu_product
    # too, Adagrad in its constructor) and read them with .item(): on the meta backend they were
    # meta tensors (NAdam's read raised, or with 1 standing in divided by zero); now they are host
    # tensors holding the real count, while the moments follow the parameters (meta), and so
    # does every other factory call, also under mt.autocast (a mode above the meta default).
    # The same on a torch without its private device mode and factory list (the fallback: a plain
    # TorchFunctionMode and meshtorch's list)
    if device_mode == "fallback":
        from torch.overrides import TorchFunctionMode

        import meshtorch.launcher.meta as meta

        monkeypatch.setattr(meta, "_device_constructors", None)
        assert torch.tensor in meta._factories() and torch.zeros in meta._factories()
        monkeypatch.setattr(meta, "_MetaDefault", meta._meta_default_class(TorchFunctionMode))

    def step():
        w = torch.nn.Parameter(torch.ones(4))
        opts = [torch.optim.NAdam([w], lr=0.1), torch.optim.Adagrad([w], lr=0.1)]
        for _ in range(2):
            with mt.autocast(torch.bfloat16, enabled=autocast):
                (w * w).sum().backward()
                for opt in opts:
                    opt.step()
        nadam, adagrad = (opt.state[w] for opt in opts)
        return (w.device.type, nadam["exp_avg"].device.type, adagrad["sum"].device.type,
                [(st["step"].device.type, float(st["step"])) for st in (nadam, adagrad)],
                nadam["mu_product"].device.type, torch.zeros(1).device.type)

    assert mt.launch(step, mesh="b:2", backend="meta") == [
        ("meta", "meta", "meta", [("cpu", 2.0), ("cpu", 2.0)], "cpu", "meta")]


def test_a_compiled_step_on_meta_makes_its_tensors_on_meta():
    """``compile_step`` under the meta backend: the step's factories (``mt.ones``, ``torch.zeros``)
    are traced (the default device's check of who calls a factory is not: Dynamo refuses
    ``sys._getframe``) and make meta tensors, as on threads they make host ones."""
    from meshtorch.compiler import compile_step

    def program():
        def step(x):
            return mt.reduce_sum(x * mt.ones("batch:4")), torch.zeros(())
        a, b = compile_step(step, backend="eager")(mt.from_global(torch.ones(4), "batch:4"))
        return a.local.device.type, b.device.type

    assert mt.launch(program, mesh="b:2", rules="batch:b", backend="meta") == [("meta", "meta")]
