"""The key-only boundary scores of `vtoken bench keyscores` against plain per-token arithmetic."""

import numpy as np
import torch

from vtoken.bench.keyscores import key_scores


def _keys(seed=0, layers=3, kvh=2, n=11, d=8):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(kvh, n, d, generator=g) * (1 + torch.rand(kvh, n, 1, generator=g)) for _ in range(layers)]


def test_knorm_is_minus_the_mean_key_norm_of_the_alive_tokens():
    keys, alive = _keys(), np.array([0, 2, 3, 7, 10])
    want = [-np.mean([float(torch.linalg.vector_norm(k[h, t])) for k in keys for h in range(2)]) for t in alive]
    np.testing.assert_allclose(key_scores(keys, "knorm", alive), want, rtol=1e-5)


def test_keydiff_is_minus_the_cosine_with_the_alive_keys_mean_direction():
    keys, alive = _keys(1), np.array([1, 4, 5, 6, 9])
    want = []
    for t in alive:
        cos = []
        for k in keys:
            for h in range(2):
                units = [k[h, s] / torch.linalg.vector_norm(k[h, s]) for s in alive]  # dead tokens do not count
                anchor = sum(units) / len(units)
                cos.append(float(units[list(alive).index(t)] @ anchor / torch.linalg.vector_norm(anchor)))
        want.append(-np.mean(cos))
    got = key_scores(keys, "keydiff", alive)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # negative control: the anchor over every token (dead ones too) gives other scores
    assert not np.allclose(key_scores(keys, "keydiff", np.arange(11))[alive], got, atol=1e-4)
