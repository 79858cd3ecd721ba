"""Serving a trained PyTorch model with torch.export (`pstore.serving.torch`): the embedding
lookups of the exported program come from a serving artifact, and its outputs equal the
training-side model's exactly. Skipped when torch or torch.export is missing."""

from __future__ import annotations

import numpy as np
import pytest

import pstore
from pstore import init, optim, serving

torch = pytest.importorskip("torch")
if not hasattr(torch, "export") or not hasattr(torch.library, "custom_op"):
    pytest.skip(
        "this torch has no torch.export or torch.library.custom_op", allow_module_level=True
    )

import pstore.torch as pt  # noqa: E402
from pstore.serving.torch import ArtifactEmbedding  # noqa: E402


class Model(torch.nn.Module):
    """Two fields of ids, their rows summed, then a small MLP."""

    def __init__(self, emb: torch.nn.Module, dim: int) -> None:
        super().__init__()
        self.emb = emb
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(dim, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.emb(ids).sum(dim=1))


def test_an_exported_program_reads_the_artifact_and_matches_training(tmp_path):
    dim = 8
    store = pstore.Store(num_shards=4, threads=2)
    table = store.create_sparse_table(
        "user", dim, optimizer=optim.Adagrad(lr=0.1), initializer=init.Normal(0.0, 0.1), seed=5
    )
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    emb = pt.Embedding(table, staleness=0, share_threads=False)
    model = Model(emb, dim)
    opt = torch.optim.SGD(model.mlp.parameters(), lr=0.05)
    for _ in range(20):
        ids = torch.from_numpy(rng.integers(0, 500, size=(64, 2)))
        loss = (model(ids) - 1.0).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    emb.flush()
    store.snapshot(tmp_path / "snap")
    serving.export(tmp_path / "snap", tmp_path / "model")

    # Serving side: the same dense layers, the rows from the artifact.
    served = Model(ArtifactEmbedding(tmp_path / "model", "user"), dim)
    served.mlp.load_state_dict(model.mlp.state_dict())
    model.eval()
    served.eval()
    example = torch.from_numpy(rng.integers(0, 1000, size=(32, 2)))  # half never trained
    batch = getattr(torch.export.Dim, "DYNAMIC", None) or torch.export.Dim("batch")
    program = torch.export.export(served, (example,), dynamic_shapes={"ids": {0: batch}})
    assert "pstore.artifact_lookup" in str(program.graph)
    torch.export.save(program, tmp_path / "model.pt2")
    loaded = torch.export.load(tmp_path / "model.pt2").module()
    for _ in range(3):
        ids = torch.from_numpy(rng.integers(0, 1000, size=(128, 2)))
        with torch.no_grad():
            want = model(ids)
            got_eager = served(ids)
            got = loaded(ids)
        torch.testing.assert_close(got_eager, want, rtol=0, atol=0)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    # Unknown ids get the training table's initial rows; wrong dtypes are refused by name.
    new = torch.tensor([[10_000, 10_001]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(new), model(new), rtol=0, atol=0)
    with pytest.raises(pstore.DtypeError, match="ids"):
        torch.ops.pstore.artifact_lookup(
            str(tmp_path / "model"), "user", torch.tensor([1], dtype=torch.int32), dim, "initial"
        )
    store.close()
