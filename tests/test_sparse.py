"""Sparse COO tensors on 'cuda' (remotecuda/sparse.py): a graph network's adjacency moved to the
gateway and multiplied with dense features gives the CPU's values and gradients; the rest of
the sparse API such a tensor meets answers as torch's; other ops say plainly they are not
supported."""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from local_parity import data as _data
from local_parity import to_cpu as _cpu
from torch import nn

pytestmark = pytest.mark.usefixtures("remote")



def _adjacency(n: int = 12) -> torch.Tensor:
    """A normalized adjacency with self loops, as pygcn builds it."""
    a = (torch.rand(n, n, generator=torch.Generator().manual_seed(3)) < 0.3).float()
    a = ((a + a.T) > 0).float() + torch.eye(n)
    d = a.sum(1).pow(-0.5)
    return d[:, None] * a * d[None, :]


def _pygcn(dev: str) -> list:
    """pygcn's training loop: a scipy-style COO adjacency made a torch sparse tensor, ``.cuda()``,
    and ``torch.spmm(adj, x @ W)`` in each layer."""
    torch.manual_seed(0)
    a = _adjacency().numpy()
    row, col = np.nonzero(a)
    indices = torch.from_numpy(np.vstack((row, col)).astype(np.int64))
    adj = torch.sparse_coo_tensor(indices, torch.from_numpy(a[row, col]), torch.Size(a.shape))

    class GraphConvolution(nn.Module):
        def __init__(self, i: int, o: int) -> None:
            super().__init__()
            self.weight, self.bias = nn.Parameter(torch.empty(i, o)), nn.Parameter(torch.empty(o))
            nn.init.uniform_(self.weight, -0.3, 0.3)
            nn.init.uniform_(self.bias, -0.3, 0.3)

        def forward(self, x: torch.Tensor, adj: torch.Tensor) -> torch.Tensor:
            return torch.spmm(adj, torch.mm(x, self.weight)) + self.bias

    g1, g2 = GraphConvolution(6, 8).to(dev), GraphConvolution(8, 3).to(dev)
    adj = adj.to(dev)
    x, y = _data(12, 6).to(dev), (torch.arange(12) % 3).to(dev)
    opt = torch.optim.Adam([*g1.parameters(), *g2.parameters()], lr=0.01, weight_decay=5e-4)
    losses = []
    for _ in range(3):
        out = F.log_softmax(g2(F.relu(g1(x, adj)), adj), dim=1)
        loss = F.nll_loss(out[:8], y[:8])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    # the other spellings of the product, and torch.sparse.addmm
    h = _data(12, 4, seed=1).to(dev)
    more = [torch.sparse.mm(adj, h), adj @ h, torch.mm(adj, h),
            torch.sparse.addmm(torch.ones(12, 4, device=dev), adj, h, beta=0.5, alpha=2.0)]
    # PageRank's power iteration: the product with a vector
    r = torch.full((12,), 1 / 12, device=dev, requires_grad=True)
    ranked = 0.85 * (adj @ r) + 0.15 / 12
    ranked.pow(2).sum().backward()
    return [torch.tensor(losses), out, g1.weight.grad, g2.bias, *more, adj.is_sparse, adj._nnz(), ranked, r.grad]


def test_pygcn_with_a_sparse_adjacency_on_cuda_trains_as_on_the_cpu():
    got, want = _cpu(_pygcn("cuda")), _cpu(_pygcn("cpu"))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def _api(dev: str) -> list:
    i, v = torch.tensor([[0, 1, 1, 2, 0], [2, 0, 2, 1, 2]]), torch.tensor([3.0, 4, 5, 6, 1])
    s = torch.sparse_coo_tensor(i, v, (3, 3), device=dev)  # (a repeated index: uncoalesced)
    inferred = torch.sparse_coo_tensor(i.to(dev), v.to(dev))
    mixed = torch.sparse_coo_tensor(i.to(dev), v, (3, 4), dtype=torch.float64)
    c = s.coalesce()
    hybrid = _data(4, 3, 2).to(dev)
    hybrid[1] = 0
    hs = hybrid.to_sparse(1)
    return [s.is_coalesced(), c.is_coalesced(), c.indices(), c.values(), s._nnz(), c._nnz(), s.to_dense(),
            inferred.shape, inferred.to_dense(), mixed.to_dense(), s.t().to_dense(),
            s.transpose(0, 1).coalesce().indices(), (s * 2).to_dense(), (0.5 * s).to_dense(), s.sum(),
            s.sparse_dim(), s.dense_dim(), s.cpu().to_dense(), c.cpu().indices(), s.cpu().is_coalesced(),
            s.to_dense().to_sparse().indices(), s.double().to_dense(), s.detach().to_dense(),
            s.clone()._nnz(), hs._nnz(), hs.indices(), hs.values(), hs.cpu().to_dense(),
            # a GCN's degrees and self loops, and the ops that keep zeros
            torch.sparse.sum(s, dim=1).to_dense(), torch.sparse.sum(c, 0).indices(), torch.sparse.sum(hs, (0, 2)),
            torch.sparse.sum(s), (c + c).is_coalesced(), (c + torch.eye(3).to_sparse().to(dev)).to_dense(),
            (s + s).to_dense(), torch.ones(3, 3, device=dev) + s, (-s).to_dense(), (s / 2).to_dense(),
            (s ** 2).to_dense(),
            # a dense mask, broadcast or not, a 0-d tensor's scale, and zeros_like
            (s * torch.arange(9.0).view(3, 3).to(dev)).to_dense(), (s * _data(3, 1).to(dev)).to_dense(),
            (s * torch.tensor(2.0, device=dev)).to_dense(), (hs * _data(4, 1, 2, seed=4).to(dev)).to_dense(),
            torch.zeros_like(s)._nnz(), torch.zeros_like(s).is_coalesced(), torch.zeros_like(hs).to_dense(),
            # rows picked (repeated too), and dense @ sparse
            s.index_select(0, torch.tensor([2, 0, 2], device=dev)).to_dense(),
            s.index_select(1, torch.tensor([1], device=dev)).coalesce().indices(),
            hs.index_select(0, torch.tensor([3, 1], device=dev)).to_dense(),
            torch.arange(6.0).view(2, 3).to(dev) @ s,
            # the legacy constructor, as older GNN code builds its adjacency
            (torch.cuda.sparse.FloatTensor(i, v.double(), torch.Size([3, 3])) if dev == "cuda"
             else torch.sparse.FloatTensor(i, v.double(), torch.Size([3, 3]))).to_dense(),
            (torch.cuda.sparse.DoubleTensor(2, 3) if dev == "cuda" else torch.sparse.DoubleTensor(2, 3)).to_dense()]


def test_the_sparse_api_of_a_coo_tensor_on_cuda_answers_as_on_the_cpu():
    got, want = _cpu(_api("cuda")), _cpu(_api("cpu"))
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_gradients_flow_through_to_sparse_and_the_product():
    def run(dev: str) -> list:
        x = (_data(4, 5) * (_data(4, 5, seed=1) > 0)).to(dev).requires_grad_(True)
        y = _data(5, 3, seed=2).to(dev).requires_grad_(True)
        out = torch.sparse.mm(x.to_sparse(), y)
        (out ** 2).sum().backward()
        leaf = _adjacency(5).to_sparse().to(dev).requires_grad_(True)  # a sparse leaf's own gradient
        (torch.sparse.mm(leaf, y.detach()) ** 2).sum().backward()
        w = _data(2, 5, seed=4).to(dev).requires_grad_(True)  # dense @ sparse, and its gradient
        left = w @ leaf.detach()
        (left ** 2).sum().backward()
        return [out, x.grad, y.grad, leaf.grad.to_dense(), leaf.grad.is_coalesced(), left, w.grad]
    torch.testing.assert_close(_cpu(run("cuda")), _cpu(run("cpu")), rtol=1e-5, atol=1e-6)


def _skipgram(dev: str) -> list:
    """word2vec's skip-gram with negative sampling: nn.Embedding(sparse=True) trained by SparseAdam,
    and by SGD with momentum (each step a sparse gradient, built by C++ from 'cuda' parts)."""
    torch.manual_seed(0)
    u_emb, v_emb = nn.Embedding(20, 8, sparse=True).to(dev), nn.Embedding(20, 8, sparse=True).to(dev)
    opt = torch.optim.SparseAdam([*u_emb.parameters(), *v_emb.parameters()], lr=0.01)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(3):
        center, context, negative = (torch.randint(0, 20, shape, generator=g).to(dev) for shape in [(6,), (6,), (6, 3)])
        u = u_emb(center)
        positive = F.logsigmoid((u * v_emb(context)).sum(1))
        loss = -(positive + F.logsigmoid(-(v_emb(negative) @ u.unsqueeze(2)).squeeze(2)).sum(1)).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    sgd_emb = nn.Embedding(20, 8, sparse=True).to(dev)
    sgd = torch.optim.SGD(sgd_emb.parameters(), lr=0.1, momentum=0.9)
    for _ in range(2):
        sgd_emb(torch.tensor([1, 2, 2], device=dev)).sum().backward()
        sgd.step()
    return [torch.stack(losses), u_emb.weight, v_emb.weight, sgd_emb.weight.grad.to_dense(), sgd_emb.weight]


def test_embeddings_with_sparse_gradients_train_as_on_the_cpu():
    torch.testing.assert_close(_cpu(_skipgram("cuda")), _cpu(_skipgram("cpu")), rtol=1e-5, atol=1e-6)


def test_sparse_softmax_is_the_cpus():
    def run(dev: str) -> list:
        i = torch.tensor([[0, 1, 1, 2, 0, 2], [2, 0, 2, 1, 2, 2], [0, 1, 0, 1, 1, 1]])
        s = torch.sparse_coo_tensor(i, _data(6), (3, 3, 2), device=dev)
        return [torch.sparse.softmax(s, d).to_dense() for d in (0, 1, 2, -1)] + \
            [torch.sparse.softmax(s, 1).coalesce().indices()]
    torch.testing.assert_close(_cpu(run("cuda")), _cpu(run("cpu")), rtol=1e-6, atol=1e-7)


def test_a_coo_tensor_marked_coalesced_is_the_cpus():
    """PyG's ``to_torch_coo_tensor`` (and ``to_edge_index``) mark the sorted edge index they built
    with ``_coalesced_(True)``: was refused on 'cuda'."""
    def run(dev: str) -> list:
        edges = torch.tensor([[0, 0, 1, 2], [1, 2, 2, 0]], device=dev)
        adj = torch.sparse_coo_tensor(edges, torch.ones(4, device=dev), (3, 3))._coalesced_(True)
        marked = [adj.is_coalesced(), adj._coalesced_(False).is_coalesced(), adj._coalesced_(True).is_coalesced()]
        return [*marked, adj.indices(), adj.values(), torch.sparse.mm(adj, _data(3, 2).to(dev))]
    torch.testing.assert_close(_cpu(run("cuda")), _cpu(run("cpu")), rtol=0, atol=0)


def test_the_legacy_sparse_types_build_on_cuda_and_match_its_tensors():
    s = torch.cuda.sparse.FloatTensor(torch.tensor([[0, 1], [1, 0]]), torch.tensor([1.0, 2.0]))
    assert s.is_cuda and s.is_sparse and s.shape == (2, 2) and s.type() == "torch.cuda.sparse.FloatTensor"
    assert isinstance(s, torch.cuda.sparse.FloatTensor) and not isinstance(s, torch.cuda.sparse.DoubleTensor)
    assert not isinstance(s.to_dense(), torch.cuda.sparse.FloatTensor)


def test_a_sparse_buffer_moves_with_its_module_and_loads_from_a_state_dict():
    class Propagate(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("adj", _adjacency(4).to_sparse())
            self.lin = nn.Linear(3, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.sparse.mm(self.adj, self.lin(x))

    m = Propagate().cuda()
    assert m.adj.is_cuda and m.adj.is_sparse and m.adj.layout == torch.sparse_coo
    assert m.adj.device == torch.device("cuda", 0) and "device='cuda:0'" in repr(m.adj)
    other = Propagate().cuda()
    other.load_state_dict(m.state_dict())
    x = _data(4, 3)
    torch.testing.assert_close(other(x.cuda()).cpu(), m.cpu()(x))
    assert m.adj.device.type == "cpu" and m.adj.layout == torch.sparse_coo


def test_a_coo_tensor_made_in_a_cuda_device_context_is_there_and_names_a_cuda_type():
    with torch.device("cuda"):
        s = torch.sparse_coo_tensor(torch.tensor([[0, 1], [1, 0]]), torch.tensor([1.0, 2.0]), (2, 2))
    assert s.is_cuda and s.is_sparse and s.type() == "torch.cuda.sparse.FloatTensor"
    assert torch.equal(s.to_dense().cpu(), torch.tensor([[0.0, 1.0], [2.0, 0.0]]))


def test_a_sparse_cuda_tensor_saved_loads_as_one_with_weights_only():
    s = torch.sparse_coo_tensor(torch.tensor([[0, 2], [1, 0]]), torch.tensor([1.0, 2.0]), (3, 3)).cuda()
    buffer = io.BytesIO()
    torch.save({"adj": s}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)["adj"]
    assert loaded.is_cuda and loaded.is_sparse
    assert torch.equal(loaded.to_dense().cpu(), s.cpu().to_dense())


def test_other_ops_on_a_sparse_cuda_tensor_say_plainly_they_are_not_supported():
    s = torch.eye(3).to_sparse().cuda()
    for op in [lambda: s * s, lambda: s @ s, lambda: torch.sparse.log_softmax(s, 1)]:
        with pytest.raises(NotImplementedError, match="remotecuda: .* not supported on a remote 'cuda' device"):
            op()
    v = torch.ones(3, device="cuda", requires_grad=True)
    with pytest.raises(NotImplementedError, match="values that require grad"):
        torch.sparse_coo_tensor(torch.tensor([[0, 1, 2], [0, 1, 2]], device="cuda"), v, (3, 3))
    with pytest.raises(NotImplementedError, match="dense one that requires grad"):
        s * v
    with pytest.raises(RuntimeError, match="expected scalar type Double but found Float"):
        torch.sparse.mm(s.double(), torch.ones(3, 2, device="cuda"))
    assert torch.equal(s.to_dense().cpu(), torch.eye(3))  # the session goes on


@pytest.mark.filterwarnings("ignore:Sparse invariant checks are implicitly disabled")
@pytest.mark.parametrize(("indices", "nnz", "size", "check"), [
    ([[0, 1], [1, 0]], 2, (1, 2), True),     # an index past its dimension
    ([[0, -1], [1, 0]], 2, (2, 2), True),    # a negative index
    ([[0, -1], [1, 0]], 2, (2, 2), "global"),  # (torch.sparse.check_sparse_tensor_invariants)
    ([[0, 1], [1, 0]], 1, (2, 2), None),     # nnz of indices and values differ
    ([[0, 1], [1, 0]], 2, (2,), None),       # fewer sizes than dimensions
], ids=["past", "negative", "global", "nnz", "ndim"])
def test_sparse_coo_tensor_of_cuda_indices_is_checked_as_torch_checks_it(indices, nnz, size, check):
    """torch's checks of the arguments, in its words: the shapes always, the indices' values
    where the invariant checks are on (they were not checked: a bad index was accepted)."""
    def outcome(dev: str) -> str:
        i, v = torch.tensor(indices, device=dev), torch.ones(nnz, device=dev)
        kw = {} if check in (None, "global") else {"check_invariants": check}
        try:
            with torch.sparse.check_sparse_tensor_invariants(enable=check == "global"):
                s = torch.sparse_coo_tensor(i, v, size, **kw)
        except RuntimeError as e:
            return str(e)
        return f"made {tuple(s.shape)}"
    assert outcome("cuda") == outcome("cpu")
